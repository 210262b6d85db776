import importlib.util

import pytest
import torch

from specserve.kernels import compact_kv, write_kv
from specserve.kernels.cpu import layer_ops
from specserve.kernels.triton.kv_write import compact_kv_ref, compact_kv_triton, write_kv_ref, write_kv_triton

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(shape, dtype=torch.float32, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype)


@needs_triton
@pytest.mark.parametrize("H,D,bs", [(2, 64, 16), (4, 128, 32), (3, 80, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_ref(H, D, bs, dtype):
    kc, vc = _cache((6, bs, H, D), dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    T = 9
    slots = torch.randperm(6 * bs)[:T]
    slots[[1, 5]] = -1  # padding tokens are skipped
    slots = slots.to(DEV)
    k = torch.randn(T, H, D, device=DEV)
    v = torch.randn(T, H, D, device=DEV)
    write_kv_triton(k, v, kc, vc, slots)
    write_kv_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, H, D)[slots[keep]], k[keep].to(dtype))


@needs_triton
def test_write_kv_into_layer_slice():
    kc, vc = _cache((3, 4, 16, 2, 64))  # stacked layers; write into layer 1 only
    ref_k, ref_v = kc.clone(), vc.clone()
    k, v = torch.randn(5, 2, 64, device=DEV), torch.randn(5, 2, 64, device=DEV)
    slots = torch.tensor([0, 17, 33, -1, 63], device=DEV)
    write_kv_triton(k, v, kc[1], vc[1], slots)
    write_kv_ref(k, v, ref_k[1], ref_v[1], slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def _literal_compact(cache, src, dst):
    H, D = cache.shape[-2:]
    if cache.dim() == 4:
        flat = cache.view(-1, H, D)
        flat[dst] = flat[src].clone()
    else:
        flat = cache.view(cache.shape[0], -1, H, D)
        flat[:, dst] = flat[:, src].clone()


# (src, dst): accepted tree paths move to consecutive slots (dst increasing, dst <= src)
MOVES = [
    ([20, 22, 25, 26], [20, 21, 22, 23]),  # overlapping: dst[2] == src[1]
    ([5], [5]),  # no-op
    ([14, 15, 18, 31, 40], [13, 14, 15, 16, 17]),  # crosses block boundaries
    ([], []),
]


@pytest.mark.parametrize("impl", [pytest.param(compact_kv_triton, marks=needs_triton), compact_kv_ref])
@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("move", MOVES)
def test_compact_kv(impl, layers, move):
    shape = (4, 16, 2, 64) if layers is None else (layers, 4, 16, 2, 64)
    kc, vc = _cache(shape)
    ref_k, ref_v = kc.clone(), vc.clone()
    src = torch.tensor(move[0], dtype=torch.long, device=DEV)
    dst = torch.tensor(move[1], dtype=torch.long, device=DEV)
    impl(kc, vc, src, dst)
    _literal_compact(ref_k, src, dst)
    _literal_compact(ref_v, src, dst)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


needs_c = pytest.mark.skipif(not layer_ops.available(), reason="our C kernels cannot run here")


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("move", MOVES)
def test_slot_mover_is_compact_kv(dtype, move):
    """The CPU's one-call move (layer_ops.slot_mover, what ModelRunner.move_kv uses) gives
    what the reference gives, overlaps included, in every layer of K and V."""
    kc, vc = _cache((3, 4, 16, 2, 64), dtype, "cpu")
    ref_k, ref_v = kc.clone(), vc.clone()
    layer_ops.slot_mover(kc, vc)(*move)
    compact_kv_ref(ref_k, ref_v, torch.tensor(move[0], dtype=torch.long), torch.tensor(move[1], dtype=torch.long))
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@needs_c
def test_slot_mover_checks_slots():
    kc, vc = _cache((2, 4, 16, 2, 8), device="cpu")
    before = kc.clone()
    with pytest.raises(IndexError):
        layer_ops.slot_mover(kc, vc)([3, 64], [0, 1])  # 4 blocks of 16: slots 0..63
    assert torch.equal(kc, before)


def test_dispatch_cpu():
    kc, vc = _cache((2, 16, 1, 16), device="cpu")
    k = torch.ones(1, 1, 16)
    write_kv(k, k, kc, vc, torch.tensor([3]))
    assert torch.equal(kc[0, 3], k[0])
    compact_kv(kc, vc, torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(kc[0, 0], k[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_real_shapes_bf16():
    kc, vc = _cache((2048, 16, 8, 128), torch.bfloat16, "cuda")
    k2, v2 = kc.clone(), vc.clone()
    T = 4096
    slots = torch.randperm(2048 * 16, device="cuda")[:T]
    k = torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16)
    write_kv_triton(k, k, kc, vc, slots)
    write_kv_ref(k, k, k2, v2, slots)
    assert torch.equal(kc, k2) and torch.equal(vc, v2)
    kl, vl = _cache((4, 256, 16, 8, 128), torch.bfloat16, "cuda")
    rk = kl.clone()
    src = torch.tensor([1000, 1003, 1004, 1010, 1017], device="cuda")
    dst = torch.arange(1000, 1005, device="cuda")
    compact_kv_triton(kl, vl, src, dst)
    _literal_compact(rk, src, dst)
    assert torch.equal(kl, rk)
