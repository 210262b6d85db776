"""The compiled, graph-captured step on CUDA (model/compiled.py, model/cuda_graphs.py): the
same tokens as the eager path, every step replayed from a graph, no host sync in a replay.
Skipped without a CUDA device (`-m gpu` selects them)."""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = dict(device="cuda", dtype="float32", max_model_len=256, num_blocks=64, max_num_seqs=8,
            max_num_batched_tokens=128,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
PROMPTS = ["one two three one two three one two three one two", "hello world hello world hello world",
           "a b c d a b c d a b"]


@pytest.fixture(scope="module")
def graph_llm(make_llm, tiny_model_dir):
    return make_llm(str(tiny_model_dir), **ARGS)


def test_graphs_give_the_eager_tokens(make_llm, tiny_model_dir, graph_llm):
    eager = make_llm(str(tiny_model_dir), enforce_eager=True, **ARGS)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in graph_llm.generate(PROMPTS, params)]
    runner, stats = graph_llm.engine.runner, graph_llm.engine.stats
    steps = runner.steps
    assert eager.engine.runner.steps is None and eager.engine.runner.graph_capture_seconds == 0
    assert steps is not None and steps.compiled and steps.graphs is not None
    assert set(steps.graphs.graphs) == set(steps.all_buckets())
    assert runner.graph_capture_seconds > 0 and stats.cuda_graph_capture_seconds == runner.graph_capture_seconds
    assert got == want
    assert steps.counts["decode"] > 0 and steps.counts["verify"] > 0
    assert sum(steps.counts.values()) == stats.num_steps
    assert stats.spec_num_accepted_tokens > 0


@torch.inference_mode()
def test_a_replay_does_not_sync(graph_llm):
    # two requests in blocks of their own (free after the other tests): the null block holds the
    # padding rows' K/V, which a request never reads. Only the 6 rows the requests own are
    # compared: a padding row belongs to no request, its attention output is never written and
    # its hidden state is whatever that memory held
    steps = graph_llm.engine.runner.steps
    tables = [[0], [1]]
    bucket = steps.bucket([5, 1], tables)
    steps.buffers.fill(bucket, [5, 6, 7, 8, 9, 4], [3, 4, 4, 5, 6, 9], [8, 10], [5, 1], tables,
                       [[-1, 0, 0, 1, 2], None])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = steps.graphs.replay(bucket)
        eager = steps.run(*steps.buffers._views(bucket))  # the compiled forward itself
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert hidden is not None and torch.allclose(hidden[:6], eager[:6], atol=1e-4)


def test_triton_ops_match_the_dense_op():
    torch.manual_seed(0)
    q_lens, prefix, bs, hq, hkv, d = [1, 5, 1, 3], [700, 40, 1, 2000], 16, 32, 8, 128
    seq = [p + n for p, n in zip(prefix, q_lens)]
    blocks = [-(-s // bs) for s in seq]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks).tolist()
    tables, i = [], 0
    for n in blocks:
        tables.append(perm[i:i + n] + [0] * (max(blocks) - n))
        i += n
    cache = torch.randn(2, 1, num_blocks, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor(tables, dtype=torch.int32, device="cuda")
    seq_t = torch.tensor(seq, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 1, 6, 7, 10], dtype=torch.int32, device="cuda")
    from specserve.model import tree_mask as trees

    mask = torch.from_numpy(trees.packed_step_mask([None, [-1, 0, 0, 1, 1], None, None], q_lens)).cuda()
    args = (q, cache[0], cache[1], 0, table, seq_t, qsl)
    ops = torch.ops.specserve
    for tree in (None, mask):
        dense = ops.dense_attention(*args, tree, d ** -0.5, 5)
        kernel = (ops.paged_attention(*args, d ** -0.5, 5) if tree is None
                  else ops.tree_attention(*args, tree, d ** -0.5, 5))
        assert torch.allclose(kernel.float(), dense.float(), atol=3e-2, rtol=3e-2)


def test_drafting_attention_builds_no_cudnn_plans():
    """EAGLE's drafting passes see a new key length every call: in bfloat16 none may go to
    cuDNN's attention (an execution plan built per new shape), and the result is SDPA's."""
    from torch.profiler import ProfilerActivity, profile

    from specserve.model.arch import ModelArch
    from specserve.spec_decode.eagle_head import DraftPass, EagleHead, HeadKV, Segment
    from tests.test_eagle_medusa import HEAD

    torch.manual_seed(0)
    head = EagleHead(ModelArch.from_dict({**HEAD, "hidden_size": 256, "num_attention_heads": 4,
                                          "num_key_value_heads": 2}))
    head = head.to("cuda", torch.bfloat16)
    draft, kv, past = DraftPass(head, lambda w, b: (lambda x: torch.nn.functional.linear(x, w, b))), HeadKV(), 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for rows in (37, 3, 5, 2, 7):  # a prompt, then trees of a few nodes, every length new
            feats = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
            out = draft(feats, feats, torch.arange(past, past + rows, device="cuda"), [Segment(kv, past, rows, None)])
            assert out.shape == (rows, 256) and torch.isfinite(out.float()).all()
            past += rows
        torch.cuda.synchronize()
    names = [e.key.lower() for e in prof.key_averages()]
    assert not [n for n in names if "cudnn" in n], names


def test_batch_invariant_bfloat16_speculation_is_lossless(make_llm, tiny_model_dir):
    """bfloat16 on CUDA is batch-invariant by default (--batch-invariant): ngram's verify steps
    (graph-replayed, batches of several requests) give plain decoding's tokens exactly; the
    plain engine prefills past its buckets (eagerly), the speculating one through its compiled
    step."""
    args = {**ARGS, "dtype": "bfloat16"}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = make_llm(str(tiny_model_dir), **{**args, "speculative_config": None})
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    spec = make_llm(str(tiny_model_dir), **args)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.stats.spec_num_drafts > 0
    assert plain.engine.runner.steps.compiled and spec.engine.runner.steps.compiled
    assert plain.engine.runner.batch_invariant and spec.engine.runner.batch_invariant
    assert plain.engine.runner.steps.counts["eager"] > 0


def test_an_eagle3_head_reads_the_graphs_inner_layers(make_llm, tiny_model_dir, tmp_path):
    """An EAGLE-3 head's step returns inner layers' outputs from the captured graphs (their
    static output buffer is as wide): greedy output equals the eager plain engine's, its
    drafting passes attending through the head's K/V pool (a GPU's form)."""
    from tests.test_eagle_medusa import write_eagle3

    head = write_eagle3(tmp_path / "eagle3", (0, 1))
    config = {"method": "eagle", "model": str(head), "num_speculative_tokens": 6, "adaptive": False,
              "lookup_branch": 0, "depth": 3, "topk": 2}
    args = {**ARGS, "speculative_config": None}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(str(tiny_model_dir), enforce_eager=True, **args).generate(
        PROMPTS, params)]
    llm = make_llm(str(tiny_model_dir), **{**args, "speculative_config": config})
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    steps = llm.engine.runner.steps
    assert steps.graphs is not None and steps.graphs.out.shape[1] == 3 * 64
    assert got == want and llm.engine.stats.spec_num_drafts > 0
    assert steps.counts["verify"] > 0
    assert llm.engine.spec.proposer.pool is not None  # the head's K/V pooled on CUDA
