"""Scores for relevance maps: do they point at the ground truth, and do they say what the model uses?
Localisation, against masks: the pointing game (Zhang et al. 2016), relevance mass, average precision. Faithfulness:
deletion and insertion curves (Petsiuk et al. 2018). Sanity (Adebayo et al. 2018): `rank_correlation` of maps before and
after the weights are randomised."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vit.explain.relevance import to_pixels


def pointing_game(maps: Tensor, masks: Tensor) -> Tensor:
    """`(B,)` 1.0 where the most relevant cell of `maps (B, gh, gw)` overlaps the mask `(B, H, W)`, else 0.0."""
    hits = F.adaptive_max_pool2d(masks[:, None].float(), maps.shape[-2:]).flatten(1) > 0  # (B, gh * gw): any pixel
    top = maps.flatten(1).argmax(1)  # (B,)
    return hits.gather(1, top[:, None])[:, 0].float()


def relevance_mass(maps: Tensor, masks: Tensor) -> Tensor:
    """`(B,)` share of each map's relevance (spread evenly over each cell's pixels) inside the mask."""
    pixels = to_pixels(maps, masks.shape[-2:])  # (B, H, W)
    total, inside = pixels.flatten(1).sum(1), (pixels * masks.float()).flatten(1).sum(1)
    return torch.where(total > 0, inside / total.clamp(min=1e-12), torch.zeros_like(total))


def average_precision(maps: Tensor, masks: Tensor) -> Tensor:
    """`(B,)` average precision of the pixel relevance as a score for "this pixel is on an object"."""
    from sklearn.metrics import average_precision_score

    pixels = to_pixels(maps, masks.shape[-2:]).flatten(1).numpy()
    truth = masks.flatten(1).numpy()
    return torch.tensor([average_precision_score(t, p) if t.any() else float("nan") for t, p in zip(truth, pixels)])


@torch.no_grad()
def deletion_insertion(
    model: nn.Module,
    images: Tensor,
    maps: Tensor,
    *,
    background: float | Tensor = 0.0,
    target: Tensor | None = None,
    steps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`(deletion AUC, insertion AUC)`, each `(B,)`: the target's probability as the map's cells go, or come, in
    relevance order, at `steps + 1` points (default: one cell at a time); trapezoids over the fraction of cells."""
    (B, _, H, W), (gh, gw) = images.shape, maps.shape[-2:]
    cells = gh * gw
    steps = cells if steps is None else steps
    model.eval()
    if target is None:
        target = model(images).argmax(-1)
    order = maps.flatten(1).argsort(dim=1, descending=True)  # (B, cells), most relevant first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(cells).expand(B, cells))  # rank of each cell
    rank_pixels = F.interpolate(rank.view(B, 1, gh, gw).float(), size=(H, W), mode="nearest")  # (B, 1, H, W)
    fill = torch.as_tensor(background, dtype=images.dtype).expand_as(images)
    counts, deletion, insertion = torch.linspace(0, cells, steps + 1).round(), [], []
    for k in counts:
        removed = rank_pixels < k  # the k most relevant cells
        for curve, x in (
            (deletion, torch.where(removed, fill, images)),
            (insertion, torch.where(removed, images, fill)),
        ):
            curve.append(model(x).softmax(-1).gather(1, target[:, None])[:, 0])
    fraction = (counts / cells).numpy()
    auc = [torch.from_numpy(np.trapezoid(torch.stack(c, 1).numpy(), fraction, axis=1)) for c in (deletion, insertion)]
    return auc[0].float(), auc[1].float()


def rank_correlation(maps_a: Tensor, maps_b: Tensor) -> Tensor:
    """`(B,)` Spearman rank correlation between two methods' (or models') maps of the same images."""
    from scipy.stats import spearmanr

    return torch.tensor(
        [spearmanr(a, b).statistic for a, b in zip(maps_a.flatten(1).numpy(), maps_b.flatten(1).numpy())]
    )
