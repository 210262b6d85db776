"""Split-KV (flash-decoding) paged and tree attention: contexts over several fixed partitions,
GQA groups of 1, 4 and 8, and batch invariance.

Both launch modes (split: partials + reduction; fused: partitions merged in registers) run on
every case and must give the same bits; a request's rows must give the same bits alone, inside
a larger batch, as decode rows of the same tokens and (chain trees) through the tree kernel.
"""
import importlib.util

import pytest
import torch

from specserve.kernels.triton import paged_attention as pa
from specserve.kernels.triton.paged_attention import (
    PARTITION_SIZE,
    launch_paged_attn,
    paged_attention_ref,
    paged_attention_triton,
)
from specserve.kernels.triton.tree_attention import (
    causal_tree_mask,
    num_mask_words,
    tree_attention_ref,
    tree_attention_triton,
    tree_mask_from_parents,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEV == "cpu" else 1e-2  # fp32 tl.dot uses tf32 on GPU
P = PARTITION_SIZE

# (num_q_heads, num_kv_heads, head_dim, block_size): GQA groups 1, 4 and 8
CONFIGS = [(1, 1, 64, 16), (4, 1, 128, 32), (8, 1, 64, 16)]
# (q_lens, prefix_lens): contexts within one partition, over several and ending in a partial one
CASES = {
    # a verify chain across the first boundary beside decodes just before and after it
    "boundary": ([5, 1, 1], [P - 3, P - 1, P]),
    # one partition, two full ones, two and a partial one
    "several": ([1, 3, 2, 1], [40, 2 * P - 3, P + 88, 2 * P + 90]),
    # more partitions than the reduction loads at once (REDUCE_LOAD_AHEAD), in no multiple of it
    "long": ([1, 2], [(pa.REDUCE_LOAD_AHEAD + 1) * P + 5, (2 * pa.REDUCE_LOAD_AHEAD + 1) * P - 1]),
}


def _ids(c):
    return "h%d_kv%d_d%d_bs%d" % c


def _both_modes(fn_kwargs, tree_mask=None):
    outs = [launch_paged_attn(**fn_kwargs, tree_mask=tree_mask, split=s) for s in (False, True)]
    assert torch.equal(outs[0], outs[1]), "split and fused launches differ"
    return outs[0]


def _trim(b, tables, seq_lens):
    """Block tables as wide as the batch's longest context needs, as a step builds them."""
    bs = b["k_cache"].shape[1]
    return tables[:, :(int(seq_lens.max()) + bs - 1) // bs].contiguous()


def _sub_batch(b, reqs, tree_mask=None):
    """Requests `reqs` of batch b (in that order) over the same cache."""
    qsl = b["query_start_loc"].tolist()
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in reqs])
    q_lens = torch.tensor([qsl[r + 1] - qsl[r] for r in reqs])
    new_qsl = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    new_qsl[1:] = q_lens.cumsum(0)
    idx = torch.tensor(reqs).to(DEV)
    sub = dict(b, q=b["q"][rows.to(DEV)], block_tables=_trim(b, b["block_tables"][idx], b["seq_lens"][idx]),
               seq_lens=b["seq_lens"][idx], query_start_loc=new_qsl.to(DEV), max_query_len=int(q_lens.max()))
    return sub, rows, (None if tree_mask is None else tree_mask[rows.to(DEV)])


def _decode_rows(b, r):
    """Request r's query tokens as separate one-token decode requests (same cache, same rows)."""
    qsl = b["query_start_loc"].tolist()
    n, seq_len = qsl[r + 1] - qsl[r], int(b["seq_lens"][r])
    seq_lens = torch.arange(seq_len - n + 1, seq_len + 1, dtype=torch.int32, device=DEV)
    return dict(b, q=b["q"][qsl[r]:qsl[r + 1]], block_tables=_trim(b, b["block_tables"][[r] * n], seq_lens),
                seq_lens=seq_lens, query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=DEV),
                max_query_len=1)


@pytest.fixture
def launches(monkeypatch):
    """Records the compile-time parameters of every attention launch (kernel, sorted kwargs)."""
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(pa, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((self.name, tuple(sorted(kwargs.items()))))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in ("_attn_fused_kernel", "_attn_split_kernel"):
        monkeypatch.setattr(pa, name, Recorder(name))
    return seen


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_split_matches_ref(make_batch, case, cfg):
    hq, hkv, D, bs = cfg
    q_lens, prefix = CASES[case]
    b = make_batch(q_lens, prefix, hq, hkv, D, bs, device=DEV)
    out = _both_modes(dict(b, max_query_len=max(q_lens)))
    torch.testing.assert_close(out, paged_attention_ref(**b), atol=TOL, rtol=TOL)
    assert torch.equal(paged_attention_triton(**b), out)  # the public entry (its own launch choice)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_paged_rows_are_batch_invariant(make_batch, cfg, launches):
    """Request 1 (a 4-token verify over two partitions and a partial one) gives the same bits
    alone, inside a batch with a longer context and a longer query, in another order and as
    four single-token decodes."""
    hq, hkv, D, bs = cfg
    b = make_batch([2, 4, 1, 7, 1], [300, 2 * P - 2, 20, 100, 4 * P + 10], hq, hkv, D, bs, device=DEV, seed=4)
    full = _both_modes(dict(b, max_query_len=7))
    qsl = b["query_start_loc"].tolist()
    mine = full[qsl[1]:qsl[2]]
    alone, _, _ = _sub_batch(b, [1])
    reordered, rows, _ = _sub_batch(b, [4, 1, 3, 0, 2])
    got = {
        "alone": launch_paged_attn(**alone, split=False),
        "reordered": launch_paged_attn(**reordered, split=True)[(rows >= qsl[1]) & (rows < qsl[2])],
        "as decodes": launch_paged_attn(**_decode_rows(b, 1), split=True),
    }
    assert {k: torch.equal(v, mine) for k, v in got.items()} == dict.fromkeys(got, True)
    torch.testing.assert_close(mine, paged_attention_ref(**b)[qsl[1]:qsl[2]], atol=TOL, rtol=TOL)
    # Tile shapes, partition size and warps are the same whatever the batch (on a GPU the
    # instruction a dot compiles to may depend on them, which the interpreter cannot show).
    assert len(launches) == 5 and len({kwargs for _, kwargs in launches}) == 1


def _random_parents(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(1, n)])


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_tree_split_matches_ref_and_is_batch_invariant(make_batch, cfg):
    """Trees whose nodes cross a partition boundary, beside a plain decode and a deep tree past
    two partitions: the reference's values, the same bits in both modes and alone."""
    hq, hkv, D, bs = cfg
    trees = [_random_parents(20, 1), torch.tensor([-1]), _random_parents(34, 2)]
    prefix = [P - 7, 2 * P + 3, 2 * P - 30]
    b = make_batch([len(t) for t in trees], prefix, hq, hkv, D, bs, device=DEV, seed=5)
    W = num_mask_words(34)
    mask = torch.cat([tree_mask_from_parents(t, W) for t in trees]).to(DEV)
    full = _both_modes(dict(b, max_query_len=34), tree_mask=mask)
    torch.testing.assert_close(full, tree_attention_ref(**b, tree_mask=mask), atol=TOL, rtol=TOL)
    assert torch.equal(tree_attention_triton(**b, tree_mask=mask), full)
    sub, rows, sub_mask = _sub_batch(b, [2, 0], mask)
    assert torch.equal(launch_paged_attn(**sub, tree_mask=sub_mask, split=True), full[rows.to(DEV)])


@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=_ids)
def test_tree_path_rows_equal_paged_rows(make_batch, cfg):
    """Tree rows whose ancestors sit at consecutive positions (a chain tree; the first path of
    a bushy tree) give the paged kernel's bits for the same tokens, as verify and as decodes."""
    hq, hkv, D, bs = cfg
    bushy = torch.tensor([-1, 0, 1, 0, 2, 1, 4, 3])  # nodes 0-1-2 are a chain, then siblings
    q_lens, prefix = [6, 1, len(bushy)], [P - 2, P + 5, 2 * P - 1]
    b = make_batch(q_lens, prefix, hq, hkv, D, bs, device=DEV, seed=6)
    W = num_mask_words(max(q_lens))
    mask = torch.cat([causal_tree_mask(6, W), causal_tree_mask(1, W), tree_mask_from_parents(bushy, W)]).to(DEV)
    tree = _both_modes(dict(b, max_query_len=max(q_lens)), tree_mask=mask)
    paged = launch_paged_attn(**b, max_query_len=max(q_lens), split=False)
    assert torch.equal(tree[:7], paged[:7])  # the chain request and the decode
    # the bushy tree's chain 0-1-2 as decodes
    assert torch.equal(tree[7:10], launch_paged_attn(**_decode_rows(b, 2), split=True)[:3])
    torch.testing.assert_close(tree[7:], tree_attention_ref(**b, tree_mask=mask)[7:], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=_ids)
def test_prefetch_gives_the_same_bits(make_batch, cfg, monkeypatch, launches):
    """Loading the next K/V tile before computing on the current one (CONFIG's "prefetch")
    changes the schedule, not the arithmetic: paged and tree rows, both launch modes (and the
    launches with it set did compile the prefetching kernel)."""
    hq, hkv, D, bs = cfg
    trees = [_random_parents(20, 3), torch.tensor([-1]), torch.arange(-1, 4)]  # bushy, decode, chain
    b = make_batch([len(t) for t in trees], [P - 7, 2 * P + 3, 40], hq, hkv, D, bs, device=DEV, seed=8)
    mask = torch.cat([tree_mask_from_parents(t, 1) for t in trees]).to(DEV)
    kw = dict(b, max_query_len=20)
    monkeypatch.setitem(pa.CONFIG, D, dict(pa.CONFIG[D], prefetch=False))
    before = [_both_modes(kw), _both_modes(kw, tree_mask=mask)]
    monkeypatch.setitem(pa.CONFIG, D, dict(pa.CONFIG[D], prefetch=True))
    after = [_both_modes(kw), _both_modes(kw, tree_mask=mask)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    prefetch = [dict(kwargs)["PREFETCH"] for _, kwargs in launches]
    assert prefetch == [False] * 4 + [True] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 16)])
def test_gpu_bf16_rows_are_batch_invariant(make_batch, hq, hkv):
    """Compiled, bfloat16, real shapes: a verify request's rows alone, in a batch of 16 and as
    decodes give the same bits, and a chain tree gives the paged bits."""
    q_lens = [5] + [1] * 14 + [64]
    prefix = [4000] + [1023 + 500 * i for i in range(14)] + [2500]
    b = make_batch(q_lens, prefix, hq, hkv, 128, 16, dtype=torch.bfloat16, device="cuda", seed=7)
    full = _both_modes(dict(b, max_query_len=64))
    alone, _, _ = _sub_batch(b, [0])
    assert torch.equal(_both_modes(alone), full[:5])
    assert torch.equal(_both_modes(_decode_rows(b, 0)), full[:5])
    W = num_mask_words(64)
    mask = torch.cat([causal_tree_mask(n, W) for n in q_lens]).to("cuda")
    assert torch.equal(_both_modes(dict(b, max_query_len=64), tree_mask=mask), full)
    torch.testing.assert_close(full.float(), paged_attention_ref(**b).float(), atol=2e-2, rtol=2e-2)
