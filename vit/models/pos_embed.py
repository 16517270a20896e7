"""Fixed sinusoidal position encodings, as pure functions of the grid and the width."""

from __future__ import annotations

import torch


def sincos_1d(positions: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """The encoding of "Attention Is All You Need" for integer positions, `(len(positions), dim)`:
    `PE(pos, 2i) = sin(pos / T^(2i / dim))`, `PE(pos, 2i + 1) = cos(pos / T^(2i / dim))`, interleaved."""
    if dim % 2 != 0:
        raise ValueError(f"sin/cos position encoding needs an even width, got dim={dim}")
    two_i = torch.arange(0, dim, 2, dtype=torch.float64)  # (dim/2,)
    angles = positions.to(torch.float64)[:, None] / temperature ** (two_i / dim)  # (P, dim/2)
    pe = torch.stack([angles.sin(), angles.cos()], dim=-1)  # (P, dim/2, 2)
    return pe.flatten(1).to(torch.float32)  # (P, dim): sin, cos, sin, cos, ...


def sincos_2d(grid_h: int, grid_w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """2-D form over a patch grid (Beyer et al. 2022), `(grid_h * grid_w, dim)`: the first half of the channels
    encodes the patch row with `sincos_1d`, the second the column; patches row-major, as `PatchEmbed` emits them."""
    if dim % 4 != 0:
        raise ValueError(f"2-D sin/cos position encoding needs a width divisible by 4, got dim={dim}")
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")  # (gh, gw) each
    halves = [sincos_1d(rows.flatten(), dim // 2, temperature), sincos_1d(cols.flatten(), dim // 2, temperature)]
    return torch.cat(halves, dim=1)  # (gh * gw, dim)
