"""EagleProposer: EAGLE-2 dynamic draft trees from a feature-level head, batched over requests
(the method and its measurements: docs/eagle.md).

Per request the proposer keeps a cache, never the truth: the target features it was shown
(`observe`) until their pairs have run (but the last: a rollback may run it again) or have
fallen out of the next catch-up's window, and the head's K/V of the committed pairs
(f_t, x_{t+1}), t < P (specserve.spec_decode.eagle_head). `propose`, for a batch of requests:
  1. catch up: one head pass over every request's committed pairs not run yet, at most
     PROMPT_WINDOW on its first pass and CATCH_UP_WINDOW after that;
  2. grow: depth 1 takes the root's top-k; each further depth runs the k best nodes of the last
     depth of every request through the head in one pass and adds their top-k children, score
     = parent score + log q(child) (the bookkeeping in C: tree_ops.eagle_children and
     eagle_next_pass, one host synchronisation per depth);
  3. rerank: each request's m best-scored nodes (a tree: ancestors score at least as high).
Nodes scoring below `batch.min_score` (the cost model's) are neither expanded nor returned.
Nodes are the draft's deterministic top-k, so trees carry no probabilities (one-hot q) and
verification stays exact under sampling. With `d2t` in the checkpoint the head scores only
those N frequent tokens (logits = f_hat @ W_lm[d2t].T) and ids map back through d2t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.config import DEFAULT_DRAFTS
from specserve.host import int_tensor
from specserve.sampling import draft_top_k
from specserve.spec_decode import tree_ops
from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch, preorder
from specserve.env import env_str
from specserve.spec_decode.eagle_grow import DeviceGrowth, growth_mode
from specserve.spec_decode.eagle_head import DraftPass, HeadKV, HeadKVPool, Segment
from specserve.spec_decode.quant import draft_linear, draft_lm_head, f32_kernel_for

DEFAULT_EAGLE_DIR = Path(__file__).resolve().parent.parent / "data" / "eagle-smollm2-135m"
CATCH_UP_WINDOW = 32  # most pairs a catch-up runs after a gap: the head's cache restarts from the last ones
PROMPT_WINDOW = 32  # most pairs of a request's first pass: the prompt's last ones (docs/eagle.md)


def pooled_kv(device: torch.device, c_pass: bool = False) -> bool:
    """Whether the head's K/V live in one pool (HeadKVPool: a pass's attention one batched call)
    rather than per request (HeadKV: each request's rows attending in place). Where the head's
    pass is one C call (`c_pass`: DraftPass.c_pass, the pool its paged attention's cache), the
    pool; else on a CPU the per-request form is faster (a pass's attention at 16 requests:
    0.65-0.73 ms against 1.1-1.9 ms pooled through SDPA, on an AMX Xeon); on a GPU, where each
    request's calls are launches, the pool. SPECSERVE_DRAFT_KV=pooled|per_request chooses (per
    request: the pass in Python)."""
    choice = env_str("DRAFT_KV", "auto").strip().lower()
    if choice not in ("auto", "pooled", "per_request"):
        raise ValueError(f"SPECSERVE_DRAFT_KV: expected auto, pooled or per_request, got {choice!r}")
    return choice == "pooled" or (choice == "auto" and (device.type == "cuda" or c_pass))


@dataclass
class _HeadCache:
    base: int = 0  # position of feats[0]: > 0 after a prefix-cache hit (no features before it)
    feats: list[torch.Tensor | None] = field(default_factory=list)  # target features f_base.., each [hidden]
    dropped: int = 0  # feats[:dropped] are None, never read again (run, or past the next catch-up's window)
    kv: object = field(default_factory=HeadKV)  # head K/V (HeadKV, PooledKV): the committed pairs, then a tree
    pairs: int = 0  # P: committed pairs in kv
    last_out: torch.Tensor | None = None  # [hidden] head output of pair P - 1 (f_hat_P)
    ran: bool = False  # the head has run pairs of this request (kept on a restart): catch-ups read `window`


@dataclass
class _Growing:
    """One request's tree while it grows."""
    cache: _HeadCache
    position: int  # n: position of the last committed token
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    out_row: list[int] = field(default_factory=list)  # each expanded node's row in its pass's output
    rows: list[int] = field(default_factory=list)  # head K/V entry of each expanded node (-1: none)
    frontier: list[int] = field(default_factory=list)
    expanded: int = 0  # nodes run through the head so far


class EagleProposer:
    name = "eagle"
    needs_hidden = True
    costs_per_request = True

    def __init__(self, target_model, head_dir: str | Path | None = None,
                 num_speculative_tokens: int = DEFAULT_DRAFTS["eagle"], depth: int | None = None,
                 topk: int | None = None, max_positions: int = 8192, quantize: int = 0) -> None:
        """Defaults (also speculative_config's): depth min(4, m), top-2."""
        from specserve.spec_decode.heads_io import load_eagle

        m = num_speculative_tokens
        self.m, self.depth, self.topk = m, min(4, m) if depth is None else depth, 2 if topk is None else topk
        param = target_model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        self.on_cpu = self.device.type == "cpu"
        head, d2t, embed = load_eagle(head_dir or DEFAULT_EAGLE_DIR, target_model.arch, max_positions)
        self.head = head.to(self.device, self.dtype).requires_grad_(False)  # (drafting needs no grad context)
        self.head.rotary.float()
        self.embed = (embed.to(self.device, self.dtype) if embed is not None
                      else target_model.embed_tokens.weight).detach()
        f32_kernel = f32_kernel_for(param, head.arch.hidden_size, head.arch.intermediate_size)
        self.draft = DraftPass(self.head, lambda w, b: draft_linear(w, b, quantize, f32_kernel), embed=self.embed)
        # an EAGLE-3 head: target features are its fusion of the final hidden states and inner
        # layers' outputs (the decoder shows it those: StepLogits.features)
        self._fuse = (None if head.fuse is None
                      else draft_linear(self.head.fuse.weight, None, quantize, f32_kernel))
        lm_head, self.d2t = draft_lm_head(None, param, d2t, quantize, f32_kernel)  # spec_decode.quant
        norm = self.head.norm  # an EAGLE-3 head's (where it has one), before the LM head
        self._lm_head = lm_head if norm is None else (lambda x: lm_head(norm(x)))
        self._d2t_ptr = 0 if self.d2t is None else self.d2t.data_ptr()
        self.cache: dict[str, _HeadCache] = {}
        self.window, self.prompt_window = CATCH_UP_WINDOW, PROMPT_WINDOW
        arch = head.arch
        self.pool = (HeadKVPool(arch.num_kv_heads, arch.head_dim, self.dtype, self.device)
                     if pooled_kv(self.device, self.draft.c_pass is not None) else None)
        if self.pool is None:  # (the C pass runs over a pool only)
            self.draft.c_pass = None
        mode = growth_mode(self.device)  # the trees grown on the host, or on the device (eagle_grow)
        self.growth = (None if mode == "host" else
                       DeviceGrowth(self.draft, self._lm_head, self.d2t, self.embed, self.depth, self.topk,
                                    graphs=mode == "graphs"))

    @property
    def feature_steps(self) -> int:
        """Features a probe after a pause needs to draft as it would have: its catch-up runs
        the last `window` pairs (`prompt_window` where the head never ran for the request); a
        cache restarted at a gap in what it was shown runs as many, from the gap on."""
        return max(self.window, self.prompt_window)

    def _new_kv(self):
        return HeadKV() if self.pool is None else self.pool.new()

    def observe(self, request_ids: list[str], starts: list[int], sizes: list[int], hidden: torch.Tensor) -> None:
        """Target features of positions start .. start + n - 1 (the next n rows of hidden: final
        hidden states, for an EAGLE-3 head followed by the aux layers' outputs, fused here); anything
        cached at or past `start` is dropped first (rollback, recompute)."""
        hidden = hidden if hidden.dtype is self.dtype else hidden.to(self.dtype)
        if self._fuse is not None:
            hidden = self._fuse(self.head.fuse_input(hidden))
        rows, end = hidden.unbind(0), 0
        for rid, start, n in zip(request_ids, starts, sizes):
            c = self.cache.get(rid)
            if c is None or not c.base + c.dropped <= start <= c.base + len(c.feats):
                # new, a gap (prefix-cache hit: the target never computed those features; steps
                # whose features the decoder did not show), or a rollback past the features
                # already let go; a request the head has run for catches up as after a long
                # gap then (its last `window` pairs), one it never has as over a prompt
                c = self.cache[rid] = _HeadCache(base=start, kv=self._new_kv(), ran=c is not None and c.ran)
            del c.feats[start - c.base:]
            if c.pairs > start - c.base:
                c.pairs, c.last_out = start - c.base, None
            c.feats.extend(rows[end:end + n])
            end += n
            # the next catch-up reads at most the last `window` (a gap longer than that restarts)
            _let_go(c, len(c.feats) - (self.window if c.pairs or c.ran else self.prompt_window))

    def free(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

    def _catch_up(self, caches: list[_HeadCache], token_ids: list[list[int]]) -> None:
        """Run the head over every committed pair up to the last token of each request, in one
        pass for all of them."""
        todo, rows = [], ([], [], [], [])  # (cache, n); feats, ids, positions, segments
        for c, tokens in zip(caches, token_ids):
            n = len(tokens) - 1 - c.base  # pairs up to the last committed token
            if c.pairs == n and c.last_out is not None:
                continue
            window = self.window if c.pairs or c.ran else self.prompt_window
            if n - c.pairs > window:  # a long gap since its last run, or a long prompt: the last ones
                cut = n - window
                c.base, c.feats, c.dropped, c.kv = c.base + cut, c.feats[cut:], 0, self._new_kv()
                c.pairs, c.last_out = 0, None
                n = window
            p = min(c.pairs, n - 1)  # rolled back exactly to here: recompute the last pair
            todo.append((c, n))
            for acc, new in zip(rows, (c.feats[p:n], tokens[c.base + p + 1:c.base + n + 1],
                                       range(c.base + p, c.base + n), [Segment(c.kv, p, n - p, None)])):
                acc.extend(new)
        if todo:
            ids, positions = int_tensor([rows[1], rows[2]], self.device).unbind()  # one tensor call, not two
            out = self.draft.tokens(torch.stack(rows[0]), ids, positions, rows[3])
            end = -1
            for (c, n), seg in zip(todo, rows[3]):
                end += seg.rows
                c.pairs, c.last_out, c.ran = n, out[end], True
                _let_go(c, n - 1)  # run; only the last pair may be recomputed

    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        # no torch.inference_mode here (the head's pass has its own): nothing else it computes
        # requires grad, and entering it cost ~10 us a step between forwards
        ready = [j for j, (rid, tokens) in enumerate(zip(batch.request_ids, batch.token_ids))
                 if (c := self.cache.get(rid)) is not None and 1 <= len(tokens) - 1 - c.base <= len(c.feats)]
        out: list[DraftTree | None] = [None] * len(batch.request_ids)
        if not ready:
            return out
        caches = [self.cache[batch.request_ids[j]] for j in ready]
        self._catch_up(caches, [batch.token_ids[j] for j in ready])
        budgets = [min(self.m, batch.max_drafts[j]) for j in ready]
        if self.growth is not None:  # on the device, one host round trip (eagle_grow)
            nodes = self.growth.grow(caches, [len(batch.token_ids[j]) - 1 for j in ready])
        else:
            grow = [_Growing(c, len(batch.token_ids[j]) - 1) for c, j in zip(caches, ready)]
            self._grow(grow, batch.min_score)
            nodes = [(g.tokens, g.parents, g.scores) for g in grow]
        for j, (tokens, parents, scores), m in zip(ready, nodes, budgets):
            tree = _rerank(tokens, parents, scores, m, batch.min_score)
            out[j] = tree if len(tree) else None
        return out

    def _grow(self, grow: list[_Growing], min_score: float) -> None:
        """Each pass's inputs and each tree's bookkeeping in one C call (tree_ops: eagle_next_pass,
        eagle_children), the head and LM head batched over every tree with a frontier."""
        out = torch.stack([g.cache.last_out for g in grow])  # the roots' outputs, row b: grow[b]'s
        self._add_children(grow, [[-1] for _ in grow], out, min_score)
        for d in range(1, self.depth):
            step = tree_ops.eagle_next_pass(grow, d, None if self.on_cpu else self.device, self.pool is not None)
            if step is None:  # no frontier left
                return
            active, ids, positions, src, masks = step
            segments = [Segment(grow[b].cache.kv, past, f, mask) for b, (mask, past, f) in zip(active, masks)]
            out = self.draft.tokens(out.index_select(0, src), ids, positions, segments)
            self._add_children([grow[b] for b in active], [grow[b].frontier for b in active], out, min_score)

    def _add_children(self, grow, parents: list[list[int]], outs: torch.Tensor, min_score: float) -> None:
        """Each parent node (-1: the root) gets its top-k children, score = parent score +
        log q(child); each request's next frontier is its k best new nodes worth expanding.
        outs: [sum of parents, hidden], the parents' head outputs in order."""
        view, ids, _alive = draft_top_k(self._lm_head(outs), self.topk, self.d2t)
        tree_ops.eagle_children(view, self.topk, self._d2t_ptr, min_score, grow, parents, ids)


def _let_go(c: _HeadCache, upto: int) -> None:
    """Features before index `upto` are never read again: let them go (their place stays,
    as None, so that indices and lengths keep their meaning)."""
    for i in range(c.dropped, upto):
        c.feats[i] = None
    c.dropped = max(c.dropped, upto)


def _rerank(tokens: list[int], parents: list[int], scores: list[float], m: int,
            min_score: float = -math.inf) -> DraftTree:
    """The m best-scored nodes scoring at least min_score (ties: earlier node first), depth
    first (siblings in creation order: best first), re-indexed, with their scores. A child
    scores at most its parent (log q <= 0) and comes after it, so those nodes are a tree."""
    ranked = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)[:m]  # stable: ties keep order
    best = sorted(i for i in ranked if scores[i] >= min_score)
    return DraftTree(tokens, parents, None, scores).select(preorder(parents, best), True)
