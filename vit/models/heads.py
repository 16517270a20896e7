"""Pooling heads that turn the token sequence into one vector per image."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.init import trunc_normal_

from vit.models.attention import Attention
from vit.models.mlp import Mlp
from vit.models.scores import Score


class MAPHead(nn.Module):
    """Multihead attention pooling (big_vision's "map" head).

    A learned query (the probe) cross-attends to the tokens, then a residual MLP refines the
    result: `p = attn(probe, tokens)`, `p = p + mlp(norm(p))`. The image is summarised by what one
    learned question finds, instead of by a token reserved for it (CLS) or by an average.
    """

    def __init__(
        self, dim: int, *, num_heads: int, mlp_ratio: float = 4.0, attn_score: Score = "scaled_dot", score_dim: int = 16
    ) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, dim))
        self.attn = Attention(dim, num_heads=num_heads, attn_score=attn_score, score_dim=score_dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        trunc_normal_(self.probe, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, N, D) -> (B, D)`."""
        p = self.attn(self.probe.expand(x.shape[0], -1, -1), x)  # the probe reads the tokens: (B, 1, D)
        p = p + self.mlp(self.norm(p))  # (B, 1, D)
        return p[:, 0]
