"""A small ResNet for small images: the convolutional baseline the ViT is compared with."""

from __future__ import annotations

import torch
from torch import nn

from vit.checks import check_size
from vit.models.contract import Backbone, ToMaps
from vit.models.inputs import check_image_batch


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_chs: int, out_chs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_chs, out_chs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_chs)
        self.conv2 = nn.Conv2d(out_chs, out_chs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_chs)
        self.act = nn.ReLU(inplace=True)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and in_chs == out_chs
            else nn.Sequential(nn.Conv2d(in_chs, out_chs, 1, stride=stride, bias=False), nn.BatchNorm2d(out_chs))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.act(y + self.shortcut(x))


class ResNet(Backbone):
    """`(B, C, H, W) -> (B, num_classes)`: a 3x3 stem (no max-pool: the CIFAR variant of He et al. 2016), stages of
    basic blocks, each after the first halving the resolution, then global average pooling."""

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
        if not widths or any(w < 1 for w in widths):
            raise ValueError(f"widths={widths} must be a non-empty tuple of positive ints")
        for name, value in (
            ("in_chans", in_chans),
            ("num_classes", num_classes),
            ("blocks_per_stage", blocks_per_stage),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.img_size, self.in_chans, self.num_classes = check_size("img_size", img_size), in_chans, num_classes
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True)
        )
        stages, in_chs = [], widths[0]
        for i, width in enumerate(widths):
            blocks = [BasicBlock(in_chs, width, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(width, width) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            in_chs = width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_chs, num_classes)

    def gradcam_target(self) -> tuple[nn.Module, ToMaps]:
        return self.stages, lambda fmap: fmap  # the last stage's feature map, before pooling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size, dtype=self.stem[0].weight.dtype)
        x = self.stages(self.stem(x))  # (B, C_last, H / 2^(S-1), W / 2^(S-1))
        return self.head(self.pool(x).flatten(1))  # (B, num_classes)
