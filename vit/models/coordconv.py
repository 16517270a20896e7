"""CoordConv baseline: the ResNet, fed two extra channels that hold each pixel's row and column.

Liu et al. (2018, "An intriguing failing of convolutional neural networks and the CoordConv solution"):
a plain CNN struggles to map *where* something is, and coordinate channels fix it. The two-circles study's
control: if a CNN fails a relation between distant parts, is it the local view or the missing absolute
position? A CoordConv ResNet keeps the local view and adds the position.
"""

from __future__ import annotations

import torch
from torch import nn

from vit.checks import check_size
from vit.models.inputs import check_image_batch
from vit.models.resnet import ResNet


def coord_channels(img_size: int | tuple[int, int], *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """`(2, H, W)` pixel-centre coordinates scaled to [-1, 1]: channel 0 the row (y), channel 1 the column (x).

    `img_size` is a side or `(H, W)`; each axis is scaled by its own length, so both span [-1, 1].
    """
    H, W = check_size("img_size", img_size)
    y = (torch.arange(H, dtype=dtype, device=device) + 0.5) / H * 2 - 1  # (H,)
    x = (torch.arange(W, dtype=dtype, device=device) + 0.5) / W * 2 - 1  # (W,)
    rows, cols = torch.meshgrid(y, x, indexing="ij")  # (H, W) each
    return torch.stack([rows, cols])  # (2, H, W)


class CoordConvResNet(nn.Module):
    """`(B, C, H, W) -> (B, num_classes)`: `ResNet` on the input with normalised y and x channels appended.

    The coordinates are a buffer (not a parameter, not in the state dict), so the model has exactly
    the ResNet's parameters plus the stem's kernels for the two extra channels.
    """

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
        self.img_size = check_size("img_size", img_size)  # (H, W)
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.resnet = ResNet(img_size=self.img_size, in_chans=in_chans + 2, num_classes=num_classes, widths=widths,
                             blocks_per_stage=blocks_per_stage)
        self.register_buffer("coords", coord_channels(self.img_size), persistent=False)  # (2, H, W)

    def add_coords(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, C, H, W) -> (B, C + 2, H, W)`: the input followed by its row and column channels."""
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size)
        coords = self.coords.to(x.dtype).expand(x.shape[0], -1, -1, -1)  # (B, 2, H, W)
        return torch.cat([x, coords], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnet(self.add_coords(x))
