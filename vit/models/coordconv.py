"""CoordConv baseline (Liu et al. 2018): the ResNet, fed two extra channels that hold each pixel's row and column.
The control for a CNN that fails a relation between distant parts: the local view, plus the absolute position."""

from __future__ import annotations

import torch
from torch import nn

from vit.checks import check_size
from vit.models.contract import Backbone, ToMaps
from vit.models.inputs import check_image_batch
from vit.models.resnet import ResNet


def coord_channels(img_size: int | tuple[int, int], *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """`(2, H, W)` pixel-centre coordinates, each axis scaled to [-1, 1]: channel 0 the row (y), 1 the column (x)."""
    H, W = check_size("img_size", img_size)
    y = (torch.arange(H, dtype=dtype, device=device) + 0.5) / H * 2 - 1  # (H,)
    x = (torch.arange(W, dtype=dtype, device=device) + 0.5) / W * 2 - 1  # (W,)
    rows, cols = torch.meshgrid(y, x, indexing="ij")  # (H, W) each
    return torch.stack([rows, cols])  # (2, H, W)


class CoordConvResNet(Backbone):
    """`(B, C, H, W) -> (B, num_classes)`: `ResNet` on the input with normalised y and x channels appended."""

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        widths: tuple[int, ...] = (32, 64, 128),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        self.img_size, self.in_chans, self.num_classes = check_size("img_size", img_size), in_chans, num_classes
        self.resnet = ResNet(
            img_size=self.img_size,
            in_chans=in_chans + 2,
            num_classes=num_classes,
            widths=widths,
            blocks_per_stage=blocks_per_stage,
        )
        self.register_buffer("coords", coord_channels(self.img_size), persistent=False)  # (2, H, W)

    def add_coords(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, C + 2, H, W)`: the input followed by its row and column channels."""
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size)
        coords = self.coords.to(x.dtype).expand(x.shape[0], -1, -1, -1)  # (B, 2, H, W)
        return torch.cat([x, coords], dim=1)

    def gradcam_target(self) -> tuple[nn.Module, ToMaps]:
        return self.resnet.gradcam_target()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnet(self.add_coords(x))
