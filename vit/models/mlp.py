"""The Transformer's feed-forward layer: the same two-layer MLP applied to every token."""

from __future__ import annotations

import torch
from torch import nn


class Mlp(nn.Module):
    """`(B, N, D) -> (B, N, out_features)`: `fc2(drop(act(fc1(x))))`, GELU by default.

    The hidden width is `hidden_features` (in a ViT block `mlp_ratio * D`). Attribute names are
    timm's (`fc1`, `act`, `drop1`, `fc2`, `drop2`), so timm state dicts load as they are.
    """

    def __init__(
        self,
        in_features: int,
        hidden_features: int | None = None,
        out_features: int | None = None,
        *,
        act_layer: type[nn.Module] = nn.GELU,
        drop: float = 0.0,
    ) -> None:
        super().__init__()
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features or in_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop1(self.act(self.fc1(x)))  # (B, N, hidden)
        return self.drop2(self.fc2(x))  # (B, N, out)
