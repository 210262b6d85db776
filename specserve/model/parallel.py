"""Tensor parallelism: one model split across ranks, each a process with its own device.

Every rank holds a slice of each layer and runs the same step on the same inputs (rank 0 sends
them; the worker loop and the start-up are in specserve/model/tp_worker.py):

  * q/k/v (fused) column-parallel: each rank its query heads and the KV heads they read; where a
    model has fewer KV heads than ranks, a KV head is replicated on the ranks that share it
    (tensor_parallel_size a multiple of the KV heads). Each rank's paged KV cache holds its KV
    heads only.
  * o_proj and down_proj row-parallel: each rank's partial product, then one all-reduce each
    (`RowParallel`), so the residual stream, every norm and the final hidden states are whole
    and the same on every rank.
  * gate/up (fused) column-parallel: each rank a slice of the intermediate columns.
  * the embedding and the LM head vocabulary-parallel: each rank a slice of the vocabulary
    (ceil(V / N) rows, the last slice padded with zero rows); an embedding lookup is one
    all-reduce (a row is found on one rank, zeros elsewhere: the sum is exact), and rank 0
    gathers the slices' logits into whole rows for sampling and verification. Draft heads
    (EAGLE, Medusa) run on rank 0 only and read the whole embedding and LM head: rank 0 then
    keeps them too (`HeadView`).

Reductions: on CUDA (NCCL) an all-reduce. On a CPU (gloo) every rank gathers the partial sums
and adds them in rank order, which costs N times the bytes of one partial but makes each row's
bits independent of the batch around it (gloo's ring all-reduce sums an element in an order
that depends on where it falls in the buffer, i.e. on the batch size) and the same on every
rank: with our batch-invariant CPU kernels, speculation stays exactly lossless under TP.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

COLLECTIVE_TIMEOUT_S = 300.0  # a collective that waits longer than this fails (a hung rank)


class WorkerLost(BaseException):
    """A tensor-parallel rank died, or a step failed part-way on some rank: the ranks can no
    longer run the same step. Not an Exception on purpose: the engine's recovery (a failed step
    retried in ever smaller groups) cannot help, so it goes through it and ends the engine: the
    server's engine thread dies (every request gets an error, /health turns 503, the process
    exits non-zero) and `LLM.generate` raises it."""


def check_shape(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """ValueError unless a model of this shape splits across `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be at least 1, got {size}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size: the model's {num_heads} attention heads do not "
                         f"split across {size} ranks")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: the model's {num_kv_heads} KV heads do not split "
                         f"across {size} ranks (nor does {size} replicate them evenly)")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size: the model's intermediate size {intermediate_size} "
                         f"does not split across {size} ranks")


def local_heads(num_heads: int, num_kv_heads: int, size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank."""
    return num_heads // size, max(1, num_kv_heads // size)


def kv_head_start(num_kv_heads: int, size: int, rank: int) -> int:
    """The first KV head of `rank` (a replicated KV head: the one its query heads read)."""
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)


def vocab_slice(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first token id, tokens held, rows with padding) of `rank`'s vocabulary slice."""
    per = math.ceil(vocab_size / size)
    start = min(vocab_size, rank * per)
    return start, min(vocab_size, start + per) - start, per


class TensorParallel:
    """One rank's place in the group: its rank, the group's size, its device and the process
    group; on rank 0 (the engine's process) also its workers (tp_worker.Workers)."""

    def __init__(self, rank: int, size: int, store_path: str, device: torch.device,
                 vocab_size: int, timeout: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.rank, self.size, self.device, self.vocab_size = rank, size, device, vocab_size
        store = dist.FileStore(store_path, size)
        if device.type == "cuda":  # untested: no multi-GPU machine has run it
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=timeout)
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
            self.ordered = False
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
            self.ordered = True
        self.workers = None  # rank 0: tp_worker.Workers, set by tp_worker.start
        self.keep_vocab = False  # rank 0 with a draft head: keep the whole embedding and LM head

    # -- collectives (every rank, in the same order) ----------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (each rank's partial), the same bits on every rank."""
        x = x.contiguous()
        if not self.ordered:
            self._wait(self.pg.allreduce([x]))
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.pg.allgather([parts], [x]))
        total = parts[0] + parts[1]
        for p in parts[2:]:
            total += p
        return total

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each rank's logits of its vocabulary slice [R, per] -> on rank 0 the whole rows
        [R, V]; None on the others."""
        if logits.shape[0] == 0:  # no row to sample this step (every rank knows it)
            return logits.new_empty(0, self.vocab_size) if self.rank == 0 else None
        logits = logits.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self._wait(self.pg.gather([], [logits], opts))
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._wait(self.pg.gather([parts], [logits], opts))
        return torch.cat(parts, dim=1)[:, :self.vocab_size]

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # a peer died (gloo: the connection closed) or timed out
            if self.workers is not None:
                raise self.workers.lost(f"a collective failed ({str(e).splitlines()[0][:200]})") from e
            raise

    # -- rank 0 ---------------------------------------------------------------------------------
    def run(self, op: str, fn, args: tuple):
        """Rank 0: send step `op` with `args` to the workers, then run `fn(*args)` here. An
        error here after the workers have the step leaves them inside it: the group is lost."""
        self.workers.send(op, args)
        try:
            return fn(*args)
        except WorkerLost:
            raise
        except Exception as e:  # noqa: BLE001 - the ranks are out of step from here
            raise self.workers.lost(f"step {op!r} failed on rank 0 after the workers started it "
                                    f"({e!r})") from e
        except BaseException:  # KeyboardInterrupt: the same, but it stays what it was
            self.workers.lost(f"step {op!r} was interrupted on rank 0 after the workers started it")
            raise

    def check(self) -> None:
        """Rank 0: raise WorkerLost if a worker has died (cheap: a flag the watchdog sets)."""
        if self.workers is not None:
            self.workers.check()

    def shutdown(self) -> None:
        """Rank 0: stop the workers (idempotent)."""
        if self.workers is not None:
            self.workers.shutdown()

    # -- the model --------------------------------------------------------------------------------
    def shard(self, model) -> None:
        """Keep this rank's slice of every weight of `model` (a LlamaForCausalLM with its
        whole weights loaded, before the cast to its dtype), in place."""
        arch, r, n = model.arch, self.rank, self.size
        check_shape(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, n)
        heads, kv_heads = local_heads(arch.num_heads, arch.num_kv_heads, n)
        d, inter = arch.head_dim, arch.intermediate_size // n
        q0, kv0 = r * heads * d, kv_head_start(arch.num_kv_heads, n, r) * d
        k_base, v_base = arch.num_heads * d, (arch.num_heads + arch.num_kv_heads) * d
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            _keep_rows(attn.qkv_proj, [(q0, q0 + heads * d), (k_base + kv0, k_base + kv0 + kv_heads * d),
                                       (v_base + kv0, v_base + kv0 + kv_heads * d)])
            attn.num_heads, attn.num_kv_heads = heads, kv_heads
            attn.q_size, attn.kv_size = heads * d, kv_heads * d
            attn.o_proj = RowParallel(_keep_cols(attn.o_proj, q0, q0 + heads * d), self)
            i0 = r * inter
            _keep_rows(mlp.gate_up_proj, [(i0, i0 + inter),
                                          (arch.intermediate_size + i0, arch.intermediate_size + i0 + inter)])
            mlp.intermediate = inter
            mlp.down_proj = RowParallel(_keep_cols(mlp.down_proj, i0, i0 + inter), self)
        start, count, per = vocab_slice(arch.vocab_size, n, r)
        tied = model.lm_head.weight is model.embed_tokens.weight
        embed, head = model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
        if self.keep_vocab:
            model.head_view = HeadView(arch, embed, None if tied else head)
        embed_slice = _padded_rows(embed, start, count, per)
        model.embed_tokens = VocabParallelEmbedding(embed_slice, start, count, self)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight
        else:
            model.lm_head.weight = nn.Parameter(_padded_rows(head, start, count, per), requires_grad=False)
        model.lm_head.out_features = per


def _keep_rows(linear: nn.Linear, ranges: list[tuple[int, int]]) -> None:
    """A column-parallel slice: the output rows in `ranges`, in that order."""
    idx = torch.cat([torch.arange(a, b) for a, b in ranges]).to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.detach().index_select(0, idx), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().index_select(0, idx), requires_grad=False)
    linear.out_features = len(idx)


def _keep_cols(linear: nn.Linear, a: int, b: int) -> nn.Linear:
    """A row-parallel slice: the input columns [a, b) (o_proj and down_proj have no bias in
    this model family, so nothing is added once per rank)."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, a:b].contiguous(), requires_grad=False)
    linear.in_features = b - a
    return linear


def _padded_rows(weight: torch.Tensor, start: int, count: int, per: int) -> torch.Tensor:
    out = weight.new_zeros(per, weight.shape[1])
    out[:count] = weight[start:start + count]
    return out


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product (`inner`, the model's Linear on
    this rank's input columns; packed or quantized like any other), then the sum over ranks."""

    def __init__(self, inner: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a lookup sums every rank's (zeros where a token is
    another rank's): exact, whatever the order."""

    def __init__(self, weight: torch.Tensor, start: int, count: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.count, self.tp = start, count, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.count)
        x = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(~mine[:, None], 0))


class _Weight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)


class HeadView(nn.Module):
    """What a draft head (EAGLE, Medusa) reads of its target: the config and the whole
    embedding and LM head weights (rank 0 keeps them when a head drafts; a submodule of the
    model, so they follow its dtype)."""

    def __init__(self, arch, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = _Weight(embed)
        self.lm_head = self.embed_tokens if lm_head is None else _Weight(lm_head)
