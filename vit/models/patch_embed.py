"""Patch embedding: cut the image into non-overlapping patches and project each one to a token."""

from __future__ import annotations

import torch
from torch import nn

from vit.models.inputs import check_image_batch, to_2tuple


class PatchEmbed(nn.Module):
    """`(B, C, H, W) -> (B, N, D)` with a strided convolution, `N = (H / P) * (W / P)`.

    A convolution with kernel = stride = patch size is exactly "flatten each P x P patch and apply
    one shared linear map", written so that the kernel does the reshaping. `img_size` is the side
    of a square image or `(H, W)`; each side must be a multiple of `patch_size`.
    """

    def __init__(self, *, img_size: int | tuple[int, int], patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        sides = to_2tuple(img_size)
        for side in sides:
            if patch_size <= 0 or patch_size > side:
                raise ValueError(f"patch_size={patch_size} must be in [1, img_size={side}]")
            if side % patch_size != 0:
                raise ValueError(
                    f"img_size={side} is not divisible by patch_size={patch_size}; "
                    f"allowed patch sizes for this image: {[p for p in range(1, side + 1) if side % p == 0]}"
                )
        self.img_size = img_size
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid_size = (sides[0] // patch_size, sides[1] // patch_size)  # (gh, gw)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size, dtype=self.proj.weight.dtype)
        x = self.proj(x)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)
