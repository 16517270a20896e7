"""The pre-norm Transformer encoder block."""

from __future__ import annotations

import torch
from timm.layers import DropPath
from torch import nn

from vit.models.attention import Attention
from vit.models.mlp import Mlp
from vit.models.scores import Score


class Block(nn.Module):
    """`x + attn(norm1(x))`, then `x + mlp(norm2(x))`, each branch with stochastic depth."""

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        # eps=1e-6 as in timm and the original ViT, so timm checkpoints give identical outputs.
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(
            dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            attn_score=attn_score,
            score_dim=score_dim,
            attn_drop=attn_drop,
            proj_drop=proj_drop,
        )
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """`(B, N, D) -> (B, N, D)`; `mask` (bool or additive, `vit.models.masks`) limits the attention."""
        x = x + self.drop_path1(self.attn(self.norm1(x), mask=mask))
        return x + self.drop_path2(self.mlp(self.norm2(x)))
