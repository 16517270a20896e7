"""Multi-head attention as the general mechanism `softmax(f(Q, K) + M) V`.

`f` is a score function (`vit.models.scores`), `M` an additive mask (`vit.models.masks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vit.checks import check_int
from vit.models.masks import attention_bias
from vit.models.scores import DotScore, GeneralScore, Score, build_score

# The scores that are a (rescaled) dot product, by option name and by `build_score`'s module: they can run
# through the fused `F.scaled_dot_product_attention` kernel, the additive forms cannot.
FUSED_SCORES = ("scaled_dot", "dot", "general")
FUSED_SCORE_MODULES = (DotScore, GeneralScore)


class Attention(nn.Module):
    """Multi-head self- or cross-attention with a selectable score function and masks.

    `attn(x)`: self-attention over `x (B, M, dim)`. `attn(x, context)`: queries from `x`, keys and values from
    `context (B, N, kdim)`; `attn(x, context, value=v)`: values from `v (B, N, vdim)`. With `kdim = vdim = dim`
    (the default) the three input projections are one `qkv` layer, timm's layout; other widths get separate
    `q`, `k`, `v` layers to the attention width `attn_dim` (default `dim`).

    Two paths compute the same numbers: `attend`, the explicit `softmax(f(Q, K) + M) V`, and `attend_fused`,
    `F.scaled_dot_product_attention`, which never materialises the `(M, N)` weights. The dot-product scores
    take the fused path, the additive ones the explicit one; under `vit.models.record_attention` every score
    takes the explicit path and the weights `(B, H, M, N)` are recorded, still in the autograd graph.

    Masks (`vit.models.masks`): `mask` bool (True = may attend) or float (added), broadcastable to
    `(B, H, M, N)`; `key_mask (B, N)` bool, False for padding keys; `causal`. Masked weights are exactly 0,
    and a query whose every key is masked gets zero weights and a zero output, not NaN.
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
        qk_norm: bool = False,
        attn_score: Score = "scaled_dot",
        score_dim: int = 16,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        inner = attn_dim or dim
        check_int("num_heads", num_heads, 1)
        if inner % num_heads != 0:
            raise ValueError(
                f"embed_dim={inner} is not divisible by num_heads={num_heads}; "
                f"allowed num_heads for this width: {[h for h in range(1, inner + 1) if inner % h == 0]}"
            )
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
        # QK-norm (Dehghani et al. 2023): a LayerNorm over each head's queries and keys bounds the
        # logits by the norms' gains, which are learned; timm's names, Identity (no parameters) when off.
        self.q_norm = nn.LayerNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.score = build_score(attn_score, num_heads=num_heads, head_dim=self.head_dim, score_dim=score_dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(inner, out_dim or dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.recorder: list[torch.Tensor] | None = None  # set by `vit.models.record_attention`

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """`(B, M, dim) -> (B, M, out_dim)`: self-attention, or cross-attention to `context` (values from `value`)."""
        B, M, _ = x.shape
        H, d = self.num_heads, self.head_dim
        if context is None and value is None and self.fused_qkv:  # self-attention: one projection, then split
            q, k, v = self.qkv(x).reshape(B, M, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, M, d) each
        else:
            q, k, v = self._cross_project(x, context, value)  # (B, H, M, d), (B, H, N, d), (B, H, N, d)
        q, k = self.q_norm(q), self.k_norm(k)
        bias = None  # the additive mask M: 0 where a query may look, -inf where it may not
        if mask is not None or key_mask is not None or causal:
            bias = attention_bias(batch=B, heads=H, num_queries=M, num_keys=k.shape[2], mask=mask,
                                  key_mask=key_mask, causal=causal, device=q.device)
        dropout_p = self.attn_drop.p if self.training else 0.0
        if self.recorder is None and isinstance(self.score, FUSED_SCORE_MODULES):
            out = attend_fused(q, k, v, self.score, bias, dropout_p=dropout_p)  # one kernel; no (M, N) weights made
        else:
            out, weights = attend(q, k, v, self.score, bias, dropout_p=dropout_p)  # softmax(f(q, k) + M) v
            if self.recorder is not None:
                self.recorder.append(weights)  # (B, H, M, N), for `vit.models.record_attention`
        out = out.transpose(1, 2).reshape(B, M, H * d)  # heads concatenated: (B, M, H * d)
        return self.proj_drop(self.proj(out))

    def _cross_project(self, x: torch.Tensor, context: torch.Tensor | None, value: torch.Tensor | None):
        """Queries from `x`, keys from `context`, values from `value` (else `context`), each split into heads."""
        if context is None:
            raise ValueError("value was given without context: pass the keys' input as context")
        if value is not None and value.shape[1] != context.shape[1]:
            raise ValueError(f"value has {value.shape[1]} tokens but context has {context.shape[1]}")
        value = context if value is None else value
        if self.fused_qkv:  # through the slices of the fused projection
            w_q, w_k, w_v = self.qkv.weight.chunk(3)
            b_q, b_k, b_v = self.qkv.bias.chunk(3) if self.qkv.bias is not None else (None, None, None)
            q, k, v = F.linear(x, w_q, b_q), F.linear(context, w_k, b_k), F.linear(value, w_v, b_v)
        else:
            q, k, v = self.q(x), self.k(context), self.v(value)
        return [t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)
                for t in (q, k, v)]


def attend_or_record(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score: nn.Module,
    recorder: list[torch.Tensor] | None,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """`softmax(f(q, k) + M) v` `(B, H, M, d)` by the fused kernel where the score allows it (`attend_fused`),
    else explicitly (`attend`); while `recorder` is a list (`vit.models.record_attention`), always explicitly,
    the weights `(B, H, M, N)` appended to it."""
    if recorder is None and isinstance(score, FUSED_SCORE_MODULES):
        return attend_fused(q, k, v, score, bias, dropout_p=dropout_p)
    out, weights = attend(q, k, v, score, bias, dropout_p=dropout_p)
    if recorder is not None:
        recorder.append(weights)
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score: nn.Module,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general mechanism `softmax(f(q, k) + M) v`, explicitly; returns `(out (B, H, M, d), weights (B, H, M, N))`.

    `score` computes `f(q, k)` `(B, H, M, N)`; `bias` is the additive mask `M` (0 / -inf / finite), broadcastable
    to the scores. A query whose keys are all masked gets zero weights and a zero output instead of the NaN that a
    softmax over a row of -inf gives. `weights` are the softmax before dropout: what the query attends to.
    """
    scores = score(q, k)  # (B, H, M, N)
    empty = None
    if bias is not None:
        empty = _empty_rows(bias)  # (..., M, 1)
        scores = scores + bias.masked_fill(empty, 0.0)
    weights = scores.softmax(dim=-1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    out = F.dropout(weights, p=dropout_p) @ v  # (B, H, M, d)
    return out, weights


def attend_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score: nn.Module,
    bias: torch.Tensor | None = None,
    *,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """`attend` through `F.scaled_dot_product_attention`, for the dot-product scores; weights never materialised.

    `general` runs as a dot product too: `q^T W k = (W^T q) . k`.
    """
    if isinstance(score, GeneralScore):
        q, scale = q @ score.weight, 1.0
    elif isinstance(score, DotScore):
        scale = score.scale
    else:
        raise ValueError(f"{type(score).__name__} has no fused path; use attend()")
    empty = None
    if bias is not None:
        empty = _empty_rows(bias)
        bias = bias.masked_fill(empty, 0.0).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)  # (B, H, M, d)
    return out if empty is None else out.masked_fill(empty, 0.0)


def _empty_rows(bias: torch.Tensor) -> torch.Tensor:
    """`(..., M, 1)` True for queries whose every key is masked (-inf)."""
    return ~(bias > float("-inf")).any(dim=-1, keepdim=True)
