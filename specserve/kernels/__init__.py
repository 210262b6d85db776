"""Our kernels, one subpackage per path, and the dispatch of the attention, KV-cache and
batch-invariant ops (linear, RMSNorm, rotary, SiLU x up).

* ``specserve.kernels.triton``: the GPU's Triton kernels (paged and tree attention,
  KV-cache writes, the batch-invariant linear layer and RMSNorm, a layer's rotary embedding and
  SiLU x up in one launch each), each op beside a plain PyTorch reference with the same signature.
* ``specserve.kernels.cpu``: the CPU's C kernels for x86 with AVX2/FMA (linear layers,
  a layer's small ops, paged attention, greedy verification), built at first use by
  ``cbuild``; the model, sampling and the speculative methods call them directly where
  they run (``available()``).

Every op here has a Triton implementation (``*_triton``) and the PyTorch reference
(``*_ref``).  The unsuffixed names dispatch on the device of their first tensor
argument via :func:`use_triton`:

* CUDA tensors and triton importable -> Triton kernel;
* otherwise (CPU) -> PyTorch reference;
* env ``SPECSERVE_KERNELS=triton|torch`` forces one backend (Triton on CPU only
  works with ``TRITON_INTERPRET=1`` set before triton is first imported).

Importing this package never requires triton, and builds no C.
"""
from typing import Optional

import torch

from specserve.env import env_str

from .triton.kv_write import compact_kv_ref, compact_kv_triton, write_kv_ref, write_kv_triton
from .triton.matmul import linear_invariant_ref, linear_invariant_triton
from .triton.paged_attention import HAS_TRITON, paged_attention_ref, paged_attention_triton
from .triton.fused import rotary_ref, rotary_triton, silu_mul_ref, silu_mul_triton
from .triton.rms_norm import (
    add_rms_norm_invariant_triton,
    add_rms_norm_ref,
    rms_norm_invariant_triton,
    rms_norm_ref,
)
from .triton.tree_attention import (
    causal_tree_mask,
    dense_mask_attention_ref,
    pack_tree_mask,
    tree_attention_ref,
    tree_attention_triton,
    tree_mask_from_parents,
    unpack_tree_mask,
)

__all__ = [
    "HAS_TRITON", "use_triton",
    "paged_attention", "paged_attention_ref", "paged_attention_triton",
    "tree_attention", "tree_attention_ref", "tree_attention_triton", "dense_mask_attention_ref",
    "tree_mask_from_parents", "causal_tree_mask", "pack_tree_mask", "unpack_tree_mask",
    "write_kv", "write_kv_ref", "write_kv_triton",
    "compact_kv", "compact_kv_ref", "compact_kv_triton",
    "linear_invariant", "linear_invariant_ref", "linear_invariant_triton",
    "rms_norm_invariant", "rms_norm_ref", "rms_norm_invariant_triton",
    "add_rms_norm_invariant", "add_rms_norm_ref", "add_rms_norm_invariant_triton",
    "rotary", "rotary_ref", "rotary_triton", "silu_mul", "silu_mul_ref", "silu_mul_triton",
]


def use_triton(device) -> bool:
    """True when ops on ``device`` should run the Triton kernels."""
    forced = env_str("KERNELS").strip().lower()
    if forced == "torch":
        return False
    if forced == "triton":
        if not HAS_TRITON:
            raise RuntimeError("SPECSERVE_KERNELS=triton but triton is not installed")
        return True
    if forced:
        raise ValueError(f"SPECSERVE_KERNELS must be 'triton' or 'torch', got {forced!r}")
    return HAS_TRITON and torch.device(device).type == "cuda"


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len: Optional[int] = None) -> torch.Tensor:
    fn = paged_attention_triton if use_triton(q.device) else paged_attention_ref
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)


def tree_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale,
                   max_query_len: Optional[int] = None) -> torch.Tensor:
    fn = tree_attention_triton if use_triton(q.device) else tree_attention_ref
    return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, tree_mask, scale, max_query_len)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    fn = write_kv_triton if use_triton(k_cache.device) else write_kv_ref
    fn(k, v, k_cache, v_cache, slot_mapping)


def compact_kv(k_cache, v_cache, src_slots, dst_slots) -> None:
    fn = compact_kv_triton if use_triton(k_cache.device) else compact_kv_ref
    fn(k_cache, v_cache, src_slots, dst_slots)


def linear_invariant(x, weight, bias=None) -> torch.Tensor:
    fn = linear_invariant_triton if use_triton(x.device) else linear_invariant_ref
    return fn(x, weight, bias)


def rms_norm_invariant(x, weight, eps: float) -> torch.Tensor:
    fn = rms_norm_invariant_triton if use_triton(x.device) else rms_norm_ref
    return fn(x, weight, eps)


def add_rms_norm_invariant(x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    fn = add_rms_norm_invariant_triton if use_triton(x.device) else add_rms_norm_ref
    return fn(x, residual, weight, eps)


def rotary(qkv, cos, sin, heads: int, head_dim: int) -> torch.Tensor:
    fn = rotary_triton if use_triton(qkv.device) else rotary_ref
    return fn(qkv, cos, sin, heads, head_dim)


def silu_mul(x) -> torch.Tensor:
    fn = silu_mul_triton if use_triton(x.device) else silu_mul_ref
    return fn(x)
