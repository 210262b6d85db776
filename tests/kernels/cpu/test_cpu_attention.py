"""Our CPU paged-attention kernel (specserve/kernels/cpu/paged_attention.c) through its backend,
CPUPagedAttention: decode, chain, tree and prefill rows read in place match the SDPA backend
(itself checked against the references), the kernel writes the step's K/V itself, and a row's
result is the same bits whatever the batch around it, however its prompt is chunked and however
many rows its tree has."""

import pytest
import torch

from specserve.kernels.cpu import cpu_attention
from specserve.model import attention as A

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason=f"CPU attention kernel unavailable: {cpu_attention.why_unavailable()}")


def attend(backend, b, q_lens, trees=None, rows=None):
    """The backend over the batch (the new tokens' K/V are already in the cache), or over the
    requests `rows` only."""
    keep = range(len(q_lens)) if rows is None else rows
    seq = [int(b["seq_lens"][r]) for r in keep]
    lens = [q_lens[r] for r in keep]
    tables = [b["block_tables"][r].tolist() for r in keep]
    starts = b["query_start_loc"].tolist()
    q = torch.cat([b["q"][starts[r]:starts[r + 1]] for r in keep])
    meta = backend.build_metadata(seq, lens, tables, b["k_cache"].shape[1], torch.device("cpu"),
                                  None if trees is None else [trees[r] for r in keep])
    kv = b["k_cache"].shape[2]
    k, v = b["k_cache"].view(-1, kv, b["k_cache"].shape[3]), b["v_cache"].view(-1, kv, b["v_cache"].shape[3])
    return backend(q, k[meta.slot_mapping].clone(), v[meta.slot_mapping].clone(), b["k_cache"], b["v_cache"],
                   meta, b["scale"])


def one_thread(fn, *args):
    """fn(*args) with torch (and so the kernel) on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 72)])
def test_decode_chain_and_tree_rows_match_sdpa(make_batch, heads):
    hq, hkv, d = heads
    q_lens, prefix = [1, 4, 6, 1, 3], [40, 17, 33, 0, 70]
    trees = [None, None, [-1, 0, 0, 1, 2, 1], None, [-1, 0, 0]]
    b = make_batch(q_lens, prefix, hq, hkv, d, 16, seed=4)
    out = attend(A.CPUPagedAttention(), b, q_lens, trees)
    torch.testing.assert_close(out, attend(A.TorchAttention(), b, q_lens, trees), atol=1e-5, rtol=1e-5)


def test_the_kernel_writes_the_new_keys_and_values_from_views_of_one_product(make_batch):
    """q, k and v as the model passes them (views of its fused q/k/v product, rows strided):
    the kernel writes the step's K/V to their slots in the same call, then attends as SDPA."""
    hq, hkv, d = 9, 3, 64
    q_lens, prefix = [1, 4, 1], [40, 17, 5]
    trees = [None, [-1, 0, 0, 1], None]
    b = make_batch(q_lens, prefix, hq, hkv, d, 16, seed=7)
    backend, sdpa = A.CPUPagedAttention(), A.TorchAttention()
    meta, sdpa_meta = (x.build_metadata(b["seq_lens"].tolist(), q_lens, [r.tolist() for r in b["block_tables"]],
                                        16, torch.device("cpu"), trees) for x in (backend, sdpa))
    flat_k, flat_v = (c.view(-1, hkv, d) for c in (b["k_cache"], b["v_cache"]))
    fused = torch.cat([b["q"].reshape(len(b["q"]), -1), flat_k[meta.slot_mapping].reshape(len(b["q"]), -1),
                       flat_v[meta.slot_mapping].reshape(len(b["q"]), -1)], 1)
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], 1)
    want = sdpa(q.reshape(-1, hq, d).contiguous(), k.reshape(-1, hkv, d).contiguous(),
                v.reshape(-1, hkv, d).contiguous(), b["k_cache"].clone(), b["v_cache"].clone(), sdpa_meta, b["scale"])
    flat_k[meta.slot_mapping], flat_v[meta.slot_mapping] = 0.0, 0.0  # only the kernel's write can restore them
    got = backend(q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d), b["k_cache"], b["v_cache"], meta,
                  b["scale"])
    assert torch.equal(flat_k[meta.slot_mapping], k.reshape(-1, hkv, d))
    assert torch.equal(flat_v[meta.slot_mapping], v.reshape(-1, hkv, d))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_prefill_chunk_beside_decodes_goes_to_the_kernel_in_runs(make_batch):
    """A chunk of 100 rows beside decodes: the kernel takes it in runs of at most
    KERNEL_MAX_QUERY rows, each with its request's block table; it matches SDPA, and its rows
    have the bits they get in chunks of other lengths (a prompt's K/V the same however the
    scheduler cut it, or a prefix cache left it)."""
    from specserve.model.attention.cpu_paged import KERNEL_MAX_QUERY

    q_lens, prefix = [1, 100, 3, 1], [30, 0, 12, 70]
    b = make_batch(q_lens, prefix, 6, 2, 32, 16, seed=2)
    backend = A.CPUPagedAttention()
    meta = backend.build_metadata(b["seq_lens"].tolist(), q_lens, [r.tolist() for r in b["block_tables"]],
                                  16, torch.device("cpu"))
    runs = -(-100 // KERNEL_MAX_QUERY)
    starts = [0, 1] + [1 + KERNEL_MAX_QUERY * i for i in range(1, runs)] + [101, 104, 105]
    assert meta.query_start.tolist() == starts
    assert torch.equal(meta.table[1:1 + runs], b["block_tables"][1].to(torch.int64).expand(runs, -1))
    whole = attend(backend, b, q_lens)
    torch.testing.assert_close(whole, attend(A.TorchAttention(), b, q_lens), atol=1e-5, rtol=1e-5)
    for cut in (37, 64, 99):  # the same prompt as a first chunk of `cut` rows, then the rest
        first, rest = dict(b), dict(b)
        first["seq_lens"], rest["seq_lens"] = b["seq_lens"].clone(), b["seq_lens"].clone()
        first["seq_lens"][1] = cut
        rest_q = b["q"][1 + cut:101]
        first["q"] = torch.cat([b["q"][:1 + cut], b["q"][101:]])
        rest["q"] = torch.cat([b["q"][:1], rest_q, b["q"][101:]])
        for d, lens in ((first, [1, cut, 3, 1]), (rest, [1, 100 - cut, 3, 1])):
            d["query_start_loc"] = torch.tensor([0, 1, 1 + lens[1], 4 + lens[1], 5 + lens[1]], dtype=torch.int32)
        a, z = attend(backend, first, [1, cut, 3, 1], rows=[1]), attend(backend, rest, [1, 100 - cut, 3, 1], rows=[1])
        assert torch.equal(torch.cat([a, z]), whole[1:101]), cut


def test_a_tree_of_more_rows_than_a_run_keeps_each_nodes_bits(make_batch):
    """A verify tree of 25 nodes (more than one run of the kernel's): every node's result has
    the bits it gets in a tree of its ancestors alone, and matches SDPA."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    q_lens, prefix = [1, len(parents), 1], [40, 300, 9]
    trees = [None, parents, None]
    b = make_batch(q_lens, prefix, 9, 3, 64, 16, seed=13)
    backend = A.CPUPagedAttention()
    whole = attend(backend, b, q_lens, trees)
    torch.testing.assert_close(whole, attend(A.TorchAttention(), b, q_lens, trees), atol=1e-5, rtol=1e-5)
    starts = b["query_start_loc"].tolist()
    small = dict(b, seq_lens=b["seq_lens"].clone())  # the tree cut to its first 7 nodes (still a tree)
    small["seq_lens"][1] = prefix[1] + 7
    small["q"] = torch.cat([b["q"][:starts[1] + 7], b["q"][starts[2]:]])
    small["query_start_loc"] = torch.tensor([0, 1, 8, 9], dtype=torch.int32)
    part = attend(backend, small, [1, 7, 1], [None, parents[:7], None], rows=[1])
    assert torch.equal(part, whole[starts[1]:starts[1] + 7])


def test_a_row_has_the_same_bits_alone_and_in_any_batch(make_batch):
    q_lens, prefix = [1, 5, 1, 3], [25, 60, 200, 9]
    trees = [None, [-1, 0, 1, 1, 0], None, None]
    b = make_batch(q_lens, prefix, 9, 3, 64, 16, seed=5)
    backend = A.CPUPagedAttention()
    whole = attend(backend, b, q_lens, trees)
    starts = b["query_start_loc"].tolist()
    for rows in ([1], [2], [3, 1], [1, 0]):
        part = attend(backend, b, q_lens, trees, rows)
        expect = torch.cat([whole[starts[r]:starts[r + 1]] for r in rows])
        assert torch.equal(part, expect), rows
    assert torch.equal(one_thread(attend, backend, b, q_lens, trees), whole)


def test_long_contexts_split_into_partitions_keep_every_rows_bits(make_batch):
    """Contexts over the kernel's partition (256 keys) are split into tasks whose results are
    merged in a fixed order: rows of a request that straddles a partition boundary (a chain
    from 253 keys, a tree from 1,020) match SDPA and have the same bits alone, in any batch, as
    single-token decodes of their own length and with one thread."""
    q_lens, prefix = [5, 1, 4, 1], [253, 1100, 1020, 7]
    trees = [None, None, [-1, 0, 0, 1], None]
    b = make_batch(q_lens, prefix, 9, 3, 64, 16, seed=11)
    backend = A.CPUPagedAttention()
    whole = attend(backend, b, q_lens, trees)
    torch.testing.assert_close(whole, attend(A.TorchAttention(), b, q_lens, trees), atol=1e-5, rtol=1e-5)
    starts = b["query_start_loc"].tolist()
    parts = {rows: attend(backend, b, q_lens, trees, list(rows)) for rows in ((0,), (2,), (1, 0), (3, 2))}
    expect = {rows: torch.cat([whole[starts[r]:starts[r + 1]] for r in rows]) for rows in parts}
    assert all(torch.equal(parts[rows], expect[rows]) for rows in parts)
    # the chain's rows one at a time, as decodes of 254 .. 258 keys (one partition, then two)
    singles = []
    for i in range(q_lens[0]):
        one = dict(b, seq_lens=b["seq_lens"].clone())
        one["seq_lens"][0] = prefix[0] + i + 1
        one["q"] = torch.cat([b["q"][starts[0] + i:starts[0] + i + 1], b["q"][starts[1]:]])
        one["query_start_loc"] = torch.tensor([0, 1] + [1 + s - starts[1] for s in starts[2:]], dtype=torch.int32)
        singles.append(attend(backend, one, [1] + q_lens[1:], [None] + trees[1:], [0]))
    assert torch.equal(torch.cat(singles), whole[starts[0]:starts[1]])
    assert torch.equal(one_thread(attend, backend, b, q_lens, trees), whole)


def test_one_request_with_a_short_last_partition_keeps_its_bits(make_batch):
    """One request whose rows see a little over a partition (~300 keys: 256 and a short last
    partition): on two threads its KV heads are tasks of their own, on one thread a partition's
    heads are taken in turn; the rows match SDPA, a tree's first path has the chain's bits, and
    both schedules give the same bits."""
    q_lens, prefix = [6], [296]
    trees = [[-1, 0, 1, 0, 3, 4]]
    b = make_batch(q_lens, prefix, 9, 3, 64, 16, seed=5)
    backend = A.CPUPagedAttention()
    chain = attend(backend, b, q_lens)
    torch.testing.assert_close(chain, attend(A.TorchAttention(), b, q_lens), atol=1e-5, rtol=1e-5)
    tree = attend(backend, b, q_lens, trees)
    torch.testing.assert_close(tree, attend(A.TorchAttention(), b, q_lens, trees), atol=1e-5, rtol=1e-5)
    # the tree's first path (nodes 0, 1, 2) sees what the chain's first rows see
    assert torch.equal(tree[:3], chain[:3])
    assert torch.equal(one_thread(attend, backend, b, q_lens, trees), tree)


def test_auto_picks_the_kernel_for_float32_only(monkeypatch):
    monkeypatch.delenv("SPECSERVE_ATTENTION_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert isinstance(A.get_attention_backend(cpu, torch.float32, (9, 3, 64)), A.CPUPagedAttention)
    assert type(A.get_attention_backend(cpu, torch.float32, (9, 3, 60))) is A.TorchAttention  # D % 8
    assert type(A.get_attention_backend(cpu, torch.float32, (64, 2, 64))) is A.TorchAttention  # G > 16
    assert type(A.get_attention_backend(cpu, torch.float16, (9, 3, 64))) is A.TorchAttention
    assert isinstance(A.get_attention_backend(cpu, torch.bfloat16, (9, 3, 64)), A.InvariantAttention)
    monkeypatch.setenv("SPECSERVE_ATTENTION_BACKEND", "torch")
    assert type(A.get_attention_backend(cpu, torch.float32, (9, 3, 64))) is A.TorchAttention


def test_more_rows_than_the_kernel_takes_is_a_clear_error(make_batch):
    b = make_batch([17], [5], 4, 2, 32, 16)
    ptr = torch.zeros(18, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 16 query tokens"):
        cpu_attention.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"].long(),
                                      torch.tensor([0, 17]), torch.arange(6, 23), ptr,
                                      torch.zeros(0, dtype=torch.int64), 22, b["scale"])


def _has_avx512() -> bool:
    if not cpu_attention.available():
        return False
    before = cpu_attention.wide()
    try:
        return cpu_attention.wide(True)
    finally:
        cpu_attention.wide(before)


AVX512 = _has_avx512()


@pytest.mark.skipif(not AVX512, reason="no AVX-512F on this CPU")
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128), (8, 8, 64), (12, 4, 80)])
def test_the_avx512_passes_give_the_avx2_bits(make_batch, heads):
    """pick_wide chooses between the two for speed alone: every row (decode, chains, trees, an
    odd number of rows, contexts with a partial last group of keys) has the same bits."""
    hq, hkv, d = heads
    q_lens, prefix = [1, 4, 6, 1, 3, 16], [40, 17, 33, 0, 1031, 5]
    trees = [None, None, [-1, 0, 0, 1, 2, 1], None, [-1, 0, 0], None]
    b = make_batch(q_lens, prefix, hq, hkv, d, 16, seed=7)
    before = cpu_attention.wide()
    try:
        out = {on: (cpu_attention.wide(on), attend(A.CPUPagedAttention(), b, q_lens, trees))[1]
               for on in (False, True)}
    finally:
        cpu_attention.wide(before)
    assert torch.equal(out[True], out[False])
    torch.testing.assert_close(out[True], attend(A.TorchAttention(), b, q_lens, trees), atol=1e-5, rtol=1e-5)
