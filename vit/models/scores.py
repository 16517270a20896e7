"""Attention score functions `f(q, k)`: one pure function each, and a small module holding its weights.

Every function takes per-head queries `q (B, H, M, d)` and keys `k (B, H, N, d)` and returns the
scores `(B, H, M, N)` that go into `softmax(f(Q, K) + mask)`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from vit.checks import check_choice, check_int

Score = Literal["scaled_dot", "dot", "general", "additive", "concat"]
SCORES: tuple[str, ...] = get_args(Score)


def dot_score(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Luong et al. 2015, "dot": `q . k`."""
    return q @ k.transpose(-2, -1)  # (B, H, M, N)


def general_score(q: torch.Tensor, k: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Luong et al. 2015, "general": `q^T W k`, with one learned `W (d, d)` per head (`weight (H, d, d)`)."""
    return (q @ weight) @ k.transpose(-2, -1)  # (B, H, M, d) @ (B, H, d, N) -> (B, H, M, N)


def concat_score(
    q: torch.Tensor, k: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_a: torch.Tensor
) -> torch.Tensor:
    """Bahdanau et al. 2015: `w_a^T tanh(W_q q + W_k k)`, weights `(H, d_a, d)`, `(H, d_a, d)`, `(H, d_a)`.

    The sum inside tanh is formed for every (query, key) pair: a `(B, H, M, N, d_a)` tensor, kept
    for the backward pass. That is the memory cost of the additive family, and why `d_a` is small.
    """
    hq = q @ w_q.transpose(-2, -1)  # (B, H, M, d_a)
    hk = k @ w_k.transpose(-2, -1)  # (B, H, N, d_a)
    e = torch.tanh(hq.unsqueeze(-2) + hk.unsqueeze(-3))  # (B, H, M, N, d_a)
    return (e @ w_a[:, None, :, None]).squeeze(-1)  # (B, H, M, N)


def additive_score(q: torch.Tensor, k: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor) -> torch.Tensor:
    """`w_a^T tanh(W_b [q ; k])`, with `W_b (H, d_a, 2d)` acting on the concatenation of q and k.

    `W_b [q ; k] = W_b[:, :d] q + W_b[:, d:] k` exactly, so this is `concat_score` with the two halves of one
    matrix: the two forms are the same function family, parameterised differently (the literature lists them
    separately). Concatenating every pair would materialise `(B, H, M, N, 2d)` for nothing, so the split is used.
    """
    d = q.shape[-1]
    return concat_score(q, k, w_b[..., :d], w_b[..., d:], w_a)


class DotScore(nn.Module):
    """`q . k`, optionally times `scale`: `d**-0.5` gives Vaswani et al.'s scaled dot product, which
    keeps the logits' variance ~1 at any head width."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return dot_score(q, k) * self.scale if self.scale != 1.0 else dot_score(q, k)


class GeneralScore(nn.Module):
    """`q^T W k` per head. `W` starts at `I / sqrt(d)`, so training starts from scaled dot-product."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1) * head_dim**-0.5)  # (H, d, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return general_score(q, k, self.weight)


class ConcatScore(nn.Module):
    """`w_a^T tanh(W_q q + W_k k)` per head, hidden width `score_dim` (d_a)."""

    def __init__(self, num_heads: int, head_dim: int, score_dim: int) -> None:
        super().__init__()
        self.w_q = nn.Parameter(torch.randn(num_heads, score_dim, head_dim) * head_dim**-0.5)
        self.w_k = nn.Parameter(torch.randn(num_heads, score_dim, head_dim) * head_dim**-0.5)
        self.w_a = nn.Parameter(torch.randn(num_heads, score_dim) * score_dim**-0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return concat_score(q, k, self.w_q, self.w_k, self.w_a)


class AdditiveScore(nn.Module):
    """`w_a^T tanh(W_b [q ; k])` per head, hidden width `score_dim` (d_a)."""

    def __init__(self, num_heads: int, head_dim: int, score_dim: int) -> None:
        super().__init__()
        # std 1/sqrt(d) per half, as in ConcatScore: same pre-activation scale for the two forms.
        self.w_b = nn.Parameter(torch.randn(num_heads, score_dim, 2 * head_dim) * head_dim**-0.5)
        self.w_a = nn.Parameter(torch.randn(num_heads, score_dim) * score_dim**-0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return additive_score(q, k, self.w_b, self.w_a)


def build_score(score: str, *, num_heads: int, head_dim: int, score_dim: int = 16) -> nn.Module:
    """The module computing `f(q, k)` for the option name `score` (one of `SCORES`)."""
    check_choice("attn_score", score, Score)
    if score in ("additive", "concat"):
        check_int("score_dim", score_dim, 1)
    if score == "scaled_dot":
        return DotScore(scale=head_dim**-0.5)
    if score == "dot":
        return DotScore()
    if score == "general":
        return GeneralScore(num_heads, head_dim)
    if score == "concat":
        return ConcatScore(num_heads, head_dim, score_dim)
    return AdditiveScore(num_heads, head_dim, score_dim)
