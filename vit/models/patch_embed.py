"""Patch embedding: cut the image into non-overlapping patches and project each one to a token."""

from __future__ import annotations

import torch
from torch import nn

from vit.checks import check_int
from vit.models.inputs import check_image_batch


class PatchEmbed(nn.Module):
    """`(B, C, H, W) -> (B, N, D)` with a strided convolution, `N = (H / P) * (W / P)`. `kernel_size` > `patch_size`
    makes the patches overlap: each token sees a `kernel_size`-wide window centred on its patch (zero-padded)."""

    def __init__(
        self,
        *,
        img_size: tuple[int, int],
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        kernel_size: int | None = None,
    ) -> None:
        super().__init__()
        for side in img_size:
            if patch_size <= 0 or patch_size > side:
                raise ValueError(f"patch_size={patch_size} must be in [1, img_size={side}]")
            if side % patch_size != 0:
                raise ValueError(
                    f"img_size={side} is not divisible by patch_size={patch_size}; allowed patch sizes "
                    f"for this image: {[p for p in range(1, side + 1) if side % p == 0]}"
                )
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans  # img_size: (H, W), as timm's
        self.grid_size = (img_size[0] // patch_size, img_size[1] // patch_size)  # (gh, gw)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        kernel_size = patch_size if kernel_size is None else kernel_size
        check_int("kernel_size", kernel_size, patch_size)
        if (kernel_size - patch_size) % 2:
            raise ValueError(
                f"kernel_size={kernel_size} is not allowed: expected patch_size={patch_size} plus an "
                "even number, so that the overlap is the same on both sides"
            )
        self.proj = nn.Conv2d(
            in_chans, embed_dim, kernel_size=kernel_size, stride=patch_size, padding=(kernel_size - patch_size) // 2
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size, dtype=self.proj.weight.dtype)
        x = self.proj(x)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D)
