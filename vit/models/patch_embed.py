"""Patch embedding: cut the image into non-overlapping patches and project each one to a token."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from vit.checks import check_choice, check_int
from vit.models.inputs import check_image_batch, to_2tuple


class PatchEmbed(nn.Module):
    """`(B, C, H, W) -> (B, N, D)` with a strided convolution, `N = (H / P) * (W / P)`.

    A convolution with kernel = stride = patch size is exactly "flatten each P x P patch and apply
    one shared linear map", written so that the kernel does the reshaping. `img_size` is the side
    of a square image or `(H, W)`; each side must be a multiple of `patch_size`.

    `kernel_size` > `patch_size` makes the patches overlap: each token then sees a
    `kernel_size`-wide window centred on its patch (zero padding `(kernel_size - patch_size) / 2`
    keeps the grid), so a feature smaller than the window but cut by a patch border is still seen
    whole by one token. `stem="conv"` replaces the single projection by the convolutional stem of
    Xiao et al. 2021 ("Early convolutions help transformers see better"): 3x3 convolutions of
    stride 2 with BatchNorm and ReLU until the total stride is `patch_size` (a power of 2), then a
    1x1 convolution to the width (`proj`).
    """

    def __init__(self, *, img_size: int | tuple[int, int], patch_size: int, in_chans: int, embed_dim: int,
                 kernel_size: int | None = None, stem: Literal["patch", "conv"] = "patch") -> None:
        super().__init__()
        check_choice("stem", stem, ("patch", "conv"))
        sides = to_2tuple(img_size)
        for side in sides:
            if patch_size <= 0 or patch_size > side:
                raise ValueError(f"patch_size={patch_size} must be in [1, img_size={side}]")
            if side % patch_size != 0:
                raise ValueError(
                    f"img_size={side} is not divisible by patch_size={patch_size}; "
                    f"allowed patch sizes for this image: {[p for p in range(1, side + 1) if side % p == 0]}"
                )
        self.img_size = sides  # (H, W), as timm's PatchEmbed keeps it
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.grid_size = (sides[0] // patch_size, sides[1] // patch_size)  # (gh, gw)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.stem = None
        if stem == "conv":
            if kernel_size is not None:
                raise ValueError(f"kernel_size={kernel_size} applies to stem='patch' only; stem='conv' has its own 3x3 kernels")
            if patch_size < 2 or patch_size & (patch_size - 1):
                raise ValueError(f"stem='conv' needs patch_size a power of 2 >= 2 (stride-2 convolutions), got {patch_size}")
            layers, width = [], in_chans
            for i in range(patch_size.bit_length() - 1):  # log2(P) stride-2 convolutions
                out = max(embed_dim // 2 ** (patch_size.bit_length() - 2 - i), 8)
                layers += [nn.Conv2d(width, out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(out),
                           nn.ReLU(inplace=True)]
                width = out
            self.stem = nn.Sequential(*layers)
            self.proj = nn.Conv2d(width, embed_dim, kernel_size=1)
        else:
            kernel_size = patch_size if kernel_size is None else kernel_size
            check_int("kernel_size", kernel_size, patch_size)
            if (kernel_size - patch_size) % 2:
                raise ValueError(f"kernel_size={kernel_size} is not allowed: expected patch_size={patch_size} plus an "
                                 "even number, so that the overlap is the same on both sides")
            self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=kernel_size, stride=patch_size,
                                  padding=(kernel_size - patch_size) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size, dtype=self.proj.weight.dtype)
        if self.stem is not None:
            x = self.stem(x)  # (B, C', H/P, W/P)
        x = self.proj(x)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)
