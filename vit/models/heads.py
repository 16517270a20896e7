"""Pooling heads that turn the token sequence into one vector per image."""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import AttentionPoolLatent
from torch import nn

from vit.models.attention import attend_or_record
from vit.models.contract import Recorded
from vit.models.scores import Score, build_score


class MAPHead(AttentionPoolLatent, Recorded):
    """Multihead attention pooling (big_vision's "map" head) with timm's `AttentionPoolLatent` parameters; the forward
    pass is ours, so that the learned query's attention uses `attn_score` and is recorded, `(B, H, 1, N)`."""

    def __init__(
        self, dim: int, *, num_heads: int, mlp_ratio: float = 4.0, attn_score: Score = "scaled_dot", score_dim: int = 16
    ) -> None:
        super().__init__(dim, num_heads=num_heads, mlp_ratio=mlp_ratio, norm_layer=partial(nn.LayerNorm, eps=1e-6))
        self.attn_score = attn_score
        self.score = build_score(attn_score, num_heads=num_heads, head_dim=self.head_dim, score_dim=score_dim)
        self.recorder: list[torch.Tensor] | None = None  # set by `vit.models.record_attention`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, N, D) -> (B, D)`."""
        (B, N, _), H, d = x.shape, self.num_heads, self.head_dim
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, H, d).transpose(1, 2)  # (B, H, 1, d)
        k, v = self.kv(x).reshape(B, N, 2, H, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, d) each
        q, k = self.q_norm(q), self.k_norm(k)
        p = attend_or_record(q, k, v, self.score, self.recorder)  # (B, H, 1, d); recorded: weights (B, H, 1, N)
        p = self.proj_drop(self.proj(p.transpose(1, 2).reshape(B, 1, H * d)))  # the probe's reading: (B, 1, D)
        p = p + self.mlp(self.norm(p))  # (B, 1, D)
        return p[:, 0]
