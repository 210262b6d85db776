import importlib.util

import pytest
import torch

from specserve.kernels import paged_attention, use_triton
from specserve.kernels.triton.paged_attention import paged_attention_ref, paged_attention_triton

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEV == "cpu" else 1e-2  # fp32 tl.dot uses tf32 on GPU

# (q_lens, prefix_lens) per request
CASES = {
    "one_token": ([1], [0]),
    "decode_batch": ([1, 1, 1], [5, 16, 40]),
    "cross_block": ([6], [13]),
    "empty_prefix_prefill": ([20], [0]),
    "mixed_prefill_decode": ([1, 17, 1, 5], [30, 0, 3, 44]),
    "long_context": ([3], [100]),
}
# (head_dim, block_size, num_q_heads, num_kv_heads)
CONFIGS = [(64, 16, 4, 4), (128, 32, 8, 2), (64, 32, 6, 2), (128, 16, 4, 1)]


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "d%d_bs%d_h%d_kv%d" % c)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_ref(make_batch, case, cfg):
    D, bs, hq, hkv = cfg
    q_lens, prefix = CASES[case]
    b = make_batch(q_lens, prefix, hq, hkv, D, bs, device=DEV)
    out = paged_attention_triton(**b, max_query_len=max(q_lens))
    ref = paged_attention_ref(**b)
    _close(out, ref, TOL)


@needs_triton
def test_triton_fp16_and_default_max_query_len(make_batch):
    b = make_batch([3, 1], [20, 7], 4, 2, 64, 16, dtype=torch.float16, device=DEV)
    _close(paged_attention_triton(**b), paged_attention_ref(**b), 5e-3)


def test_ref_matches_naive_loop(make_batch):
    """Independent check of the reference: per (token, head) softmax over positions."""
    b = make_batch([4, 1], [3, 18], 4, 2, 16, 16, seed=1)
    out = paged_attention_ref(**b)
    kf = b["k_cache"].reshape(-1, 2, 16)
    vf = b["v_cache"].reshape(-1, 2, 16)
    bs = 16
    t = 0
    for r, (n, sl) in enumerate(zip([4, 1], b["seq_lens"].tolist())):
        for i in range(n):
            pos = sl - n + i
            slots = [int(b["block_tables"][r, p // bs]) * bs + p % bs for p in range(pos + 1)]
            for h in range(4):
                k, v = kf[slots, h // 2], vf[slots, h // 2]
                w = torch.softmax(k @ b["q"][t, h] * b["scale"], 0)
                torch.testing.assert_close(out[t, h], w @ v, atol=1e-5, rtol=1e-5)
            t += 1


def test_ref_any_block_size_and_head_dim(make_batch):
    b = make_batch([2], [5], 2, 1, 24, 5)  # not powers of two: reference only
    out = paged_attention_ref(**b)
    assert out.shape == b["q"].shape and torch.isfinite(out).all()


def test_dispatch_cpu_uses_ref(make_batch, monkeypatch):
    monkeypatch.delenv("SPECSERVE_KERNELS", raising=False)
    assert not use_triton("cpu")
    b = make_batch([2], [3])
    assert torch.equal(paged_attention(**b), paged_attention_ref(**b))
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    assert not use_triton("cuda")
    monkeypatch.setenv("SPECSERVE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        use_triton("cpu")


@needs_triton
def test_dispatch_forced_triton(make_batch, monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNELS", "triton")
    assert use_triton("cpu")
    b = make_batch([1], [9], device=DEV)
    _close(paged_attention(**b), paged_attention_ref(**b), TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 16)])
@pytest.mark.parametrize("q_lens,prefix", [([1] * 8, [1023, 4000, 1, 2047, 3000, 100, 4095, 513]),
                                           ([1, 128, 1, 300], [4000, 0, 2000, 1500])])
def test_gpu_real_shapes_bf16(make_batch, block_size, hq, hkv, q_lens, prefix):
    b = make_batch(q_lens, prefix, hq, hkv, 128, block_size, dtype=torch.bfloat16, device="cuda")
    out = paged_attention_triton(**b)
    ref = paged_attention_ref(**b)
    _close(out, ref, 2e-2)


@pytest.mark.parametrize("backend", ["TorchAttention", "InvariantAttention"])
def test_dense_backends_split_a_mixed_step_and_match_the_reference(make_batch, backend):
    """A prefill chunk beside decodes and a verify: the dense layouts attend in groups of
    similar query length (no decode row is padded to the chunk's length) and still match the
    paged reference."""
    import numpy as np

    from specserve.model import attention as A

    q_lens, prefix = [1, 100, 3, 1], [30, 0, 12, 70]
    b = make_batch(q_lens, prefix, 6, 2, 32, 16, seed=2)
    impl = getattr(A, backend)()
    tables = [row.tolist() for row in b["block_tables"]]
    meta = impl.build_metadata(b["seq_lens"].tolist(), q_lens, tables, 16, torch.device("cpu"))
    # query lengths 1 | 2-4 | 65-256 attend apart (token rows of each group)
    assert [g.tolist() for g, _ in meta.parts] == [[0, 104], [101, 102, 103], list(range(1, 101))]
    assert A.split_by_query_len(np.array([1, 1, 1])) is None  # a decode step stays whole
    assert A.split_by_query_len(np.array([5, 16, 9])) is None
    # the new tokens' K/V are already in the cache: writing them again changes nothing
    flat_k, flat_v = b["k_cache"].view(-1, 2, 32), b["v_cache"].view(-1, 2, 32)
    k, v = flat_k[meta.slot_mapping].clone(), flat_v[meta.slot_mapping].clone()
    out = impl(b["q"], k, v, b["k_cache"], b["v_cache"], meta, b["scale"])
    _close(out, paged_attention_ref(**b), 1e-4)
