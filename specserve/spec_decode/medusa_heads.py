"""Medusa's heads (the method: specserve.spec_decode.medusa): K heads on the target's last
feature, each `num_layers` residual blocks x + SiLU(W x + b) followed by its own LM head, or the
target's when it has none.

Module layout (= the public medusa_lm_head checkpoint, read by specserve.spec_decode.heads_io):
`{k}.{l}.linear.weight/bias`, `{k}.{num_layers}.weight`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity, as Medusa does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """vocab 0: the heads have no LM head of their own (the caller applies the target's)."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int = 0) -> None:
        heads = []
        for _ in range(num_heads):
            blocks: list[nn.Module] = [ResBlock(hidden) for _ in range(num_layers)]
            if vocab:
                blocks.append(nn.Linear(hidden, vocab, bias=False))
            heads.append(nn.Sequential(*blocks))
        super().__init__(heads)
        self.num_heads, self.num_layers, self.hidden_size, self.vocab = num_heads, num_layers, hidden, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [K, N, hidden]: each head's residual blocks (before any LM head)."""
        out = []
        for head in self:
            f = x
            for i in range(self.num_layers):
                f = head[i](f)
            out.append(f)
        return torch.stack(out)

    def logits(self, x: torch.Tensor, lm_head) -> torch.Tensor:
        """x: [N, hidden] -> [K, N, V'] with each head's own LM head, else `lm_head` ([rows,
        hidden] -> [rows, V'], the target's, maybe restricted; one product for all heads)."""
        feats = self(x)
        if self.vocab:
            return torch.stack([head[self.num_layers](f) for head, f in zip(self, feats)])
        return lm_head(feats.reshape(-1, feats.shape[-1])).view(*feats.shape[:2], -1)
