"""Lossless verification of every request's draft tree in one batched call.

A step's target rows are flattened over the batch: request b owns rows root_row[b] ..
root_row[b] + n_b, row root_row[b] being the distribution after its last committed token (the
root) and row root_row[b] + 1 + i the distribution after its draft node i. Node i is tested
against its parent's row. A request without drafts is a root without nodes: verification then
is plain sampling, so every row of a step goes through this one function.

Greedy request: a node passes when its token is the argmax of its parent's row.

Seeded sampled request (coupled): a node passes when its token is the one plain sampling
draws at its parent's row, argmax(p / E) with the request's own noise E at that row's
position; the final token is that draw at the leaf. The output is then token for token what
plain sampling with this seed emits, whatever was drafted, so a seed reproduces a completion
whatever the batch and the cost model did. For one-hot drafts the chance of acceptance is
that of the rule below (a draw lands on a node's token with probability p(token)); a draft
model draws its drafts with the same noise (specserve.spec_decode.draft_model) to couple its
choices with the target's.

Sampled request without a seed (Leviathan et al. 2023, Chen et al. 2023; for several children the multi-draft
rule of SpecInfer, Miao et al. 2024): at a row with target distribution p the children are
tried in rank order; child c with token x and draft distribution q_c is accepted with
probability min(1, p'(x) / q_c(x)), where p' is p after the earlier siblings' rejections:
p' = norm(max(0, p - q_s)) over rejected siblings s. Nodes without a draft distribution are
one-hot (q = e_x): then p' is p with the rejected siblings' tokens removed, so the test reads
u * (1 - mass of earlier siblings) < p(x). A node with a draft distribution must be the only
child of its parent (draft chains), so its test is u * q(x) < p(x). Every test depends only on
its parent's row, so all of them run at once; the accepted path then follows, from the root,
the first passing child of each row.

The final token is drawn at the end of the accepted path (the leaf row): greedy the argmax;
sampled from the residual p' after all of the leaf's children were rejected (the *recovered*
token), or from p when it had none (the *bonus* token), with the exponential race over
hash noise of (seed, position, column); a residual that is identically zero (numerically)
falls back to p. Uniforms of the acceptance tests are the same hash at column V + rank, at
the position of the parent's row. So the emitted tokens follow the target distribution
exactly and a seeded request is reproducible whatever else is in the batch.

No per-node host synchronisation: an all-greedy step brings each row's argmax to the host in
one transfer and follows the matching children there (on an x86 CPU one C call follows them,
taking the argmax of the rows on the way only: specserve.kernels.cpu.layer_ops.greedy_walk);
otherwise tensor ops over all nodes find each row's first passing child, one transfer brings
those to the host, which follows every request's accepted path, and a second brings the final
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.host import int_tensor
from specserve.kernels.cpu import layer_ops
from specserve.sampling.sampler import (SamplingBatch, TokenCounts, apply_penalties, exponential_noise,
                                        processed_probs, row_argmax, row_counts, uniform_at)


class FlatTrees:
    """Draft nodes of every request in a step, flattened; nodes of a request are contiguous
    and in its tree's order (parents before children), node i of request b at row
    root_row[b] + 1 + i. The host lists are kept (the walk along accepted paths runs on the
    host, over one transfer); the device columns are built on first use (an all-greedy step
    never needs them)."""

    def __init__(self, root_rows: list[int], trees: list[tuple[list[int], list[int], torch.Tensor | None]],
                 vocab_size: int, device) -> None:
        """trees: per request (tokens, parents, probs [n, V] or None)."""
        self.root_row, self.trees, self.vocab_size, self.device = list(root_rows), trees, vocab_size, device
        self.node_start = [0]
        for toks, _, _ in trees:
            self.node_start.append(self.node_start[-1] + len(toks))
        self._columns: tuple | None = None

    def __len__(self) -> int:
        return self.node_start[-1]

    def columns(self):
        """(token, parent_row, rank, req, probs, has_probs, max_width) on the device: [N] int64
        each, probs [N, V] and has_probs [N] bool or None when every node is one-hot."""
        if self._columns is None:
            token, parent_row, rank, req = [], [], [], []
            for b, (toks, parents, _) in enumerate(self.trees):
                kids: dict[int, int] = {}
                root = self.root_row[b]
                for p in parents:
                    r = kids.get(p, 0)
                    kids[p] = r + 1
                    parent_row.append(root + 1 + p)
                    rank.append(r)
                token += toks
                req += [b] * len(toks)
            cols = int_tensor([token, parent_row, rank, req], self.device)
            probs = has_probs = None
            if any(p is not None for _, _, p in self.trees):
                start = self.node_start
                probs = torch.zeros(len(token), self.vocab_size, device=self.device)
                has = torch.zeros(len(token), dtype=torch.bool)
                for b, (_, _, p) in enumerate(self.trees):
                    if p is not None and len(p):
                        probs[start[b]:start[b + 1]] = p.to(self.device)
                        has[start[b]:start[b + 1]] = True
                has_probs = has.to(self.device)
            self._columns = (cols[0], cols[1], cols[2], cols[3], probs, has_probs, max(rank, default=-1) + 1)
        return self._columns


@dataclass
class TreeVerdict:
    accepted: list[list[int]]  # per request: accepted node indices (into its tree), root to leaf
    final: list[int]  # per request: the token drawn at the end of the accepted path


def verify_targets(logits: torch.Tensor, requests, trees: list[tuple[list[int], list[int]]],
                   counts: list[TokenCounts] | None, vocab_size: int):
    """What verify_trees needs for the step's rows: (target, exact, seeds, row_pos, all_exact,
    coupled). requests: each with .params, .sampling_seed, .num_tokens, .all_token_ids; trees:
    each request's draft (tokens, parents), whose rows follow its root row; counts: each
    request's TokenCounts when any request has penalties (they see the drafts before a row,
    as plain decoding would have seen those tokens)."""
    if counts is None and all(r.params.greedy for r in requests):  # argmax of the logits: nothing else
        return logits, None, None, None, True, None
    device = logits.device
    params, seeds, positions, row_counts_of, extra, coupled = [], [], [], [], [], []
    for b, (req, (tokens, parents)) in enumerate(zip(requests, trees)):
        ancestors: list[list[int]] = [[]]
        for p, tok in zip(parents, tokens):
            ancestors.append(ancestors[p + 1] + [tok])
        seeded = req.params.seed is not None and not req.params.greedy
        own = counts[b].sync(req.all_token_ids) if counts is not None else None
        for anc in ancestors:
            if seeded:
                coupled.append(len(positions))
            params.append(req.params)
            seeds.append(req.sampling_seed)
            positions.append(req.num_tokens + len(anc))
            if counts is not None:
                row_counts_of.append(own)
                extra.append(anc)
    exact_l = [r.params.greedy or r.params.seed is not None for r in requests]
    coupled_rows = (int_tensor(coupled, device), int_tensor([seeds[i] for i in coupled], device)) if coupled else None
    batch = SamplingBatch.build(params, seeds, positions, vocab_size, device,
                                row_counts(row_counts_of, extra) if counts is not None else None)
    target = apply_penalties(logits, batch)
    if not batch.all_greedy:
        target = torch.where(batch.greedy[:, None], target, processed_probs(logits, batch))
    return (target, torch.tensor(exact_l, dtype=torch.bool, device=device),
            int_tensor([r.sampling_seed for r in requests], device), int_tensor(positions, device), all(exact_l),
            coupled_rows)


def coupled_tokens(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What plain sampling draws from rows probs [N, V] at (seed, position) [N]: [N] int64."""
    return row_argmax(probs / exponential_noise(seeds, positions, probs.shape[1]))


def verify_trees(target: torch.Tensor, exact: torch.Tensor | None, seeds: torch.Tensor | None,
                 row_pos: torch.Tensor | None, trees: FlatTrees, all_exact: bool,
                 coupled: tuple[torch.Tensor, torch.Tensor] | None = None) -> TreeVerdict:
    """target: [R, V] float, rows of greedy requests (penalised) logits, rows of sampled ones
    probabilities; exact: [B] bool, requests whose nodes must equal one token per row (greedy,
    coupled); seeds: [B] int64; row_pos: [R] int64, the position of the token each row samples
    (it keys the noise); coupled: (rows [Rc], their seeds [Rc]) of the coupled (seeded sampled)
    requests, whose token is plain sampling's draw instead of the argmax. An all-greedy step
    (all_exact, no coupled rows) needs only target."""
    if all_exact and coupled is None and layer_ops.host_available() and (view := layer_ops.rows_view(target)):
        # greedy: one C call, the path's rows alone
        return TreeVerdict(*layer_ops.greedy_walk(view, trees.root_row, trees.trees))
    best = row_argmax(target)  # [R]: the one token of each exact row
    if coupled is not None:
        rows, row_seeds = coupled
        best[rows] = coupled_tokens(target[rows], row_seeds, row_pos[rows])
    if all_exact:  # one token per row: follow the children that match it, on the host
        best_l = best.tolist()
        accepted, final = [], []
        for root, (tokens, parents, _) in zip(trees.root_row, trees.trees):
            kids = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
            path, row = [], root
            while (node := kids.get((row - root - 1, best_l[row]))) is not None:
                path.append(node)
                row = root + 1 + node
            accepted.append(path)
            final.append(best_l[row])
        return TreeVerdict(accepted, final)
    num_rows, n = target.shape[0], len(trees)
    next_node = torch.full((num_rows,), -1, dtype=torch.int64, device=target.device)
    if n:  # the first passing child of each row
        parent_row, rank = trees.columns()[1:3]
        max_width = trees.columns()[6]
        passed = _tests(target, best, exact, seeds, row_pos, trees)
        key = torch.where(passed, rank, torch.full_like(rank, max_width))
        first = torch.full((num_rows,), max_width, dtype=torch.int64, device=key.device)
        first = first.scatter_reduce(0, parent_row, key, reduce="amin")
        chosen = passed & (rank == first[parent_row])
        nodes = torch.arange(n, device=key.device)
        next_node[parent_row[chosen]] = nodes[chosen]
    next_node_l = next_node.tolist()  # one transfer, a second for the final draws
    accepted, leaves = [], []
    for b, root in enumerate(trees.root_row):
        path, row, node = [], root, next_node_l[root]
        while node >= 0:  # node i of request b sits at row root + 1 + (i - node_start[b])
            path.append(node - trees.node_start[b])
            row = root + 1 + path[-1]
            node = next_node_l[row]
        accepted.append(path)
        leaves.append(row)
    leaf = int_tensor(leaves, target.device)
    drawn = torch.where(exact, best[leaf], _draw_final(target, leaf, seeds, row_pos, trees))
    return TreeVerdict(accepted, drawn.tolist())


def _tests(target, best, exact, seeds, row_pos, t: FlatTrees) -> torch.Tensor:
    """[N] bool: each node's acceptance test against its parent's row."""
    token, parent_row, rank, req, probs, has_probs, max_width = t.columns()
    match = token == best[parent_row]
    p_x = target[parent_row, token].double()
    # mass of the earlier (rejected, one-hot) siblings: exclusive sum over ranks per parent row
    mass = torch.zeros(target.shape[0], max_width + 1, dtype=torch.float64, device=target.device)
    mass[parent_row, rank + 1] = p_x
    before = mass.cumsum(1)[parent_row, rank]
    q_x = torch.ones_like(p_x)
    if probs is not None:
        own = probs[torch.arange(len(token), device=p_x.device), token].double()
        q_x = torch.where(has_probs, own, q_x)
        before = torch.where(has_probs, torch.zeros_like(before), before)
    # the test's uniform: hash column V + rank, past the columns of the row's own draw
    u = uniform_at(seeds[req], row_pos[parent_row], target.shape[1] + rank)
    sampled = (p_x > 0) & (u * q_x * (1.0 - before).clamp_min(0.0) < p_x)
    return torch.where(exact[req], match, sampled)


def _draw_final(target, leaf, seeds, row_pos, t: FlatTrees) -> torch.Tensor:
    """Sampled requests' recovered or bonus token at their leaf rows: [B] int64."""
    p = target[leaf].double()  # [B, V]
    resid = p.clone()
    if len(t):  # the leaf's children were all rejected: take them out of p
        token, parent_row, _, req, probs, has_probs, _ = t.columns()
        kids = parent_row == leaf[req]
        one_hot = kids if has_probs is None else kids & ~has_probs
        resid[req[one_hot], token[one_hot]] = 0.0
        if probs is not None:
            q_kids = kids & has_probs  # at most one per leaf (only children)
            q = torch.zeros_like(p).index_add_(0, req[q_kids], probs[q_kids].double())
            has_q = torch.zeros(len(leaf), dtype=torch.bool, device=p.device)
            has_q[req[q_kids]] = True
            resid = torch.where(has_q[:, None], (p - q).clamp_min(0.0), resid)
    noise = exponential_noise(seeds, row_pos[leaf], p.shape[1])
    score = resid / noise
    drawn = score.argmax(-1)
    return torch.where(score.amax(-1) > 0, drawn, (p / noise).argmax(-1))
