"""The input contract every backbone shares: `(B, in_chans, img_size, img_size)`."""

from __future__ import annotations

import torch


def check_image_batch(x: torch.Tensor, *, in_chans: int, img_size: int) -> None:
    """Raise a ValueError naming the expected and the actual shape when `x` does not fit the model."""
    if x.ndim != 4 or x.shape[1] != in_chans or x.shape[2:] != (img_size, img_size):
        raise ValueError(f"expected input of shape (B, {in_chans}, {img_size}, {img_size}), got {tuple(x.shape)}")
