"""Speculative methods: the default method and the decoder's parts.

`resolve` turns the default method "auto" into a real one (values are checked when the config
is made: specserve.config.SpecConfig); `kv_bytes_per_block` is the KV memory a method adds per
block (a draft model's cache); `make_decoder` builds the SpecDecoder with its proposer, prompt
lookup and policy: ngram (lookup alone), suffix (suffix.SuffixProposer: frequency-scored trees
from the request's text and its tenant's earlier outputs), draft_model
(draft_model.DraftModelProposer), eagle (eagle.EagleProposer) and medusa
(medusa.MedusaProposer), the last two with a grafted lookup chain.
"""

from __future__ import annotations

from dataclasses import replace

from specserve.config import DEFAULT_DRAFTS, DEFAULT_MODEL, SpecConfig
from specserve.spec_decode.cost_model import StepCostModel
from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.policy import FAIRNESS, SpecPolicy

LOOKUP_BRANCH = 4  # default lookup chain grafted onto trees; chains of up to 4x this are drafted


def resolve(config: SpecConfig, model: str) -> SpecConfig:
    """"auto": EAGLE with the shipped head on the default model (where its C host calls build),
    prompt lookup elsewhere."""
    if config.method != "auto":
        return config
    from specserve.model.loader import canonical_alias
    from specserve.spec_decode import tree_ops

    eagle = canonical_alias(model) == DEFAULT_MODEL and config.model is None and tree_ops.available()
    method = "eagle" if eagle else "ngram"
    k = config.num_speculative_tokens or DEFAULT_DRAFTS[method]
    return replace(config, method=method, num_speculative_tokens=k)


def kv_bytes_per_block(config: SpecConfig, target_arch, block_size: int, dtype) -> int:
    """Extra KV bytes per block the method needs beside the target's (a draft model's cache)."""
    if config.method != "draft_model":
        return 0
    from specserve.model.runner import kv_bytes_per_block as per_block
    from specserve.spec_decode.draft_model import draft_arch

    return per_block(draft_arch(config.model, target_arch)[1], block_size, dtype)


def aux_layers(config: SpecConfig) -> tuple[int, ...]:
    """The target's decoder layers whose outputs the method's proposer reads (an EAGLE-3 head's
    fused features: heads_io.eagle_aux_layers), else ()."""
    if config.method != "eagle":
        return ()
    from specserve.spec_decode.eagle import DEFAULT_EAGLE_DIR
    from specserve.spec_decode.heads_io import eagle_aux_layers

    return eagle_aux_layers(config.model or DEFAULT_EAGLE_DIR)


def make_decoder(config: SpecConfig, runner, kv, stats, model_config, max_model_len: int,
                 scheduler_config):
    """The SpecDecoder of an engine; `config` resolved and validated (or method None)."""
    from specserve.spec_decode.decoder import SpecDecoder

    if config.method is None:
        return SpecDecoder(runner, kv, stats, max_model_len, scheduler_config.max_num_batched_tokens)
    k = config.num_speculative_tokens
    proposer, chain = None, 0
    if config.method == "ngram":
        chain = k
    elif config.method == "suffix":
        from specserve.spec_decode.suffix import DEFAULT_CORPUS_TOKENS, SuffixProposer

        extra = config.extra
        proposer = SuffixProposer(k, config.prompt_lookup_min, extra.get("max_match", 12),
                                  extra.get("corpus_tokens", DEFAULT_CORPUS_TOKENS),
                                  extra.get("shared_corpus", False))
    elif config.method == "draft_model":
        from specserve.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config.model, runner, model_config, max_model_len,
                                      scheduler_config.max_num_batched_tokens)
    else:
        proposer = _tree_proposer(config, runner, model_config.model, max_model_len)
        chain = 4 * config.extra.get("lookup_branch", LOOKUP_BRANCH)
    lookup = None
    if chain and config.extra.get("lookup", "ngram") == "suffix":  # a tree method's branch
        from specserve.spec_decode.suffix import DEFAULT_CORPUS_TOKENS, SuffixProposer

        lookup = SuffixProposer(chain, config.prompt_lookup_min, config.extra.get("max_match", 12),
                                config.extra.get("corpus_tokens", DEFAULT_CORPUS_TOKENS),
                                config.extra.get("shared_corpus", False))
    elif chain:
        lookup = NgramProposer(chain, config.prompt_lookup_min, config.prompt_lookup_max)
    growth = getattr(proposer, "growth", None)
    if growth is not None:  # EAGLE's tree growth in CUDA graphs (eagle_grow.py), captured before anything is timed
        stats.cuda_graph_capture_seconds += growth.capture(scheduler_config.max_num_seqs, max_model_len)
    adaptive = config.extra.get("adaptive", True)
    max_drafts = (k if proposer is not None else 0) + chain
    cost = StepCostModel.measure(runner, kv, min(scheduler_config.max_num_batched_tokens, 64)) if adaptive else None
    policy = SpecPolicy(cost, max(chain, k, 1), adaptive, config.extra.get("min_draft_prob"),
                        config.extra.get("fairness", FAIRNESS))
    return SpecDecoder(runner, kv, stats, max_model_len, scheduler_config.max_num_batched_tokens,
                       proposer, lookup, policy, max_drafts)


def _tree_proposer(config: SpecConfig, runner, model_name: str, max_model_len: int):
    from specserve.spec_decode import tree_ops
    from specserve.spec_decode.quant import check_quantization

    if not tree_ops.available():
        raise ValueError(f"speculative_config: method {config.method!r} grows its trees in C, which needs a C "
                         f"compiler and Python's headers here ({tree_ops.why_unavailable()}); use 'ngram'")

    model = runner.model
    if getattr(model, "head_view", None) is not None:  # tensor parallel: rank 0's whole vocabulary
        model = model.head_view
    weight = model.lm_head.weight
    quantize = check_quantization(config.extra.get("quantization"), weight.device, model.arch.hidden_size,
                                  model.arch.intermediate_size, weight.dtype)
    if config.method == "eagle":
        from specserve.model.loader import canonical_alias
        from specserve.spec_decode.eagle import EagleProposer

        if config.model is None and canonical_alias(model_name) != DEFAULT_MODEL:
            raise ValueError("speculative_config.model: the shipped EAGLE head is for the default "
                             "model; name a head trained for this target")
        return EagleProposer(model, config.model, config.num_speculative_tokens, config.depth, config.topk,
                             max_positions=max_model_len + 64, quantize=quantize)
    from specserve.spec_decode.medusa import MedusaProposer

    if config.model is None:
        raise ValueError("speculative_config.model: method 'medusa' needs a heads directory")
    return MedusaProposer(model, config.model, config.num_speculative_tokens, config.extra.get("medusa_tree"),
                          quantize=quantize)
