"""A decoder layer's small float32 ops on x86 CPUs, one C call each (`layer_ops.c`), and the
vocabulary argmax of sampling and verification.

At a few rows a layer's RMS norms, residual adds, rotary embedding and MLP activation cost
PyTorch some twenty dispatches of a few microseconds each, more than their arithmetic; here
they are four calls per layer. `rms_norm` sums the residual in (the same additions as
PyTorch's) and normalises each row with its own fixed summation order (batch-invariant, not
PyTorch's bits); `rotary_` computes exactly PyTorch's rotate-half expression (the same bits);
`silu_mul` is the MLP's silu(gate) * up (to ~1e-7); `argmax` gives exactly torch.argmax's
indices, in a fraction of its time over a vocabulary; `copy_slots` moves KV cache slots in every
layer at once. Built and loaded by specserve.kernels.cpu.cbuild; `available()` says whether
they can run here. Greedy verification, which a speculative step calls between its forwards on
every device, goes through host_ops.c, the same C as an extension module that reads and returns
Python lists (`host_available()`); it takes a tensor's geometry from `rows_view`, once, as the
speculative methods' tree growth does (specserve.spec_decode.tree_ops, an extension module on
this C).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specserve.kernels.cpu.cbuild import Extension, Kernel


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ptr, ptr, ctypes.c_int]
    lib.rms_norm.restype = None
    lib.rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int]
    lib.rotary.restype = None
    lib.argmax.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.argmax.restype = None
    lib.top_logprobs.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.top_logprobs.restype = None
    lib.silu_mul.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.silu_mul.restype = None
    lib.copy_slots.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64]
    lib.copy_slots.restype = ctypes.c_int


_kernel = Kernel(Path(__file__).with_name("layer_ops.c"), _declare)
_host = Extension(Path(__file__).with_name("host_ops.c"))  # greedy verification's host call (host_ops.c)


def available() -> bool:
    return _kernel.available()


def why_unavailable() -> str | None:
    return _kernel.why_unavailable()


def kernel_address(name: str) -> int:
    """The address of one of layer_ops.c's functions (rms_norm, rotary, silu_mul), for a
    caller in C (decoder.c)."""
    assert _kernel.lib is not None, _kernel.why_unavailable()
    return ctypes.cast(getattr(_kernel.lib, name), ctypes.c_void_p).value


def host_available() -> bool:
    """Whether greedy_walk can run here: the CPU's kernels as a CPython extension module
    (host_ops.c), which needs a C compiler and Python's headers to build. (Asked every step:
    the answer is kept.)"""
    global _host_ok
    if _host_ok is None:
        _host_ok = _kernel.available() and _host.available()
    return _host_ok


_host_ok: bool | None = None


def rows_view(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(data pointer, rows, columns, row stride) of x when these kernels can read its rows (a
    2-d float32 CPU tensor with unit stride along a row, the library built), else None. Five
    tensor calls: between a step's forwards every distinct call into torch costs several
    microseconds (its code comes back cold), so the step's wrappers below take x's geometry once,
    here, and check nothing else of it."""
    if not (x.is_cpu and x.dtype is torch.float32):
        return None
    stride = x.stride()
    if len(stride) != 2 or stride[1] != 1 or not _kernel.available():
        return None
    rows, n = x.shape
    return x.data_ptr(), rows, n, stride[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., dim] float32; weight: [dim] float32 contiguous -> (norm(s) * weight,
    s) with s = x + residual (x itself without a residual)."""
    dim = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    res = None if residual is None else residual.contiguous()  # kept alive through the call
    total = x if res is None else torch.empty_like(x)
    _kernel.lib.rms_norm(x.data_ptr(), 0 if res is None else res.data_ptr(), weight.data_ptr(), x.numel() // dim,
                         dim, eps, 0 if res is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out, total


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate, in place, the first `heads` heads of each row of x [T, >= heads * head_dim]
    (float32, unit stride along a row); cos, sin: [T, ..., head_dim / 2] float32 contiguous."""
    assert x.stride(-1) == 1 and x.shape[-1] >= heads * head_dim
    _kernel.lib.rotary(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                       torch.get_num_threads())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, n] float32 (unit stride along a row, n >= 1) -> [rows] int64, exactly
    torch.argmax(x, -1) (first index on ties, the first NaN if any)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] > 0
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernel.lib.argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def greedy_walk(x: tuple[int, int, int, int], roots: list[int], trees: list[tuple]
                ) -> tuple[list[list[int]], list[int]]:
    """Greedy verification (host_ops.c, layer_ops.c: greedy_walk; needs host_available()). x:
    rows_view of [rows, n] logits; request b's root at row roots[b], its tree (tokens, parents,
    ...: a tuple, its first two items read) node i at row roots[b] + 1 + i. -> (each request's
    accepted nodes from the root, the argmax after them): what following each row's
    torch.argmax gives, reading only the rows on the way. IndexError when a tree's rows run
    past x."""
    return _host.module.greedy_walk(*x, roots, trees, torch.get_num_threads())


def top_logprobs(x: torch.Tensor, k: int, d2t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] float32 logits (unit stride along a row), 1 <= k <= n -> (log-softmax
    values [rows, k] float32, descending, and their column indices [rows, k] int64): what
    x.log_softmax(-1).topk(k) gives, to ~1e-6 (the lower index first on ties); the indices
    mapped through d2t ([n] int64 contiguous) when given."""
    assert x.dim() == 2 and x.stride(-1) == 1 and 1 <= k <= x.shape[1]
    assert d2t is None or (d2t.dtype == torch.int64 and d2t.is_contiguous() and len(d2t) == x.shape[1])
    val = torch.empty(x.shape[0], k)
    idx = torch.empty(x.shape[0], k, dtype=torch.int64)
    _kernel.lib.top_logprobs(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k,
                             0 if d2t is None else d2t.data_ptr(), val.data_ptr(), idx.data_ptr(),
                             torch.get_num_threads())
    return val, idx


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] float32 contiguous (each row gate then up) -> silu(gate) * up,
    [rows, inter] float32 (to ~1e-7 of PyTorch's)."""
    assert gate_up.dim() == 2 and gate_up.is_contiguous() and gate_up.shape[1] % 2 == 0
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter)
    _kernel.lib.silu_mul(gate_up.data_ptr(), gate_up.shape[0], inter, out.data_ptr(), torch.get_num_threads())
    return out


def slot_mover(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """A callable (src, dst) that copies, in every layer of k_cache and v_cache ([L, num_blocks,
    block_size, ...] contiguous, one dtype, on the CPU), slot src[i] to slot dst[i] (slot =
    block * block_size + offset; lists of ints), every source read before any write: what
    specserve.kernels.compact_kv does, in one C call (the geometry is read once, here)."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert k_cache.dtype == v_cache.dtype and k_cache.dim() >= 3 and k_cache.device.type == "cpu"
    k, v, layers = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0]
    slots, size = k_cache.shape[1] * k_cache.shape[2], k_cache.element_size()
    row, layer_stride = k_cache.stride(2) * size, k_cache.stride(0) * size
    copy = _kernel.lib.copy_slots

    def move(src: list[int], dst: list[int]) -> None:
        n = len(src)
        if not n:
            return
        if len(dst) != n or min(src) < 0 or min(dst) < 0 or max(src) >= slots or max(dst) >= slots:
            raise IndexError(f"copy_slots: {n} sources, {len(dst)} targets, slots 0..{slots - 1}")
        ids = (ctypes.c_int64 * (2 * n))(*src, *dst)
        if copy(k, v, layers, layer_stride, row, row, ids, ctypes.byref(ids, 8 * n), n):
            raise MemoryError("copy_slots: out of memory")

    return move
