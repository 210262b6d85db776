"""OpAttention: attention as `torch.library` custom ops, the backend of the compiled and
graph-captured step (specserve/model/compiled.py).

Each call of the model's attention is a few registered ops with tensor arguments only, so
`torch.compile(fullgraph=True)` traces the whole forward without a break and a CUDA graph can
replay it: nothing inside reads a Python list, an environment variable or a value from the
device.

* ``specserve::write_kv(k, v, k_cache, v_cache, layer, slot_mapping)`` writes the step's K/V
  into layer `layer` of the whole caches ([L, num_blocks, block_size, Hkv, D]); the caches are
  declared mutated (`mutates_args`), so the compiler orders the reads after the write and keeps
  the cache in place. Every slot is a real one: padding rows write the reserved null block's.
* ``specserve::paged_attention`` (prefill chunks and decodes, causal) and
  ``specserve::tree_attention`` (verify rows, a packed ancestor mask per row, tree_mask.py):
  the Triton kernels on CUDA; elsewhere the PyTorch references of specserve.kernels.
* ``specserve::dense_attention``: the PyTorch path on any device (the CPU's, and a reference on
  CUDA): every request's context gathered through its block table into one padded batch and
  one SDPA call with a dense mask (causal, or the tree's), as TorchAttention does, computed
  from the tensors alone (no host round trip: the request of each token comes from
  `searchsorted` over the query starts).

The caches are passed whole with a layer index, never as per-layer views: the compiled graph
then has one input per cache and mutates it in place. The model hands each layer
``kv_cache = ((k_cache, layer), (v_cache, layer))`` (compiled.py); a plain per-layer view
(what the eager runner passes) works too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from specserve.model import tree_mask as trees

from .metadata import StepIndex, TreeParents
from .paged import PagedMetadata, paged_metadata

# -- the ops ---------------------------------------------------------------------------------


@torch.library.custom_op("specserve::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             layer: int, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into slots `slot_mapping` [T] (every one valid) of cache layer `layer`."""
    _write_rows(k, v, k_cache, v_cache, layer, slot_mapping)


def _write_rows(k, v, k_cache, v_cache, layer: int, slot_mapping) -> None:
    for new, cache in ((k, k_cache), (v, v_cache)):
        slots = cache[layer].view(-1, *cache.shape[3:])  # [num_blocks * block_size, Hkv, D]
        slots.index_copy_(0, slot_mapping, new.to(cache.dtype))


@write_kv.register_fake
def _(k, v, k_cache, v_cache, layer, slot_mapping) -> None:
    return None


@write_kv.register_kernel("cuda")
def _(k, v, k_cache, v_cache, layer, slot_mapping) -> None:
    from specserve.kernels.triton.kv_write import HAS_TRITON, write_kv_triton

    if HAS_TRITON:
        write_kv_triton(k, v, k_cache[layer], v_cache[layer], slot_mapping)
    else:
        _write_rows(k, v, k_cache, v_cache, layer, slot_mapping)


@torch.library.custom_op("specserve::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, max_query_len: int) -> torch.Tensor:
    """Causal paged attention of layer `layer` (specserve.kernels.paged_attention's contract)."""
    from specserve import kernels

    return kernels.paged_attention(q, k_cache[layer], v_cache[layer], block_tables, seq_lens,
                                   query_start_loc, scale, max_query_len)


@paged_attention.register_fake
def _(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, scale, max_query_len):
    return torch.empty_like(q)


@paged_attention.register_kernel("cuda")
def _(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, scale, max_query_len):
    from specserve.kernels.triton.paged_attention import paged_attention_triton

    return paged_attention_triton(q, k_cache[layer], v_cache[layer], block_tables, seq_lens,
                                  query_start_loc, scale, max_query_len)


@torch.library.custom_op("specserve::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float, max_query_len: int) -> torch.Tensor:
    """Tree attention of layer `layer` (specserve.kernels.tree_attention's contract)."""
    from specserve import kernels

    return kernels.tree_attention(q, k_cache[layer], v_cache[layer], block_tables, seq_lens,
                                  query_start_loc, tree_mask, scale, max_query_len)


@tree_attention.register_fake
def _(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, tree_mask, scale,
      max_query_len):
    return torch.empty_like(q)


@tree_attention.register_kernel("cuda")
def _(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, tree_mask, scale,
      max_query_len):
    from specserve.kernels.triton.tree_attention import tree_attention_triton

    return tree_attention_triton(q, k_cache[layer], v_cache[layer], block_tables, seq_lens,
                                 query_start_loc, tree_mask, scale, max_query_len)


@torch.library.custom_op("specserve::dense_attention", mutates_args=())
def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    tree_mask: Optional[torch.Tensor], scale: float, max_query_len: int) -> torch.Tensor:
    """The PyTorch path: paged_attention's contract (tree_mask None) or tree_attention's."""
    return dense_attention_ref(q, k_cache[layer], v_cache[layer], block_tables, seq_lens,
                               query_start_loc, tree_mask, scale, max_query_len)


@dense_attention.register_fake
def _(q, k_cache, v_cache, layer, block_tables, seq_lens, query_start_loc, tree_mask, scale,
      max_query_len):
    return torch.empty_like(q)


def dense_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        tree_mask: torch.Tensor | None, scale: float, max_query_len: int) -> torch.Tensor:
    """q [T, Hq, D], one layer's caches [num_blocks, block_size, Hkv, D], block_tables [B, M],
    seq_lens [B], query_start_loc [B + 1] (any integer dtype), tree_mask [T, W] int32 packed
    or None (causal) -> [T, Hq, D].

    Request b's queries are padded to `max_query_len` rows and its context to the table's M
    blocks ([B, Q] against [B, M * block_size]); the mask hides what a row must not see, and a
    row that sees nothing (padding) sees position 0, so every output is finite. Tokens past the
    last request's queries get some request's row (padding: never read)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    num_reqs, width = block_tables.shape
    group, length, rows = num_heads // num_kv, width * block_size, max_query_len
    device = q.device
    starts = query_start_loc.long()
    first, qlen, seq = starts[:-1], starts[1:] - starts[:-1], seq_lens.long()
    prefix = seq - qlen
    j = torch.arange(rows, device=device)
    valid = j[None, :] < qlen[:, None]  # [B, Q]
    token = torch.where(valid, first[:, None] + j, 0).clamp(max=num_tokens - 1)
    queries = q[token]  # [B, Q, Hq, D]
    blocks = block_tables.long()
    keys = k_cache[blocks].reshape(num_reqs, length, num_kv, head_dim)
    values = v_cache[blocks].reshape(num_reqs, length, num_kv, head_dim)
    ctx = torch.arange(length, device=device)
    if tree_mask is None:
        see = ctx[None, None, :] <= (prefix[:, None] + j)[:, :, None]  # causal [B, Q, L]
    else:  # the prefix, and node n where bit n of the row's words is set
        words = tree_mask[token]  # [B, Q, W]
        node = ctx[None, :] - prefix[:, None]  # [B, L]
        is_node = (node >= 0) & (node < qlen[:, None])
        node = node.clamp(0, words.shape[-1] * trees.WORD_BITS - 1)
        word = torch.gather(words.long(), 2, (node // trees.WORD_BITS)[:, None, :].expand(-1, rows, -1))
        bit = (word >> (node % trees.WORD_BITS)[:, None, :]) & 1
        see = (ctx[None, None, :] < prefix[:, None, None]) | ((bit != 0) & is_node[:, None, :])
    see = see & (ctx[None, None, :] < seq[:, None, None]) & valid[:, :, None]
    see = see | ((ctx == 0)[None, None, :] & ~see.any(-1, keepdim=True))
    # GQA without copying K/V: the query heads of a KV head folded into the query axis
    folded = queries.view(num_reqs, rows, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(num_reqs, num_kv, group * rows, head_dim)
    mask = see[:, None].repeat(1, 1, group, 1)  # [B, 1, G * Q, L], group-major like `folded`
    out = F.scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    out = out.view(num_reqs, num_kv, group, rows, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(num_reqs * rows, num_heads, head_dim)
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(starts[1:], t, right=True).clamp(max=num_reqs - 1)
    local = (t - first[req]).clamp(0, rows - 1)
    return out[req * rows + local]


# -- the backend ------------------------------------------------------------------------------


@dataclass
class OpMetadata(PagedMetadata):
    """OpAttention's metadata: tensors only (filled by StepBuffers, or built from lists as
    TritonAttention's)."""

    # the step's tokens are exactly requests x max_query_len (a padded step, step_buffers.py): the
    # ops take the width from the shapes, so one compiled graph serves every width
    uniform: bool = False


class OpAttention:
    """Attention through the registered ops; which ops is decided once, here: the Triton
    kernels where specserve.kernels dispatches to them (CUDA), the dense PyTorch op elsewhere."""

    def __init__(self, device: torch.device | str = "cpu", kernels: bool | None = None) -> None:
        if kernels is None:
            from specserve.kernels import use_triton

            kernels = use_triton(device)
        self.kernels = kernels

    def build_metadata(self, seq_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device,
                       tree_parents: TreeParents | None = None) -> OpMetadata:
        """From the step's lists, as the other backends do (the compiled step fills its
        StepBuffers instead)."""
        return paged_metadata(OpMetadata, StepIndex.build(seq_lens, query_lens, block_tables, block_size,
                                                          tree_parents), device)

    def __call__(self, q, k, v, k_cache, v_cache, meta: OpMetadata, scale: float) -> torch.Tensor:
        if isinstance(k_cache, tuple):  # (whole cache, layer): the compiled step's handles
            (k_cache, layer), (v_cache, _) = k_cache, v_cache
        else:  # one layer's view
            k_cache, v_cache, layer = k_cache.unsqueeze(0), v_cache.unsqueeze(0), 0
        ops = torch.ops.specserve
        ops.write_kv(k, v, k_cache, v_cache, layer, meta.slot_mapping)
        args = (q, k_cache, v_cache, layer, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        width = q.shape[0] // meta.seq_lens.shape[0] if meta.uniform else meta.max_query_len
        if not self.kernels:
            return ops.dense_attention(*args, meta.tree_mask, scale, width)
        if meta.tree_mask is None:
            return ops.paged_attention(*args, scale, width)
        return ops.tree_attention(*args, meta.tree_mask, scale, width)
