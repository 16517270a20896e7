"""Attention score functions `f(q, k)`: queries `(B, H, M, d)` and keys `(B, H, N, d)` -> scores `(B, H, M, N)`."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from vit.checks import check_choice, check_int

Score = Literal["scaled_dot", "dot", "general", "additive", "concat"]
SCORES: tuple[str, ...] = get_args(Score)


def concat_score(
    q: torch.Tensor, k: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_a: torch.Tensor
) -> torch.Tensor:
    """Bahdanau et al. 2015: `w_a^T tanh(W_q q + W_k k)`, weights `(H, d_a, d)`, `(H, d_a, d)`, `(H, d_a)`. The sum
    inside tanh, `(B, H, M, N, d_a)`, is kept for the backward pass: the memory cost of the family."""
    hq = q @ w_q.transpose(-2, -1)  # (B, H, M, d_a)
    hk = k @ w_k.transpose(-2, -1)  # (B, H, N, d_a)
    e = torch.tanh(hq.unsqueeze(-2) + hk.unsqueeze(-3))  # (B, H, M, N, d_a)
    return (e @ w_a[:, None, :, None]).squeeze(-1)  # (B, H, M, N)


def additive_score(q: torch.Tensor, k: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor) -> torch.Tensor:
    """`w_a^T tanh(W_b [q ; k])`, `W_b (H, d_a, 2d)`: `concat_score` with the two halves of one matrix, as
    `W_b [q ; k] = W_b[:, :d] q + W_b[:, d:] k`, without materialising the `(B, H, M, N, 2d)` pairs."""
    d = q.shape[-1]
    return concat_score(q, k, w_b[..., :d], w_b[..., d:], w_a)


class DotScore(nn.Module):
    """`q . k` (Luong et al. 2015, "dot"), optionally times `scale` (`d**-0.5`: Vaswani et al.'s scaled dot product)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)  # (B, H, M, N)
        return scores * self.scale if self.scale != 1.0 else scores


class GeneralScore(nn.Module):
    """`q^T W k` (Luong et al. 2015, "general"), one `W (d, d)` per head, starting at `I / sqrt(d)` (scaled dot)."""

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(num_heads, 1, 1) * head_dim**-0.5)  # (H, d, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ self.weight) @ k.transpose(-2, -1)  # (B, H, M, d) @ (B, H, d, N) -> (B, H, M, N)


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
        return (ConcatScore if score == "concat" else AdditiveScore)(num_heads, head_dim, score_dim)
    if score == "general":
        return GeneralScore(num_heads, head_dim)
    return DotScore(scale=head_dim**-0.5 if score == "scaled_dot" else 1.0)
