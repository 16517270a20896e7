"""A relative position bias (Shaw et al. 2018; the table of Swin and BEiT, in timm's `RelPosBias` layout): every head
learns one number per offset `(dy, dx)` between two patches, added to their attention score, so that a score can
depend on where a key is relative to the query and nowhere on where the pair is. With a CLS token, three more
numbers per head: CLS to a patch, a patch to CLS, CLS to itself (BEiT)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.init import trunc_normal_


def relative_index(grid_size: tuple[int, int], class_token: bool) -> torch.Tensor:
    """`(N, N)` indices into the table: patch `i` to patch `j` at `(dy + gh - 1) * (2 gw - 1) + dx + gw - 1`, with
    `(dy, dx)` = `i`'s row and column minus `j`'s; with `class_token`, row 0 (CLS to a patch) `D`, column 0 (a patch
    to CLS) `D + 1`, `[0, 0]` `D + 2`, `D` = `(2 gh - 1)(2 gw - 1)` the number of offsets."""
    gh, gw = grid_size
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()  # (num_patches,) each, row-major
    dy, dx = rows[:, None] - rows[None], cols[:, None] - cols[None]  # (P, P) each
    index = (dy + gh - 1) * (2 * gw - 1) + dx + gw - 1
    if not class_token:
        return index
    offsets = (2 * gh - 1) * (2 * gw - 1)
    full = torch.empty(gh * gw + 1, gh * gw + 1, dtype=torch.long)
    full[1:, 1:] = index
    full[0, 1:], full[1:, 0], full[0, 0] = offsets, offsets + 1, offsets + 2
    return full


class RelativePositionBias(nn.Module):
    """`forward()` -> the bias `(1, num_heads, N, N)` one attention layer adds to its scores, `N` the patches and the
    CLS token if any; `relative_position_bias_table` `(offsets [+ 3], num_heads)` (timm's name) holds it."""

    def __init__(self, grid_size: tuple[int, int], num_heads: int, num_prefix_tokens: int) -> None:
        super().__init__()
        if num_prefix_tokens > 1:
            raise ValueError(
                f"pos_embed='relative' takes at most one prefix token (a CLS token), got "
                f"{num_prefix_tokens}: register tokens have no offset to the patches (use reg_tokens=0)"
            )
        gh, gw = grid_size
        rows = (2 * gh - 1) * (2 * gw - 1) + 3 * num_prefix_tokens
        self.relative_position_bias_table = nn.Parameter(trunc_normal_(torch.empty(rows, num_heads), std=0.02))
        self.register_buffer(
            "relative_position_index", relative_index(grid_size, num_prefix_tokens == 1), persistent=False
        )

    def forward(self) -> torch.Tensor:
        bias = self.relative_position_bias_table[self.relative_position_index]  # (N, N, H)
        return bias.permute(2, 0, 1)[None]  # (1, H, N, N)
