"""Batch invariance of the CPU bfloat16 path (what makes speculation exactly lossless there).

A token's hidden state must have the same bits whether it is decoded alone, verified behind
other drafts, verified as a tree node, or computed beside other requests. These tests check
the two pieces that carry that property, on the machine that runs the suite: the GEMMs
(`Linear` with `pad_single_row`, in calls of at most `invariant_call_rows` rows) and
`InvariantAttention`; and the whole engine, plain decoding against speculation under load.
"""

import pytest
import torch

from specserve.model.attention import InvariantAttention, _sum_chunks
from specserve.model.llama import Linear, invariant_call_rows
from specserve.model.runner import cpu_has_native_bf16

pytestmark = pytest.mark.skipif(not cpu_has_native_bf16(),
                                reason="this CPU has no native bfloat16 GEMM (auto picks float32)")

BF16 = torch.bfloat16
BLOCK = 16
HKV, GROUP, D = 3, 3, 64


@pytest.mark.parametrize("shape", [(3072, 576), (576, 1536), (576, 2048), (960, 576)])
def test_linear_rows_do_not_depend_on_the_batch(shape):
    torch.manual_seed(0)
    layer = Linear(shape[1], shape[0], bias=False).to(BF16)
    layer.pad_single_row = True
    x = (torch.randn(24, shape[1]) * torch.rand(24, 1) * 3).to(BF16)
    with torch.inference_mode():
        full = layer(x)
        for m in range(1, 24):
            assert torch.equal(layer(x[:m]), full[:m]), m
        for j in range(24):
            assert torch.equal(layer(x[j:j + 1])[0], full[j]), j


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49152, 576)])
def test_linear_calls_of_the_measured_size_give_each_row_its_bits_alone(shape):
    """oneDNN picks its kernel by the number of rows (on an AMX Xeon calls of 33 rows and more
    gave other bits than 1-32): cut into calls of the size measured here, a row of a 96-row
    product, or of any call of 1-96 rows, has the bits it gets alone."""
    torch.manual_seed(0)
    layer = Linear(shape[1], shape[0], bias=False).to(BF16)
    layer.pad_single_row = True
    layer.rows_per_call = n = invariant_call_rows([layer])
    x = (torch.randn(96, shape[1]) * torch.rand(96, 1) * 3).to(BF16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[j:j + 1]) for j in range(96)])
        if n < 64:  # the size found is the largest that keeps the bits: one more row does not
            assert not (torch.equal(layer.dense(x[:n + 1]), alone[:n + 1])
                        and torch.equal(layer.dense(x[-n - 1:]), alone[-n - 1:]))
        for m in (2, 17, 33, 40, 64, 65, 96):
            assert torch.equal(layer(x[:m]), alone[:m]), m
            assert torch.equal(layer(x[96 - m:]), alone[96 - m:]), m


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, default_model_dir):
    """A random model of the default model's width (576; 2 layers), whose products' reductions
    are as long as the default model's."""
    from tests.conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("wide"), default_model_dir, hidden=576, heads=9, kv_heads=3)


def test_bfloat16_speculation_under_load_is_plain_decoding(make_llm, wide_model_dir):
    """bfloat16 on a CPU is batch-invariant by default: prompt lookup's verify steps at 16 in
    flight (rows of several requests, more than 32 a step) give plain decoding's tokens
    exactly, and a prompt's rows the same bits whatever the chunk beside them (with
    `batch_invariant=False` on an AMX Xeon, some of these outputs differ)."""
    from specserve import SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": (torch.randint(3, 400, (5,), generator=gen).tolist() * 8)[:4 + 3 * i]}
               for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    args = {"dtype": "bfloat16", "max_num_seqs": 16, "max_model_len": 256, "num_blocks": 512}
    plain = make_llm(str(wide_model_dir), speculative_config=None, **args)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = make_llm(str(wide_model_dir), speculative_config={"method": "ngram", "adaptive": False}, **args)
    assert spec.engine.runner.batch_invariant and spec.engine.runner.model.invariant_rows >= 1
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.stats.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("head_dim", [64, 80])
def test_chunk_sums_do_not_depend_on_rows_or_trailing_chunks(head_dim):
    torch.manual_seed(0)
    part = (torch.randn(2, 3, 37, 12, head_dim) * torch.rand(1, 1, 37, 1, 1) * 100).to(BF16)
    full = _sum_chunks(part)
    for rows in (1, 3, 5, 9):
        assert torch.equal(_sum_chunks(part[:, :, :, :rows].contiguous()), full[:, :, :rows]), rows
    zeros = torch.zeros(2, 3, 30, 12, head_dim, dtype=BF16)
    for chunks in (5, 16, 17, 33):
        head = part[:, :, :chunks].contiguous()
        assert torch.equal(_sum_chunks(torch.cat([head, zeros], 2)), _sum_chunks(head)), chunks


class _Cache:
    """Random K/V for `length` context positions of a few requests, one block table each."""

    def __init__(self, num_reqs: int, length: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.blocks_per_req = -(-length // BLOCK) + 2
        n = num_reqs * self.blocks_per_req
        self.k = torch.zeros(n, BLOCK, HKV, D, dtype=BF16)
        self.v = torch.zeros_like(self.k)
        self.tables = [list(range(r * self.blocks_per_req, (r + 1) * self.blocks_per_req))
                       for r in range(num_reqs)]
        self.keys = torch.randn(num_reqs, length, HKV, D, generator=gen).to(BF16)
        self.vals = torch.randn(num_reqs, length, HKV, D, generator=gen).to(BF16)
        self.queries = torch.randn(num_reqs, length, HKV * GROUP, D, generator=gen).to(BF16)

    def run(self, reqs: list[tuple[int, int, int]], tree_parents=None, order=None) -> list[torch.Tensor]:
        """reqs: (request, first position, new tokens); new tokens come from positions
        order[r] (default: consecutive). Returns each request's attention output."""
        q, k, v, seq, qlen, tables = [], [], [], [], [], []
        for i, (r, start, n) in enumerate(reqs):
            src = order[i] if order and order[i] is not None else list(range(start, start + n))
            q.append(self.queries[r, src])
            k.append(self.keys[r, src])
            v.append(self.vals[r, src])
            flat_k = self.k.view(-1, HKV, D)
            flat_v = self.v.view(-1, HKV, D)
            for p in range(start):  # context before the new tokens, written at its positions
                slot = self.tables[r][p // BLOCK] * BLOCK + p % BLOCK
                flat_k[slot], flat_v[slot] = self.keys[r, p], self.vals[r, p]
            seq.append(start + n)
            qlen.append(n)
            tables.append(self.tables[r])
        backend = InvariantAttention()
        meta = backend.build_metadata(seq, qlen, tables, BLOCK, torch.device("cpu"), tree_parents)
        with torch.inference_mode():
            out = backend(torch.cat(q), torch.cat(k), torch.cat(v), self.k, self.v, meta, D ** -0.5)
        return list(out.split(qlen))


# 1021 and 1100: more than 16 chunks of keys (the chunk sums run in blocks of 16), and verify
# rows on both sides of a chunk boundary
@pytest.mark.parametrize("prefix", [5, 63, 64, 200, 700, 1021, 1100])
def test_verify_rows_equal_single_decodes(prefix):
    cache = _Cache(num_reqs=3, length=max(prefix + 8, 120), seed=prefix)
    decodes = [cache.run([(0, prefix + i, 1)])[0][0] for i in range(6)]
    verify = cache.run([(0, prefix, 6)])[0]
    for i in range(6):
        assert torch.equal(verify[i], decodes[i]), i
    # the same rows beside other requests: a long prefill chunk and another decode
    mixed = cache.run([(1, 0, 40), (0, prefix, 6), (2, prefix + 7, 1)])[1]
    assert torch.equal(mixed, verify)
    # beside a longer prefill chunk: the step attends in groups of similar query length
    split = cache.run([(1, 0, 100), (0, prefix, 6), (2, prefix + 7, 1)])[1]
    assert torch.equal(split, verify)


# 1021: the tree's nodes straddle the boundary of chunks 15 and 16 (and of the first 16)
@pytest.mark.parametrize("prefix", [90, 1021])
def test_tree_nodes_equal_decoding_their_path(prefix):
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = [-1, 0, 0, 1, 1, 2, 3]
    paths = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]
    cache = _Cache(num_reqs=2, length=max(prefix + 16, 120), seed=1)
    # node j's q/k/v are taken from source position prefix + j
    tree = cache.run([(1, 30, 1), (0, prefix, len(parents))], tree_parents=[None, parents],
                     order=[None, [prefix + j for j in range(len(parents))]])[1]
    beside_prefill = cache.run([(1, 0, 100), (0, prefix, len(parents))], tree_parents=[None, parents],
                               order=[None, [prefix + j for j in range(len(parents))]])[1]
    assert torch.equal(beside_prefill, tree)  # split step: the tree's group has no prefill rows
    for node, path in enumerate(paths):
        # plain decoding would have written the path's tokens at consecutive positions
        chain = _Cache(num_reqs=1, length=prefix + len(path), seed=1)
        chain.keys[0, :prefix] = cache.keys[0, :prefix]
        chain.vals[0, :prefix] = cache.vals[0, :prefix]
        for depth, j in enumerate(path):
            chain.keys[0, prefix + depth] = cache.keys[0, prefix + j]
            chain.vals[0, prefix + depth] = cache.vals[0, prefix + j]
            chain.queries[0, prefix + depth] = cache.queries[0, prefix + j]
        decode = chain.run([(0, prefix + len(path) - 1, 1)])[0][0]
        assert torch.equal(tree[node], decode), node
