"""EagleProposer: EAGLE-2 dynamic draft trees from a feature-level head (specserve.spec_decode.eagle_head).

Per request the proposer keeps a cache, never the truth: the target features f_0..f_{m-1} it
was shown (`observe`) and the head's K/V for the committed pairs (f_t, x_{t+1}), t < P <= m.
`propose` first extends the head's cache over the new committed pairs up to the last committed
token x_n (that pass also yields f_hat_n, whose logits are the root's draft distribution), then
grows a tree (EAGLE-2, Li et al. 2024):

  * depth 1: the top-k tokens of the root distribution, scored by their log-probability;
  * each further depth: the k best-scored nodes of the last depth are run through the head
    together (each sees the committed pairs, its tree ancestors and itself) and each adds its
    top-k children with score = parent score + log q(child);
  * rerank: the m best-scored nodes of the whole tree (ancestors always score at least as high
    as their descendants, so the set is a tree) are returned, parents first.

With `min_prob` > 0 the tree is also cut by confidence: a node whose cumulative draft
probability (exp of its score, which tracks its chance of acceptance) is below min_prob is
neither expanded nor returned. On a machine where every verified row costs time (a CPU), an
unlikely node costs more than it is expected to bring; a step where nothing is likely enough
drafts no tree at all (and stops expanding early, saving head passes).

Nodes are the deterministic top-k of the draft, so the DraftTree carries no probabilities
(one-hot q): tree verification then stays exact under sampling too.

The head scores a restricted vocabulary when its checkpoint has `d2t` (the N most frequent
tokens): logits = f_hat @ W_lm[d2t].T, and draft ids map back through d2t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.config import DEFAULT_DRAFTS
from specserve.spec_decode.draft_tree import DraftTree
from specserve.spec_decode.eagle_head import HeadKV
from specserve.spec_decode.quant import draft_lm_head

DEFAULT_EAGLE_DIR = Path(__file__).resolve().parent.parent / "data" / "eagle-smollm2-135m"


@dataclass
class _HeadCache:
    base: int = 0  # position of feats[0]: > 0 after a prefix-cache hit (no features before it)
    feats: list[torch.Tensor] = field(default_factory=list)  # target features f_base.., each [hidden]
    kv: HeadKV = field(default_factory=HeadKV)  # head K/V: the committed pairs, then a tree
    pairs: int = 0  # P: committed pairs in kv
    last_out: torch.Tensor | None = None  # [hidden] head output of pair P - 1 (f_hat_P)


class EagleProposer:
    name = "eagle"

    def __init__(self, target_model, head_dir: str | Path | None = None,
                 num_speculative_tokens: int = DEFAULT_DRAFTS["eagle"], depth: int | None = None,
                 topk: int | None = None, max_positions: int = 8192, min_prob: float = 0.0,
                 quantize: bool = False) -> None:
        """Defaults (also speculative_config's): depth min(4, m), top-2; on a CPU the engine
        also sets min_prob (tree_decoder.MIN_DRAFT_PROB) and quantize."""
        from specserve.spec_decode.heads_io import load_eagle

        m = num_speculative_tokens
        self.m, self.depth, self.topk = m, min(4, m) if depth is None else depth, 2 if topk is None else topk
        if self.m < 1 or self.depth < 1 or self.topk < 1:
            raise ValueError("speculative_config: num_speculative_tokens, depth and topk must be >= 1")
        self.min_score = math.log(min_prob) if min_prob > 0 else -math.inf
        param = target_model.lm_head.weight
        self.device, self.dtype = param.device, param.dtype
        head, d2t, embed = load_eagle(head_dir or DEFAULT_EAGLE_DIR, target_model.arch, max_positions)
        self.head = head.to(self.device, self.dtype)
        self.head.rotary.float()
        self.embed = (embed.to(self.device, self.dtype) if embed is not None
                      else target_model.embed_tokens.weight)
        self.d2t = d2t.to(self.device) if d2t is not None else None
        w = target_model.lm_head.weight
        lm_weight = w.index_select(0, self.d2t) if d2t is not None else w  # [N, hidden]
        self._lm_head = draft_lm_head(self.head, lm_weight, quantize)  # int8 head: specserve.spec_decode.quant
        self.cache: dict[str, _HeadCache] = {}

    # -- state ------------------------------------------------------------------------------------
    def observe(self, req, start: int, hidden: torch.Tensor) -> None:
        """The target's features of positions start .. start + n - 1 (hidden: [n, hidden]).
        Anything cached at or past `start` is dropped first (rollback, recompute)."""
        c = self.cache.get(req.request_id)
        if c is None or not c.base <= start <= c.base + len(c.feats):
            # new, or a gap (prefix-cache hit: the target never computed those features): the
            # head's context starts here
            c = self.cache[req.request_id] = _HeadCache(base=start)
        del c.feats[start - c.base:]
        self._truncate_pairs(c, start - c.base)
        c.feats.extend(hidden.detach().to(self.dtype).unbind(0))

    def free(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

    @staticmethod
    def _truncate_pairs(c: _HeadCache, num_pairs: int) -> None:
        if c.pairs > num_pairs:
            c.pairs = num_pairs
            c.last_out = None

    # -- drafting ---------------------------------------------------------------------------------
    def _scores(self, out: torch.Tensor) -> torch.Tensor:
        """out: [N, hidden] -> draft log-probabilities [N, V'] (float32)."""
        return torch.log_softmax(self._lm_head(out).float(), -1)

    def _to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[ids] if self.d2t is not None else ids

    @torch.inference_mode()
    def _extend(self, c: _HeadCache, tokens: list[int]) -> torch.Tensor | None:
        """Run the head over the committed pairs up to position n-1 (n = last token index), pair
        i being (f_{base+i}, x_{base+i+1}) at position base + i; -> f_hat_n [hidden]."""
        b, n = c.base, len(tokens) - 1 - c.base  # n: number of pairs up to the last token
        if n < 1 or len(c.feats) < n:
            return None
        p = c.pairs
        if p == n and c.last_out is not None:
            return c.last_out
        if p == n:  # rolled back exactly to here: recompute the last pair
            self._truncate_pairs(c, n - 1)
            p = n - 1
        feats = torch.stack(c.feats[p:n])[None]
        ids = torch.tensor(tokens[b + p + 1:b + n + 1], device=self.device)
        pos = torch.arange(b + p, b + n, device=self.device)
        mask = None
        if p > 0:
            mask = torch.ones(1, n - p, n, dtype=torch.bool, device=self.device)
            mask[0, :, p:] = torch.tril(mask[0, :, p:])
        out, _, _ = self.head(feats, self.embed[ids][None], pos, mask=mask, kv=(c.kv, p))
        c.pairs = n
        c.last_out = out[0, -1]
        return c.last_out

    @torch.inference_mode()
    def propose_one(self, req, max_drafts: int) -> DraftTree | None:
        c = self.cache.get(req.request_id)
        budget = min(self.m, max_drafts)
        if c is None or budget < 1:
            return None
        root = self._extend(c, req.all_token_ids)
        if root is None:
            return None
        n, k = req.num_tokens - 1, self.topk
        # node records: token (target id), parent node, score; tree K/V for the expanded nodes
        logp = self._scores(root[None])[0]
        top_lp, top_ix = logp.topk(k)
        tokens = self._to_target_ids(top_ix).tolist()
        parents = [-1] * k
        scores = top_lp.tolist()
        frontier = [i for i in range(k) if scores[i] >= self.min_score]  # nodes to expand next
        parent_out = [root] * k  # head output that node i's pair reads (its parent's f_hat)
        anc: list[list[int]] = [[] for _ in range(k)]  # expanded-node rows each node descends from
        num_rows = 0  # expanded nodes so far: head K/V entries past + 0 .. num_rows - 1
        past = c.pairs
        for d in range(1, self.depth):
            if not frontier:
                break
            f = len(frontier)
            feats = torch.stack([parent_out[i] for i in frontier])[None]
            ids = torch.tensor([tokens[i] for i in frontier], device=self.device)
            pos = torch.full((f,), n + d - 1, device=self.device)
            mask = torch.zeros(1, f, past + num_rows + f, dtype=torch.bool, device=self.device)
            mask[0, :, :past] = True
            for j, i in enumerate(frontier):
                mask[0, j, [past + a for a in anc[i]] + [past + num_rows + j]] = True
            out, _, _ = self.head(feats, self.embed[ids][None], pos, mask=mask, kv=(c.kv, past + num_rows))
            child_lp, child_ix = self._scores(out[0]).topk(k, -1)  # [f, k]
            cum = torch.tensor([scores[i] for i in frontier], device=child_lp.device)[:, None] + child_lp
            child_tok = self._to_target_ids(child_ix).tolist()
            cum_l = cum.tolist()
            new_nodes = []
            for j, i in enumerate(frontier):
                for r in range(k):
                    tokens.append(child_tok[j][r])
                    parents.append(i)
                    scores.append(cum_l[j][r])
                    parent_out.append(out[0, j])
                    anc.append(anc[i] + [num_rows + j])
                    new_nodes.append(len(tokens) - 1)
            num_rows += f
            best = cum.flatten().topk(min(k, cum.numel())).indices.tolist()
            frontier = [new_nodes[b] for b in best if scores[new_nodes[b]] >= self.min_score]
        tree = _rerank(tokens, parents, scores, budget, self.min_score)
        return tree if len(tree) else None

    def propose(self, requests: list, max_drafts: list[int]) -> list[DraftTree | None]:
        return [self.propose_one(r, m) for r, m in zip(requests, max_drafts)]


def _rerank(tokens: list[int], parents: list[int], scores: list[float], m: int,
            min_score: float = -math.inf) -> DraftTree:
    """The m best-scored nodes scoring at least min_score (ties: earlier node first, so parents
    precede children), in creation order, re-indexed."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    chosen: set[int] = set()
    for i in order:
        if len(chosen) == m or scores[i] < min_score:
            break
        if parents[i] < 0 or parents[i] in chosen:
            chosen.add(i)
    keep = sorted(chosen)
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree([tokens[i] for i in keep], [index[parents[i]] if parents[i] >= 0 else -1 for i in keep])
