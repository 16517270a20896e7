"""The input contract every backbone shares: `(B, in_chans, H, W)` floats of the weights' dtype, `img_size = (H, W)`."""

from __future__ import annotations

import torch


def check_image_batch(
    x: torch.Tensor, *, in_chans: int, img_size: tuple[int, int], dtype: torch.dtype | None = None
) -> None:
    """`ValueError` naming what was expected and what came unless `x` fits the model (`dtype` not under autocast)."""
    H, W = img_size
    if x.ndim != 4 or x.shape[1] != in_chans or x.shape[2:] != (H, W):
        raise ValueError(f"expected input of shape (B, {in_chans}, {H}, {W}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(
            f"expected a floating-point input, got {x.dtype}: images as integers must be scaled first, "
            "e.g. x.float() / 255 for 8-bit pixels"
        )
    if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(
            f"input dtype {x.dtype} does not match the model's weights ({dtype}): convert the input "
            f"with x.to({dtype}), or the model with model.to({x.dtype}), or run under torch.autocast"
        )
