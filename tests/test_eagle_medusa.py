"""EAGLE and Medusa: public checkpoint layouts load and draft; through the engine, trees of a
random head (int8, as on a CPU) reproduce plain greedy decoding token for token, and the
shipped head does on the default model; the cost model's cut and a gated-off head."""

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch

from benchmarks._runner import prompt_features
from specserve.config import CacheConfig, ModelConfig, SpecConfig
from specserve.kv_cache.manager import KVCacheManager
from specserve.model.arch import ModelArch
from specserve.model.runner import ModelRunner
from specserve.request import Request, SamplingParams
from specserve.spec_decode.cost_model import LOOKUP_ONLY, PLAIN, SPEC, Curve
from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch
from specserve.spec_decode.eagle import DEFAULT_EAGLE_DIR, EagleProposer
from specserve.kernels.cpu import cpu_linear, layer_ops
from specserve.spec_decode import tree_ops
from specserve.spec_decode import eagle_head
from specserve.spec_decode.eagle_head import DraftPass, EagleHead, HeadKV, HeadKVPool, Segment
from specserve.spec_decode.heads_io import load_eagle
from specserve.spec_decode.training.checkpoints import save_eagle
from specserve.spec_decode.policy import PROBE_FIRST
from specserve.spec_decode.quant import draft_linear
from tests import tree_reference
from tests.spec_helpers import check_tree

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True}
HEAD = {**TINY, "num_hidden_layers": 1}
EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
               *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
               *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 17, 33, 2, 8, 8, 1, 4]}, {"prompt_token_ids": [7, 7, 1, 80]}]


def write_eagle1(path: Path, seed: int = 0) -> Path:
    """An EAGLE-1 checkpoint in the public layout (pytorch_model.bin, no input_layernorm)."""
    head = EagleHead(ModelArch.from_dict(HEAD))
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.randn(TINY["vocab_size"], TINY["hidden_size"], generator=g)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps({**HEAD, "architectures": ["LlamaForCausalLM"]}))
    return path


def write_eagle3(path: Path, layers=(0, 1), seed: int = 0) -> Path:
    """An EAGLE-3 head of ours (features fused from the target layers `layers`), random weights."""
    head = EagleHead(ModelArch.from_dict(HEAD), aux_layers=layers, out_norm=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_eagle(head, torch.arange(0, 96, 2), path, dtype=torch.float32)
    return path


def write_medusa(path: Path, heads: int = 3) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    h, v = TINY["hidden_size"], TINY["vocab_size"]
    state = {}
    for k in range(heads):
        state[f"{k}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.1
        state[f"{k}.0.linear.bias"] = torch.zeros(h)
        state[f"{k}.1.weight"] = torch.randn(v, h, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "medusa_lm_head.safetensors"))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": 1,
                                                  "base_model_name_or_path": "tiny"}))
    return path


def tiny_llm(tmp_path: Path, speculative_config=None, **kwargs):
    """The engine on a tiny random model (the default model's tokenizer, ids < 96)."""
    import shutil

    from specserve import LLM
    from specserve.model.loader import resolve_model_dir

    model_dir = tmp_path / "tiny-model"
    if not model_dir.exists():
        model_dir.mkdir()
        for f in resolve_model_dir("smollm2-135m-instruct").iterdir():
            if f.name.startswith("tokenizer") or f.suffix == ".jinja":
                shutil.copy(f, model_dir / f.name)
        (model_dir / "config.json").write_text(json.dumps({**TINY, "eos_token_id": 95}))
    return LLM(str(model_dir), load_format="dummy", seed=3, max_model_len=256, num_blocks=96,
               block_size=4, speculative_config=speculative_config, **kwargs)


def greedy_ids(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def propose_batch(reqs, m: int, min_score: float = -math.inf) -> ProposeBatch:
    return ProposeBatch([r.request_id for r in reqs], [r.all_token_ids for r in reqs], [m] * len(reqs),
                        min_score, [r.params for r in reqs], [0] * len(reqs), [r.block_ids for r in reqs],
                        [r.num_computed_tokens for r in reqs])


def test_eagle1_layout_has_no_input_norm_and_loads(tmp_path):
    arch = ModelArch.from_dict(HEAD)
    assert set(EagleHead(arch).state_dict()) == EAGLE1_KEYS
    head, d2t, embed = load_eagle(write_eagle1(tmp_path / "eagle"), arch)
    assert d2t is None and embed.shape == (96, 64) and head.layers[0].input_layernorm is None


def test_eagle_round_trip_with_restricted_vocab(tmp_path):
    arch = ModelArch.from_dict(HEAD)
    head = EagleHead(arch)
    d2t = torch.arange(0, 96, 3)
    save_eagle(head, d2t, tmp_path / "ours")
    loaded, d2t2, _ = load_eagle(tmp_path / "ours", arch)
    assert torch.equal(d2t2, d2t)
    x = torch.randn(1, 5, 64)
    torch.testing.assert_close(head(x, x, torch.arange(5))[0], loaded(x, x, torch.arange(5))[0], atol=2e-2, rtol=0)


def test_eagle3_head_round_trip_and_engine_equal_plain_greedy(tmp_path):
    """An EAGLE-3 head: config.json names the target layers it reads, the engine's steps return
    their outputs (and only then), its trees keep greedy output exactly plain decoding's."""
    from specserve.spec_decode.heads_io import eagle_aux_layers

    path = write_eagle3(tmp_path / "eagle3")
    assert eagle_aux_layers(path) == (0, 1) and eagle_aux_layers(write_eagle1(tmp_path / "eagle1")) == ()
    head, d2t, _ = load_eagle(path, ModelArch.from_dict(TINY))
    assert head.fuse.weight.shape == (64, 192) and head.norm is not None and d2t.numel() == 48
    plain = tiny_llm(tmp_path)
    ref = greedy_ids(plain)
    assert plain.engine.runner.model.aux_layers == ()
    llm = tiny_llm(tmp_path, {"method": "eagle", "model": str(path), "num_speculative_tokens": 8,
                              "adaptive": False, "lookup_branch": 0, "depth": 3, "topk": 2})
    assert llm.engine.runner.model.aux_layers == (0, 1)
    seen = []
    observe = llm.engine.spec.proposer.observe
    llm.engine.spec.proposer.observe = lambda ids, starts, sizes, hidden: (seen.append(hidden.shape[1]),
                                                                          observe(ids, starts, sizes, hidden))
    assert greedy_ids(llm) == ref
    assert seen and set(seen) == {192}  # the final hidden states and the two layers' outputs
    assert llm.engine.stats.spec_num_drafts > 0
    with pytest.raises(ValueError, match="layers"):
        llm.engine.runner.model.aux_layers = ()
        llm.engine.runner.set_aux_layers((0, 5))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_trees_in_the_engine_equal_plain_greedy(tmp_path, method, caplog):
    import logging

    ref = greedy_ids(tiny_llm(tmp_path))
    head = write_eagle1(tmp_path / "head") if method == "eagle" else write_medusa(tmp_path / "head")
    config = {"method": method, "model": str(head), "num_speculative_tokens": 10, "adaptive": False,
              "quantization": "int8", "lookup_branch": 0}
    if method == "eagle":
        config.update(depth=4, topk=3)
    llm = tiny_llm(tmp_path, config)
    engine = llm.engine
    engine.spec.log.interval = 0.0
    shapes = {True: 0, False: 0}  # drafts verified as a chain / as a tree
    tree_parents = engine.spec.tree_parents

    def checked_tree_parents(sched):  # chains go to the target without tree parents
        out = tree_parents(sched)
        for i, (tree, k) in enumerate(zip(engine.spec._scheduled_trees(sched), sched.num_drafts)):
            if k:
                tree = check_tree(tree)
                assert tree.dfs  # both proposers' trees come depth first, as verification wants them
                chain = tree.is_chain
                assert (out is None or out[i] is None) == chain
                shapes[chain] += 1
        return out

    engine.spec.tree_parents = checked_tree_parents
    prop, shown = engine.spec.proposer, []
    observe = prop.observe
    prop.observe = lambda ids, starts, sizes, hidden: shown.append(list(sizes)) or observe(ids, starts, sizes, hidden)
    with caplog.at_level(logging.INFO, logger="specserve.spec_decode"):
        assert greedy_ids(llm) == ref
        assert greedy_ids(llm) == ref  # prefix-cache hits now
    assert "acceptance" in caplog.text.lower()  # the periodic acceptance line
    assert engine.stats.spec_num_drafts > 0 and shapes[False] > 0
    assert any(n > 1 for sizes in shown for n in sizes)  # prompts, accepted paths: every committed feature
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.9, max_tokens=20, seed=7, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 20 for o in sampled)
    assert engine.stats.num_free_blocks == engine.stats.num_total_blocks
    prop = engine.spec.proposer
    assert not engine.spec.states and not getattr(prop, "cache", None) and not getattr(prop, "last", None)


class Oracle:
    """A proposer that knows plain greedy's output and hides it in a tree behind decoys:
    accepted paths are never a prefix of the tree, so their KV must be moved into place."""

    name, needs_hidden = "oracle", False

    def __init__(self, outputs: dict[tuple, list[int]]) -> None:
        self.outputs = outputs  # prompt -> greedy output

    def observe(self, *args) -> None:
        pass

    def free(self, request_id: str) -> None:
        pass

    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        trees = []
        for tokens in batch.token_ids:
            prompt, out = next((p, o) for p, o in self.outputs.items() if list(p) == tokens[:len(p)])
            c = (out + [0, 0, 0])[len(tokens) - len(prompt):][:3]
            d = [(t + 1) % 96 for t in c]
            trees.append(DraftTree([d[0], c[0], d[1], c[1], c[2]], [-1, -1, 1, 1, 3]))
        return trees


def test_oracle_trees_move_the_accepted_paths_kv(tmp_path):
    ref = greedy_ids(tiny_llm(tmp_path))
    llm = tiny_llm(tmp_path, {"method": "ngram", "adaptive": False})
    spec = llm.engine.spec
    spec.proposer, spec.lookup, spec.max_drafts = Oracle({tuple(p["prompt_token_ids"]): o
                                                          for p, o in zip(PROMPTS, ref)}), None, 5
    assert greedy_ids(llm) == ref
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens >= 2 * stats.spec_num_drafts  # three a step, but at the end
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.skipif(not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file(), reason="no shipped head")
def test_shipped_head_on_default_model_equals_plain_greedy(llm, make_llm):
    prompt = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user",
                                                              "content": "Explain how a bicycle works."}])}]
    params = SamplingParams(temperature=0, max_tokens=32)
    spec = make_llm(max_model_len=1024, speculative_config={"method": "eagle", "adaptive": False,
                                                           "num_speculative_tokens": 12, "depth": 5, "topk": 3})
    got = greedy_ids(spec, prompt, params)
    assert got == greedy_ids(llm, prompt, params)
    stats = spec.engine.stats
    per_step = stats.spec_num_accepted_tokens / stats.spec_num_drafts
    print(f"\nshipped EAGLE head: mean acceptance length {1 + per_step:.2f}")
    assert per_step > 0.5


def test_tree_shape_and_the_cost_models_cut(tmp_path):
    """Trees have at most m nodes and `depth` levels; a cut by score drafts exactly the nodes
    of the full expansion that score above it (skipping unlikely nodes' expansion loses none
    that could pass), and a cut no node reaches drafts nothing."""
    import specserve.spec_decode.eagle as eagle_mod

    arch = ModelArch.from_dict(TINY)
    runner = ModelRunner(None, arch, ModelConfig(load_format="dummy", seed=3), CacheConfig(4, 64), 256)
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    prop = EagleProposer(runner.model, write_eagle1(tmp_path / "eagle"), 8, depth=3, topk=3)
    reqs = [Request(str(i), p, SamplingParams(temperature=0), set(), 0)
            for i, p in enumerate([[5, 9, 17, 33, 2], [7, 7, 1, 80, 44, 3, 12]])]
    for r in reqs:
        h = prompt_features(runner, kv, r)
        prop.observe([r.request_id], [0], [len(h)], h)
        r.all_token_ids.append(11)  # one pending token, as after a step
    full = prop.propose(propose_batch(reqs, 8))
    assert [len(check_tree(t)) for t in full] == [8, 8] and all(max(t.depth) <= 3 for t in full)
    assert all(t.dfs for t in full)  # depth first as drafted: the decoder does not reorder them
    seen = []
    rerank = eagle_mod._rerank
    eagle_mod._rerank = lambda t, p, s, *rest: seen.append((list(t), list(p), list(s))) or rerank(t, p, s, *rest)
    try:
        prop.propose(propose_batch(reqs, 8))
        ranked = sorted(seen[0][2], reverse=True)  # the first request keeps at least 5 nodes; the
        i = next(i for i in range(4, len(ranked) - 1) if ranked[i] - ranked[i + 1] > 1e-3)  # cut in a gap:
        cut = (ranked[i] + ranked[i + 1]) / 2  # a pass's last bits depend on its rows (float32)
        pruned = prop.propose(propose_batch(reqs, 8, cut))
    finally:
        eagle_mod._rerank = rerank
    for got, (t, p, s) in zip(pruned, seen):
        want = rerank(t, p, s, 8, cut)
        assert (got.tokens, got.parents) == (want.tokens, want.parents) if len(want) else got is None
        assert got is None or min(got.scores) >= cut
    assert sum(len(t or []) for t in pruned) < 16
    assert prop.propose(propose_batch(reqs, 8, math.log(0.999))) == [None, None]
    for r in reqs:
        kv.free(r)


def _count_head_passes(llm, window: int | None = None) -> list[list[int]]:
    """A head that never pays (its pass priced at 100 s); per engine step, the rows of each
    head pass it ran."""
    spec = llm.engine.spec
    spec.policy.draft_cost = Curve({1: 100.0})
    if window is not None:
        spec.proposer.window = window
    prop, passes = spec.proposer, []
    draft, step = prop.draft.tokens, llm.engine.step

    def counted(*args):
        passes[-1].append(sum(s.rows for s in args[-1]))
        return draft(*args)

    def counted_step():
        passes.append([])
        return step()

    prop.draft.tokens, llm.engine.step = counted, counted_step
    return passes


def test_the_drafting_cost_is_learnt_from_steady_calls(tmp_path):
    """What a proposer call costs (draft_pays' share) is learnt only from calls whose requests
    it drafted for in the step before: not from a request's first call (its pass over the
    prompt) nor from a probe's catch-up after steps without drafting."""
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "lookup_branch": 0,
              "quantization": "none"}
    llm = tiny_llm(tmp_path, config)
    spec, engine = llm.engine.spec, llm.engine
    calls, steps = [], [0]  # per proposer call: [engine step, request ids, learnt]
    propose, update, step = spec.proposer.propose, spec.policy.draft_cost.update, engine.step
    spec.proposer.propose = lambda batch: calls.append([steps[0], set(batch.request_ids), False]) or propose(batch)

    def learnt(*args):
        calls[-1][2] = True
        return update(*args)

    def counted_step():
        steps[0] += 1
        return step()

    spec.policy.draft_cost.update, engine.step = learnt, counted_step
    spec.policy.draft_cost.x, spec.policy.draft_cost.y = [], []  # (nothing learnt: every request drafts)
    for prompt in PROMPTS:  # one request at a time: a first call each, then steady ones and gaps
        greedy_ids(llm, [prompt])
    assert not calls[0][2] and any(c[2] for c in calls) and not all(c[2] for c in calls[1:])
    for (at, ids, _), (then, now, was_learnt) in zip(calls, calls[1:]):
        assert was_learnt == (then == at + 1 and now <= ids)


def test_a_gated_off_head_adds_no_work(tmp_path):
    """A head that does not pay runs on no step but its probes; a probe catches the head up on
    every committed token since its last run in one batched pass, at most `window` of them
    (a first pass at most `prompt_window`: a long prompt's last pairs), and output stays exact."""
    ref = greedy_ids(tiny_llm(tmp_path))
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "lookup_branch": 0,
              "quantization": "none"}
    llm = tiny_llm(tmp_path, config)
    passes = _count_head_passes(llm)
    assert greedy_ids(llm, PROMPTS[:1]) == ref[:1]
    active = [i for i, p in enumerate(passes) if p]
    assert len(passes) > 2 * PROBE_FIRST and 0 < len(active) <= 2  # probes only (8, then 16 steps later)
    for before, at in zip(active, active[1:]):  # one catch-up pass over every pair since, then the tree
        assert passes[at][0] >= at - before and all(rows <= 2 for rows in passes[at][1:])

    longer = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), PROMPTS[:1], longer)
    prompt_pairs = len(PROMPTS[0]["prompt_token_ids"]) + PROBE_FIRST  # pairs when first probed
    for prompt_window, first in ((64, prompt_pairs), (5, 5)):
        llm = tiny_llm(tmp_path, config)  # gaps longer than the window: the last `window` pairs only
        passes = _count_head_passes(llm, window=4)
        llm.engine.spec.proposer.prompt_window = prompt_window
        llm.engine.spec.policy.realized.margin = -0.99  # never off as a whole: the head's own probes
        assert greedy_ids(llm, PROMPTS[:1], longer) == ref
        active = [i for i, p in enumerate(passes) if p]
        assert len(active) >= 2 and passes[active[0]][0] == first
        assert all(passes[at][0] == 4 for at in active[1:])


def test_a_head_gated_off_for_long_is_shown_no_features_until_its_probe_nears(tmp_path):
    """While steps with the head measured slower and its next probe is further off than its
    catch-up window (Realized.quiet), decode steps show it no features; the window's steps
    before the probe do (a prefill always does), so the probe's catch-up runs the last
    `window` pairs, as it would have; output stays exact."""
    longer = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), PROMPTS[:1], longer)
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "lookup_branch": 0,
              "quantization": "none"}
    llm = tiny_llm(tmp_path, config)
    spec, probe, window = llm.engine.spec, 30, 4
    passes = _count_head_passes(llm, window=window)  # (counts engine steps too)
    spec.proposer.prompt_window = window  # (the features a first pass reads: feature_steps)
    spec.policy.draft_pays = lambda *args: True
    shown, observe = [], spec.proposer.observe
    spec.proposer.observe = lambda *args: (shown.append(len(passes) - 1), observe(*args))

    def quiet(batch, steps):
        assert steps == window
        return probe - (len(passes) - 1) > steps
    spec.policy.realized.quiet = quiet
    spec.policy.realized.speculate = lambda batch, fallback=False: SPEC if len(passes) - 1 >= probe else PLAIN
    assert greedy_ids(llm, PROMPTS[:1], longer) == ref
    assert shown[0] == 0 and not any(0 < s < probe - window for s in shown)  # the prefill, then none
    assert set(range(probe - window, len(passes))) <= set(shown)
    first = next(i for i, p in enumerate(passes) if p)
    assert first == probe and passes[first][0] == window  # the catch-up: the last `window` pairs, as after a gap


def test_a_request_whose_gate_is_off_is_shown_no_features_until_its_probe_nears(tmp_path):
    """A request whose own gate has the head off (it never pays) and whose next probe is
    further off than the features a probe needs is shown none; the steps up to each probe
    are, and every probe's catch-up runs the last `window` pairs; output stays exact."""
    longer = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), PROMPTS[:1], longer)
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "lookup_branch": 0,
              "quantization": "none"}
    llm = tiny_llm(tmp_path, config)
    passes, spec = _count_head_passes(llm, window=4), llm.engine.spec
    spec.proposer.prompt_window = 4
    spec.policy.realized.margin = -0.99  # never off as a whole: the request's own probes
    shown, observe = set(), spec.proposer.observe
    spec.proposer.observe = lambda *args: (shown.add(len(passes) - 1), observe(*args))
    assert greedy_ids(llm, PROMPTS[:1], longer) == ref
    probes = [i for i, p in enumerate(passes) if p]
    assert len(probes) >= 3 and all(passes[at][0] == 4 for at in probes)
    assert all(set(range(at - 3, at + 1)) <= shown for at in probes)  # (a step shows, then drafts)
    assert len(set(range(len(passes))) - shown) > len(passes) // 3  # most steps between probes unseen


def test_the_head_lets_go_of_the_features_it_has_run(tmp_path):
    """A feature is read once, when its pair goes through the head (the last pair may be run
    again after a rollback): a long generation keeps a few per request, not one per token, and
    output stays exact."""
    ref = greedy_ids(tiny_llm(tmp_path), PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "num_speculative_tokens": 4,
              "adaptive": False, "quantization": "none"}
    engine = tiny_llm(tmp_path, config).engine
    engine.add_request("r", PROMPTS[0]["prompt_token_ids"], SamplingParams(temperature=0.0, max_tokens=80,
                                                                           ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.outputs[0].token_ids
        cache = engine.spec.proposer.cache.get("r")
        if cache is not None:
            held.append((len(cache.feats), sum(f is not None for f in cache.feats)))
            # drafting runs in no grad-mode context: nothing it keeps may carry a graph
            assert cache.last_out is None or not (cache.last_out.requires_grad or cache.last_out.grad_fn)
    assert out == ref[0]
    assert held[-1][0] > 60 and max(live for _, live in held[2:]) <= 2 + 4 + 1  # 1 + drafts + the rerun one


def test_lookup_chains_alone_keep_greedy_output(tmp_path):
    """With the head gated off for good, tree methods still draft the grafted prompt-lookup
    chains (no head pass); the output is plain greedy's."""
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17]}, {"prompt_token_ids": [7, 7, 7, 7]}]
    ref = greedy_ids(tiny_llm(tmp_path), prompts)
    llm = tiny_llm(tmp_path, {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")),
                              "adaptive": False, "lookup_branch": 5})
    spec = llm.engine.spec
    spec.policy.draft_pays = lambda *args: False
    spec.proposer.propose = lambda batch: pytest.fail("a paused head drafted")
    assert greedy_ids(llm, prompts) == ref
    assert llm.engine.stats.spec_num_drafts > 0


def test_a_head_measured_slower_falls_back_to_its_lookup_chains(tmp_path):
    """Where the gate measured steps with the head slower than plain (Realized), the next steps
    draft the lookup chains alone (LOOKUP_ONLY: no head pass) and are timed as their own kind;
    the output is plain greedy's."""
    prompts = [{"prompt_token_ids": [5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17]}, {"prompt_token_ids": [7, 7, 7, 7]}]
    ref = greedy_ids(tiny_llm(tmp_path), prompts)
    llm = tiny_llm(tmp_path, {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")),
                              "lookup_branch": 5})
    spec, kinds = llm.engine.spec, []
    assert spec._fallback
    spec.policy.realized.speculate = lambda batch, fallback=False: LOOKUP_ONLY if fallback else PLAIN
    observe = spec.policy.realized.observe
    spec.policy.realized.observe = lambda b, kind, *a: (kinds.append(kind), observe(b, kind, *a))
    spec.policy.select = lambda batch, trees, *a, **k: [list(range(len(t))) for t in trees]  # verify all
    spec.proposer.propose = lambda batch: pytest.fail("the head drafted in a lookup-only step")
    assert greedy_ids(llm, prompts) == ref
    assert llm.engine.stats.spec_num_drafts > 0 and LOOKUP_ONLY in kinds and SPEC not in kinds


def test_tree_config_keys_reach_the_proposer(tmp_path):
    from specserve.spec_decode.methods import _tree_proposer
    from specserve.model.quant import Int8Linear

    runner = tiny_llm(tmp_path).engine.runner
    head = str(write_eagle1(tmp_path / "head"))

    def make(**keys):
        extra = keys.pop("extra", {})
        return _tree_proposer(SpecConfig(method="eagle", model=head, extra=extra, **keys), runner, "tiny", 256)

    prop = make(num_speculative_tokens=6, depth=3, topk=5)
    assert (prop.m, prop.depth, prop.topk) == (6, 3, 5)
    prop = make()
    assert (prop.m, prop.depth, prop.topk) == (8, 4, 2)  # the defaults
    assert SpecConfig.parse('{"method": "eagle"}').num_speculative_tokens == 8
    assert SpecConfig.parse("none").method is None and SpecConfig.parse("auto").method == "auto"
    prop = make(extra={"quantization": "int8"})
    assert isinstance(prop.draft.fc, Int8Linear) and isinstance(prop._lm_head, Int8Linear)
    assert not isinstance(make(extra={"quantization": "none"}).draft.fc, Int8Linear)
    with pytest.raises(ValueError, match="quantization"):
        make(extra={"quantization": "int4"})


def test_medusa_tree_is_validated():
    from specserve.spec_decode.medusa import medusa_plan

    # paths (0,), (1,), (0, 2): shorter first as (head, rank, prefix), then depth first
    assert medusa_plan([[1], [0], [0, 2], [0, 2, 1]], 2) == ([(0, 0, -1), (0, 1, -1), (1, 2, 0)], [0, 2, 1])
    with pytest.raises(ValueError, match="deeper than the 2 heads"):
        medusa_plan([[0, 0, 0]], 2)
    for bad, message in [([], "non-empty list"), ([[0, -1]], "integers >= 0"), ([[]], "non-empty"),
                         ([["a"]], "integers"), ([[0, 1]], "lacks its prefix"), ({"0": 1}, "list of paths")]:
        with pytest.raises(ValueError, match=message):  # when the config is made
            SpecConfig(method="medusa", model="heads", extra={"medusa_tree": bad})


def test_medusa_trees_come_depth_first_and_a_budget_keeps_the_shorter_paths(tmp_path, monkeypatch):
    """Medusa's tree lists its nodes depth first (rank paths in lexicographic order); a budget
    smaller than the tree keeps the shorter paths first, as before the order changed. A top-k
    taken by PyTorch (as on a GPU) gives the C the same trees."""
    llm = tiny_llm(tmp_path, {"method": "medusa", "model": str(write_medusa(tmp_path / "heads")),
                              "adaptive": False, "quantization": "none", "lookup_branch": 0})
    prop = llm.engine.spec.proposer
    req = Request("r", [5, 9, 17, 33], SamplingParams(temperature=0), set(), 0)
    req.all_token_ids.append(11)  # one pending token: the heads read the feature before it
    prop.observe(["r"], [3], [1], torch.randn(1, TINY["hidden_size"]))
    full = check_tree(prop.propose(propose_batch([req], 64))[0])
    assert full.dfs and len(full) == len(prop.plan) and not full.is_chain
    assert [h for h, _, _ in prop.plan] == sorted(h for h, _, _ in prop.plan)  # the plan: shorter paths first
    for budget in (1, 4, 6):
        cut = check_tree(prop.propose(propose_batch([req], budget))[0])
        assert cut.dfs and len(cut) == budget
        # the full tree's node j is the plan's path prop.dfs[j]: the cut keeps the plan's first ones
        want = {(t, s) for j, (t, s) in enumerate(zip(full.tokens, full.scores)) if prop.dfs[j] < budget}
        assert set(zip(cut.tokens, cut.scores)) == want
    assert torch.is_grad_enabled() and not any(p.requires_grad for p in prop.heads.parameters())  # no graph
    from_logits = [prop.propose(propose_batch([req], budget))[0] for budget in (4, 64)]
    real = layer_ops.rows_view  # as on a GPU: the top-k taken by PyTorch, the trees from it
    monkeypatch.setattr(layer_ops, "rows_view", lambda x: None if x.shape[1] > prop.width else real(x))
    given = [prop.propose(propose_batch([req], budget))[0] for budget in (4, 64)]
    assert [(t.tokens, t.parents) for t in given] == [(t.tokens, t.parents) for t in from_logits]
    for a, b in zip(given, from_logits):  # PyTorch's log-softmax, not the C's: to ~1e-6
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


@pytest.mark.parametrize("min_score,d2t", [(-math.inf, False), (-6.0, True), (-4.5, False)])
def test_medusa_trees_is_the_python_walk(min_score, d2t):
    from specserve.spec_decode.medusa import DEFAULT_MEDUSA_TREE, medusa_plan

    plan, dfs = medusa_plan(DEFAULT_MEDUSA_TREE, 4)
    g = torch.Generator().manual_seed(1)
    heads, b, width = 4, 6, 4
    logits = 3 * torch.randn(heads * b, 300, generator=g)  # row k * b + j: head k, request j
    ids = torch.randperm(49152, generator=g)[:300] if d2t else None  # the heads' vocabulary in the target's
    budgets = [16, 3, 0, 18, 7, 1]
    top_lp, top = layer_ops.top_logprobs(logits, width)
    top = ids[top] if d2t else top
    want = tree_reference.medusa_trees(plan, dfs, top_lp.view(heads, b, width).tolist(),
                                       top.view(heads, b, width).tolist(), budgets, min_score)
    build = tree_ops.medusa_tree_builder(heads, width, ids, torch.tensor(plan), torch.tensor(dfs))
    got = build(layer_ops.rows_view(logits), budgets, min_score)
    assert got == want == build(layer_ops.rows_view(top_lp), budgets, min_score, top.data_ptr())  # top-k given
    assert not got[2][0] and all(len(t[0]) <= n for t, n in zip(got, budgets))
    if min_score == -math.inf:
        assert [len(t[0]) for t in got] == budgets[:3] + [18, 7, 1]
    else:
        assert any(0 < len(t[0]) < n for t, n in zip(got, budgets))  # the score cut took some


def test_eagle_and_medusa_grow_their_trees_in_c_and_say_so_without_it(monkeypatch):
    """Without their C (tree_ops) "auto" takes prompt lookup, and EAGLE and Medusa say why."""
    from specserve.config import DEFAULT_MODEL
    from specserve.spec_decode.methods import _tree_proposer, resolve

    assert tree_ops.available(), tree_ops.why_unavailable()
    monkeypatch.setattr(tree_ops, "available", lambda: False)
    assert resolve(SpecConfig(method="auto"), DEFAULT_MODEL).method == "ngram"
    monkeypatch.setattr(tree_ops, "available", lambda: True)
    assert resolve(SpecConfig(method="auto"), DEFAULT_MODEL).method == "eagle"
    monkeypatch.setattr(tree_ops, "available", lambda: False)
    for method in ("eagle", "medusa"):
        with pytest.raises(ValueError, match=f"method '{method}' grows its trees in C.*use 'ngram'"):
            _tree_proposer(SpecConfig(method=method, model="heads"), None, DEFAULT_MODEL, 256)


def test_graft_merges_a_chain_into_a_tree_and_select_reindexes():
    tree = DraftTree([10, 11, 12, 13], [-1, -1, 0, 1], scores=[-0.1, -0.2, -0.3, -0.4])
    merged, path = tree.graft([10, 12, 7, 8])  # shares 10 -> 12, then new nodes
    assert merged.tokens == [10, 11, 12, 13, 7, 8]
    assert merged.parents == [-1, -1, 0, 1, 2, 4]
    assert path == [0, 2, 4, 5] == merged.graft([10, 12, 7, 8])[1]  # grafted again: all found
    assert merged.graft([10, 12, 7, 8])[0].tokens == merged.tokens
    assert merged.scores == [-0.1, -0.2, -0.3, -0.4, None, None]
    sub = merged.select([0, 2, 4])
    assert (sub.tokens, sub.parents, sub.scores) == ([10, 12, 7], [-1, 0, 1], [-0.1, -0.3, None])
    assert DraftTree([], []).graft([3, 4]) == (DraftTree([3, 4], [-1, 0], None, [None, None], True), [0, 1])
    # depth first: kept where the new nodes hang off the tree's last path, else not
    dfs = DraftTree([10, 12, 11, 13], [-1, 0, -1, 2], dfs=True)
    assert check_tree(dfs.graft([11, 13, 9])[0]).dfs and check_tree(dfs.graft([11, 8])[0]).dfs
    assert check_tree(dfs.graft([14])[0]).dfs and check_tree(dfs.graft([11, 13])[0]).dfs
    assert not dfs.graft([10, 7])[0].dfs and not tree.graft([14])[0].dfs
    assert DraftTree([], []).graft([3, 4])[0].dfs and check_tree(dfs.prefix(3)).dfs
    with pytest.raises(AssertionError, match="distinct"):
        check_tree(DraftTree([5, 5], [-1, -1]))


@pytest.mark.parametrize("f32_kernel,fused,pooled", [(False, False, False), (False, True, False),
                                                     (True, True, False), (False, False, True)])
def test_draft_pass_over_head_kv_matches_the_head_over_the_whole_sequence(f32_kernel, fused, pooled):
    """Drafting (DraftPass: fused products, our float32 kernel or PyTorch's, layer_ops or not)
    feeds the head a few pairs at a time through HeadKV (grown as it fills, read in place) or a
    HeadKVPool's blocks (gathered, padded); the outputs equal the training network's one causal
    pass over the whole sequence."""
    if (f32_kernel and not cpu_linear.available()) or (fused and not layer_ops.available()):
        pytest.skip("CPU kernels unavailable")
    torch.manual_seed(0)
    head = EagleHead(ModelArch.from_dict(HEAD))
    draft = DraftPass(head, lambda w, b: draft_linear(w, b, 0, f32_kernel))
    draft.fused = fused
    t, hidden = 150, TINY["hidden_size"]
    feats, embeds, pos = torch.randn(1, t, hidden), torch.randn(1, t, hidden), torch.arange(t)
    with torch.no_grad():
        whole = head(feats, embeds, pos)[0][0]
    arch = head.arch
    pool = HeadKVPool(arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu"))
    buffers, outs, start = pool.new() if pooled else HeadKV(), [], 0
    for size in (5, 1, 60, 2, 82):  # grows past 64 and 128 entries
        end = start + size
        outs.append(draft(feats[0, start:end], embeds[0, start:end], pos[start:end],
                          [Segment(buffers, start, size, None)]))
        start = end
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)


def _tree_mask(past: int, entries: list[list[int]], width: int) -> torch.Tensor:
    """A drafting pass's mask as eagle_next_pass makes it: each row sees the `past` committed
    pairs, then the tree entries listed (its ancestors and itself)."""
    mask = torch.zeros(len(entries), width, dtype=torch.bool)
    mask[:, :past] = True
    for row, seen in zip(mask, entries):
        row[seen] = True
    return mask


@pytest.mark.parametrize("quantize", [0, "a8", "int8"])
def test_head_pass_in_one_c_call_matches_the_python_pass(quantize):
    """DraftPass.tokens over a HeadKVPool runs the whole pass as one C call (decoder.c:
    head_pass; the products, norm, rotary and activation kernels of the Python path, the paged
    attention kernel for SDPA): over two requests' causal catch-ups (one of 37 rows: runs of at
    most 16), then tree rows that see committed pairs, ancestors and themselves (one row not
    every committed pair), its outputs and the K/V it writes equal the Python pass's to float
    rounding; an id or a position past its table is an error, not a read out of bounds."""
    from specserve.kernels.cpu import decoder
    from specserve.spec_decode.quant import A8, INT8_ALWAYS

    if not (decoder.available() and cpu_linear.available()) or (quantize == "a8" and not cpu_linear.a8_available()):
        pytest.skip("CPU kernels unavailable")
    code = {0: 0, "a8": A8, "int8": INT8_ALWAYS}[quantize]
    torch.manual_seed(0)
    head = EagleHead(ModelArch.from_dict(HEAD))
    with torch.no_grad():
        head.layers[0].post_attention_layernorm.weight.uniform_(0.5, 1.5)
    embed = torch.randn(96, 64)
    fast = DraftPass(head, lambda w, b: draft_linear(w, b, code, True), embed=embed)
    slow = DraftPass(head, lambda w, b: draft_linear(w, b, code, True), embed=embed)
    assert fast.c_pass is not None
    slow.c_pass = None  # the same products, the pass in Python
    arch = head.arch
    pools = [HeadKVPool(arch.num_kv_heads, arch.head_dim, torch.float32, torch.device("cpu")) for _ in range(2)]
    kvs = [[pool.new(), pool.new()] for pool in pools]
    passes = [[(0, 37, None), (0, 5, None)],
              [(37, 2, _tree_mask(37, [[37], [38]], 39)), (5, 3, _tree_mask(5, [[5], [6], [7]], 8))],
              [(39, 2, _tree_mask(37, [[37, 39], [38, 40]], 41)), (8, 1, _tree_mask(3, [[6, 8]], 9))]]
    for rows in passes:
        n = sum(t for _, t, _ in rows)
        feats, ids = torch.randn(n, 64), torch.randint(0, 96, (n,))
        positions = torch.cat([torch.arange(past, past + t) for past, t, _ in rows])
        outs = [draft.tokens(feats, ids, positions, [Segment(kv, past, t, mask)
                                                     for kv, (past, t, mask) in zip(kv_pair, rows)])
                for draft, kv_pair in zip((fast, slow), kvs)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)
    for a, b in zip(kvs[0], kvs[1]):
        end = 41 if len(a.blocks) > 1 else 9
        got, want = a.slots(0, end), b.slots(0, end)
        torch.testing.assert_close(pools[0].k[got], pools[1].k[want], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(pools[0].v[got], pools[1].v[want], atol=1e-5, rtol=1e-4)
    for bad_ids, bad_pos in (([96], [3]), ([-1], [3]), ([4], [head.rotary.cos.shape[0]])):
        with pytest.raises(ValueError, match="past its table"):
            fast.tokens(torch.randn(1, 64), torch.tensor(bad_ids), torch.tensor(bad_pos),
                        [Segment(kvs[0][0], 41, 1, None)])


def test_the_head_pass_runs_in_c_on_a_cpu_unless_told_not_to(tmp_path, monkeypatch):
    """On a CPU float32 model whose head products are our kernels the proposer keeps its head
    K/V in a pool and runs each pass as one C call; SPECSERVE_DRAFT_KV=per_request keeps the
    per-request K/V and the pass in Python. Greedy output is plain decoding's either way."""
    from specserve.kernels.cpu import decoder

    if not (decoder.available() and cpu_linear.available()):
        pytest.skip("CPU kernels unavailable")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 3 for j in range(5)]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), prompts, params)
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "num_speculative_tokens": 6,
              "adaptive": False, "depth": 3, "topk": 2, "quantization": "int8"}
    for choice, in_c in (("auto", True), ("per_request", False)):
        monkeypatch.setenv("SPECSERVE_DRAFT_KV", choice)
        llm = tiny_llm(tmp_path, config)
        prop = llm.engine.spec.proposer
        assert (prop.pool is not None) == in_c == (prop.draft.c_pass is not None)
        calls = []
        if in_c:  # every pass of the run goes through the C call
            c_pass = prop.draft.c_pass
            prop.draft.c_pass = lambda *a: calls.append(len(a[0])) or c_pass(*a)
        assert greedy_ids(llm, prompts, params) == ref and llm.engine.stats.spec_num_drafts >= 4
        if in_c:
            assert len(calls) >= 4 and not prop.cache and len(prop.pool.free) == prop.pool.num_blocks


@pytest.mark.parametrize("aux", [(), (0, 1)], ids=["eagle2", "eagle3"])
def test_training_time_test_matches_the_proposers_deep_drafts(tmp_path, aux):
    """train.unrolled's step j is what a depth-j node computes at inference: a top-1 chain
    drafted by EagleProposer equals the argmax of the unrolled steps over the same tokens;
    also for an EAGLE-3 head (features fused from the target layers' outputs, its own norm
    before the LM head)."""
    from specserve.spec_decode.training.train import _draft_logits, ttt_mask, unrolled

    assert ttt_mask(4, 2).int().tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 1, 0, 0],
                                             [1, 1, 0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 0, 1]]
    arch = ModelArch.from_dict(TINY)
    runner = ModelRunner(None, arch, ModelConfig(load_format="dummy", seed=3, dtype="float32"),
                         CacheConfig(block_size=4, num_blocks=64), 256)
    runner.set_aux_layers(aux)
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    head = EagleHead(ModelArch.from_dict(HEAD), aux_layers=aux, out_norm=bool(aux))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_eagle(head, None, tmp_path / "head", dtype=torch.float32)
    prop = EagleProposer(runner.model, tmp_path / "head", 3, depth=3, topk=1)
    req = Request("r", [5, 9, 17, 33, 2, 8, 8, 1, 4, 60, 12], SamplingParams(temperature=0), set(), 0)
    h = prompt_features(runner, kv, req)  # f_0..f_{n-1} (eagle3: the two layers' outputs)
    assert h.shape[1] == 64 * (1 + len(aux))
    prop.observe(["r"], [0], [len(h)], h)
    req.all_token_ids.append(60)
    chain = prop.propose(propose_batch([req], 3))[0]
    assert chain.is_chain and len(chain) == 3
    seq = req.all_token_ids + chain.tokens
    n = req.num_tokens - 1
    feats = h  # [n, hidden]: what it was shown (it lets go of the features of pairs it has run)
    feats = torch.cat([feats, torch.zeros(3, feats.shape[1])])[None]  # positions >= n: unused
    embeds = runner.model.embed_tokens.weight[torch.tensor(seq[1:n + 4])][None]
    with torch.no_grad():
        outs = unrolled(prop.head, feats, embeds, 3)
    lm = runner.model.lm_head.weight
    assert chain.tokens == [int(_draft_logits(prop.head, outs[j][0, n - 1 + j], lm).argmax()) for j in range(3)]
    kv.free(req)


@pytest.mark.parametrize("with_map", [False, True])
def test_eagle_children_in_one_c_call_are_the_python_reference(with_map):
    """EAGLE's children of a pass (top-k per parent, scores, the next frontier: the k best new
    nodes, the earlier on ties, above the score cut) come the same from the C call over the
    logits, over a top-k given (as on a GPU), and from the plain-Python reference, over two
    passes, ties included."""
    from specserve.spec_decode.eagle import _Growing

    g = torch.Generator().manual_seed(5)
    prop = EagleProposer.__new__(EagleProposer)  # what _add_children reads, alone
    prop.topk, prop._lm_head = 3, lambda x: x
    prop.d2t = torch.randperm(5000, generator=g)[:300] if with_map else None
    prop._d2t_ptr = 0 if prop.d2t is None else prop.d2t.data_ptr()
    roots, later = 3 * torch.randn(3, 300, generator=g), 3 * torch.randn(9, 300, generator=g)
    roots[1] = 0.5  # one row of ties: its children score alike
    later[0, :4] = later[0].max() + 1  # a parent whose best children tie

    def reference(grow, parents, logits, cut):
        tree_reference.eagle_children(grow, parents, *layer_ops.top_logprobs(logits, 3, prop.d2t), 3, cut)

    def given(grow, parents, logits, cut):  # the top-k taken already (on a GPU: by PyTorch)
        val, idx = layer_ops.top_logprobs(logits, 3, prop.d2t)
        tree_ops.eagle_children(layer_ops.rows_view(val), 3, 0, cut, grow, parents, idx.data_ptr())

    results = []
    for add in (prop._add_children, given, reference):
        grow = [_Growing(None, 10) for _ in range(3)]
        add(grow, [[-1]] * 3, roots, -7.0)
        parents = [list(t.frontier) for t in grow]
        add(grow, parents, later[:sum(map(len, parents))], -4.0)
        results.append([(t.tokens, t.scores, t.parents, t.out_row, t.rows, t.frontier) for t in grow])
    assert results[0] == results[1] == results[2]
    assert any(len(t[5]) < 3 for t in results[0]) and any(len(t[5]) == 3 for t in results[0])  # the cut took some
    with pytest.raises(ValueError):  # a row per parent
        tree_ops.eagle_children(layer_ops.rows_view(roots), 3, 0, -7.0, [_Growing(None, 10)], [[-1, -1]])


def test_eagle_next_pass_in_one_c_call_is_the_python_reference():
    """The inputs of EAGLE's next head passes (rows, positions, parents' rows, masks over the
    committed pairs and each node's ancestors) and the trees' bookkeeping come the same from
    the C call as from the plain-Python reference, over three depths; also handed to a device
    (here torch.device("cpu"): the one-copy path a GPU takes)."""
    from types import SimpleNamespace

    from specserve.spec_decode.eagle import _Growing

    g = torch.Generator().manual_seed(7)
    prop = EagleProposer.__new__(EagleProposer)
    prop.topk, prop._lm_head, prop.d2t, prop._d2t_ptr = 2, (lambda x: x), None, 0
    pairs = [5, 0, 3] + list(range(7, 20))  # 16 requests: rows past any first guess of their number
    logits = [3 * torch.randn(2 * len(pairs), 50, generator=g) for _ in range(4)]
    runs = []
    on_device = partial(tree_ops.eagle_next_pass, device=torch.device("cpu"))
    for next_pass in (tree_ops.eagle_next_pass, on_device, tree_reference.eagle_next_pass):
        grow = [_Growing(SimpleNamespace(pairs=p, kv=None), 20 + p) for p in pairs]
        prop._add_children(grow, [[-1]] * len(pairs), logits[0][:len(pairs)], -3.0)
        passes = []
        for d in range(1, 4):
            step = next_pass(grow, d)
            if step is None:
                break
            active, ids, positions, src, masks = step
            passes.append((active, ids.tolist(), positions.tolist(), src.tolist(),
                           [(m.tolist(), past, f) for m, past, f in masks]))
            prop._add_children([grow[b] for b in active], [grow[b].frontier for b in active],
                               logits[d][:len(ids)], -3.0)
        runs.append((passes, [(t.tokens, t.parents, t.rows, t.out_row, t.expanded, t.frontier) for t in grow]))
    assert runs[0] == runs[1] == runs[2]
    assert len(runs[0][0]) >= 2 and any(len(p[0]) < len(pairs) for p in runs[0][0])  # deeper passes, some done


@pytest.mark.parametrize("method,given", [("eagle", False), ("medusa", False), ("eagle", True), ("medusa", True)])
def test_trees_of_ten_requests_at_once_equal_plain_greedy(tmp_path, monkeypatch, method, given):
    """Ten requests drafting and verifying together (a step's host calls then carry dozens of
    tree rows: EAGLE's frontier passes, Medusa's trees, the greedy walk) keep plain greedy;
    also with the drafts' top-k taken by PyTorch and handed to the C (`given`: a GPU's way)."""
    if given:
        real = layer_ops.rows_view
        monkeypatch.setattr(layer_ops, "rows_view", lambda x: None if x.shape[1] > 4 else real(x))
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 3 for j in range(5)]} for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), prompts, params)
    head = write_eagle1(tmp_path / "head") if method == "eagle" else write_medusa(tmp_path / "head")
    config = {"method": method, "model": str(head), "num_speculative_tokens": 10, "adaptive": False,
              "quantization": "none", **({"depth": 4, "topk": 3} if method == "eagle" else {})}
    llm = tiny_llm(tmp_path, config)
    assert greedy_ids(llm, prompts, params) == ref
    assert llm.engine.stats.spec_num_drafts >= 10


def test_pooled_head_kv_keeps_greedy_and_gives_every_block_back(tmp_path, monkeypatch):
    """SPECSERVE_DRAFT_KV=pooled (a GPU's default): ten requests' head K/V in one pool, each
    drafting pass's attention one padded call for all of them; plain greedy is kept and every
    block is back in the pool once the requests are done."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 3 for j in range(5)]} for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), prompts, params)
    monkeypatch.setenv("SPECSERVE_DRAFT_KV", "pooled")
    calls = []
    for name in ("_attend_pooled", "_paged_meta"):  # (the pass in Python, or in C where it can be)
        real = getattr(eagle_head, name)
        monkeypatch.setattr(eagle_head, name, lambda segs, *a, real=real: calls.append(len(segs)) or real(segs, *a))
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "num_speculative_tokens": 10,
              "adaptive": False, "depth": 4, "topk": 3}
    llm = tiny_llm(tmp_path, config)
    assert greedy_ids(llm, prompts, params) == ref
    pool = llm.engine.spec.proposer.pool
    assert pool is not None and max(calls) == 10 and llm.engine.stats.spec_num_drafts >= 10
    assert not llm.engine.spec.proposer.cache and len(pool.free) == pool.num_blocks
    monkeypatch.setenv("SPECSERVE_DRAFT_KV", "paged")
    with pytest.raises(ValueError, match="SPECSERVE_DRAFT_KV"):
        tiny_llm(tmp_path, config)


def test_an_eagle3_head_grown_from_an_eagle2_one_drafts_the_same(tmp_path):
    """train-draft --init EAGLE-2 --aux-layers: the grown head computes what the EAGLE-2 head
    did (the fusion passes the final hidden state through), saves and loads as EAGLE-3."""
    from specserve.spec_decode.training.train import grow_eagle3

    arch = ModelArch.from_dict(TINY)
    old = load_eagle(write_eagle1(tmp_path / "eagle1"), arch)[0]
    grown = grow_eagle3(old, (0, 1), 512)
    f, aux, e = torch.randn(1, 6, 64), torch.randn(1, 6, 128), torch.randn(1, 6, 64)
    with torch.no_grad():
        want = old(f, e, torch.arange(6))[0]
        got = grown(grown.fuse(grown.fuse_input(torch.cat([f, aux], -1))), e, torch.arange(6))[0]
    torch.testing.assert_close(got, want)
    save_eagle(grown, None, tmp_path / "grown", dtype=torch.float32)
    loaded = load_eagle(tmp_path / "grown", arch)[0]
    assert loaded.aux_layers == (0, 1) and loaded.norm is None and loaded.fuse is not None


def _proposer_with_requests(tmp_path, depth: int, topk: int, device: str = "cpu"):
    """An EagleProposer on the tiny model (float32, on `device`) and three requests it has
    seen, each with one pending token; the requests and their KV manager."""
    arch = ModelArch.from_dict(TINY)
    config = ModelConfig(load_format="dummy", seed=3, device=device, dtype="float32")
    runner = ModelRunner(None, arch, config, CacheConfig(4, 64), 256)
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    prop = EagleProposer(runner.model, write_eagle1(tmp_path / "eagle", seed=depth), 8, depth=depth, topk=topk)
    reqs = [Request(str(i), p, SamplingParams(temperature=0), set(), 0)
            for i, p in enumerate([[5, 9, 17, 33, 2], [7, 7, 1, 80, 44, 3, 12], [3, 4, 5]])]
    for r in reqs:
        h = prompt_features(runner, kv, r)
        prop.observe([r.request_id], [0], [len(h)], h)
        r.all_token_ids.append(11)
    return prop, reqs, kv


@pytest.mark.parametrize("pooled", [False, True], ids=["per_request", "pooled"])
@pytest.mark.parametrize("depth,topk", [(3, 3), (5, 2)])
def test_device_growth_builds_the_host_growths_trees(tmp_path, monkeypatch, pooled, depth, topk):
    """The growth on the device (eagle_grow: every frontier expanded, no host round trip
    between depths) drafts the trees the host growth does, scores to the bit, with and
    without a score cut (the cut's nodes then dropped afterwards), over either head K/V."""
    from specserve.spec_decode.eagle_grow import DeviceGrowth

    monkeypatch.setenv("SPECSERVE_DRAFT_KV", "pooled" if pooled else "per_request")
    prop, reqs, kv = _proposer_with_requests(tmp_path, depth, topk)
    assert prop.growth is None  # the host's, on a CPU
    prop.draft.c_pass = None  # (the host's passes in Python: the device growth's attention is SDPA's too)
    device = DeviceGrowth(prop.draft, prop._lm_head, prop.d2t, prop.embed, depth, topk)
    cut_some = 0
    for cut in (-math.inf, -3.0, -1.5, math.log(0.999)):
        prop.growth = None
        want = prop.propose(propose_batch(reqs, 8, cut))
        prop.growth = device
        got = prop.propose(propose_batch(reqs, 8, cut))
        for w, g in zip(want, got):
            assert (w is None) == (g is None)
            if w is not None:
                assert (g.tokens, g.parents, g.scores, g.dfs) == (w.tokens, w.parents, w.scores, w.dfs)
                cut_some += len(w) < 8
    assert cut_some and want == [None, None, None]  # the cuts pruned some trees, the last all
    for r in reqs:
        kv.free(r)


def test_device_growth_has_no_host_round_trip():
    """The growth's ops run on the meta device, where anything that reads a value back
    (.item(), .tolist(), a mask's nonzero, a data-dependent shape) raises: what lets a CUDA
    graph capture them."""
    from specserve.spec_decode.eagle_grow import DeviceGrowth

    head = EagleHead(ModelArch.from_dict(HEAD)).to("meta")
    draft = DraftPass(head, lambda w, b: partial(torch.nn.functional.linear, weight=w, bias=b), fused=False)
    embed = torch.empty(96, 64, device="meta")
    lm = embed[:48].t()
    growth = DeviceGrowth(draft, lambda x: x @ lm, torch.empty(48, dtype=torch.int64, device="meta"), embed, 4, 2)
    b, width = 3, 16 + growth.entries

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    out = growth.run(empty(b, 64), empty(b, width, 2, 16), empty(b, width, 2, 16), empty(b, dtype=torch.int64),
                     empty(b, dtype=torch.int64))
    assert [o.shape for o in out] == [(b, growth.nodes)] * 3 and growth.nodes == 2 + 3 * 4


def test_device_growth_in_the_engine_keeps_greedy(tmp_path, monkeypatch):
    """SPECSERVE_DRAFT_GROWTH=device through the engine: ten requests at once keep plain greedy;
    an unknown choice, and graphs off CUDA, are refused with the variable's name."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 3 for j in range(5)]} for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = greedy_ids(tiny_llm(tmp_path), prompts, params)
    config = {"method": "eagle", "model": str(write_eagle1(tmp_path / "head")), "num_speculative_tokens": 10,
              "adaptive": False, "depth": 4, "topk": 3}
    monkeypatch.setenv("SPECSERVE_DRAFT_GROWTH", "device")
    llm = tiny_llm(tmp_path, config)
    assert llm.engine.spec.proposer.growth is not None
    assert greedy_ids(llm, prompts, params) == ref and llm.engine.stats.spec_num_drafts >= 10
    for bad in ("gpu", "graphs"):
        monkeypatch.setenv("SPECSERVE_DRAFT_GROWTH", bad)
        with pytest.raises(ValueError, match="SPECSERVE_DRAFT_GROWTH"):
            tiny_llm(tmp_path, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_captured_growth_on_cuda_drafts_the_host_growths_trees(tmp_path):
    """On CUDA (SPECSERVE_DRAFT_GROWTH's default there): the growth's graphs, captured for
    every bucket, replay the uncaptured ops' trees bit for bit and the host growth's trees
    (its attention reads the same K/V in another layout: scores to rounding)."""
    prop, reqs, kv = _proposer_with_requests(tmp_path, 4, 2, "cuda")
    growth = prop.growth
    assert growth is not None and growth.use_graphs and not growth._graphs
    assert growth.capture(4, 256) > 0 and (4, 256) in growth._graphs and (1, 64) in growth._graphs
    for cut in (-math.inf, -3.0):
        graphs = prop.propose(propose_batch(reqs, 8, cut))
        growth.use_graphs, saved, growth._graphs = False, growth._graphs, {}
        eager = prop.propose(propose_batch(reqs, 8, cut))
        prop.growth = None
        host = prop.propose(propose_batch(reqs, 8, cut))
        prop.growth, growth._graphs, growth.use_graphs = growth, saved, True
        for g, e, h in zip(graphs, eager, host):
            if h is None:
                assert g is None and e is None
                continue
            assert (g.tokens, g.parents, g.scores) == (e.tokens, e.parents, e.scores)
            assert (g.tokens, g.parents) == (h.tokens, h.parents)
            assert g.scores == pytest.approx(h.scores, abs=1e-4)
    for r in reqs:
        kv.free(r)


def test_captured_buckets_take_each_call_padded(tmp_path, monkeypatch):
    """The graphs' host side, on a CPU: capture() makes a bucket for every power of two of
    requests and context within GRAPH_BYTES, their K/V views of one buffer; a call fills the
    bucket of its batch and longest context (padding rows and stale entries masked) and
    replays it, drafting the host growth's trees. A stand-in replays the ops where CUDA would
    replay their graph."""
    import specserve.spec_decode.eagle_grow as eagle_grow

    class Replay:  # what a CUDA graph does on replay: the captured ops over the same buffers
        def __init__(self, growth, inputs):
            self.run = lambda: growth.run(inputs[0], inputs[1], inputs[2], inputs[3][0], inputs[3][1])
            self.outputs, self.replays = self.run(), 0

        def replay(self):
            for old, new in zip(self.outputs, self.run()):
                old.copy_(new)
            self.replays += 1

    def capture_one(growth, inputs):
        graph = Replay(growth, inputs)
        return eagle_grow._Captured(graph, inputs, graph.outputs)

    monkeypatch.setattr(eagle_grow.DeviceGrowth, "_capture_one", capture_one)
    prop, reqs, kv = _proposer_with_requests(tmp_path, 4, 2)
    growth = prop.growth = eagle_grow.DeviceGrowth(prop.draft, prop._lm_head, prop.d2t, prop.embed, 4, 2, True)
    monkeypatch.setattr(eagle_grow, "GRAPH_BYTES", growth._entry_bytes() * 4 * (128 + growth.entries))
    assert growth.capture(3, 200) > 0
    assert sorted(growth._graphs) == [(1, 64), (1, 128), (1, 256), (2, 64), (2, 128), (2, 256), (4, 64), (4, 128)]
    assert len({g.inputs[1].data_ptr() for g in growth._graphs.values()}) == 1  # one K buffer for all
    for cut in (-math.inf, -3.0):
        for batch in (reqs, reqs[:1]):
            got = prop.propose(propose_batch(batch, 8, cut))
            prop.growth = None
            want = prop.propose(propose_batch(batch, 8, cut))
            prop.growth = growth
            assert [(t.tokens, t.parents) if t else None for t in got] == \
                [(t.tokens, t.parents) if t else None for t in want]
            assert all(t is None or t.scores == pytest.approx(w.scores, abs=1e-5) for t, w in zip(got, want))
    assert growth._graphs[(4, 64)].graph.replays == 2 and growth._graphs[(1, 64)].graph.replays == 2
    for r in reqs:
        kv.free(r)
