"""EAGLE's tree growth on the device: each depth's head pass, LM head and top-k and the choice of
the next frontier as tensor ops of fixed shapes, with no host round trip between depths; on CUDA
replayed from a CUDA graph per (requests, context) bucket.

On a CPU EagleProposer (spec_decode/eagle.py) grows its trees on the host: after each depth's
LM head the top-k comes to the host, C bookkeeping (tree_ops) picks the next frontier and builds
the next pass's inputs. On a GPU that way each depth waits for the device to drain and launches
its small kernels one by one, and a drafting call cost more than the target's step it drafted
for (docs/benchmarks.md).

Here every request expands exactly k nodes per depth (EAGLE-2's frontier: the k best new nodes,
ties to the earlier one) whatever they score; nodes under the cost model's score cut are dropped
afterwards with their descendants, which score lower still, so the trees are the ones the host
growth builds (tests/test_eagle_medusa.py checks it). A request's frontier rows attend to its
committed pairs (gathered once a call from the head's K/V into a padded buffer) and to the
tree entries the earlier depths wrote there, under a mask built on the device from the context
lengths and each frontier node's ancestors. The [B, N] tokens, parents and scores cross to the
host in one copy, where each request keeps its m best nodes (eagle._rerank).

SPECSERVE_DRAFT_GROWTH chooses: `host`, `device` (these ops, run as they come), `graphs` (these
ops replayed from CUDA graphs captured at engine start, one per bucket of requests and context
length; CUDA only) or `auto` (the default: `graphs` on CUDA, `host` elsewhere).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from specserve.env import env_str
from specserve.sampling.sampler import top_logprobs
from specserve.spec_decode.eagle_head import DRAFT_SDPA_BACKENDS, PooledKV

logger = logging.getLogger(__name__)

GROWTH_CHOICES = ("auto", "host", "device", "graphs")
MIN_CONTEXT = 64  # the smallest context bucket (committed pairs gathered per request)
GRAPH_BYTES = 256 << 20  # the K/V the captured buckets read (one buffer for all); larger calls run uncaptured


def growth_mode(device: torch.device) -> str:
    """SPECSERVE_DRAFT_GROWTH for a head on `device`: host, device or graphs."""
    choice = env_str("DRAFT_GROWTH", "auto").strip().lower()
    if choice not in GROWTH_CHOICES:
        raise ValueError(f"SPECSERVE_DRAFT_GROWTH: expected one of {', '.join(GROWTH_CHOICES)}, got {choice!r}")
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if choice == "graphs" and not cuda:
        raise ValueError("SPECSERVE_DRAFT_GROWTH=graphs: CUDA graphs need a CUDA device")
    if choice == "auto":
        return "graphs" if cuda else "host"
    return choice


def _pow2_at_least(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


class DeviceGrowth:
    """The growth of one EagleProposer's trees on its device (the module's docstring).

    draft: the head's DraftPass; lm_head: [rows, hidden] -> draft logits; d2t: the draft
    vocabulary's ids in the target's (or None); embed: the token embeddings; depth, topk: the
    tree's; graphs: replay the ops from CUDA graphs."""

    def __init__(self, draft, lm_head, d2t: torch.Tensor | None, embed: torch.Tensor, depth: int, topk: int,
                 graphs: bool = False) -> None:
        self.draft, self.lm_head, self.d2t, self.embed = draft, lm_head, d2t, embed
        self.depth, self.k = depth, topk
        self.entries = (depth - 1) * topk  # tree entries: the nodes run through the head
        self.nodes = topk + (depth - 1) * topk * topk  # nodes made: the root's k, then k*k a depth
        self.hidden = embed.shape[1]
        self.num_kv, self.head_dim = draft.num_kv, draft.head_dim
        self.device, self.dtype = embed.device, embed.dtype
        self.use_graphs = graphs  # until capture() captured them, or failed to
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = None  # the graphs' memory pool

    # -- the host side ----------------------------------------------------------------------
    @torch.inference_mode()  # (the captured buffers are inference tensors, written in place here)
    def grow(self, caches: list, positions: list[int]) -> list[tuple[list[int], list[int], list[float]]]:
        """caches: each request's _HeadCache, caught up (its committed pairs in its K/V, the
        root's head output in last_out); positions: each one's last committed position -> per
        request the nodes made (tokens, parents, scores; node i's parent before it, -1: the
        root), in the host growth's order."""
        b = len(caches)
        longest = max(c.pairs for c in caches)
        captured = self._graphs.get((_pow2_at_least(b), _pow2_at_least(longest, MIN_CONTEXT)))
        if captured is not None:
            root, keys, values, meta = captured.inputs
            self._fill(caches, positions, longest, root, keys, values, meta)
            captured.graph.replay()
            return self._to_host(*captured.outputs, b)
        width = longest + self.entries
        root = torch.zeros(b, self.hidden, dtype=self.dtype, device=self.device)
        keys = torch.zeros(b, width, self.num_kv, self.head_dim, dtype=self.dtype, device=self.device)
        values, meta = torch.zeros_like(keys), torch.zeros(2, b, dtype=torch.int64, device=self.device)
        self._fill(caches, positions, longest, root, keys, values, meta)
        return self._to_host(*self.run(root, keys, values, meta[0], meta[1]), b)

    def _fill(self, caches, positions, longest: int, root, keys, values, meta) -> None:
        """Write a call's inputs into the (possibly larger, padded) buffers: the roots' outputs,
        each request's committed K/V at entries 0 .. pairs - 1 (longest: the most pairs of any),
        context lengths and positions (padding rows: 0 pairs, position 0, a zero root; entries
        past a request's pairs are left as they are, finite and masked)."""
        b = len(caches)
        root[:b] = torch.stack([c.last_out for c in caches])
        root[b:] = 0
        host = np.zeros((2, meta.shape[1]), np.int64)
        host[0, :b] = [c.pairs for c in caches]
        host[1, :b] = positions
        meta.copy_(torch.from_numpy(host), non_blocking=True)
        if isinstance(caches[0].kv, PooledKV):  # one gather from the pool for every request
            pool, slots = caches[0].kv.pool, np.zeros((b, longest), np.int64)
            for j, c in enumerate(caches):
                slots[j, :c.pairs] = c.kv.slots(0, c.pairs)
            index = torch.from_numpy(slots.ravel()).to(self.device, non_blocking=True)
            shape = (b, longest, self.num_kv, self.head_dim)
            keys[:b, :longest] = pool.k.index_select(0, index).view(shape)
            values[:b, :longest] = pool.v.index_select(0, index).view(shape)
        else:  # HeadKV: [Hkv, capacity, D] per request
            for j, c in enumerate(caches):
                keys[j, :c.pairs] = c.kv.k[:, :c.pairs].transpose(0, 1)
                values[j, :c.pairs] = c.kv.v[:, :c.pairs].transpose(0, 1)

    def _to_host(self, tokens, parents, scores, b: int):
        """The first b requests' nodes as lists, in one copy (one synchronisation)."""
        n = self.nodes
        both = torch.cat([tokens[:b], parents[:b], scores[:b].view(torch.int64)], 1).cpu()
        ids, par = both[:, :n].tolist(), both[:, n:2 * n].tolist()
        sc = both[:, 2 * n:].contiguous().view(torch.float64).tolist()
        return list(zip(ids, par, sc))

    # -- the device side ---------------------------------------------------------------------
    def run(self, root: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pairs: torch.Tensor,
            position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The growth as tensor ops of fixed shapes (what a graph captures). root [B, hidden];
        keys, values [B, L + T, Hkv, D]: a request's committed pairs at entries < pairs[b], the
        T tree entries after the L context ones written here; pairs, position [B] int64 -> nodes
        [B, N]: tokens int64, parents int64 (-1: the root), scores float64 (log q of the path)."""
        if root.device.type != "cuda":
            return self._run(root, keys, values, pairs, position)
        with torch.nn.attention.sdpa_kernel(DRAFT_SDPA_BACKENDS):
            return self._run(root, keys, values, pairs, position)

    def _run(self, root, keys, values, pairs, position):
        b, hidden = root.shape
        k, entries = self.k, self.entries
        length, device = keys.shape[1] - entries, root.device
        val, tok = top_logprobs(self.lm_head(root), k, self.d2t)  # depth 1: the root's top-k
        tokens, scores = [tok], [val.double()]
        parents = [torch.full((b, k), -1, dtype=torch.int64, device=device)]
        f_ids, f_score, f_tok = torch.arange(k, device=device).expand(b, k), scores[0], tok
        f_feat = root.unsqueeze(1).expand(b, k, hidden)
        ancestors = torch.zeros(b, k, entries, dtype=torch.bool, device=device)  # the frontier's, tree entries
        see_context = (torch.arange(length, device=device) < pairs[:, None]).unsqueeze(1).expand(b, k, length)
        entry = torch.arange(entries, device=device)
        made = k
        for d in range(1, self.depth):
            first = (d - 1) * k  # the frontier's tree entries: first .. first + k - 1
            itself = entry == (first + torch.arange(k, device=device))[:, None]  # [k, T]
            mask = torch.cat([see_context, ancestors | itself], -1)
            out = self.draft.run(f_feat.reshape(b * k, hidden), self.embed.index_select(0, f_tok.reshape(-1)),
                                 (position + (d - 1)).repeat_interleave(k),
                                 lambda q, kk, vv: self._attend(keys, values, length + first, mask, q, kk, vv))
            val, tok = top_logprobs(self.lm_head(out), k, self.d2t)  # [B * k, k]
            child_score = (f_score.unsqueeze(2) + val.view(b, k, k).double()).view(b, k * k)
            child_tok = tok.view(b, k * k)
            tokens.append(child_tok)
            scores.append(child_score)
            parents.append(f_ids.repeat_interleave(k, 1))  # parent-major, then by rank
            if d + 1 == self.depth:
                break
            best = torch.sort(child_score, stable=True, dim=1, descending=True).indices[:, :k]
            src = best.div(k, rounding_mode="floor")  # each new frontier node's parent's row
            f_ids, made = made + best, made + k * k
            f_score, f_tok = child_score.gather(1, best), child_tok.gather(1, best)
            f_feat = out.view(b, k, hidden).gather(1, src.unsqueeze(2).expand(b, k, hidden))
            ancestors = (ancestors.gather(1, src.unsqueeze(2).expand(b, k, entries))
                         | (entry == (first + src).unsqueeze(2)))
        return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(scores, 1)

    def _attend(self, keys, values, at: int, mask, q, k, v) -> torch.Tensor:
        """A depth's attention: the frontier's K/V written at tree entries at .. at + k - 1 of
        keys/values [B, W, Hkv, D]; its rows q [B * k, Hq, D] attend under mask [B, k, W], the
        query heads of a KV head folded into the query axis (grouped-query attention without
        repeating K/V, on any SDPA backend) -> [B * k, Hq * D]."""
        b, rows, width = mask.shape
        heads, dim = q.shape[1], q.shape[2]
        group = heads // self.num_kv
        keys[:, at:at + rows] = k.view(b, rows, self.num_kv, dim)
        values[:, at:at + rows] = v.view(b, rows, self.num_kv, dim)
        folded = q.view(b, rows, self.num_kv, group, dim).permute(0, 2, 3, 1, 4).reshape(b, self.num_kv, -1, dim)
        see = mask.unsqueeze(1).expand(b, group, rows, width).reshape(b, 1, group * rows, width)
        out = F.scaled_dot_product_attention(folded, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=see)
        return out.view(b, self.num_kv, group, rows, dim).permute(0, 3, 1, 2, 4).reshape(b * rows, heads * dim)

    # -- CUDA graphs -------------------------------------------------------------------------
    def _entry_bytes(self) -> int:
        return 2 * self.num_kv * self.head_dim * self.embed.element_size()  # a context entry's K and V

    @torch.inference_mode()
    def capture(self, max_requests: int, max_context: int) -> float:
        """With graphs: capture a graph for every bucket of up to max_requests requests (powers
        of two) and contexts of up to max_context pairs (powers of two from MIN_CONTEXT) whose
        K/V fit in GRAPH_BYTES, largest first, into one memory pool, their static K/V views of
        one pair of buffers (one call replays at a time); a call past them runs uncaptured.
        -> the seconds it took. If a capture fails, the growth runs uncaptured from then on."""
        if not self.use_graphs:
            return 0.0
        start = time.perf_counter()
        entries = GRAPH_BYTES // self._entry_bytes()
        buckets = [(b, n) for b in _powers(1, _pow2_at_least(max_requests))
                   for n in _powers(MIN_CONTEXT, _pow2_at_least(max_context, MIN_CONTEXT))
                   if b * (n + self.entries) <= entries]
        if not buckets:
            return 0.0
        flat = max(b * (n + self.entries) for b, n in buckets) * self.num_kv * self.head_dim
        flat_k = torch.zeros(flat, dtype=self.dtype, device=self.device)
        flat_v = torch.zeros_like(flat_k)
        try:
            for b, n in sorted(buckets, key=lambda bn: bn[0] * bn[1], reverse=True):
                shape = (b, n + self.entries, self.num_kv, self.head_dim)
                size = math.prod(shape)
                inputs = (torch.zeros(b, self.hidden, dtype=self.dtype, device=self.device),
                          flat_k[:size].view(shape), flat_v[:size].view(shape),
                          torch.zeros(2, b, dtype=torch.int64, device=self.device))
                self._graphs[(b, n)] = self._capture_one(inputs)
        except Exception:  # noqa: BLE001 - drafting goes on uncaptured: the trees are the same
            logger.exception("EAGLE's tree growth could not be captured in CUDA graphs; it runs uncaptured")
            self._graphs.clear()
        self.use_graphs = bool(self._graphs)
        seconds = time.perf_counter() - start
        logger.info("EAGLE's tree growth: %d CUDA graphs captured in %.2f s", len(self._graphs), seconds)
        return seconds

    def _capture_one(self, inputs) -> "_Captured":
        """One bucket's graph over its static inputs (root, keys, values, [pairs; position])."""
        from specserve.model.cuda_graphs import capture_graph

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        root, keys, values, meta = inputs
        graph, outputs = capture_graph(lambda: self.run(root, keys, values, meta[0], meta[1]), self._pool)
        return _Captured(graph, inputs, outputs)


def _powers(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to high (powers of two)."""
    out = [low]
    while out[-1] < high:
        out.append(2 * out[-1])
    return out


class _Captured:
    """One bucket's graph, its static inputs (root, keys, values, [pairs; position]) and the
    outputs its replay writes."""

    def __init__(self, graph, inputs, outputs) -> None:
        self.graph, self.inputs, self.outputs = graph, inputs, outputs
