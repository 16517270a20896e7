"""Relevance maps drawn over their images in colour: one overlay, and a grid of images x methods with colour bars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from vit.checks import check_choice
from vit.explain.methods import SCALES, ColourScale
from vit.explain.rollout import minmax

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

PANEL_INCHES = 3.0  # each image and overlay of `rollout_grid` is this many inches square
COLORBAR_INCHES = 0.75  # the width `rollout_grid` adds for its colour bars
CMAP = "inferno"  # perceptually uniform and readable in grey print, unlike jet
ALPHA = 0.6  # of the colour map over the image


def overlay(image: Tensor, patch_map: Tensor, alpha: float = ALPHA) -> np.ndarray:
    """`(H, W, 3)` floats in [0, 1]: a patch map `(gh, gw)`, upsampled bilinearly and coloured from its min to its max,
    over `display_image(image)`: pytorch-grad-cam's `show_cam_on_image` (image_weight=1 - alpha), less its `/ max`."""
    import matplotlib
    from matplotlib.colors import Normalize

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    rgb = display_image(image)  # (H, W, 3)
    heat = _upsample(patch_map, rgb.shape[:2]).numpy()  # (H, W)
    norm = Normalize(*_limits([torch.as_tensor(patch_map)]), clip=True)
    colours = matplotlib.colormaps[CMAP](norm(heat))[..., :3]  # (H, W, 3), drop alpha
    return ((1.0 - alpha) * rgb + alpha * colours).astype("float32")


def rollout_grid(
    images: Tensor, maps: Mapping[str, Tensor], titles: Sequence[str] | None = None, scale: ColourScale = "row"
) -> Figure:
    """A `matplotlib.figure.Figure` (not pyplot's: safe in a callback), one row per image `(B, C, H, W)`: the image
    (`display_image`), titled by `titles`, then each of `maps` (column name -> `(B, gh, gw)`) over it, and colour bars.
    `scale`: a `"row"`'s maps or the whole `"figure"`'s share one colour scale; `"panel"` stretches each map alone."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.figure import Figure

    _check_grid(images, maps, titles, scale)
    B, _, H, W = images.shape
    # The limits are the patch maps' own: bilinear upsampling stays within them.
    rows = [[m[row].detach().cpu().float() for m in maps.values()] for row in range(B)]
    norms = _grid_norms(rows, len(maps), scale)

    cols = 1 + len(maps)
    fig = Figure(figsize=(PANEL_INCHES * cols + COLORBAR_INCHES, PANEL_INCHES * B), layout="constrained")
    axes = fig.subplots(B, cols, squeeze=False)
    for row in range(B):
        rgb = display_image(images[row])  # (H, W, 3)
        axes[row, 0].imshow(rgb)
        if titles is not None or row == 0:
            axes[row, 0].set_title("image" if titles is None else titles[row], fontsize="small")
        for col, (name, patch_map, norm) in enumerate(zip(maps, rows[row], norms[row]), start=1):
            axes[row, col].imshow(rgb)
            axes[row, col].imshow(_upsample(patch_map, (H, W)).numpy(), cmap=CMAP, norm=norm, alpha=ALPHA)
            if row == 0:
                axes[row, col].set_title(name, fontsize="small")
        if scale == "row":  # the bars are opaque: the colours as they are, not blended with the image
            fig.colorbar(
                ScalarMappable(norm, CMAP), ax=axes[row, 1:], shrink=0.9, label="relevance per patch (this row)"
            )
    _shared_colorbar(fig, axes, norms, scale)
    for ax in axes.flat:
        ax.set_axis_off()
    return fig


def _check_grid(images: Tensor, maps: Mapping[str, Tensor], titles: Sequence[str] | None, scale: ColourScale) -> None:
    """Check `rollout_grid`'s arguments: images `(B, C, H, W)`, maps `(B, gh, gw)`, one title per image, the scale."""
    if images.ndim != 4:
        raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
    B = images.shape[0]
    if not maps:
        raise ValueError("maps must hold at least one (B, gh, gw) map")
    for name, patch_maps in maps.items():
        if patch_maps.ndim != 3 or patch_maps.shape[0] != B:
            raise ValueError(f"maps[{name!r}] must have shape (B={B}, gh, gw), got {tuple(patch_maps.shape)}")
    if titles is not None and len(titles) != B:
        raise ValueError(f"titles must hold one title per image ({B}), got {len(titles)}")
    check_choice("scale", scale, SCALES)


def _grid_norms(rows: list[list[Tensor]], n_maps: int, scale: ColourScale) -> list[list[Normalize]]:
    """The colour scale of each map of each row: one for the figure, one per row, or each map's own."""
    from matplotlib.colors import Normalize

    if scale == "figure":
        return [[Normalize(*_limits([m for r in rows for m in r], from_zero=True))] * n_maps] * len(rows)
    if scale == "row":
        return [[Normalize(*_limits(r, from_zero=True))] * n_maps for r in rows]
    return [[Normalize(*_limits([m])) for m in r] for r in rows]


def _shared_colorbar(fig: Figure, axes: np.ndarray, norms: list[list[Normalize]], scale: ColourScale) -> None:
    """The one colour bar beside all the maps: the figure's scale, or a min-to-max bar for per-panel scales."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    if scale == "figure":
        norm = norms[0][0]  # one scale, shared by every map
        fig.colorbar(ScalarMappable(norm, CMAP), ax=axes[:, 1:], shrink=0.6, label="relevance per patch (one scale)")
    elif scale == "panel":
        bar = fig.colorbar(
            ScalarMappable(Normalize(0.0, 1.0), CMAP),
            ax=axes[:, 1:],
            shrink=0.6,
            label="each map from its own min to its max",
        )
        bar.set_ticks([0.0, 1.0], labels=["min", "max"])


def _upsample(patch_map: Tensor, size: tuple[int, int]) -> Tensor:
    """A patch map `(gh, gw)` upsampled bilinearly to `size` `(H, W)`, as floats on the CPU."""
    patch_map = torch.as_tensor(patch_map)
    if patch_map.ndim != 2:
        raise ValueError(f"patch_map must have shape (gh, gw), got {tuple(patch_map.shape)}")
    return F.interpolate(
        patch_map.detach().cpu().float()[None, None], size=tuple(size), mode="bilinear", align_corners=False
    )[0, 0]  # (H, W)


def _limits(maps: Sequence[Tensor], from_zero: bool = False) -> tuple[float, float]:
    """`(vmin, vmax)` over `maps`; from 0 when asked (relevance is a share, so 0 means none), never an empty range."""
    lo, hi = min(float(m.min()) for m in maps), max(float(m.max()) for m in maps)
    lo = min(lo, 0.0) if from_zero else lo
    return (lo, hi) if hi > lo else (lo, lo + 1.0)


def display_image(image: Tensor) -> np.ndarray:
    """`(C, H, W)`, C 1 or 3 -> `(H, W, 3)` floats: as it is in [0, 1] (decoded), else min-max over all channels."""
    if image.ndim != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"image must have shape (C, H, W) with C 1 or 3, got {tuple(image.shape)}")
    image = image.detach().cpu().float()  # one range for all channels keeps a normalised image's colour balance
    image = image if 0 <= image.min() and image.max() <= 1 else minmax(image[None])[0]
    return image.expand(3, -1, -1).permute(1, 2, 0).numpy()  # (H, W, 3)
