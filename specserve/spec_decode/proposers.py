"""Chain speculation: configuration checks, the proposer factory, and ChainSpecDecoder.

`make_spec_decoder(config, engine)` is what SpecDecoder.create calls when a method is set.
It validates the speculative config (unknown method, k < 1, bad lookup bounds, a draft with
another vocabulary: ValueError at start) and returns a ChainSpecDecoder around one Proposer:

    ngram        specserve.spec_decode.ngram.NgramProposer (prompt lookup)
    draft_model  specserve.spec_decode.draft_model.DraftModelProposer (a second model runner)
    eagle/medusa specserve.spec_decode.tree_decoder.TreeSpecDecoder (tree methods, their own decoder)

ChainSpecDecoder inherits sampling and verification from SpecDecoder; it adds `propose`
(pick each request's draft length with AdaptiveLength, ask the proposer, put the chain on
the request), feeds verify results back to the adaptive rule, and logs the acceptance
figures every `log_interval` seconds on the "specserve.spec_decode" logger.
"""

from __future__ import annotations

import logging
import time

from specserve.config import SpecConfig
from specserve.model.runner import StepLogits
from specserve.request import Request
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.spec_decode.adaptive import AdaptiveLength
from specserve.spec_decode.draft_tree import Proposer
from specserve.spec_decode.step import SpecDecoder, StepResult

logger = logging.getLogger("specserve.spec_decode")

CHAIN_METHODS = ("ngram", "draft_model")
TREE_METHODS = ("eagle", "medusa")  # specserve.spec_decode.tree_decoder
METHODS = CHAIN_METHODS + TREE_METHODS
# keys of our own, beside vLLM's: "adaptive" (bool, default true), "verify_cost" (float),
# "medusa_tree" and "lookup_branch" (int >= 0; tree methods), "min_draft_prob" (eagle, 0 <= p < 1);
# vLLM's "quantization" names the draft head's weights (tree methods: "int8" | "none", quant.py)
OWN_KEYS = {"adaptive", "verify_cost", "medusa_tree", "lookup_branch", "min_draft_prob", "quantization"}
KEY_METHODS = {"lookup_branch": TREE_METHODS, "min_draft_prob": ("eagle",), "medusa_tree": ("medusa",),
               "quantization": TREE_METHODS}


def validate_spec_config(config: SpecConfig) -> None:
    if config.method not in METHODS:
        raise ValueError(f"speculative_config.method: unknown method {config.method!r}; "
                         f"expected one of {', '.join(METHODS)}")
    k = config.num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config.num_speculative_tokens: must be an integer >= 1, got {k!r}")
    if config.method in ("ngram",) + TREE_METHODS:
        lo, hi = config.prompt_lookup_min, config.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1 or hi < lo:
            raise ValueError("speculative_config.prompt_lookup_min/max: need integers with "
                             f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r}, {hi!r}")
    if config.method == "draft_model" and not config.model:
        raise ValueError("speculative_config.model: method 'draft_model' needs a draft model "
                         "(a model directory, a .gguf file or an alias)")
    for key in ("depth", "topk"):
        value = getattr(config, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"speculative_config.{key}: must be an integer >= 1, got {value!r}")
    for key, methods in KEY_METHODS.items():  # a key the method would ignore is a mistake
        if key in config.extra and config.method not in methods:
            raise ValueError(f"speculative_config.{key}: applies to method {' or '.join(methods)}, "
                             f"not {config.method!r}")
    branch = config.extra.get("lookup_branch", 0)
    if not isinstance(branch, int) or isinstance(branch, bool) or branch < 0:
        raise ValueError(f"speculative_config.lookup_branch: must be an integer >= 0, got {branch!r}")
    min_prob = config.extra.get("min_draft_prob", 0.0)
    if not isinstance(min_prob, (int, float)) or isinstance(min_prob, bool) or not 0 <= min_prob < 1:
        raise ValueError(f"speculative_config.min_draft_prob: must be a number in [0, 1), got {min_prob!r}")
    if not isinstance(config.extra.get("adaptive", True), bool):
        raise ValueError("speculative_config.adaptive: must be true or false")
    unknown = sorted(set(config.extra) - OWN_KEYS)
    if unknown:  # vLLM has many more keys; accept them so configs carry over
        logger.warning("speculative_config: ignoring keys %s", ", ".join(unknown))


def make_spec_decoder(config: SpecConfig, engine) -> SpecDecoder:
    validate_spec_config(config)
    if config.method in TREE_METHODS:
        from specserve.spec_decode.tree_decoder import TreeSpecDecoder

        return TreeSpecDecoder(config, engine)
    k = config.num_speculative_tokens
    if config.method == "ngram":
        from specserve.spec_decode.ngram import NgramProposer

        proposer: Proposer = NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    else:
        from specserve.spec_decode.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config.model, engine)
    return ChainSpecDecoder(config, engine, proposer)


class ChainSpecDecoder(SpecDecoder):
    """Speculation with one chain per request, drawn by `proposer`."""

    def __init__(self, config: SpecConfig, engine, proposer: Proposer) -> None:
        super().__init__(config, engine)
        self.proposer = proposer
        self.max_drafts = config.num_speculative_tokens
        self.adaptive = AdaptiveLength(self.max_drafts, config.extra.get("adaptive", True),
                                       float(config.extra.get("verify_cost", 0.1)))
        self._propose_end = 0.0

    def sample_and_verify(self, sched: SchedulerOutput, step: StepLogits) -> list[StepResult]:
        if self._propose_end:
            target_s = time.perf_counter() - self._propose_end  # schedule + target forward
            self.adaptive.observe_target_step(target_s, len(sched), sum(sched.num_drafts),
                                              sched.total_tokens)
            drafted = max((len(r.spec_token_ids) for r in sched.requests), default=0)
            if drafted and self.proposer.name == "draft_model":
                self.adaptive.observe_costs(target_s, self.proposer.last_forward_time / drafted)
        return super().sample_and_verify(sched, step)

    def _count(self, req: Request, k: int, accepted: int) -> None:
        super()._count(req, k, accepted)
        if k:
            self.adaptive.observe(req, k, accepted)

    def propose(self, running: list[Request]) -> None:
        reqs, ks = [], []
        max_len = self.engine.max_model_len
        for req in running:
            # only requests past their prefill, with every token but the last computed
            if req.num_output_tokens == 0 or req.num_computed_tokens < req.num_tokens - 1:
                continue
            room = min(req.max_tokens - req.num_output_tokens, max_len - req.num_tokens) - 1
            k = min(self.adaptive.num_drafts(req), room)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if reqs:
            for req, tree in zip(reqs, self.proposer.propose(reqs, ks)):
                if tree is None or not len(tree):
                    continue
                assert tree.is_chain, "only chains are verified for now"
                req.spec_token_ids = tree.tokens
                req.spec_draft_probs = tree.probs
        self._propose_end = time.perf_counter()
        self._maybe_log()
