"""Tree verification: accept the longest valid path of a draft tree, lossless in both modes.

A request's verify step feeds n + 1 tokens in one target forward: its last committed token (the
root, tree index 0) and the n draft nodes of a DraftTree (tree index i + 1 for node i), with
`tree_parents = [-1] + [p + 1 for p in tree.parents]`, so row 0 of the target is the
distribution after the committed tokens and row i + 1 the distribution after node i.

Greedy: from the root, follow the child whose token equals the target argmax at the current
node; stop where none does. Emit the path's tokens and the argmax at its end (the bonus).

Sampled (SpecInfer's multi-draft rule; Miao et al. 2024, Chen et al. 2023): at a node with
target distribution p, try its children c_1, c_2, ... in order. Child c with token x and draft
distribution q_c (`tree.probs[c]`, one-hot at x when None) is accepted with probability
min(1, p(x) / q_c(x)); on rejection p <- norm(max(0, p - q_c)) and the next sibling is tried.
If every child is rejected, the emitted token is sampled from the residual p. Each step is a
Leviathan/Chen accept/resample against the current p, so the emitted token is distributed as
the target's whenever each sibling was drawn from its q independently of the earlier siblings'
tests (i.i.d. samples from one q, or any fixed, distinct candidates with one-hot q).

Also here: `compaction_slots` (where the accepted path's KV moves) and the hand-written loop
`prefill_step` / `tree_spec_step` that drives a runner, a KV manager and a tree proposer; the
engine's tree path is meant to lift it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.draft_tree import DraftTree


@dataclass
class TreeVerdict:
    path: list[int]  # accepted draft node indices (0-based into the DraftTree), root to leaf
    tokens: list[int]  # emitted: the accepted nodes' tokens, then the bonus/recovered token


def children_lists(parents: list[int]) -> list[list[int]]:
    """children[0] are the root's children; children[i + 1] those of node i (in node order)."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def verify_tree(target: torch.Tensor, tree: DraftTree, greedy: bool,
                uniforms: torch.Tensor | None = None, exp_noise: torch.Tensor | None = None,
                generator: torch.Generator | None = None, rule: str = "exact") -> TreeVerdict:
    """target: [n + 1, V] logits (greedy) or probabilities (sampled); row 0 is the root.
    uniforms: [n] one per draft node (its acceptance test); exp_noise: [n + 1, V] Exp(1) noise
    for the residual draw at each row (Gumbel-max / exponential race). Drawn from `generator`
    when absent. rule="naive_resample" is a deliberately wrong rule (resample from p, not from
    the residual) kept only as the statistical test's negative control."""
    kids = children_lists(tree.parents)
    toks = tree.tokens
    if greedy:
        best = target.argmax(-1).tolist()
        path, row = [], 0
        while True:
            nxt = next((c for c in kids[row] if toks[c] == best[row]), None)
            if nxt is None:
                return TreeVerdict(path, [toks[c] for c in path] + [best[row]])
            path.append(nxt)
            row = nxt + 1
    n, vocab = len(toks), target.shape[-1]
    if uniforms is None:
        uniforms = torch.rand(max(n, 1), generator=generator)
    if exp_noise is None:
        exp_noise = torch.empty(n + 1, vocab).exponential_(generator=generator).to(target.device)
    u = uniforms.tolist()
    path, row = [], 0
    while True:
        p = target[row].float()
        accepted = None
        for c in kids[row]:
            x = toks[c]
            q = tree.probs[c].float() if tree.probs is not None else None
            qx = q[x].item() if q is not None else 1.0
            if u[c] * qx < p[x].item():
                accepted = c
                break
            if rule == "naive_resample":
                continue
            if q is not None:
                resid = (p - q).clamp_min(0.0)
            else:  # one-hot q: drop x (a scalar write, on whatever device p lives)
                resid = p.clone()
                resid[x] = 0.0
            total = resid.sum()
            if total > 0:  # total == 0 only when p <= q everywhere, where rejection has probability 0
                p = resid / total
        if accepted is None:
            tok = int((p / exp_noise[row].float()).argmax())
            return TreeVerdict(path, [toks[c] for c in path] + [tok])
        path.append(accepted)
        row = accepted + 1


def compaction_slots(block_ids: list[int], block_size: int, start: int,
                     path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """KV moves after a verify step whose root sat at position `start` (tree index i at slot
    position start + i): accepted node path[j] (tree index path[j] + 1) moves to position
    start + 1 + j. Returns (src, dst) int64 slot tensors, only the pairs that move; src and
    dst increase and dst <= src, as specserve.kernels.compact_kv requires."""
    src, dst = [], []
    for j, node in enumerate(path):
        s, d = start + node + 1, start + 1 + j
        if s != d:
            src.append(block_ids[s // block_size] * block_size + s % block_size)
            dst.append(block_ids[d // block_size] * block_size + d % block_size)
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


# -- the hand-written loop (greedy or sampled; no stop strings, no penalties) -------------------

def prefill_step(runner, kv, reqs: list, proposer) -> list[int]:
    """Computes every request's whole prompt, shows the proposer all prompt features, and
    returns (and appends) the first greedy token of each."""
    from specserve.scheduler.scheduler import SchedulerOutput

    for r in reqs:
        kv.allocate(r, r.num_tokens - r.num_computed_tokens)
    sched = SchedulerOutput(list(reqs), [r.num_tokens - r.num_computed_tokens for r in reqs],
                            [0] * len(reqs))
    step = runner.execute(sched)
    hidden, off, first = step.all_hidden, 0, []
    for r, n, s in zip(reqs, sched.num_tokens, step.row_start):
        proposer.observe(r, r.num_computed_tokens, hidden[off:off + n])
        off += n
        r.num_computed_tokens += n
        tok = int(step.logits[s].argmax())
        r.all_token_ids.append(tok)
        first.append(tok)
    return first


def tree_spec_step(runner, kv, reqs: list, proposer, max_drafts: int,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """One speculative step for requests whose tokens are computed except the last one:
    propose -> one target forward over every tree -> verify -> compact the accepted path's
    KV and roll the rest back -> show the proposer the accepted features. Returns the tokens
    each request emitted (already appended to req.all_token_ids)."""
    from specserve.kernels import compact_kv
    from specserve.scheduler.scheduler import SchedulerOutput

    trees = [t or DraftTree([], []) for t in proposer.propose(reqs, [max_drafts] * len(reqs))]
    starts = [r.num_computed_tokens for r in reqs]
    for r, t, s in zip(reqs, trees, starts):
        assert s == r.num_tokens - 1, "one pending committed token per request"
        r.spec_token_ids = list(t.tokens)
        kv.allocate(r, 1 + len(t))
    sched = SchedulerOutput(list(reqs), [1 + len(t) for t in trees], [len(t) for t in trees])
    step = runner.execute(sched, [[-1] + [p + 1 for p in t.parents] for t in trees])
    emitted = []
    for r, t, s, row in zip(reqs, trees, starts, step.row_start):
        rows = slice(row, row + 1 + len(t))
        if r.params.greedy:
            verdict = verify_tree(step.logits[rows], t, True)
        else:
            probs = torch.softmax(step.logits[rows] / r.params.temperature, -1)
            verdict = verify_tree(probs, t, False, generator=generator)
        src, dst = compaction_slots(r.block_ids, kv.block_size, s, verdict.path)
        if src.numel():
            src, dst = src.to(runner.device), dst.to(runner.device)
            for k_cache, v_cache in runner.kv_caches:
                compact_kv(k_cache, v_cache, src, dst)
        kept = 1 + len(verdict.path)
        r.num_computed_tokens = s + kept
        kv.truncate(r, s + kept)
        keep_rows = torch.tensor([0] + [c + 1 for c in verdict.path], device=step.hidden.device)
        proposer.observe(r, s, step.hidden[rows].index_select(0, keep_rows))
        r.spec_token_ids = []
        r.all_token_ids.extend(verdict.tokens)
        emitted.append(verdict.tokens)
    return emitted
