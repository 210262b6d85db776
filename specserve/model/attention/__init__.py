"""Attention over the paged KV cache for a flattened batch of requests.

Each backend lives in its own module together with the metadata it reads, and builds that
metadata itself, once per step, for every layer to share:

    backend = get_attention_backend(device, dtype)
    meta = backend.build_metadata(seq_lens, query_lens, block_tables, block_size, device,
                                  tree_parents)  # tree_parents: [B] parents or None (tree_mask.py)
    out = backend(q, k, v, k_cache, v_cache, meta, scale)  # writes k, v, then attends

Backends (same interface):
  * `TorchAttention` (sdpa.py): the CPU reference. It gathers every request's context into one
    padded [B, L] batch (gathered.py) and runs one SDPA call per layer with a dense mask.
  * `CPUPagedAttention` (cpu_paged.py): the CPU float32 backend. Every row (decode, verify,
    prefill) reads the paged cache in place (our AVX2 kernel, specserve/kernels/cpu/paged_attention.c),
    with bits that depend on its own keys only.
  * `InvariantAttention` (invariant.py): the CPU backend for bfloat16. Same gathered layout,
    but every query row's result is bitwise independent of the batch around it, which is what
    makes speculation exactly lossless in bfloat16.
  * `TritonAttention` (paged.py): the kernels in specserve/kernels (CUDA).
  * `OpAttention` (ops.py): attention as registered torch.library ops (the Triton kernels on
    CUDA, a dense PyTorch op elsewhere), the backend of the compiled step (model/compiled.py).

Masks: each new token sees the context up to its own position (causal); a request whose rows
form a draft tree sees the prefix, its ancestors and itself (specserve/model/tree_mask.py).
"""

from __future__ import annotations

import torch

from specserve.env import env_str
from specserve.kernels.cpu import cpu_attention

from .cpu_paged import CPUPagedAttention, CPUPagedMetadata
from .gathered import GatheredMetadata
from .invariant import KEY_CHUNK, InvariantAttention, LogicalMetadata, _sum_chunks
from .metadata import AttentionBackend, AttentionMetadata, StepIndex, split_by_query_len
from .ops import OpAttention, OpMetadata
from .paged import PagedMetadata, TritonAttention
from .sdpa import DenseMetadata, TorchAttention

__all__ = [
    "AttentionMetadata", "StepIndex", "split_by_query_len", "get_attention_backend", "AttentionBackend",
    "TorchAttention", "DenseMetadata", "GatheredMetadata",
    "InvariantAttention", "LogicalMetadata", "KEY_CHUNK", "_sum_chunks",
    "TritonAttention", "PagedMetadata", "CPUPagedAttention", "CPUPagedMetadata", "OpAttention", "OpMetadata",
]

def get_attention_backend(device: torch.device, dtype: torch.dtype = torch.float32,
                          shape: tuple[int, int, int] | None = None) -> AttentionBackend:
    """SPECSERVE_ATTENTION_BACKEND = auto | torch | cpu | invariant | triton | ops. auto: Triton on
    CUDA; on CPU the invariant backend for bfloat16, our paged kernel (cpu) for float32 where
    it builds and covers the model's (heads, KV heads, head size) `shape`, SDPA (torch)
    otherwise."""
    choice = env_str("ATTENTION_BACKEND", "auto")
    if choice == "auto":
        if device.type == "cuda":
            choice = "triton"
        elif dtype == torch.bfloat16:
            choice = "invariant"
        else:
            choice = "cpu" if shape is not None and cpu_attention.supports(*shape, dtype) else "torch"
    backends = {"torch": TorchAttention, "cpu": CPUPagedAttention, "invariant": InvariantAttention,
                "triton": TritonAttention}
    if choice == "ops":
        return OpAttention(device)
    if choice not in backends:
        raise ValueError(f"SPECSERVE_ATTENTION_BACKEND: expected auto, torch, cpu, invariant, triton or "
                         f"ops, got {choice!r}")
    if choice == "cpu" and not cpu_attention.available():
        raise ValueError(f"SPECSERVE_ATTENTION_BACKEND=cpu: the kernel is unavailable "
                         f"({cpu_attention.why_unavailable()})")
    return backends[choice]()
