"""The compiled step on the CPU (model/compiled.py): attention as registered ops, static padded
step buffers, one graph without breaks or host syncs, and the same tokens as the eager path.

The compiled tests use inductor's CPU backend on a tiny random model, with its vectorized
code generation off (half the C++ build time; the arithmetic is the same PyTorch ops).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import SamplingParams
from specserve.kernels.triton.paged_attention import paged_attention_ref
from specserve.kernels.triton.tree_attention import tree_attention_ref
from specserve.model import tree_mask as trees
from specserve.model.attention import OpAttention, get_attention_backend
from specserve.model.attention.ops import dense_attention_ref
from specserve.model.compiled import StepRunner, _layer_forward, step_mode
from specserve.model.step_buffers import Bucket, StepBuffers, bucket_of, buckets
from specserve.request import Request
from specserve.scheduler.scheduler import SchedulerOutput

LLM_ARGS = dict(max_model_len=256, num_blocks=64, dtype="float32", max_num_seqs=4, max_num_batched_tokens=128,
                speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})


@pytest.fixture(scope="module")
def eager_llm(make_llm, tiny_model_dir):
    """The CPU's default path: float32 through our C kernels, eager."""
    return make_llm(str(tiny_model_dir), **LLM_ARGS)


# -- the ops ----------------------------------------------------------------------------------

def _paged_batch(q_lens, prefix, hq=4, hkv=2, d=16, block_size=16, seed=0):
    """Random q and caches; each request's context in shuffled blocks; int32 metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq = [p + q for p, q in zip(prefix, q_lens)]
    per = [-(-s // block_size) for s in seq]
    num_blocks = sum(per) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in per:
        tables.append(order[i:i + n])
        i += n
    width = max(per)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=table,
                seq_lens=torch.tensor(seq, dtype=torch.int32), query_start_loc=qsl, scale=d ** -0.5)


def test_dense_op_matches_the_paged_and_tree_references():
    b = _paged_batch([1, 7, 1, 3], [30, 0, 17, 40])
    causal = dense_attention_ref(**b, tree_mask=None, max_query_len=7)
    via_op = torch.ops.specserve.dense_attention(b["q"], b["k_cache"][None], b["v_cache"][None], 0,
                                                 b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                                 None, b["scale"], 7)
    parents = [[-1], [-1, 0, 0, 1, 2, 2, 5], [-1], None]  # a tree, decodes, a chain
    mask = torch.from_numpy(trees.packed_step_mask(parents, [1, 7, 1, 3]))
    tree = dense_attention_ref(**b, tree_mask=mask, max_query_len=8)  # wider than the longest query
    paged_op = torch.ops.specserve.paged_attention(b["q"], b["k_cache"][None], b["v_cache"][None], 0,
                                                   b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                                   b["scale"], 7)
    tree_op = torch.ops.specserve.tree_attention(b["q"], b["k_cache"][None], b["v_cache"][None], 0,
                                                 b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                                 mask, b["scale"], 7)
    ref = paged_attention_ref(**b)
    tree_ref = tree_attention_ref(**b, tree_mask=mask)
    assert torch.allclose(causal, ref, atol=1e-5) and torch.equal(via_op, causal)
    assert torch.allclose(tree, tree_ref, atol=1e-5) and not torch.allclose(tree, ref, atol=1e-3)
    assert torch.allclose(paged_op, ref, atol=1e-6) and torch.allclose(tree_op, tree_ref, atol=1e-6)


def test_write_kv_op_writes_its_layer_and_slots_only():
    caches = [torch.zeros(3, 4, 16, 2, 8) for _ in range(2)]
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 17, 63])
    torch.ops.specserve.write_kv(k, v, caches[0], caches[1], 1, slots)
    flat_k, flat_v = caches[0].view(3, 64, 2, 8), caches[1].view(3, 64, 2, 8)
    assert torch.equal(flat_k[1, slots], k) and torch.equal(flat_v[1, slots], v)
    flat_k[1, slots], flat_v[1, slots] = 0, 0
    assert not caches[0].any() and not caches[1].any()


# -- buckets and buffers ------------------------------------------------------------------------

def test_buckets():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 20] and buckets(1) == [1] and buckets(3) == [1, 2, 3]
    sizes = buckets(64)
    assert [bucket_of(sizes, n) for n in (1, 3, 9, 17, 64, 65)] == [1, 4, 16, 24, 64, None]


def test_buffers_pad_requests_and_tokens_into_the_null_block():
    bufs = StepBuffers(max_tokens=32, max_seqs=8, max_blocks=6, max_width=8, block_size=4, null_block=9,
                       device=torch.device("cpu"))
    # request 0: 3 rows (a tree) after 5 tokens in blocks [2, 7]; request 1: a decode after 8 tokens
    ids, positions, meta = bufs.fill(Bucket(4, 16, 4), [11, 12, 13, 14], [5, 6, 6, 8], [8, 9], [3, 1],
                                     [[2, 7], [3, 4, 1]], [[-1, 0, 0], None])
    assert ids.tolist() == [11, 12, 13, 14] + [0] * 12
    assert positions.tolist() == [5, 6, 6, 8] + [0] * 12
    assert meta.query_start_loc.tolist() == [0, 3, 4, 5, 6]  # padding requests: one token each
    assert meta.seq_lens.tolist() == [8, 9, 1, 1]
    assert meta.block_tables[:, :3].tolist() == [[2, 7, 9], [3, 4, 1], [9, 9, 9], [9, 9, 9]]
    # slots by index position (5, 6, 7: block 7; 8: block 1), padding: the null slot
    assert meta.slot_mapping.tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 1 * 4 + 0] + [36] * 12
    words = meta.tree_mask[:, 0].tolist()
    assert words[:6] == [0b1, 0b11, 0b101, 0b1, 0b1, 0b1] and not any(words[6:])
    assert meta.max_query_len == 4 and meta.uniform
    _, _, decode = bufs.fill(Bucket(2, 2, 1), [7], [9], [10], [1], [[2, 7, 3]])
    assert decode.tree_mask.tolist() == [[1], [1]] and decode.query_start_loc.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="does not fit"):
        bufs.fill(Bucket(2, 2, 1), [1, 2, 3], [0, 1, 2], [3], [3], [[0]], None)


# -- a padded step gives the unpadded step's rows ------------------------------------------------

def _requests(engine, lengths, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for i, n in enumerate(lengths):
        req = Request(f"pad-{i}", rng.integers(3, engine.vocab_size, n).tolist(), SamplingParams(), set(), 0)
        engine.kv.allocate(req, n + 8)
        reqs.append(req)
    return reqs


def test_padded_step_gives_the_unpadded_rows(eager_llm):
    """Decode and verify steps (a tree, a chain, a decode) padded into buckets through the op
    backend give the eager path's rows (the final hidden states and an inner layer's outputs,
    which an EAGLE-3 head reads), write the same KV slots, and padding writes only the null
    block."""
    engine, runner = eager_llm.engine, eager_llm.engine.runner
    assert runner.steps is None  # the CPU's default path is the eager one
    reqs = _requests(engine, [20, 7, 33])
    runner.set_aux_layers((0,))
    try:
        runner.execute(SchedulerOutput(reqs, [r.num_tokens for r in reqs], [0, 0, 0]))  # prefill, eager
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            r.all_token_ids.append(r.all_token_ids[-1] + 1)  # the sampled token
        padded = StepRunner(runner, max_seqs=8, max_tokens=128, max_width=16, compile=False, graphs=False)
        decode = SchedulerOutput(reqs, [1, 1, 1], [0, 0, 0])
        for r, drafts in zip(reqs, ([5, 6, 7, 8], [9, 10], [])):
            r.spec_token_ids = drafts
        verify = SchedulerOutput(reqs, [5, 3, 1], [4, 2, 0])
        parents = [[-1, 0, 0, 1, 2], None, None]
        tables = [r.block_ids for r in reqs]
        assert padded.bucket([1, 1, 1], tables) == Bucket(4, 4, 1, 4)
        assert padded.bucket([5, 3, 1], tables) == Bucket(4, 32, 8, 4)
        owned = {b for r in reqs for b in r.block_ids}
        free = [b for b in range(runner.num_blocks) if b not in owned]
        results = []
        for sched, tree in ((decode, None), (verify, parents)):
            for r in reqs:
                r.num_computed_tokens = r.num_tokens - 1
            before = runner.k_cache.clone(), runner.v_cache.clone()
            runner.steps = None
            eager = runner.execute(sched, tree)
            after_eager = runner.k_cache.clone()
            runner.k_cache.copy_(before[0])
            runner.v_cache.copy_(before[1])
            runner.steps = padded
            try:
                out = runner.execute(sched, tree)
            finally:
                runner.steps = None
            results.append((eager, out, before[0], after_eager, runner.k_cache.clone()))
        null, real = runner.null_block, slice(0, runner.num_blocks)
        for eager, out, before, after_eager, after in results:
            assert out.logits.shape == eager.logits.shape and out.row_start == eager.row_start
            assert torch.equal(out.logits.argmax(-1), eager.logits.argmax(-1))
            assert torch.allclose(out.logits, eager.logits, atol=1e-4, rtol=1e-4)
            assert torch.allclose(out.all_hidden, eager.all_hidden, atol=1e-4)
            assert out.features.shape == eager.features.shape == (len(out.all_hidden), 2 * runner.arch.hidden_size)
            assert torch.allclose(out.features, eager.features, atol=1e-4)
            assert torch.allclose(after[:, real], after_eager[:, real], atol=1e-5)  # the same slots
            assert torch.equal(after[:, free], before[:, free])  # no other block
            assert torch.equal(after_eager[:, null], before[:, null])  # the eager path leaves it alone
            assert after[:, null].abs().sum() > 0  # padding rows write there
        assert padded.counts == {"decode": 1, "verify": 1, "eager": 0}
    finally:
        runner.model.aux_layers = ()
        for r in reqs:
            engine.kv.free(r)


# -- the compiled step --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_inductor():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
        yield


@pytest.fixture(scope="module")
def compiled_llm(make_llm, tiny_model_dir, quick_inductor):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_COMPILE", "1")
        return make_llm(str(tiny_model_dir), **LLM_ARGS)


def test_step_mode():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert step_mode(cpu) == (False, False)  # the CPU's eager path stays the default
    assert step_mode(cuda)[0] and step_mode(cuda)[1] == torch.cuda.is_available()
    assert step_mode(cuda, enforce_eager=True) == (False, False)
    assert step_mode(cuda, quantization="int8") == (False, False)
    # arithmetic that must round as eager ops do: graphs over the uncompiled step
    assert step_mode(cuda, eager_arithmetic=True) == (False, torch.cuda.is_available())
    assert step_mode(cpu, eager_arithmetic=True) == (False, False)


def _sample_steps(steps):
    """A decode step and a verify step with a tree, in the null block (nothing real is touched)."""
    null = steps.buffers.null_block
    decode = steps.buffers.fill(Bucket(2, 2, 1), [5, 6], [3, 4], [4, 5], [1, 1], [[null], [null]])
    tree = steps.buffers.fill(Bucket(2, 8, 4), [5, 6, 7, 8, 9], [3, 4, 4, 5, 9], [7, 10], [4, 1],
                              [[null], [null]], [[-1, 0, 0, 1], None])
    return decode, tree


def _layer_calls(steps, step) -> list[tuple]:
    """The arguments of a step's first two decoder-layer calls (the first has no residual yet),
    the layers run eagerly."""
    calls = []

    def record(*args):
        calls.append(args)
        return _layer_forward(*args)
    ids, positions, meta = step
    steps.model(ids, positions, steps.kv, meta, steps.backend, layer_fn=record)
    return calls[:2]


def _explain(args):
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        return torch._dynamo.explain(_layer_forward)(*args)


@torch.inference_mode()
def test_each_layer_is_one_graph_without_host_syncs(compiled_llm, monkeypatch):
    """The compiled region (a decoder layer: norms, products, rotary, attention ops, MLP) is
    one graph with no break, in a decode step and in a tree step, with and without the residual
    it is handed; and the check catches a host sync (a value read from a tensor)."""
    steps = compiled_llm.engine.runner.steps
    found = [_explain(args) for step in _sample_steps(steps) for args in _layer_calls(steps, step)]
    assert [(e.graph_count, e.graph_break_count) for e in found] == [(1, 0)] * 4
    decode_args = _layer_calls(steps, _sample_steps(steps)[0])[1]
    call = OpAttention.__call__

    def syncing(self, q, k, v, k_cache, v_cache, meta, scale):
        if int(meta.seq_lens.max()) > 0:
            return call(self, q, k, v, k_cache, v_cache, meta, scale)
        return q

    monkeypatch.setattr(OpAttention, "__call__", syncing)
    torch._dynamo.reset()
    try:
        with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)), \
                torch._dynamo.config.patch(capture_scalar_outputs=False):
            torch.compile(_layer_forward, fullgraph=True, backend="eager")(*decode_args)
    finally:
        torch._dynamo.reset()


@torch.inference_mode()
def test_an_invariant_layers_arithmetic_is_all_in_registered_ops(compiled_llm):
    """With the batch-invariant ops (`--batch-invariant`), the compiled layer holds no arithmetic
    of its own: only specserve's registered ops and views of their outputs. So the compiler has
    nothing to fuse or round otherwise than the eager path, and a step past the buckets (run
    eagerly) computes what a compiled one does; which is why such a step stays compiled."""
    import operator

    model = compiled_llm.engine.runner.model
    steps = compiled_llm.engine.runner.steps
    saved = [(m, m.invariant) for m in model.modules() if hasattr(m, "invariant")]
    lm_head_t = model.lm_head_t
    model.use_invariant_products()
    try:
        calls = [args for step in _sample_steps(steps) for args in _layer_calls(steps, step)]
        graphs = [g for args in calls for g in _explain(args).graphs]
    finally:
        for m, flag in saved:
            m.invariant = flag
        model.lm_head_t = lm_head_t
        torch._dynamo.reset()
    views = {"view", "reshape", "split", "contiguous", "size", "unsqueeze", "squeeze"}
    other = set()
    for g in graphs:
        for node in g.graph.nodes:
            if node.op == "call_method" and node.target not in views:
                other.add(node.target)
            elif node.op == "call_function" and node.target is not operator.getitem \
                    and not str(node.target).startswith("specserve."):
                other.add(str(node.target))
    assert graphs and not other, f"arithmetic outside the registered ops: {sorted(other)}"
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"specserve.linear_invariant", "specserve.rotary_invariant", "specserve.silu_mul_invariant",
            "specserve.add_rms_norm_invariant", "specserve.rms_norm_invariant", "specserve.write_kv"} <= ops


@torch.inference_mode()
def test_one_compiled_graph_serves_every_layer_and_bucket(tiny_model_dir, make_llm, monkeypatch):
    """Regional compilation: after decodes, verifies and prefill chunks of several buckets
    through every layer, the layer's code holds two compiled graphs (the first layer, which has
    no residual yet, and the others), not one per layer or per bucket."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    monkeypatch.setenv("SPECSERVE_COMPILE", "1")
    llm = make_llm(str(tiny_model_dir), max_model_len=256, num_blocks=64, max_num_seqs=4,
                   max_num_batched_tokens=64, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                                  "adaptive": False})
    prompts = ["one two three one two three one two", "a b c d a b c d a b c d", "x"]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    steps = llm.engine.runner.steps
    assert steps.counts["decode"] > 0 and steps.counts["verify"] > 0
    # exactly two: the first layer's (no residual) and the others' (4 when the rows are not
    # marked dynamic: a graph per token count)
    assert len(_debug_get_cache_entry_list(steps.layer_fn.__code__)) == 2


def test_compiled_step_gives_the_eager_tokens(eager_llm, compiled_llm):
    """Greedy generation with prompt-lookup speculation: every step (prefill of the short
    prompts, decodes, verifies) runs the compiled step (inductor, fullgraph) and commits the
    eager engine's tokens."""
    eager = eager_llm
    prompts = ["one two three one two three one two three one two", "hello world hello world hello world",
               "a b c d a b c d a b"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in compiled_llm.generate(prompts, params)]
    steps, stats = compiled_llm.engine.runner.steps, compiled_llm.engine.stats
    assert eager.engine.runner.steps is None and steps.compiled and steps.graphs is None
    assert got == want
    assert steps.counts["decode"] > 0 and steps.counts["verify"] > 0
    assert sum(steps.counts.values()) == stats.num_steps  # no step took the eager path
    assert stats.spec_num_accepted_tokens > 0


@torch.inference_mode()
def test_compiled_tree_step_matches_eager(compiled_llm):
    """A verify step with a draft tree: the compiled step's rows equal the eager path's."""
    engine, runner = compiled_llm.engine, compiled_llm.engine.runner
    reqs = _requests(engine, [9, 14], seed=1)
    try:
        runner.execute(SchedulerOutput(reqs, [r.num_tokens for r in reqs], [0, 0]))
        for r, drafts in zip(reqs, ([4, 5, 6, 7], [8])):
            r.all_token_ids.append(3)  # the sampled token
            r.num_computed_tokens = r.num_tokens - 1
            r.spec_token_ids = drafts
        sched, parents = SchedulerOutput(reqs, [5, 2], [4, 1]), [[-1, 0, 0, 2, 1], None]
        before = runner.k_cache.clone(), runner.v_cache.clone()
        steps, runner.steps = runner.steps, None
        try:
            eager = runner.execute(sched, parents)
        finally:
            runner.steps = steps
        runner.k_cache.copy_(before[0])
        runner.v_cache.copy_(before[1])
        out = runner.execute(sched, parents)
        assert torch.allclose(out.logits, eager.logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(out.logits.argmax(-1), eager.logits.argmax(-1))
    finally:
        for r in reqs:
            engine.kv.free(r)


def test_op_backend_is_selectable(monkeypatch):
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "ops")
    backend = get_attention_backend(torch.device("cpu"))
    assert isinstance(backend, OpAttention) and not backend.kernels


def test_enforce_eager_flag_and_config():
    import argparse

    from specserve.config import EngineConfig
    from specserve.server.cli import add_serve_args, engine_config_from_args

    parser = add_serve_args(argparse.ArgumentParser())
    assert engine_config_from_args(parser.parse_args(["--enforce-eager"])).model.enforce_eager
    assert not engine_config_from_args(parser.parse_args([])).model.enforce_eager
    assert EngineConfig.create(enforce_eager=True).model.enforce_eager


def test_batch_invariant_flag_and_its_default():
    """--batch-invariant / --no-batch-invariant, unset by default; unset means on in
    bfloat16/float16 (CUDA: the invariant ops; a CPU: products in calls of a measured size) and
    off in float32 (a CPU's C kernels are batch-invariant without it)."""
    import argparse

    from specserve.config import EngineConfig
    from specserve.model.runner import batch_invariant_on
    from specserve.server.cli import add_serve_args, engine_config_from_args

    parser = add_serve_args(argparse.ArgumentParser())
    assert [engine_config_from_args(parser.parse_args(a)).model.batch_invariant
            for a in ([], ["--batch-invariant"], ["--no-batch-invariant"])] == [None, True, False]
    assert EngineConfig.create().model.batch_invariant is None
    assert EngineConfig.create(batch_invariant=False).model.batch_invariant is False
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [batch_invariant_on(None, cuda, d) for d in (torch.bfloat16, torch.float16, torch.float32)] \
        == [True, True, False]
    assert not batch_invariant_on(False, cuda, torch.bfloat16) and batch_invariant_on(True, cuda, torch.float32)
    assert [batch_invariant_on(None, cpu, d) for d in (torch.bfloat16, torch.float16, torch.float32)] \
        == [True, True, False]
    assert not batch_invariant_on(False, cpu, torch.bfloat16) and batch_invariant_on(True, cpu, torch.float32)


def test_capture_time_is_a_gauge():
    from prometheus_client import generate_latest

    from specserve.engine import EngineStats
    from specserve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    assert 'specserve:cuda_graph_capture_seconds{model_name="m"} 0.0' in generate_latest(metrics.registry).decode()
    metrics.update_from_stats(EngineStats(cuda_graph_capture_seconds=2.5))
    assert 'specserve:cuda_graph_capture_seconds{model_name="m"} 2.5' in generate_latest(metrics.registry).decode()


def test_step_timer_waits_for_the_gpu(monkeypatch):
    """The cost model's clock: on CUDA it reads the time once the queued work is done."""
    from specserve.spec_decode.cost_model import device_clock

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    first = device_clock(cpu)
    assert synced == [] and device_clock(cpu) >= first
    device_clock(cuda)
    assert synced == [cuda]


TRITON_SCRIPT = r"""
import json, sys
from specserve import LLM, SamplingParams
from specserve.model.attention import OpAttention
from specserve.model.compiled import StepRunner
spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
llm = LLM(sys.argv[1], max_model_len=128, num_blocks=32, dtype="float32", speculative_config=spec, max_num_seqs=4)
prompts = ["one two three one two three one two three one two", "hello world hello world"]
params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
runner = llm.engine.runner
runner.steps = steps = StepRunner(runner, 4, 64, 16, compile=False, graphs=False)
steps.backend = OpAttention(kernels=True)
got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
print(json.dumps({"want": want, "got": got, "counts": steps.counts}))
"""


def test_padded_steps_through_the_triton_kernels_interpreted(tiny_model_dir):
    """The Triton kernels (under the interpreter) read the padded buffers as the GPU will:
    padding requests in the null block, uncovered padding tokens, decode rows as one-node
    trees; the tokens are the eager path's."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, SPECSERVE_ATTENTION_BACKEND="torch", TRITON_INTERPRET="1", SPECSERVE_KERNELS="triton")
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(tiny_model_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"]
    assert out["counts"]["decode"] > 0 and out["counts"]["verify"] > 0
