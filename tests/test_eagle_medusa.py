"""EAGLE and Medusa proposers: public checkpoint layouts load and draft; the hand-written tree
loop (specserve.spec_decode.tree.tree_spec_step) reproduces plain greedy decoding token for token, on
a tiny random model and on the default model with the shipped head; KV blocks are freed."""

import json
import math
import time
from pathlib import Path

import pytest
import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.kv_cache.manager import KVCacheManager
from specserve.model.arch import ModelArch
from specserve.model.runner import ModelRunner
from specserve.request import Request, SamplingParams
from specserve.spec_decode.eagle import DEFAULT_EAGLE_DIR, EagleProposer
from specserve.spec_decode.eagle_head import EagleHead, HeadKV
from specserve.spec_decode.heads_io import load_eagle, save_eagle
from specserve.spec_decode.medusa import MedusaProposer
from specserve.spec_decode.tree import prefill_step, tree_spec_step

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True}
EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
               *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}


class NoDrafts:
    def observe(self, req, start, hidden):
        pass

    def propose(self, reqs, max_drafts):
        return [None] * len(reqs)


def tiny_runner(tmp_path: Path):
    arch = ModelArch.from_dict(TINY)
    runner = ModelRunner(None, arch, ModelConfig(load_format="dummy", seed=3),
                         CacheConfig(block_size=4, num_blocks=128), 256)
    return arch, runner, KVCacheManager(128, 4, enable_prefix_caching=False)


def write_eagle1(path: Path, arch: ModelArch, seed: int = 0) -> None:
    """An EAGLE-1 checkpoint in the public layout (pytorch_model.bin, no input_layernorm)."""
    head = EagleHead(arch)
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(arch.vocab_size, arch.hidden_size, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 1,
                                                  "architectures": ["LlamaForCausalLM"]}))


def write_medusa(path: Path, arch: ModelArch, heads: int = 3) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    h, v = arch.hidden_size, arch.vocab_size
    state = {}
    for k in range(heads):
        state[f"{k}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.1
        state[f"{k}.0.linear.bias"] = torch.zeros(h)
        state[f"{k}.1.weight"] = torch.randn(v, h, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": 1,
                                                  "base_model_name_or_path": "tiny"}))


def make_requests(prompts: list[list[int]]) -> list[Request]:
    return [Request(str(i), p, SamplingParams(temperature=0.0), set(), 0) for i, p in enumerate(prompts)]


def decode(runner, kv, proposer, prompts, num_tokens: int, max_drafts: int = 64):
    reqs = make_requests(prompts)
    prefill_step(runner, kv, reqs, proposer)
    steps = 0
    while min(r.num_output_tokens for r in reqs) < num_tokens:
        tree_spec_step(runner, kv, reqs, proposer, max_drafts)
        steps += 1
    out = [r.output_token_ids[:num_tokens] for r in reqs]
    emitted = sum(r.num_output_tokens - 1 for r in reqs)
    for r in reqs:
        kv.free(r)
        getattr(proposer, "free", lambda rid: None)(r.request_id)
    return out, emitted / max(1, steps * len(reqs))


def test_eagle1_layout_has_no_input_norm_and_loads(tmp_path):
    arch = ModelArch.from_dict({**TINY, "num_hidden_layers": 1})
    assert set(EagleHead(arch).state_dict()) == EAGLE1_KEYS
    write_eagle1(tmp_path / "eagle", arch)
    head, d2t, embed = load_eagle(tmp_path / "eagle", arch)
    assert d2t is None and embed.shape == (96, 64) and head.layers[0].input_layernorm is None


def test_eagle_round_trip_with_restricted_vocab(tmp_path):
    arch = ModelArch.from_dict({**TINY, "num_hidden_layers": 1})
    head = EagleHead(arch)
    d2t = torch.arange(0, 96, 3)
    save_eagle(head, d2t, tmp_path / "ours")
    loaded, d2t2, _ = load_eagle(tmp_path / "ours", arch)
    assert torch.equal(d2t2, d2t)
    x = torch.randn(1, 5, 64)
    out1 = head(x, x, torch.arange(5))[0]
    out2 = loaded(x, x, torch.arange(5))[0]
    assert torch.allclose(out1, out2, atol=2e-2)


def test_eagle_tree_shape_and_greedy_equivalence(tmp_path):
    arch, runner, kv = tiny_runner(tmp_path)
    write_eagle1(tmp_path / "eagle", arch)
    prop = EagleProposer(runner.model, tmp_path / "eagle", num_speculative_tokens=10, depth=4, topk=3)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 1, 80, 44, 3, 12]]
    reqs = make_requests(prompts)
    prefill_step(runner, kv, reqs, prop)
    tree = prop.propose(reqs, [10, 4])
    assert [len(t) for t in tree] == [10, 4]
    for t in tree:
        assert all(-1 <= p < i for i, p in enumerate(t.parents)) and max(t.depth) <= 4
    for r in reqs:
        kv.free(r)
    ref, _ = decode(runner, kv, NoDrafts(), prompts, 20)
    got, _ = decode(runner, kv, prop, prompts, 20)
    assert got == ref
    assert kv.num_free_blocks == kv.num_total_blocks


def test_medusa_layout_loads_and_matches_greedy(tmp_path):
    arch, runner, kv = tiny_runner(tmp_path)
    write_medusa(tmp_path / "medusa", arch)
    prop = MedusaProposer(runner.model, tmp_path / "medusa")
    prompts = [[5, 9, 17, 33, 2], [1, 2, 3]]
    ref, _ = decode(runner, kv, NoDrafts(), prompts, 16)
    got, _ = decode(runner, kv, prop, prompts, 16)
    assert got == ref
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.skipif(not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file(), reason="no shipped head")
def test_shipped_head_on_default_model_equals_plain_greedy():
    from transformers import AutoTokenizer

    from specserve.model.loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2-135m-instruct")
    arch = ModelArch.from_dir(model_dir)
    runner = ModelRunner(model_dir, arch, ModelConfig(), CacheConfig(num_blocks=64), 1024)
    kv = KVCacheManager(64, 16, enable_prefix_caching=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain how a bicycle works."}],
                                     add_generation_prompt=True, return_dict=True)["input_ids"]
    prop = EagleProposer(runner.model, num_speculative_tokens=12, depth=5, topk=3)
    ref, _ = decode(runner, kv, NoDrafts(), [list(prompt)], 32)
    start = time.time()
    got, accept = decode(runner, kv, prop, [list(prompt)], 32)
    print(f"\nshipped EAGLE head: mean tokens per step {accept:.2f} ({time.time() - start:.1f} s)")
    assert got == ref
    assert accept > 1.2
    assert kv.num_free_blocks == kv.num_total_blocks


def tiny_llm(tmp_path: Path, **kwargs):
    """The engine on a tiny random model (the default model's tokenizer, ids < 96); kwargs go
    to LLM (e.g. speculative_config)."""
    import shutil

    from specserve import LLM
    from specserve.model.loader import resolve_model_dir

    src = resolve_model_dir("smollm2-135m-instruct")
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, model_dir / f.name)
    (model_dir / "config.json").write_text(json.dumps({**TINY, "eos_token_id": 95}))
    return LLM(str(model_dir), load_format="dummy", seed=3, max_model_len=256, num_blocks=96,
               block_size=4, **kwargs)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_tree_spec_decoder_in_the_engine(tmp_path, method, caplog):
    import logging

    from specserve.config import SpecConfig
    from specserve.spec_decode.tree_decoder import TreeSpecDecoder

    llm = tiny_llm(tmp_path)
    engine = llm.engine
    arch = engine.arch
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 2, 8, 8, 1, 4]}, {"prompt_token_ids": [7, 7, 1, 80]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    if method == "eagle":  # int8 heads, as the engine makes them on a CPU
        write_eagle1(tmp_path / "head", ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
        prop = EagleProposer(engine.runner.model, tmp_path / "head", 10, depth=4, topk=3, quantize=True)
    else:
        write_medusa(tmp_path / "head", arch)
        prop = MedusaProposer(engine.runner.model, tmp_path / "head", quantize=True)
    engine.spec = TreeSpecDecoder(SpecConfig(method=method, num_speculative_tokens=10), engine, prop)
    engine.spec.gate.enabled = False  # a random head's trees never pay: keep verifying them
    engine.spec.log_interval = 0.0
    shapes = {True: 0, False: 0}  # drafts verified as a chain / as a tree
    tree_parents = engine.spec.tree_parents

    def checked_tree_parents(sched):  # chains go to the target without tree parents
        out = tree_parents(sched)
        for i, (req, k) in enumerate(zip(sched.requests, sched.num_drafts)):
            if k:
                chain = engine.spec._tree(req, k).is_chain
                assert (out is None or out[i] is None) == chain
                shapes[chain] += 1
        return out

    engine.spec.tree_parents = checked_tree_parents
    with caplog.at_level(logging.INFO, logger="specserve.spec_decode"):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]  # prefix-cache hits now
    assert "acceptance" in caplog.text.lower()  # the periodic acceptance line
    assert got == ref
    assert engine.stats.spec_num_drafts > 0 and shapes[False] > 0
    sampled = llm.generate(prompts, SamplingParams(temperature=0.9, max_tokens=20, seed=7, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 20 for o in sampled)
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks
    assert not engine.spec._tracks


def test_tree_config_keys_reach_the_proposer(tmp_path):
    from specserve.config import SpecConfig
    from specserve.spec_decode.quant import Int8Linear
    from specserve.spec_decode.tree_decoder import MIN_DRAFT_PROB, make_tree_proposer

    engine = tiny_llm(tmp_path).engine
    write_eagle1(tmp_path / "head", ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
    prop = make_tree_proposer(SpecConfig(method="eagle", model=str(tmp_path / "head"),
                                         num_speculative_tokens=6, depth=3, topk=5), engine)
    assert (prop.m, prop.depth, prop.topk) == (6, 3, 5)
    prop = make_tree_proposer(SpecConfig(method="eagle", model=str(tmp_path / "head")), engine)
    assert (prop.m, prop.depth, prop.topk) == (8, 4, 2)  # the defaults
    assert SpecConfig.parse('{"method": "eagle"}').num_speculative_tokens == 8
    assert SpecConfig.parse('{"method": "ngram"}').num_speculative_tokens == 3
    assert prop.min_score == math.log(MIN_DRAFT_PROB["cpu"])  # CPU: unlikely nodes are cut
    assert isinstance(prop.head.fc, Int8Linear) and isinstance(prop._lm_head, Int8Linear)  # CPU: int8
    prop = make_tree_proposer(SpecConfig(method="eagle", model=str(tmp_path / "head"), num_speculative_tokens=6,
                                         extra={"min_draft_prob": 0, "quantization": "none"}), engine)
    assert prop.min_score == -math.inf
    assert type(prop.head.fc) is torch.nn.Linear
    with pytest.raises(ValueError, match="quantization"):
        make_tree_proposer(SpecConfig(method="eagle", model=str(tmp_path / "head"),
                                      extra={"quantization": "int4"}), engine)


def test_medusa_tree_is_validated():
    from specserve.spec_decode.medusa import tree_from_choices

    assert tree_from_choices([[1], [0], [0, 2]], 4) == [(0,), (1,), (0, 2)]
    for bad, message in [([], "non-empty list"), ([[0, -1]], "integers >= 0"), ([[]], "non-empty"),
                         ([["a"]], "integers"), ([[0, 0, 0]], "deeper than the 2 heads"),
                         ([[0, 1]], "lacks its prefix")]:
        with pytest.raises(ValueError, match=message):
            tree_from_choices(bad, 2)


def test_graft_merges_a_chain_into_a_tree():
    from specserve.spec_decode.draft_tree import DraftTree

    tree = DraftTree([10, 11, 12, 13], [-1, -1, 0, 1])  # 10 -> 12, 11 -> 13
    merged, path = tree.graft([10, 12, 7, 8], limit=10)  # shares 10 -> 12, then new nodes
    assert merged.tokens == [10, 11, 12, 13, 7, 8]
    assert merged.parents == [-1, -1, 0, 1, 2, 4]
    assert path == [0, 2, 4, 5]  # the chain's nodes in the merged tree
    cut, path = tree.graft([5, 6], limit=5)
    assert cut.tokens == [10, 11, 12, 13, 5] and path == [4]  # the limit cuts the graft
    assert tree.graft([5], limit=2)[0].tokens == [10, 11]  # ... and the tree itself, parents first
    assert DraftTree([], []).graft([3, 4], limit=8)[0].is_chain


def test_lookup_branch_keeps_greedy_output_with_the_head_paused(tmp_path):
    """lookup_branch grafts prompt-lookup chains onto the trees; with the head paused by the
    gate, the chains are drafted alone. Both ways the output is plain greedy's."""
    from specserve.config import SpecConfig
    from specserve.spec_decode.tree_decoder import TreeSpecDecoder

    llm = tiny_llm(tmp_path)
    engine = llm.engine
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17]}, {"prompt_token_ids": [7, 7, 7, 7]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    write_eagle1(tmp_path / "head", ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
    for paused in (False, True):
        prop = EagleProposer(engine.runner.model, tmp_path / "head", 6, depth=3, topk=2)
        config = SpecConfig(method="eagle", num_speculative_tokens=6, extra={"lookup_branch": 5})
        spec = engine.spec = TreeSpecDecoder(config, engine, prop)
        spec.gate.enabled = False
        if paused:  # the gate never lets the head draft: only lookup chains are drafted
            spec.gate.active = lambda req: False
            prop.propose = lambda reqs, ks: pytest.fail("a paused head drafted")
        sizes = []
        propose = spec.propose

        def spy(running):
            propose(running)
            sizes.extend(len(t.tree) for t in spec._tracks.values() if t.tree is not None)

        spec.propose = spy
        drafts_before = engine.stats.spec_num_drafts
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert got == ref
        assert engine.stats.spec_num_drafts > drafts_before
        if not paused:
            assert max(sizes) > 6  # lookup nodes grafted beside the head's 6
        assert engine.stats.num_free_blocks == engine.stats.num_total_blocks


def test_head_kv_buffers_match_the_head_over_the_whole_sequence():
    """Drafting feeds the head a few pairs at a time through HeadKV (grown as it fills, read in
    place); the outputs equal one causal pass over the whole sequence."""
    torch.manual_seed(0)
    head = EagleHead(ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
    t, hidden = 150, TINY["hidden_size"]
    feats, embeds, pos = torch.randn(1, t, hidden), torch.randn(1, t, hidden), torch.arange(t)
    with torch.no_grad():
        whole = head(feats, embeds, pos)[0]
        buffers, outs, start = HeadKV(), [], 0
        for size in (5, 1, 60, 2, 82):  # grows past 64 and 128 entries
            end = start + size
            mask = None if start == 0 else torch.ones(1, size, end, dtype=torch.bool).tril(start)
            outs.append(head(feats[:, start:end], embeds[:, start:end], pos[start:end], mask=mask,
                             kv=(buffers, start))[0])
            start = end
    torch.testing.assert_close(torch.cat(outs, 1), whole)


def test_training_time_test_matches_the_proposers_deep_drafts(tmp_path):
    """train.unrolled's step j is what a depth-j node computes at inference: a top-1 chain
    drafted by EagleProposer equals the argmax of the unrolled steps over the same tokens."""
    from specserve.spec_decode.training.train import ttt_mask, unrolled

    assert ttt_mask(4, 2).int().tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0],
                                             [1, 1, 0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 1]]
    arch = ModelArch.from_dict(TINY)
    runner = ModelRunner(None, arch, ModelConfig(load_format="dummy", seed=3, dtype="float32"),
                         CacheConfig(block_size=4, num_blocks=64), 256)
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    head = EagleHead(ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_eagle(head, None, tmp_path / "head", dtype=torch.float32)
    prop = EagleProposer(runner.model, tmp_path / "head", 3, depth=3, topk=1)
    head = prop.head
    req = make_requests([[5, 9, 17, 33, 2, 8, 8, 1, 4, 60, 12]])[0]
    prefill_step(runner, kv, [req], prop)  # features f_0..f_{n-1}, tokens x_0..x_n
    chain = prop.propose_one(req, 3)
    assert chain.is_chain and len(chain) == 3
    seq = req.all_token_ids + chain.tokens
    n = req.num_tokens - 1
    feats = torch.stack(prop.cache[req.request_id].feats)  # [n, hidden]
    feats = torch.cat([feats, torch.zeros(3, feats.shape[1])])[None]  # positions >= n: unused
    embeds = runner.model.embed_tokens.weight[torch.tensor(seq[1:n + 4])][None]
    with torch.no_grad():
        outs = unrolled(head, feats, embeds, 3)
    lm = runner.model.lm_head.weight
    expect = [int((outs[j][0, n - 1 + j] @ lm.T).argmax()) for j in range(3)]
    assert chain.tokens == expect
    kv.free(req)


def test_min_draft_prob_cuts_unlikely_nodes_and_keeps_greedy_output(tmp_path, monkeypatch):
    import specserve.spec_decode.eagle as eagle_mod

    arch, runner, kv = tiny_runner(tmp_path)
    write_eagle1(tmp_path / "eagle", arch)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 1, 80, 44, 3, 12]]
    rerank, seen = eagle_mod._rerank, []  # every node (token, parent, score) the proposer ranks

    def spy(tokens, parents, scores, *rest):
        seen.append((list(tokens), list(parents), list(scores)))
        return rerank(tokens, parents, scores, *rest)

    monkeypatch.setattr(eagle_mod, "_rerank", spy)

    def trees(min_prob):
        prop = EagleProposer(runner.model, tmp_path / "eagle", num_speculative_tokens=8, depth=3, topk=3,
                             min_prob=min_prob)
        reqs = make_requests(prompts)
        prefill_step(runner, kv, reqs, prop)
        seen.clear()
        out = prop.propose(reqs, [8, 8])
        for r in reqs:
            kv.free(r)
        return out

    full = trees(0.0)
    nodes = list(seen)
    cut = sorted(nodes[0][2], reverse=True)[4]  # the first request keeps its 5 likeliest nodes
    pruned = trees(math.exp(cut))
    # the same as ranking the full expansion with the cut: skipping unlikely nodes' expansion
    # loses nothing that could have passed, and fewer nodes are verified
    for got, (t, p, s) in zip(pruned, nodes):
        want = rerank(t, p, s, 8, cut)
        assert (got.tokens, got.parents) == (want.tokens, want.parents) if len(want) else got is None
    assert sum(len(t or []) for t in pruned) < sum(len(t) for t in full)
    assert trees(0.999) == [None, None]  # a random head is never that sure: no trees at all
    prop = EagleProposer(runner.model, tmp_path / "eagle", num_speculative_tokens=8, depth=3, topk=3,
                         min_prob=math.exp(cut))
    ref, _ = decode(runner, kv, NoDrafts(), prompts, 16)
    got, _ = decode(runner, kv, prop, prompts, 16)
    assert got == ref and kv.num_free_blocks == kv.num_total_blocks


def test_lookup_branch_length_follows_its_acceptance(tmp_path):
    from specserve.config import SpecConfig
    from specserve.spec_decode.draft_tree import DraftTree, path_of
    from specserve.spec_decode.tree_decoder import TreeSpecDecoder

    tree, chain_nodes = DraftTree([4, 5, 6, 7], [-1, 0, -1, 2]).graft([6, 7, 8, 9], 6)
    assert chain_nodes == path_of(tree.tokens, tree.parents, [6, 7, 8, 9]) == [2, 3, 4, 5]
    assert path_of(tree.tokens, tree.parents, [4, 9]) == [0] and path_of(tree.tokens, tree.parents, [1]) == []
    engine = tiny_llm(tmp_path).engine
    write_eagle1(tmp_path / "head", ModelArch.from_dict({**TINY, "num_hidden_layers": 1}))
    prop = EagleProposer(engine.runner.model, tmp_path / "head", 6, depth=3, topk=2)

    def spec_with(adaptive):
        config = SpecConfig(method="eagle", num_speculative_tokens=6, extra={"lookup_branch": 4, "adaptive": adaptive})
        return TreeSpecDecoder(config, engine, prop)

    spec, lengths = spec_with(True), []
    for chain, k, path in [([2, 3, 4, 5], 6, [2, 3, 4, 5]),  # whole chain accepted: 4 -> 8
                           ([0, 1, 2, 3, 4, 5, 6, 7], 8, list(range(8))),  # again: 8 -> 16
                           (list(range(16)), 20, list(range(16))),  # capped at 4 L = 16
                           ([1, 2], 4, [0]),  # first chain token rejected: halve
                           ([1, 2], 4, [1, 2]),  # cut short, all accepted but shorter: keep
                           ([1], 4, []), ([1], 4, []), ([1], 4, [])]:  # down to L / 2 = 2
        track = spec._track("r")
        track.chain_nodes = chain
        spec._adapt_branch(track, k, path)
        lengths.append(track.branch)
    assert lengths == [8, 16, 16, 8, 8, 4, 2, 2]
    track.chain_nodes = [0, 1, 2, 3]
    spec._adapt_branch(track, 2, [0, 1])  # the scheduler kept 2 of its nodes, both accepted: 2 -> 4
    assert track.branch == 4 and track.chain_nodes == []
    fixed_spec = spec_with(False)
    fixed = fixed_spec._track("r")
    fixed.chain_nodes = [0, 1, 2, 3]
    fixed_spec._adapt_branch(fixed, 6, [0, 1, 2, 3])
    assert fixed.branch == 4  # "adaptive": false keeps lookup_branch
