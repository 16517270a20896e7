"""Multi-head self-attention: `softmax(Q K^T / sqrt(d)) V` per head, heads concatenated and projected."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention with one fused `qkv` projection (timm's parameter names).

    Two paths compute the same thing. Without `return_attn`, `F.scaled_dot_product_attention`
    (a fused kernel that never materialises the `(N, N)` weights); with it, the explicit
    `softmax(Q K^T / sqrt(d)) V`, which returns the weights and keeps them in the autograd graph.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 8,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={dim} is not divisible by num_heads={num_heads}; "
                f"allowed num_heads for this width: {[h for h in range(1, dim + 1) if dim % h == 0]}"
            )
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, return_attn: bool = False):
        """`(B, N, D) -> (B, N, D)`, or `(out, attn)` with `attn` `(B, H, N, N)` when asked."""
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
        q, k, v = qkv.unbind(0)  # (B, H, N, d) each
        attn = None
        if return_attn:
            scores = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, N, N)
            attn = scores.softmax(dim=-1)
            out = self.attn_drop(attn) @ v  # (B, H, N, d)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, N, D)  # heads concatenated: (B, N, H * d)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attn else out
