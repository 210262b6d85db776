"""Medusa heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", 2024): K extra heads on the target's last feature f_t; head k predicts token
t + k + 2 (the target's own LM head predicts t + 1). Each head is `num_layers` residual blocks
x + SiLU(W x + b) followed by its own LM head, or the target's when it has none (the heads:
specserve.spec_decode.medusa_heads; their checkpoints: specserve.spec_decode.heads_io). Here:
the tree of rank paths and the proposer.
"""

from __future__ import annotations

import torch

from specserve.config import DEFAULT_DRAFTS
from specserve.sampling import draft_top_k
from specserve.spec_decode import tree_ops
from specserve.spec_decode.draft_tree import DraftTree, ProposeBatch
from specserve.spec_decode.quant import draft_lm_head, f32_kernel_for


# depth-1..4 paths of top-k ranks; every prefix of a path is itself in the list
DEFAULT_MEDUSA_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 2),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)


def medusa_plan(choices, num_heads: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The rank paths (their form checked by SpecConfig) no deeper than the heads reach, shorter
    first, as (head, rank, index of the path's prefix or -1), and their indices depth first
    (the paths in lexicographic order)."""
    paths = sorted({tuple(c) for c in choices if len(c) <= num_heads}, key=lambda c: (len(c), c))
    if not paths:
        raise ValueError(f"speculative_config.medusa_tree: every path is deeper than the {num_heads} heads")
    where = {p: i for i, p in enumerate(paths)}
    return ([(len(p) - 1, p[-1], where.get(p[:-1], -1)) for p in paths],
            sorted(range(len(paths)), key=paths.__getitem__))


class MedusaProposer:
    """Medusa drafting: the heads read the target's feature of the token before the pending
    one (f_{n-1}: its LM head gave x_n, head k proposes x_{n+k+1}); the tree takes, for a path of
    ranks (r_1..r_d), the r_d-th best token of head d-1, scored by the sum of the path's log
    probabilities; the budget takes shorter paths first, and the tree lists its nodes depth
    first (rank paths in lexicographic order). One pass of the heads for the whole batch. Nodes
    are deterministic top-k candidates, so the DraftTree has no probabilities (one-hot q: exact
    under sampling)."""

    name = "medusa"
    needs_hidden = True
    feature_steps = 1  # (the feature of the token before the pending one)
    costs_per_request = True

    def __init__(self, target_model, heads_dir, num_speculative_tokens: int = DEFAULT_DRAFTS["medusa"],
                 tree: list | None = None, quantize: int = 0) -> None:
        from specserve.spec_decode.heads_io import load_medusa

        w = target_model.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        heads, d2t = load_medusa(heads_dir, target_model.arch)
        self.heads = heads.to(self.device, self.dtype).requires_grad_(False)  # (drafting needs no grad context)
        f32_kernel = f32_kernel_for(w, target_model.arch.hidden_size, target_model.arch.intermediate_size)
        self.lm_head, self.d2t = draft_lm_head(self.heads, w, d2t, quantize, f32_kernel)  # spec_decode.quant
        self.plan, self.dfs = medusa_plan(DEFAULT_MEDUSA_TREE if tree is None else tree, heads.num_heads)
        self.width = 1 + max(rank for _, rank, _ in self.plan)  # top-k each head needs
        d2t_host = None if self.d2t is None else self.d2t.cpu()  # (read by the C only for CPU logits)
        self._trees = tree_ops.medusa_tree_builder(heads.num_heads, self.width, d2t_host, torch.tensor(self.plan),
                                                   torch.tensor(self.dfs))  # top-k and trees in one C call
        self.m = num_speculative_tokens
        self.last: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (position, feature [1, hidden])

    def observe(self, request_ids: list[str], starts: list[int], sizes: list[int], hidden: torch.Tensor) -> None:
        end, hidden = 0, hidden if hidden.dtype is self.dtype else hidden.to(self.dtype)
        for rid, start, n in zip(request_ids, starts, sizes):
            end += n
            if n:  # (one row alone: hidden itself, no view to make)
                self.last[rid] = (start + n - 1, hidden if end == 1 == len(sizes) else hidden[end - 1:end])

    def free(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    def propose(self, batch: ProposeBatch) -> list[DraftTree | None]:
        # no torch.inference_mode here: nothing it reads requires grad, and entering it cost
        # ~10 us a step between forwards
        out: list[DraftTree | None] = [None] * len(batch.request_ids)
        ready = [j for j, (rid, toks) in enumerate(zip(batch.request_ids, batch.token_ids))
                 if self.last.get(rid, (-1,))[0] == len(toks) - 2]
        if not ready:
            return out
        feats = [self.last[batch.request_ids[j]][1] for j in ready]  # [1, hidden] each, in self.dtype
        feats = feats[0] if len(feats) == 1 else torch.cat(feats)
        view, ids, _alive = draft_top_k(self.heads.logits(feats, self.lm_head).flatten(0, 1), self.width, self.d2t)
        trees = self._trees(view, [min(self.m, batch.max_drafts[j]) for j in ready], batch.min_score, ids)
        for j, (tokens, parents, scores) in zip(ready, trees):
            out[j] = DraftTree(tokens, parents, None, scores, True) if tokens else None
        return out
