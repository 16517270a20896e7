"""Multi-head attention as the general mechanism `softmax(f(Q, K) + M) V`.

`f` is a score function (`vit.models.scores`), `M` an additive mask (`vit.models.masks`). Each of
the H heads attends with its own slice of the projected queries, keys and values; the heads'
outputs are concatenated and projected back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vit.models.masks import attention_bias
from vit.models.scores import SCORES, Score, build_score

# Scores that are a (rescaled) dot product of projected queries with keys, and so can run through
# the fused `F.scaled_dot_product_attention` kernel. The additive forms cannot.
_FUSED_SCORES = ("scaled_dot", "dot", "general")


class Attention(nn.Module):
    """Multi-head self- or cross-attention with a selectable score function and masks.

    Self-attention: `attn(x)`, queries, keys and values all from `x (B, M, dim)`.
    Cross-attention: `attn(x, context)`: queries from `x`, keys and values from
    `context (B, N, kdim)`; or `attn(x, context, value=v)` with values from `v (B, N, vdim)`.

    With `kdim = vdim = dim` (the default), the three input projections are one fused `qkv` linear
    layer, timm's layout. Other widths get separate `q`, `k`, `v` layers, which bring queries,
    keys and values of any width to the attention width `attn_dim` (default `dim`).

    Two paths compute the same numbers. Without `return_attn`, the dot-product scores run through
    `F.scaled_dot_product_attention`, a fused kernel that never materialises the `(M, N)` weights.
    With `return_attn` (and always for `additive` / `concat`), the explicit
    `softmax(f(Q, K) + M) V` runs and the weights `(B, H, M, N)` stay in the autograd graph.

    Masks (see `vit.models.masks`): `mask` bool (True = may attend) or float (added), broadcastable
    to `(B, H, M, N)`; `key_mask (B, N)` bool, False for padding keys; `causal`. Masked weights are
    exactly 0, and a query row with every key masked gets zero weights and a zero output, not NaN.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 8,
        kdim: int | None = None,
        vdim: int | None = None,
        attn_dim: int | None = None,
        out_dim: int | None = None,
        qkv_bias: bool = True,
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        inner = attn_dim or dim
        if inner % num_heads != 0:
            raise ValueError(
                f"embed_dim={inner} is not divisible by num_heads={num_heads}; "
                f"allowed num_heads for this width: {[h for h in range(1, inner + 1) if inner % h == 0]}"
            )
        if attn_score not in SCORES:
            raise ValueError(f"attn_score={attn_score!r} is not one of {SCORES}")
        self.num_heads = num_heads
        self.head_dim = inner // num_heads
        self.attn_score = attn_score
        self.dim, self.kdim, self.vdim = dim, kdim or dim, vdim or kdim or dim
        self.fused_qkv = self.kdim == self.vdim == dim
        if self.fused_qkv:
            self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, inner, bias=qkv_bias)
            self.k = nn.Linear(self.kdim, inner, bias=qkv_bias)
            self.v = nn.Linear(self.vdim, inner, bias=qkv_bias)
        self.score = build_score(attn_score, num_heads=num_heads, head_dim=self.head_dim, score_dim=score_dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(inner, out_dim or dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, L, _ = t.shape
        return t.reshape(B, L, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)

    def _project(self, x: torch.Tensor, context: torch.Tensor | None, value: torch.Tensor | None):
        """Queries from `x`, keys from `context` (else `x`), values from `value` (else the keys' input)."""
        for name, t, width in (("x", x, self.dim), ("context", context, self.kdim), ("value", value, self.vdim)):
            if t is not None and (t.ndim != 3 or t.shape[-1] != width or t.shape[0] != x.shape[0]):
                raise ValueError(f"{name} must have shape (B={x.shape[0]}, L, {width}), got {tuple(t.shape)}")
        if value is not None and context is not None and value.shape[1] != context.shape[1]:
            raise ValueError(f"value has {value.shape[1]} tokens but context has {context.shape[1]}")
        if self.fused_qkv and context is None:
            B, N, _ = x.shape
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d)
            return qkv.unbind(0)
        if self.fused_qkv:  # cross-attention through the slices of the fused projection
            w_q, w_k, w_v = self.qkv.weight.chunk(3)
            b_q, b_k, b_v = self.qkv.bias.chunk(3) if self.qkv.bias is not None else (None, None, None)
            q, k = F.linear(x, w_q, b_q), F.linear(context, w_k, b_k)
            v = F.linear(value if value is not None else context, w_v, b_v)
        else:
            kv_in = context if context is not None else x
            q, k, v = self.q(x), self.k(kv_in), self.v(value if value is not None else kv_in)
        return self._heads(q), self._heads(k), self._heads(v)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
        return_attn: bool = False,
    ):
        """`(B, M, dim) -> (B, M, out_dim)`, or `(out, attn)` with `attn (B, H, M, N)` when asked."""
        if value is not None and context is None:
            raise ValueError("value was given without context: pass the keys' input as context")
        q, k, v = self._project(x, context, value)  # (B, H, M, d), (B, H, N, d), (B, H, N, d)
        B, H, M, _ = q.shape
        N = k.shape[2]

        bias = empty = None
        if mask is not None or key_mask is not None or causal:
            bias = attention_bias(batch=B, heads=H, num_queries=M, num_keys=N, mask=mask, key_mask=key_mask,
                                  causal=causal, device=q.device)
            # A query with no key to look at: give its row a harmless bias (no NaN from softmax over
            # all -inf), then zero its weights and output below.
            empty = ~(bias > float("-inf")).any(dim=-1, keepdim=True)  # (..., M, 1)
            bias = bias.masked_fill(empty, 0.0)

        attn = None
        if not return_attn and self.attn_score in _FUSED_SCORES:
            scale = None  # SDPA's default, 1/sqrt(d)
            if self.attn_score == "general":
                q, scale = q @ self.score.weight, 1.0  # q^T W k = (W^T q) . k
            elif self.attn_score == "dot":
                scale = 1.0
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if bias is None else bias.to(q.dtype),
                dropout_p=self.attn_drop.p if self.training else 0.0,
                scale=scale,
            )  # (B, H, M, d)
        else:
            scores = self.score(q, k)  # (B, H, M, N)
            if bias is not None:
                scores = scores + bias
            attn = scores.softmax(dim=-1)
            if empty is not None:
                attn = attn.masked_fill(empty, 0.0)
            out = self.attn_drop(attn) @ v  # (B, H, M, d)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        out = out.transpose(1, 2).reshape(B, M, H * self.head_dim)  # heads concatenated: (B, M, H * d)
        out = self.proj_drop(self.proj(out))
        return (out, attn) if return_attn else out
