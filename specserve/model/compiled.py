"""The compiled step: the target's forward over static step buffers, its decoder layers
compiled by torch.compile (inductor; one compiled layer serves every layer) and, on CUDA, the
whole step replayed from CUDA graphs.

`StepRunner.forward` takes a step the runner has flattened (ids, rotary positions, context
lengths, query lengths, block tables, draft trees), pads it to a bucket (step_buffers.py),
writes it into the static buffers and runs the model with attention through the registered
ops (attention/ops.py): the graph of the bucket where one was captured, else the compiled (or
plain) forward. Steps whose longest query or batch is past the buckets (long prefill chunks)
return None and run the eager path. The LM head stays outside: the runner applies it to the
rows it samples.

What runs where (`step_mode`):
* CUDA: compiled and graph-captured by default; `enforce_eager` (`--enforce-eager`,
  `LLM(enforce_eager=True)`) keeps the eager path; SPECSERVE_COMPILE=0 keeps graphs over the
  uncompiled forward.
* CPU: the eager path (our C kernels) unless SPECSERVE_COMPILE=1: the compiled step then runs
  on PyTorch ops only (inductor's CPU code; no graphs), which is slower than the C kernels and
  is there to test the compiled step without a GPU.
* Never with int8 weights (their products are C kernels).
* `--batch-invariant`: compiled and graph-captured too, because a decoder layer's arithmetic is
  then all inside registered ops (model/invariant_ops.py: products, norms with their residual
  adds, rotary, SiLU x up; attention): the compiler only orders them, so a step past the buckets,
  run eagerly, computes what a captured one does. Not for a model with q/k norms (its rotary
  stays PyTorch's elementwise ops, which the compiler fuses and rounds otherwise than the eager
  ops do: bfloat16 intermediates kept in float32, FMAs): `step_mode(eager_arithmetic=True)`,
  graphs over the uncompiled forward.

Inside the compiled region (a decoder layer) nothing reads an environment variable or a value
from the device, and every op's metadata is a tensor: `fullgraph=True` holds
(tests/test_compiled_step.py). Compiling a layer rather than the whole forward makes the
compiler's work one layer's: an engine starts in about half the time at 30 layers on a CPU
(docs/benchmarks.md); under CUDA graphs the eager code between layers costs nothing (the replay
runs no Python).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

from specserve.env import env_str
from specserve.model.attention.ops import OpAttention
from specserve.model.step_buffers import Bucket, StepBuffers, bucket_of, buckets

MAX_WIDTH = 64  # the longest query a bucket holds when speculating (verify rows, calibration)


def step_mode(device: torch.device, enforce_eager: bool = False, quantization: str = "none",
              eager_arithmetic: bool = False) -> tuple[bool, bool]:
    """(compile, graphs) for a target on `device`: see the module's docstring. eager_arithmetic:
    the step's elementwise arithmetic must round as PyTorch's eager ops do (never compiled)."""
    if enforce_eager or quantization != "none":
        return False, False
    choice = env_str("COMPILE", "auto").strip().lower()
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"SPECSERVE_COMPILE: expected auto, 0 or 1, got {choice!r}")
    cuda = device.type == "cuda"
    graphs = cuda and torch.cuda.is_available()
    if eager_arithmetic:
        return False, graphs
    return choice == "1" or (choice == "auto" and cuda), graphs


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StepRunner:
    """The compiled or graph-captured step of one ModelRunner (its model, KV caches, device)."""

    def __init__(self, runner, max_seqs: int, max_tokens: int, max_width: int,
                 compile: bool, graphs: bool) -> None:
        self.model, self.device = runner.model, runner.device
        self.block_size = runner.block_size
        # the KV caches whole, with each layer's index (attention/ops.py): one graph input each
        self.kv = [((runner.k_cache, i), (runner.v_cache, i)) for i in range(runner.k_cache.shape[0])]
        self.backend = OpAttention(self.device)
        # compiled: one request pads to two, so that no size is one (the compiler gives a size of
        # one a graph of its own; a second row costs next to nothing)
        smallest = 2 if compile else 1
        self.batch = [b for b in buckets(max(max_seqs, smallest)) if b >= smallest]
        self.widths = buckets(max_width)
        max_seqs, max_tokens = self.batch[-1], max(max_tokens, self.batch[-1])
        # the mask's words and the table's width as for MAX_WIDTH whatever the speculation (a
        # plain engine's max_width is one): plain and speculating engines of a model then have
        # the same graph, and the compiler's cache serves the second one that starts
        shared = max(max_width, MAX_WIDTH)
        max_blocks = -(-(runner.max_model_len + shared) // self.block_size) + 1
        self.buffers = StepBuffers(max_tokens, max_seqs, max_blocks, max_width, self.block_size,
                                   runner.null_block, self.device, mask_width=shared)
        self.compiled = compile
        # steps run here by kind (width 1, or more), and those that fit no bucket (run eagerly)
        self.counts = {"decode": 0, "verify": 0, "eager": 0}
        # Compiled per decoder layer (regional): every layer runs the same code on tensors of the
        # same shapes, so one compiled graph serves them all (two: the first layer has no residual
        # yet), and compiling takes a layer's time, not the model's; the embedding, the rotary
        # table and the last norm run eagerly between (captured in the same CUDA graph). The step's
        # sizes are marked dynamic (_mark_dynamic): one graph for every bucket (decode and verify
        # steps alike, step_buffers.py), but for sizes of one, which none has when compiled.
        # (a code object of its own: torch.compile keeps a function's graphs on its code object, so
        # engines of other shapes in one process do not add up to its recompile limit)
        self.layer_fn = _own_copy(_layer_forward)
        self._layer = _dynamic_rows(torch.compile(self.layer_fn, fullgraph=True)) if compile else None
        self.graphs = None
        if graphs:
            from specserve.model.cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs(self.run, self.buffers, runner.model.output_width, runner.dtype, self.device)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(ids, positions, self.kv, meta, self.backend, layer_fn=self._layer)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The forward of a filled bucket -> hidden states [bucket tokens, hidden]."""
        if self.compiled:
            _mark_dynamic(ids, positions, meta, columns=self.graphs is None)
        return self._forward(ids, positions, meta)

    def all_buckets(self) -> list[Bucket]:
        """Every (requests, width) pair whose tokens fit the buffers (what graphs capture)."""
        return [Bucket(b, b * w, w) for b in self.batch for w in self.widths if b * w <= self.buffers.max_tokens]

    def capture(self) -> float:
        """Capture every bucket's graph (CUDA); -> seconds."""
        if self.graphs is None:
            return 0.0
        seconds = self.graphs.capture(self.all_buckets())
        print(f"[specserve] captured {len(self.graphs.graphs)} CUDA graphs of the "
              f"{'compiled' if self.compiled else 'eager'} step in {seconds:.1f} s", flush=True)
        return seconds

    def bucket(self, query_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> Bucket | None:
        """The padded shape of a step, or None when it fits no bucket."""
        reqs = bucket_of(self.batch, len(query_lens))
        width = bucket_of(self.widths, max(query_lens))
        used = max(map(len, block_tables))
        if reqs is None or width is None or reqs * width > self.buffers.max_tokens or used > self.buffers.max_blocks:
            return None
        # graphs read the whole table; elsewhere attention reads the columns in use, rounded up
        # (to two at least: a size of one would be a graph of its own)
        blocks = None if self.graphs is not None else min(max(2, _pow2_at_least(used)), self.buffers.max_blocks)
        return Bucket(reqs, reqs * width, width, blocks)

    def forward(self, ids: Sequence[int], positions: Sequence[int], seq_lens: Sequence[int],
                query_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                tree_parents: Sequence[Sequence[int] | None] | None) -> torch.Tensor | None:
        """Final hidden states [T, hidden] of a flattened step (ModelRunner.execute's lists),
        or None when the step fits no bucket (the caller runs it eagerly)."""
        bucket = self.bucket(query_lens, block_tables)
        if bucket is None:
            self.counts["eager"] += 1
            return None
        ids_t, positions_t, meta = self.buffers.fill(bucket, ids, positions, seq_lens, query_lens,
                                                     block_tables, tree_parents)
        num_tokens = len(ids)
        self.counts["decode" if bucket.width == 1 else "verify"] += 1
        if self.graphs is not None:
            hidden = self.graphs.replay(bucket)
            if hidden is not None:
                return hidden[:num_tokens].clone()  # (the next replay overwrites the buffer)
        return self.run(ids_t, positions_t, meta)[:num_tokens]


def _layer_forward(layer, x, residual, positions, rotary, kv_cache, meta, backend):
    """One decoder layer (what torch.compile traces, once for every layer)."""
    return layer.forward(x, residual, positions, rotary, kv_cache, meta, backend)


def _own_copy(fn):
    """fn with a code object of its own (equal, not the same)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _dynamic_rows(compiled_layer):
    """compiled_layer, its activations' row counts marked dynamic before each call (the eager
    code between layers hands them over unmarked)."""
    mark = torch._dynamo.maybe_mark_dynamic

    def run(layer, x, residual, positions, rotary, kv_cache, meta, backend):
        for t in (x, positions, *rotary) if residual is None else (x, residual, positions, *rotary):
            mark(t, 0)
        return compiled_layer(layer, x, residual, positions, rotary, kv_cache, meta, backend)
    return run


def _mark_dynamic(ids: torch.Tensor, positions: torch.Tensor, meta, columns: bool) -> None:
    """The sizes that vary between buckets: tokens, requests (and the block-table columns
    where they vary); the caches and weights keep static shapes."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc):
        mark(t, 0)
    mark(meta.tree_mask, 0)
    if columns:
        mark(meta.block_tables, 1)
