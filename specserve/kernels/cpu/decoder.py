"""A CPU float32 model's decoder layers over a step in one C call (`decoder.c`).

Called layer by layer from Python, a decode step of the default model at one row spent ~40%
of its time outside the products (module calls, each kernel wrapper's checks and pointers,
views, allocations). `Decoder` takes every layer's kernels and weights once, as pointers, and
runs the layers' loop in C, calling the same kernels (cpu_linear.c or a8_linear.c's products,
layer_ops.c's norms, rotary and activation, paged_attention.c) in the same order: a row gets
the bits the layer-by-layer path gives it, whatever the batch. LlamaForCausalLM builds one
where every layer's parts are these kernels (`LlamaForCausalLM.use_layer_ops`), and runs it for
steps whose attention metadata is the CPU paged kernel's. `HeadPass` does the same for an
EAGLE draft head's one layer (specserve.spec_decode.eagle_head), its K/V in a paged pool.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from specserve.kernels.cpu import cpu_attention, layer_ops
from specserve.kernels.cpu.cbuild import Kernel

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Proj(ctypes.Structure):
    _fields_ = [("fn", _ptr), ("status", _i64), ("packed", _ptr), ("n", _i64), ("scale", _ptr), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("in_norm", _ptr), ("post_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("rms_norm", _ptr), ("rotary", _ptr), ("silu_mul", _ptr), ("attention", _ptr),
                ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("final_norm", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("runs", _i64), ("block_size", _i64), ("max_blocks", _i64), ("max_keys", _i64),
                ("block_tables", _ptr), ("query_start", _ptr), ("dense", _ptr), ("extra_ptr", _ptr),
                ("extra_pos", _ptr), ("slot_mapping", _ptr), ("cos", _ptr), ("sin", _ptr)]


class _Head(ctypes.Structure):
    _fields_ = [("fc", _Proj), ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
                ("in_norm", _ptr), ("post_norm", _ptr), ("embed", _ptr), ("vocab", _i64),
                ("cos", _ptr), ("sin", _ptr), ("max_positions", _i64)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.head_work.argtypes = [ctypes.POINTER(_Model), _i64]
    lib.head_work.restype = _i64
    lib.head_pass.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Head), ctypes.POINTER(_Step), _ptr, _ptr,
                              _ptr, _i64, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
    lib.head_pass.restype = ctypes.c_int
    lib.decoder_work.argtypes = [ctypes.POINTER(_Model), _i64]
    lib.decoder_work.restype = _i64
    lib.decoder_layers.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _i64, ctypes.POINTER(_Step),
                                   _ptr, _ptr, _ptr, _i64, _ptr, _i64, ctypes.c_int]
    lib.decoder_layers.restype = ctypes.c_int


_kernel = Kernel(Path(__file__).with_name("decoder.c"), _declare)


def available() -> bool:
    return _kernel.available() and layer_ops.available() and cpu_attention.available()


def _proj(packed, in_features: int, out_features: int) -> _Proj:
    """A cpu_linear product (`_Packed`: any of its formats) as decoder.c calls it."""
    if (packed.in_features, packed.out_features) != (in_features, out_features):
        raise ValueError(f"decoder: a product of {packed.in_features} -> {packed.out_features} features, "
                         f"expected {in_features} -> {out_features}")
    fn, status, weights, n, scale, bias = packed.c_entry()
    return _Proj(fn, int(status), weights, n, scale, bias)


def _weight(t: torch.Tensor, size: int) -> int:
    if not (t.dtype == torch.float32 and t.is_contiguous() and t.numel() == size and t.device.type == "cpu"):
        raise ValueError("decoder: norm weights must be contiguous float32 CPU tensors of the hidden size")
    return t.data_ptr()


def _kernels(heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The addresses of the norm, rotary, activation and attention kernels decoder.c calls."""
    return (*(layer_ops.kernel_address(f) for f in ("rms_norm", "rotary", "silu_mul")),
            cpu_attention.kernel_address(heads, kv_heads, head_dim))


def _check(rc: int, rows: int, what: str) -> None:
    if rc == -2:
        raise ValueError(f"paged_attention: at most {cpu_attention.MAX_ROWS} query tokens per request")
    if rc == -3:
        raise ValueError(f"{what}: a token id or a position past its table")
    if rc:
        raise MemoryError(f"{what}: no memory for a step of {rows} rows")


class Decoder:
    """Every decoder layer of one model; `layers`: per layer (qkv, o, gate_up, down: cpu_linear
    products; input and post-attention norm weights). The weights are read through pointers
    taken here: they must not move (the packed products' never do; the norm weights are the
    model's parameters, kept here too)."""

    def __init__(self, layers: Sequence[tuple], final_norm: torch.Tensor, hidden: int, heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float, scale: float) -> None:
        lib = _kernel.lib
        assert lib is not None and available(), _kernel.why_unavailable()
        nq, nkv = heads * head_dim, kv_heads * head_dim
        self.hidden, self.kv_shape = hidden, (kv_heads, head_dim)
        self._keep = (layers, final_norm)
        self._layers = (_Layer * len(layers))()
        for slot, (qkv, o, gate_up, down, in_norm, post_norm) in zip(self._layers, layers):
            slot.qkv, slot.o = _proj(qkv, hidden, nq + 2 * nkv), _proj(o, nq, hidden)
            slot.gate_up, slot.down = _proj(gate_up, hidden, 2 * inter), _proj(down, inter, hidden)
            slot.in_norm, slot.post_norm = _weight(in_norm, hidden), _weight(post_norm, hidden)
        self._model = _Model(*_kernels(heads, kv_heads, head_dim), hidden, heads, kv_heads, head_dim, inter, eps,
                             scale, _weight(final_norm, hidden))
        self._work_per_row = lib.decoder_work(ctypes.byref(self._model), 1)
        self._kv: list | None = None  # the KV caches the layers' pointers were taken from
        self._aux: tuple[tuple[int, ...], ctypes.Array] | None = None

    def _bind(self, kv_caches: list) -> None:
        """Each layer's K and V cache pointers, from the runner's list (kept: it never changes)."""
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"decoder: {len(kv_caches)} KV caches for {len(self._layers)} layers")
        for slot, (k, v) in zip(self._layers, kv_caches):
            if not (k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
                    and k.shape == v.shape and k.dim() == 4 and tuple(k.shape[2:]) == self.kv_shape):
                raise ValueError("decoder: contiguous float32 KV caches [blocks, block_size, kv_heads, head_dim]")
            slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
        self._kv = kv_caches

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list, meta,
                 aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """x: [T, hidden] float32 contiguous, the step's embeddings (overwritten: the residual
        stream); cos, sin: [T, 1, head_dim / 2] float32 contiguous; meta: a CPUPagedMetadata ->
        [T, hidden * (1 + len(aux_layers))]: the final hidden states, then each aux layer's output."""
        if kv_caches is not self._kv:
            self._bind(kv_caches)
        rows = x.shape[0]
        width = self.hidden * (1 + len(aux_layers))
        out = torch.empty(rows, width)
        work = torch.empty(rows * self._work_per_row)
        if self._aux is None or self._aux[0] != aux_layers:
            self._aux = (aux_layers, (_i64 * max(1, len(aux_layers)))(*aux_layers))
        table = meta.table
        step = _Step(rows, meta.query_start.shape[0] - 1, kv_caches[0][0].shape[1], table.shape[1], meta.max_keys,
                     table.data_ptr(), meta.query_start.data_ptr(), meta.dense.data_ptr(), meta.extra_ptr.data_ptr(),
                     meta.extra_pos.data_ptr(), meta.slot_mapping.data_ptr(), cos.data_ptr(), sin.data_ptr())
        rc = _kernel.lib.decoder_layers(ctypes.byref(self._model), self._layers, len(self._layers),
                                        ctypes.byref(step), x.data_ptr(), work.data_ptr(), self._aux[1],
                                        len(aux_layers), out.data_ptr(), width, torch.get_num_threads())
        _check(rc, rows, "decoder")
        return out


class HeadPass:
    """An EAGLE draft head's pass in one C call (decoder.c: head_pass): its products (fc, q/k/v
    fused, o, gate/up fused, down: cpu_linear products), norm weights (in_norm: None where the
    head has none), the token embeddings [vocab, hidden] and its rotary tables [positions,
    head_dim / 2], all read through pointers taken here (kept alive here, never to move)."""

    def __init__(self, products: Sequence, in_norm: torch.Tensor | None, post_norm: torch.Tensor,
                 embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int, inter: int, eps: float) -> None:
        lib = _kernel.lib
        assert lib is not None and available(), _kernel.why_unavailable()
        vocab, hidden = embed.shape
        nq, nkv = heads * head_dim, kv_heads * head_dim
        fc, qkv, o, gate_up, down = products
        tables = (embed, cos, sin)
        if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in tables):
            raise ValueError("head pass: contiguous float32 CPU embeddings and rotary tables expected")
        if cos.shape != sin.shape or cos.shape[-1] * 2 != head_dim:
            raise ValueError("head pass: rotary tables of [positions, head_dim / 2] expected")
        self.hidden, self.kv_shape = hidden, (kv_heads, head_dim)
        self._keep = (products, in_norm, post_norm, tables)
        self._head = _Head(_proj(fc, 2 * hidden, hidden), _proj(qkv, hidden, nq + 2 * nkv), _proj(o, nq, hidden),
                           _proj(gate_up, hidden, 2 * inter), _proj(down, inter, hidden),
                           0 if in_norm is None else _weight(in_norm, hidden), _weight(post_norm, hidden),
                           embed.data_ptr(), vocab, cos.data_ptr(), sin.data_ptr(), cos.shape[0])
        self._model = _Model(*_kernels(heads, kv_heads, head_dim), hidden, heads, kv_heads, head_dim, inter, eps,
                             head_dim ** -0.5, 0)
        self._work_per_row = lib.head_work(ctypes.byref(self._model), 1)

    def __call__(self, feats: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta) -> torch.Tensor:
        """feats: [T, hidden] float32 (unit stride along a row); ids, positions: [T] int64
        contiguous; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim] float32
        contiguous; meta: the attention's metadata as paged_attention takes it, (flat, runs,
        max_blocks, max_keys) with flat one int64 tensor of query_start [runs + 1], dense [T],
        extra_ptr [T + 1], slot_mapping [T], block_tables [runs, max_blocks], extra_pos ->
        [T, hidden], the head's outputs."""
        rows = feats.shape[0]
        if feats.stride(1) != 1 or feats.dtype != torch.float32 or feats.shape[1] != self.hidden:
            feats = feats.float().contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and k_cache.dtype == torch.float32 and tuple(k_cache.shape[2:]) == self.kv_shape):
            raise ValueError("head pass: contiguous float32 K/V [blocks, block_size, kv_heads, head_dim] expected")
        flat, runs, max_blocks, max_keys = meta
        if not (len(ids) == len(positions) == rows and flat.dtype == torch.int64 and flat.is_contiguous()
                and len(flat) >= 2 + 3 * rows + runs * (1 + max_blocks)):
            raise ValueError("head pass: a token id, a position, and the attention's metadata for each row expected")
        at = flat.data_ptr()
        query_start, dense, extra_ptr = at, at + 8 * (runs + 1), at + 8 * (runs + 1 + rows)
        slots = extra_ptr + 8 * (rows + 1)
        table = slots + 8 * rows
        out = torch.empty(rows, self.hidden)
        work = torch.empty(rows * self._work_per_row)
        step = _Step(rows, runs, k_cache.shape[1], max_blocks, max_keys, table, query_start, dense, extra_ptr,
                     table + 8 * runs * max_blocks, slots, 0, 0)
        rc = _kernel.lib.head_pass(ctypes.byref(self._model), ctypes.byref(self._head), ctypes.byref(step),
                                   k_cache.data_ptr(), v_cache.data_ptr(), feats.data_ptr(), feats.stride(0),
                                   ids.data_ptr(), positions.data_ptr(), work.data_ptr(), out.data_ptr(),
                                   torch.get_num_threads())
        _check(rc, rows, "head pass")
        return out
