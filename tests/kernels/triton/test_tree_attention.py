import importlib.util

import pytest
import torch

from specserve.kernels import tree_attention
from specserve.kernels.triton.paged_attention import paged_attention_ref
from specserve.kernels.triton.tree_attention import (
    causal_tree_mask,
    dense_mask_attention_ref,
    num_mask_words,
    pack_tree_mask,
    tree_ancestors,
    tree_attention_ref,
    tree_attention_triton,
    tree_mask_from_parents,
    unpack_tree_mask,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEV == "cpu" else 1e-2  # fp32 tl.dot uses tf32 on GPU


def random_parents(n, gen):
    par = [-1]
    for i in range(1, n):
        par.append(int(torch.randint(-1, i, (), generator=gen)))
    return torch.tensor(par, dtype=torch.long)


TREES = {
    "single_node": lambda g: torch.tensor([-1]),
    "deep_chain": lambda g: torch.arange(40) - 1,
    "wide": lambda g: torch.full((24,), -1),
    "star": lambda g: torch.tensor([-1] + [0] * 15),
    "random_small": lambda g: random_parents(9, g),
    "random_two_words": lambda g: random_parents(45, g),
}


def build(make_batch, trees, prefix_lens, cfg, device=DEV, dtype=torch.float32):
    D, bs, hq, hkv = cfg
    q_lens = [len(p) for p in trees]
    b = make_batch(q_lens, prefix_lens, hq, hkv, D, bs, device=device, dtype=dtype)
    W = num_mask_words(max(q_lens))
    mask = torch.cat([tree_mask_from_parents(p, W) for p in trees]).to(device)
    # Dense mask over context positions, built independently of the bit packing.
    S = max(b["seq_lens"].tolist())
    dense = torch.zeros(sum(q_lens), S, dtype=torch.bool)
    t = 0
    for p, pre in zip(trees, prefix_lens):
        n = len(p)
        for i in range(n):
            dense[t + i, :pre] = True
            j = i
            while j >= 0:
                dense[t + i, pre + j] = True
                j = int(p[j])
        t += n
    return b, mask, dense.to(device), max(q_lens)


CONFIGS = [(64, 16, 4, 2), (128, 32, 8, 2), (64, 32, 3, 1)]


@needs_triton
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "d%d_bs%d_h%d_kv%d" % c)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("prefix", [0, 21])
def test_triton_matches_dense_ref(make_batch, tree, prefix, cfg):
    g = torch.Generator().manual_seed(list(TREES).index(tree))
    b, mask, dense, mq = build(make_batch, [TREES[tree](g)], [prefix], cfg)
    out = tree_attention_triton(**b, tree_mask=mask, max_query_len=mq)
    ref = dense_mask_attention_ref(**b, dense_mask=dense)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)


@needs_triton
def test_triton_mixed_batch(make_batch):
    g = torch.Generator().manual_seed(3)
    trees = [random_parents(7, g), torch.tensor([-1]), random_parents(33, g), torch.full((5,), -1)]
    b, mask, dense, mq = build(make_batch, trees, [50, 0, 17, 31], (64, 16, 4, 2))
    out = tree_attention_triton(**b, tree_mask=mask, max_query_len=mq)
    torch.testing.assert_close(out, dense_mask_attention_ref(**b, dense_mask=dense), atol=TOL, rtol=TOL)
    torch.testing.assert_close(tree_attention_ref(**b, tree_mask=mask), out, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("tree", list(TREES))
def test_ref_matches_dense_ref(make_batch, tree):
    g = torch.Generator().manual_seed(1)
    b, mask, dense, _ = build(make_batch, [TREES[tree](g), random_parents(6, g)], [13, 2], (16, 5, 2, 1),
                              device="cpu")
    torch.testing.assert_close(tree_attention_ref(**b, tree_mask=mask),
                               dense_mask_attention_ref(**b, dense_mask=dense))


@pytest.mark.parametrize("use_triton", [pytest.param(True, marks=needs_triton), False])
def test_causal_tree_equals_paged(make_batch, use_triton):
    q_lens, prefix = [1, 17, 40, 3], [30, 0, 5, 13]
    b = make_batch(q_lens, prefix, 4, 2, 64, 16, device=DEV if use_triton else "cpu")
    W = num_mask_words(max(q_lens))
    mask = torch.cat([causal_tree_mask(n, W) for n in q_lens]).to(b["q"].device)
    fn = tree_attention_triton if use_triton else tree_attention_ref
    out = fn(**b, tree_mask=mask, max_query_len=max(q_lens))
    torch.testing.assert_close(out, paged_attention_ref(**b), atol=TOL, rtol=TOL)


def test_mask_helpers():
    assert tree_mask_from_parents(torch.tensor([-1, 0, 0, 1, 2, -1])).flatten().tolist() == [1, 3, 5, 11, 21, 32]
    m = causal_tree_mask(33)
    assert m.shape == (33, 2) and m.dtype == torch.int32
    assert m[31, 0].item() == -1 and m[32].tolist() == [-1, 1]  # bit 31 -> negative word
    dense = torch.rand(7, 70) < 0.5
    assert torch.equal(unpack_tree_mask(pack_tree_mask(dense), 70), dense)
    assert pack_tree_mask(dense, 4).shape == (7, 4)
    assert torch.equal(tree_ancestors(torch.arange(5) - 1), torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError):
        tree_mask_from_parents(torch.tensor([-1, 2, 0]))


def test_dispatch_cpu(make_batch):
    b = make_batch([3], [4])
    mask = causal_tree_mask(3)
    assert torch.equal(tree_attention(**b, tree_mask=mask), tree_attention_ref(**b, tree_mask=mask))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("n_nodes", [8, 32, 64])
def test_gpu_real_shapes_bf16(make_batch, block_size, n_nodes):
    g = torch.Generator().manual_seed(n_nodes)
    trees = [random_parents(n_nodes, g) for _ in range(4)]
    b, mask, dense, mq = build(make_batch, trees, [1000, 4000, 1, 2500], (128, block_size, 32, 8),
                               device="cuda", dtype=torch.bfloat16)
    out = tree_attention_triton(**b, tree_mask=mask, max_query_len=mq)
    ref = dense_mask_attention_ref(**b, dense_mask=dense)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
