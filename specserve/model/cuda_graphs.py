"""CUDA graphs of the step's forward, one per bucket (step_buffers.Bucket), captured at start.

Each graph replays the forward of one padded shape over the static step buffers: the runner
writes a step's inputs into those buffers and replays the graph of its bucket, one launch for
the whole forward instead of one per kernel. The forward (compiled or not) writes its final
hidden states into one output buffer shared by every graph (a step reads its rows before the
next replay). Graphs are captured largest first into one memory pool, so the smaller ones
reuse the larger ones' intermediate memory. A warm-up run before each capture compiles what
is compiled lazily (torch.compile's graph for the shape, the Triton kernels' variants); the
warm-up and capture steps are padding only, so they write the null block and nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

from specserve.model.step_buffers import Bucket, StepBuffers

logger = logging.getLogger(__name__)
T = TypeVar("T")

WARMUP_RUNS = 2  # runs before a capture (the first compiles, the second runs as captured)


def capture_graph(run: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` warmed up WARMUP_RUNS times off the capture stream (as graphs need), then captured
    into a graph in memory pool `pool` -> (the graph, what the captured run returned: the
    tensors its replays write)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class CudaGraphs:
    def __init__(self, forward: Callable, buffers: StepBuffers, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError("CUDA graphs need a CUDA device")
        self.forward, self.buffers = forward, buffers
        self.out = torch.zeros(buffers.max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}

    def _run(self, bucket: Bucket, ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        self.out[:bucket.tokens].copy_(self.forward(ids, positions, meta))

    @torch.inference_mode()
    def capture(self, buckets: Iterable[Bucket]) -> float:
        """Capture a graph for every bucket; -> the seconds it took (warm-ups included)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(buckets, key=lambda b: (b.tokens, b.reqs), reverse=True):
            ids, positions, meta = self.buffers.fill_padding(bucket)
            self.graphs[bucket], _ = capture_graph(lambda: self._run(bucket, ids, positions, meta), pool)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def replay(self, bucket: Bucket) -> torch.Tensor | None:
        """The hidden states [bucket.tokens, hidden] of the step in the buffers, or None when
        the bucket has no graph. The result is overwritten by the next replay."""
        graph = self.graphs.get(bucket)
        if graph is None:
            return None
        graph.replay()
        return self.out[:bucket.tokens]
