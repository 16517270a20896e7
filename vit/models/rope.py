"""Rotary position embedding for images (RoPE, Heo et al. 2024): queries and keys are rotated by angles that grow with
a patch's column and row, so that a query-key product depends on their offset. Two variants, as timm builds them
(`vit_small_patch16_rope_224`, `vit_small_patch16_rope_mixed_224`):

- `axial`: a head's `d / 2` rotation planes are split in two; the first quarter of the head turns with the column
  `x`, the second with the row `y`, at fixed frequencies `temperature ** (-k / (d / 4))` (every head and block alike);
- `mixed`: every plane of every head of every block turns with a learned mix `x * f_x + y * f_y` (`freqs`), started
  at the axial magnitudes in a random direction per head and block.

Angles pair neighbouring channels (`(q0, q1)` turn together, then `(q2, q3)`, ...). Prefix tokens (CLS, registers)
get angle 0: the identity, as timm leaves them unrotated."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

Rope = Literal["axial", "mixed"]
TEMPERATURE = {"axial": 100.0, "mixed": 10.0}  # timm's defaults for the two ViT RoPE models


def grid_coords(grid_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x, y)`, each `(gh * gw,)`: every patch's column and row, in the patches' row-major order."""
    gh, gw = grid_size
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32), indexing="ij")
    return x.flatten(), y.flatten()


def axial_angles(grid_size: tuple[int, int], head_dim: int, temperature: float = TEMPERATURE["axial"]) -> torch.Tensor:
    """The axial variant's angles `(num_patches, head_dim / 2)`: `[x * f_0 .. x * f_(L-1), y * f_0 .. y * f_(L-1)]`,
    `f_k = temperature ** (-k / L)`, `L = head_dim / 4`."""
    bands = head_dim // 4
    freqs = temperature ** (-torch.arange(bands, dtype=torch.float32) / bands)  # (L,)
    x, y = grid_coords(grid_size)
    return torch.cat([x[:, None] * freqs, y[:, None] * freqs], dim=-1)  # (N, 2L)


def mixed_freqs(head_dim: int, depth: int, num_heads: int, temperature: float = TEMPERATURE["mixed"]) -> torch.Tensor:
    """The mixed variant's starting frequencies `(2, depth, num_heads, head_dim / 2)` (`[f_x, f_y]`): the axial
    magnitudes along a random direction per block and head, and along the direction a right angle on."""
    magnitude = temperature ** (-torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)  # (L,)
    theta = torch.rand(depth, num_heads, 1) * 2 * math.pi
    f_x = torch.cat([magnitude * torch.cos(theta), magnitude * torch.cos(theta + math.pi / 2)], dim=-1)
    f_y = torch.cat([magnitude * torch.sin(theta), magnitude * torch.sin(theta + math.pi / 2)], dim=-1)
    return torch.stack([f_x, f_y])


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """`x (..., N, d)` with each pair of channels `(x_2i, x_2i+1)` turned by `angles (..., N, d / 2)`[i]."""
    cos = angles.cos().repeat_interleave(2, dim=-1)  # (..., N, d): each angle for both channels of its pair
    sin = angles.sin().repeat_interleave(2, dim=-1)
    turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)  # (-x1, x0, -x3, x2, ...)
    return (x * cos + turned * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """The angles every block rotates its queries and keys by: `angles(i)` `(1 or num_heads, N, head_dim / 2)` for
    block `i`, zero for the `num_prefix_tokens` first tokens. `mixed` learns `freqs` (timm's `rope.freqs`)."""

    def __init__(
        self,
        kind: Rope,
        *,
        grid_size: tuple[int, int],
        head_dim: int,
        depth: int,
        num_heads: int,
        num_prefix_tokens: int,
        temperature: float | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(
                f"pos_embed='rope': the head width {head_dim} (embed_dim / num_heads) must be a "
                "multiple of 4 (two axes, each a set of channel pairs)"
            )
        self.kind, self.num_prefix_tokens = kind, num_prefix_tokens
        self.temperature = TEMPERATURE[kind] if temperature is None else temperature
        if kind == "axial":
            self.register_buffer("table", axial_angles(grid_size, head_dim, self.temperature), persistent=False)
        else:
            self.freqs = nn.Parameter(mixed_freqs(head_dim, depth, num_heads, self.temperature))
            x, y = grid_coords(grid_size)
            self.register_buffer("x", x, persistent=False)
            self.register_buffer("y", y, persistent=False)

    def angles(self, block: int) -> torch.Tensor:
        """Block `block`'s angles `(1 or num_heads, N, head_dim / 2)`, the prefix tokens' rows zero."""
        if self.kind == "axial":
            patches = self.table[None]  # (1, num_patches, d / 2)
        else:
            f_x, f_y = self.freqs[0, block].float(), self.freqs[1, block].float()  # (H, d / 2) each
            patches = self.x[None, :, None] * f_x[:, None] + self.y[None, :, None] * f_y[:, None]  # (H, N, d / 2)
        prefix = patches.new_zeros(patches.shape[0], self.num_prefix_tokens, patches.shape[-1])
        return torch.cat([prefix, patches], dim=1)
