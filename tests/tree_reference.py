"""Plain-Python references of the C host calls that grow draft trees
(specserve/spec_decode/tree_ops.c): what the tests check medusa_trees, eagle_children and
eagle_next_pass against."""

from __future__ import annotations

import numpy as np
import torch


def medusa_trees(plan, dfs, top_lp: list, top: list, budgets: list[int], min_score: float) -> list[tuple]:
    """Each request's tree (tokens, parents, scores) from the heads' top-k (top_lp, top:
    [K][B][w] lists): the budget's paths of `plan` (head, rank, prefix; shorter first) that
    score at least min_score and whose prefix is in, listed in the order `dfs`."""
    trees = []
    for b, budget in enumerate(budgets):
        score: list[float | None] = [None] * len(plan)
        for i, (head, rank, prefix) in enumerate(plan):
            if prefix >= 0 and score[prefix] is None:
                continue
            s = (score[prefix] if prefix >= 0 else 0.0) + top_lp[head][b][rank]
            if s < min_score:
                continue
            if not budget:
                break
            score[i], budget = s, budget - 1
        node = [-1] * len(plan)
        tokens, parents, scores = [], [], []
        for i in dfs:
            if score[i] is not None:
                head, rank, prefix = plan[i]
                node[i] = len(tokens)
                tokens.append(top[head][b][rank])
                parents.append(node[prefix] if prefix >= 0 else -1)
                scores.append(score[i])
        trees.append((tokens, parents, scores))
    return trees


def eagle_children(grow, parents: list[list[int]], lp: torch.Tensor, tok: torch.Tensor, k: int,
                   min_score: float) -> None:
    """tree_ops.eagle_children from the top-k (lp, tok [rows, k]) of each parent's row."""
    lp_l, tok_l, at = lp.flatten().tolist(), tok.flatten().tolist(), 0
    for g, ps in zip(grow, parents):
        start = len(g.tokens)
        for parent in ps:
            base = g.scores[parent] if parent >= 0 else 0.0
            g.tokens += tok_l[at:at + k]
            g.scores += [base + x for x in lp_l[at:at + k]]
            at += k
        new = len(g.tokens) - start
        g.parents += [p for p in ps for _ in range(k)]
        g.out_row += [-1] * new
        g.rows += [-1] * new
        best = sorted(range(start, len(g.tokens)), key=g.scores.__getitem__, reverse=True)[:k]  # stable
        g.frontier = [i for i in best if g.scores[i] >= min_score]


def eagle_next_pass(grow, d: int):
    """tree_ops.eagle_next_pass: every tree with a frontier runs the next pass; each frontier
    row sees the committed pairs, its ancestors' rows and itself."""
    active, src, ids, positions, masks = [], [], [], [], []
    for b, g in enumerate(grow):
        if not g.frontier:
            continue
        past, num, f = g.cache.pairs, g.expanded, len(g.frontier)
        g.expanded += f
        mask = np.zeros((f, past + num + f), dtype=bool)
        mask[:, :past] = True
        for j, i in enumerate(g.frontier):
            node, mask[j, past + num + j] = i, True
            while (node := g.parents[node]) >= 0:
                mask[j, past + g.rows[node]] = True
            g.rows[i] = num + j
            src.append(g.out_row[g.parents[i]] if g.parents[i] >= 0 else b)
            g.out_row[i] = len(ids)
            ids.append(g.tokens[i])
            positions.append(g.position + d - 1)
        active.append(b)
        masks.append((torch.from_numpy(mask), past + num, f))
    if not active:
        return None
    return active, torch.tensor(ids), torch.tensor(positions), torch.tensor(src), masks
