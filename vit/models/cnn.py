"""A plain CNN whose receptive field is a parameter: the local view of the study, made measurable.

``conv (k x k, stride s) -> BatchNorm -> ReLU`` layers, then global pooling and a head. The readout decides
what a local view can do with a relation (studies/relation/README.md):

* ``pool="avg"``, ``head="linear"`` (the default): the logit is a sum over units, additive over parts no unit
  sees together, ``h(a) + h(b)``; on same/different pairs no such rule beats ``bag_of_shapes_ceiling``.
* ``pool="max"``: one-part detectors report *which* parts are present, not how many: "one kind present"
  against "two kinds present" is linearly separable with no unit that sees both parts.
* ``head="mlp"``: ``Linear(F, 2C) -> ReLU -> Linear(2C, num_classes)`` (``head.fc1``, ``head.fc2``): not additive.
* ``pool="flatten"``: the head reads the whole last map (``C x H' x W'`` features), weighing every unit by its place.

The last layer's receptive field: ``r <- r + (k - 1) * j``, ``j <- j * s`` from ``r = j = 1`` (``receptive_field``).
``padding``: ``"zero"`` lets a deep enough network read absolute position from the border (Islam et al. 2020);
``"circular"`` wraps the image around, so with average pooling the output depends only on the content's
arrangement modulo the image size; ``"valid"`` pads nothing, each layer shrinking the map by ``k - 1``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
from torch import nn

from vit.checks import check_choice, check_size
from vit.models.contract import Backbone, ToMaps
from vit.models.inputs import check_image_batch

Padding = Literal["zero", "circular", "valid"]
FeaturePool = Literal["avg", "max", "flatten"]  # how the last feature map is pooled (a ViT's Pool: which tokens)
Head = Literal["linear", "mlp"]


def receptive_field(kernel_sizes: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Side in input pixels of the square that one unit of the last layer sees (see the module doc)."""
    r, j = 1, 1
    for k, s in zip(kernel_sizes, strides, strict=True):
        r += (k - 1) * j
        j *= s
    return r


class ConvNet(Backbone):
    """`(B, C, H, W) -> (B, num_classes)`: ``len(widths)`` conv-BN-ReLU layers, global pooling, a head (module doc)."""

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        widths: tuple[int, ...] = (32, 32, 32),
        strides: tuple[int, ...] | None = None,
        kernel_size: int = 3,
        padding: Padding = "zero",
        pool: FeaturePool = "avg",
        head: Head = "linear",
    ) -> None:
        super().__init__()
        widths, strides = self._check_options(widths, strides, kernel_size, padding, pool, head)
        self.img_size, self.in_chans, self.num_classes = check_size("img_size", img_size), in_chans, num_classes
        self.widths, self.strides, self.kernel_size, self.padding = widths, strides, kernel_size, padding
        self.receptive_field = receptive_field((kernel_size,) * len(widths), strides)
        h, w = self._last_map_size(img_size)
        self.feature_size = (h, w)
        self.features = self._conv_layers()
        self.pool = {"avg": nn.AdaptiveAvgPool2d(1), "max": nn.AdaptiveMaxPool2d(1), "flatten": nn.Identity()}[pool]
        self.num_features = widths[-1] * (h * w if pool == "flatten" else 1)  # what the head reads
        in_chs = self.num_features
        if head == "linear":  # a bare Linear: the keys `head.weight`, `head.bias`
            self.head = nn.Linear(in_chs, num_classes)
        else:
            self.head = nn.Sequential(
                OrderedDict(
                    fc1=nn.Linear(in_chs, 2 * widths[-1]), act=nn.ReLU(), fc2=nn.Linear(2 * widths[-1], num_classes)
                )
            )

    @staticmethod
    def _check_options(
        widths: tuple[int, ...],
        strides: tuple[int, ...] | None,
        kernel_size: int,
        padding: Padding,
        pool: FeaturePool,
        head: Head,
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Check the padding, pool, head, widths, strides and kernel size; return `(widths, strides)` as tuples."""
        check_choice("padding", padding, Padding)
        check_choice("pool", pool, FeaturePool)
        check_choice("head", head, Head)
        widths = tuple(widths)
        strides = tuple(strides) if strides is not None else (1,) * len(widths)
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"widths={widths!r} is not allowed: expected a non-empty tuple of ints >= 1")
        if len(strides) != len(widths) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in strides):
            raise ValueError(f"strides={strides!r} is not allowed: expected {len(widths)} ints >= 1, one per width")
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={kernel_size!r} is not allowed: expected an odd int >= 1")
        return widths, strides

    def _last_map_size(self, img_size: int | tuple[int, int]) -> tuple[int, int]:
        """`(H', W')` of the last layer's map; `ValueError` when "valid" padding leaves none (`img_size` as given)."""
        h, w = self.img_size
        for s in self.strides:  # the last map's size: "zero"/"circular" pad by k // 2, "valid" not at all
            shrink = self.kernel_size - 1 if self.padding == "valid" else 0
            h, w = (h - shrink - 1) // s + 1, (w - shrink - 1) // s + 1
        if min(h, w) < 1:
            raise ValueError(
                f"padding='valid' leaves no output for img_size={img_size!r} with kernel_size="
                f"{self.kernel_size} and strides={self.strides}: use fewer layers or padding 'zero'/'circular'"
            )
        return h, w

    def _conv_layers(self) -> nn.Sequential:
        """The conv-BN-ReLU layers, one per width, padded as `padding` says (the keys `features.<i>.*`)."""
        layers, in_chs = [], self.in_chans
        for width, stride in zip(self.widths, self.strides):
            layers += [
                nn.Conv2d(
                    in_chs,
                    width,
                    self.kernel_size,
                    stride=stride,
                    bias=False,
                    padding=0 if self.padding == "valid" else self.kernel_size // 2,
                    padding_mode="circular" if self.padding == "circular" else "zeros",
                ),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            ]
            in_chs = width
        return nn.Sequential(*layers)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's feature map ``(B, widths[-1], H', W')``, before pooling."""
        check_image_batch(x, in_chans=self.in_chans, img_size=self.img_size, dtype=self.features[0].weight.dtype)
        return self.features(x)

    def gradcam_target(self) -> tuple[nn.Module, ToMaps]:
        return self.features, lambda fmap: fmap  # the last layer's feature map, before pooling

    def forward_head(self, fmap: torch.Tensor) -> torch.Tensor:
        """``(B, C, H', W') -> (B, num_classes)``: global pooling (none for "flatten"), then the head."""
        return self.head(self.pool(fmap).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))  # (B, num_classes)
