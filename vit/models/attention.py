"""Multi-head attention as the general mechanism `softmax(f(Q, K) + M) V`: `f` a score function (`vit.models.scores`),
`M` an additive mask (`vit.models.masks`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vit.checks import check_int
from vit.models.contract import Recorded
from vit.models.masks import attention_bias
from vit.models.relpos import RelativePositionBias
from vit.models.rope import rotate
from vit.models.scores import DotScore, GeneralScore, Score, build_score

# The (rescaled) dot-product scores, by option name and by module: the ones `F.scaled_dot_product_attention` runs.
FUSED_SCORES = ("scaled_dot", "dot", "general")
FUSED_SCORE_MODULES = (DotScore, GeneralScore)


class Attention(Recorded):
    """Multi-head self- or cross-attention with a selectable score function and masks (`vit.models.masks`).
    `attn(x)`: self-attention over `x (B, M, dim)`; `attn(x, context)`: keys and values from `context (B, N, kdim)`;
    `attn(x, context, value=v)`: values from `v (B, N, vdim)`. With `kdim = vdim = dim` the input projections are one
    `qkv` layer (timm's layout), else separate `q`, `k`, `v` layers to the width `attn_dim` (default `dim`).

    Two paths compute the same numbers (tested): PyTorch's fused SDPA for the scaled-dot and dot scores, and the
    explicit `softmax(f(q, k) + M) v` for every score; while `record_attention` collects the weights, every score
    takes the explicit path, since SDPA never forms them. `qk_norm` (a LayerNorm on each head's queries and keys,
    as timm's) bounds the logits, which keeps the softmax from saturating when training at a high learning rate
    (Dehghani et al. 2023)."""

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
        relative: tuple[tuple[int, int], int] | None = None,
    ) -> None:
        super().__init__()
        inner = attn_dim or dim
        check_heads(inner, num_heads)
        self.num_heads, self.head_dim, self.attn_score = num_heads, inner // num_heads, attn_score
        self.dim, self.kdim, self.vdim = dim, kdim or dim, vdim or kdim or dim
        self.fused_qkv = self.kdim == self.vdim == dim
        if self.fused_qkv:
            self.qkv = nn.Linear(dim, 3 * inner, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, inner, bias=qkv_bias)
            self.k = nn.Linear(self.kdim, inner, bias=qkv_bias)
            self.v = nn.Linear(self.vdim, inner, bias=qkv_bias)
        # QK-norm (Dehghani et al. 2023), timm's names; Identity (no parameters) when off.
        self.q_norm = nn.LayerNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.score = build_score(attn_score, num_heads=num_heads, head_dim=self.head_dim, score_dim=score_dim)
        self.proj = nn.Linear(inner, out_dim or dim)
        self.recorder: list[torch.Tensor] | None = None  # set by `vit.models.record_attention`
        # `relative` = (patch grid, prefix tokens): a learned bias per head and offset added to every score
        self.rel_pos = RelativePositionBias(relative[0], num_heads, relative[1]) if relative is not None else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        value: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`(B, M, dim) -> (B, M, out_dim)`: self-attention, or cross-attention to `context` (values from `value`).
        `rope`: rotary angles `(1 or H, M, d / 2)` (`vit.models.rope`) that turn queries and keys before any score
        function sees them (self-attention only: both sides need a position)."""
        (B, M, _), H, d = x.shape, self.num_heads, self.head_dim
        if context is None and value is None and self.fused_qkv:  # self-attention: one projection, then split
            q, k, v = self.qkv(x).reshape(B, M, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, M, d) each
        else:
            q, k, v = self._cross_project(x, context, value)  # (B, H, M, d), (B, H, N, d), (B, H, N, d)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            if context is not None:
                raise ValueError("rope is for self-attention: cross-attention keys have no position on the grid")
            q, k = rotate(q, rope), rotate(k, rope)
        bias = None  # the additive mask M: 0 where a query may look, -inf where it may not
        if mask is not None or key_mask is not None or causal:
            bias = attention_bias(
                batch=B,
                heads=H,
                num_queries=M,
                num_keys=k.shape[2],
                mask=mask,
                key_mask=key_mask,
                causal=causal,
                device=q.device,
            )
        if self.rel_pos is not None:  # the scores become f(q, k) + relative bias, before the mask
            relative = self.rel_pos()  # (1, H, N, N)
            bias = relative if bias is None else bias + relative
        out = attend_or_record(q, k, v, self.score, self.recorder, bias)  # (B, H, M, d)
        out = out.transpose(1, 2).reshape(B, M, H * d)  # heads concatenated: (B, M, H * d)
        return self.proj(out)

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
        return [
            t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d)
            for t in (q, k, v)
        ]


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
    """`softmax(f(q, k) + M) v` `(B, H, M, d)`, fused where possible; explicit while `recorder` collects the weights."""
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
    `bias` is the additive mask `M` (0 / -inf / finite), broadcastable to the scores `(B, H, M, N)`. A query whose keys
    are all masked gets zero weights and output, not NaN. `weights` are the softmax before dropout."""
    scores = score(q, k)  # (B, H, M, N)
    bias, empty = _clear_empty_rows(bias)
    weights = (scores if bias is None else scores + bias).softmax(dim=-1)
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
    """`attend` through `F.scaled_dot_product_attention`, weights never materialised (`general`: `(W^T q) . k`)."""
    if isinstance(score, GeneralScore):
        q, scale = q @ score.weight, 1.0
    elif isinstance(score, DotScore):
        scale = score.scale
    else:
        raise ValueError(f"{type(score).__name__} has no fused path; use attend()")
    bias, empty = _clear_empty_rows(bias)
    bias = None if bias is None else bias.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)  # (B, H, M, d)
    return out if empty is None else out.masked_fill(empty, 0.0)


def check_heads(dim: int, num_heads: int) -> None:
    """Raise `ValueError` unless `num_heads >= 1` divides the attention width `dim`, listing the heads that do."""
    check_int("num_heads", num_heads, 1)
    if dim % num_heads:
        raise ValueError(
            f"embed_dim={dim} is not divisible by num_heads={num_heads}; allowed num_heads "
            f"for this width: {[h for h in range(1, dim + 1) if dim % h == 0]}"
        )


def _clear_empty_rows(bias: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`(bias, empty)`: `empty (..., M, 1)` marks queries whose every key is -inf; their `bias` rows are 0 (no NaN)."""
    if bias is None:
        return None, None
    empty = ~(bias > float("-inf")).any(dim=-1, keepdim=True)
    return bias.masked_fill(empty, 0.0), empty
