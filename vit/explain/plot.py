"""Relevance maps drawn over their images: one overlay, and a grid of images x methods.

Matplotlib is imported inside the functions, so importing `vit.explain` stays light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from vit.explain.rollout import minmax

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure


def overlay(
    image: Tensor, patch_map: Tensor, alpha: float = 0.5, cmap: str = "jet"
) -> np.ndarray:
    """Blend a patch map `(gh, gw)` over an image `(C, H, W)`; returns `(H, W, 3)` floats in [0, 1].

    The map is min-max scaled (`vit.explain.rollout.minmax`: where the relevance is, relative to the
    rest of this image), upsampled bilinearly to the image size and coloured with `cmap`, so the
    maps of `relevance` (which sum to 1) can be passed as they are. The image is min-max scaled
    too, so normalised network inputs can be passed as they are; one channel is shown as grayscale.
    """
    import matplotlib

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    patch_map = torch.as_tensor(patch_map)
    if patch_map.ndim != 2:
        raise ValueError(f"patch_map must have shape (gh, gw), got {tuple(patch_map.shape)}")
    rgb = _display_image(image)  # (H, W, 3)
    H, W, _ = rgb.shape
    heat = F.interpolate(
        minmax(patch_map.detach().cpu().float()[None, None]), size=(H, W), mode="bilinear",
        align_corners=False,
    )[0, 0].clamp(0.0, 1.0)  # (H, W); bilinear stays in [0, 1] up to rounding
    colours = matplotlib.colormaps[cmap](heat.numpy())[..., :3]  # (H, W, 3), drop alpha channel
    return ((1.0 - alpha) * rgb + alpha * colours).astype("float32")


def rollout_grid(
    images: Tensor, maps: Mapping[str, Tensor], titles: Sequence[str] | None = None
) -> Figure:
    """A figure with one row per image: the image, then its overlay for each map in `maps`.

    Args:
        images: `(B, C, H, W)`.
        maps: column name -> patch maps `(B, gh, gw)`, e.g. {"rollout": ..., "grad rollout": ...};
            each map is drawn min-max scaled (`overlay`).
        titles: optional per-row title shown above each image (e.g. label and prediction).

    Built on `matplotlib.figure.Figure`, not pyplot, so it needs no display and leaves no global
    figure state behind (safe in a Lightning callback).
    """
    from matplotlib.figure import Figure

    if images.ndim != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    B = images.shape[0]
    if not maps:
        raise ValueError("maps must hold at least one (B, gh, gw) map")
    for name, patch_maps in maps.items():
        if patch_maps.ndim != 3 or patch_maps.shape[0] != B:
            raise ValueError(
                f"maps[{name!r}] must have shape (B={B}, gh, gw), got {tuple(patch_maps.shape)}"
            )
    if titles is not None and len(titles) != B:
        raise ValueError(f"titles must hold one title per image ({B}), got {len(titles)}")

    cols = 1 + len(maps)
    fig = Figure(figsize=(2.0 * cols, 2.0 * B), layout="constrained")
    axes = fig.subplots(B, cols, squeeze=False)
    for row in range(B):
        axes[row, 0].imshow(_display_image(images[row]))
        if titles is not None:
            axes[row, 0].set_title(titles[row], fontsize="small")
        elif row == 0:
            axes[row, 0].set_title("image", fontsize="small")
        for col, (name, patch_maps) in enumerate(maps.items(), start=1):
            axes[row, col].imshow(overlay(images[row], patch_maps[row]))
            if row == 0:
                axes[row, col].set_title(name, fontsize="small")
    for ax in axes.flat:
        ax.set_axis_off()
    return fig


def _display_image(image: Tensor) -> np.ndarray:
    """`(C, H, W)` with C in {1, 3} -> `(H, W, 3)` floats in [0, 1], min-max over the image."""
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"image must have shape (C, H, W) with C 1 or 3, got {tuple(image.shape)}")
    image = image.detach().cpu().float()
    # One range for all channels keeps the colour balance of normalised inputs roughly intact.
    lo, span = image.min(), image.max() - image.min()
    image = (image - lo) / span if span > 0 else torch.zeros_like(image)
    return image.expand(3, -1, -1).permute(1, 2, 0).numpy()  # (H, W, 3)
