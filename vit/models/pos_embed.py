"""Fixed sinusoidal position encodings, as pure functions of the grid and the width."""

from __future__ import annotations

import torch


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """The encoding of "Attention Is All You Need" for the given integer positions.

    `PE(pos, 2i) = sin(pos / T^(2i / dim))`, `PE(pos, 2i + 1) = cos(pos / T^(2i / dim))`,
    sines and cosines interleaved along the channel axis. Returns `(len(positions), dim)`.
    """
    if dim % 2 != 0:
        raise ValueError(f"sin/cos position encoding needs an even width, got dim={dim}")
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] / temperature ** (two_i / dim)  # (P, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1)  # (P, dim/2, 2)
    return pe.flatten(1).to(torch.float32)  # (P, dim): sin, cos, sin, cos, ...


def sincos_2d(grid_h: int, grid_w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """2-D form over a patch grid (Beyer et al. 2022, "Better plain ViT baselines").

    The first half of the channels encodes the patch row with `sincos_1d`, the second half the patch column.
    Patches are in row-major order, as `PatchEmbed` emits them. Returns `(grid_h * grid_w, dim)`.
    """
    if dim % 4 != 0:
        raise ValueError(f"2-D sin/cos position encoding needs a width divisible by 4, got dim={dim}")
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")  # (gh, gw) each
    return torch.cat(
        [sincos_1d(rows.flatten(), dim // 2, temperature), sincos_1d(cols.flatten(), dim // 2, temperature)],
        dim=1,
    )  # (gh * gw, dim)
