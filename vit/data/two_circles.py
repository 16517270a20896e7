"""Two-circles images whose class is a spatial relation between two distant circles: no local patch tells the class.
A centre is ``(row, col)`` in pixel units (pixel ``(i, j)`` is centred at ``(i + 0.5, j + 0.5)``); a circle of
radius ``r`` covers the pixels closer than ``r + 0.5`` to its centre (``circle_masks``).

* ``task="diagonal"``: two identical filled discs, each inside one quadrant. Label 1: quadrants {top-left,
  bottom-right}; label 0: any of the other five pairs of distinct quadrants, drawn uniformly.
* ``task="relative"``: a filled disc A and a ring B ``RING_WIDTH`` px wide, anywhere. Label 1 iff A is above and
  to the left of B; label 0 the other three sign combinations. Centres differ by at least ``r`` on each axis.

Placement region (``region``), for generalisation to unseen positions. A circle's *area* is its quadrant
(``"diagonal"``) or the whole image (``"relative"``); ``e`` is the distance from its centre to the nearest side
of its area, and ``t = (radius[1] + img_size / 4) / 2`` (``region_threshold``; 6.5 for 32x32 and radius (3, 5)).
``"all"``: every centre that keeps the circle inside its area (``e >= r``); ``"inner"``: ``e >= t``, the middle
square of the area; ``"border"``: ``e < t``, the band along its sides. "inner" and "border" partition "all"."""

from typing import Literal, get_args

import numpy as np
import torch
from torch.utils.data import Dataset

from vit.checks import check_choice, check_size
from vit.data.base import SyntheticDataModule, balanced_labels, check_pixel_options, noisy_images, seeded_rng

Task = Literal["diagonal", "relative"]
CircleRegion = Literal["all", "inner", "border"]  # where the circles may be: anywhere, the inner square, the border
TASKS: tuple[str, ...] = get_args(Task)
REGIONS: tuple[str, ...] = get_args(CircleRegion)

RING_WIDTH = 1.5
# Quadrant q sits at row q // 2, column q % 2: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right.
POSITIVE_PAIR = (0, 3)
NEGATIVE_PAIRS = ((0, 1), (0, 2), (1, 2), (1, 3), (2, 3))
# Sign of (row_B - row_A, col_B - col_A): A above-left of B is the positive class.
POSITIVE_SIGNS = (1, 1)
NEGATIVE_SIGNS = ((1, -1), (-1, 1), (-1, -1))

CLASS_NAMES = {"diagonal": ["not_diagonal", "diagonal"], "relative": ["not_above_left", "above_left"]}

_MAX_ROUNDS = 1000  # rejection-sampling rounds before a placement is infeasible


def check_circle_options(
    *, task: str, img_size: int | tuple[int, int], in_chans: int, radius: tuple[int, int], noise: float, region: str
) -> int:
    """Validate the image options shared by the dataset and the datamodule (ValueError if bad); the image's side."""
    check_choice("task", task, Task)
    check_choice("region", region, CircleRegion)
    height, width = check_size("img_size", img_size, 8)
    if height != width:
        raise ValueError(
            f"img_size={img_size!r} is not allowed for two-circles: expected a square (one int), because "
            "its quadrants and inner/border regions are defined on a square image; same_different and "
            "image folders take [H, W]"
        )
    img_size = height
    if img_size % 2:
        raise ValueError(
            f"img_size={img_size!r} is not allowed: expected an even int, so that "
            "the midlines fall between pixels and each quadrant is unambiguous"
        )
    check_pixel_options(in_chans=in_chans, noise=noise)
    try:
        r_min, r_max = radius
    except (TypeError, ValueError):
        r_min = r_max = None  # not two values: refused below
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in (r_min, r_max)):
        raise ValueError(f"radius={radius!r} is not allowed: expected two ints (min, max)")
    min_radius = 3 if task == "relative" else 1  # a ring needs r >= 3 for a dark centre pixel
    if not min_radius <= r_min <= r_max:
        raise ValueError(
            f"radius={radius!r} is not allowed for task={task!r}: expected {min_radius} <= radius[0] <= radius[1]"
        )
    half = img_size // 2
    # A circle must fit in a quadrant; moving it around (inner vs border) needs strict room.
    limit = half // 2 if region == "all" else (half - 1) // 2
    if r_max > limit:
        raise ValueError(
            f"radius={radius!r} is too large for img_size={img_size} and region={region!r}: a circle "
            f"must fit inside a {half}x{half} quadrant{'' if region == 'all' else ' with room to move'}, "
            f"so radius[1] <= {limit}"
        )
    return img_size


def region_threshold(img_size: int, radius: tuple[int, int]) -> float:
    """Distance ``t`` to the nearest side of the area that separates "border" from "inner" centres."""
    return (radius[1] + img_size / 4) / 2


def distance_to_area_side(centers: torch.Tensor, img_size: int, task: str) -> torch.Tensor:
    """Distance ``e`` from each centre ``(..., 2)`` to the nearest side of its quadrant or image."""
    check_choice("task", task, TASKS)
    area = img_size // 2 if task == "diagonal" else img_size
    u = torch.remainder(centers, area) if task == "diagonal" else centers
    return torch.minimum(u, area - u).amin(dim=-1)  # (...)


def _sample_in_area(rng: np.random.Generator, radii: np.ndarray, area: int, region: str, t: float) -> np.ndarray:
    """Centres ``(n, 2)`` uniform over the allowed, region-restricted square of side ``area``."""
    n = len(radii)
    r = radii[:, None].astype(np.float64)  # (n, 1)
    centers, todo = np.empty((n, 2)), np.arange(n)
    for _ in range(_MAX_ROUNDS):
        rt = r[todo]
        proposal = rt + rng.random((len(todo), 2)) * (area - 2 * rt)  # (m, 2)
        e = np.minimum(proposal, area - proposal).min(axis=1)  # (m,)
        ok = {"all": np.ones_like(e, dtype=bool), "inner": e >= t, "border": e < t}[region]
        centers[todo[ok]] = proposal[ok]
        todo = todo[~ok]
        if len(todo) == 0:
            return centers
    raise ValueError(f"could not place circles of radius {radii.max()} in region={region!r} of a {area}x{area} area")


def _sample_diagonal(
    rng: np.random.Generator, labels: np.ndarray, radii: np.ndarray, img_size: int, region: str, t: float
) -> np.ndarray:
    """Centres ``(n, 2, 2)`` of two circles in the quadrant pair that ``labels`` asks for."""
    half = img_size // 2
    negatives = np.asarray(NEGATIVE_PAIRS)[rng.integers(len(NEGATIVE_PAIRS), size=len(labels))]
    pairs = np.where(labels[:, None] == 1, np.asarray(POSITIVE_PAIR), negatives)  # (n, 2)
    origins = np.stack([pairs // 2, pairs % 2], axis=-1) * half  # (n, 2, 2) quadrant corners
    local = np.stack([_sample_in_area(rng, radii, half, region, t) for _ in range(2)], axis=1)
    return origins + local  # (n, 2, 2)


def _sample_relative(
    rng: np.random.Generator, labels: np.ndarray, radii: np.ndarray, img_size: int, region: str, t: float
) -> np.ndarray:
    """Centres ``(n, 2, 2)`` of disc A and ring B, with A above-left of B iff the label is 1."""
    n = len(labels)
    centers, todo = np.empty((n, 2, 2)), np.arange(n)
    for _ in range(_MAX_ROUNDS):
        r = radii[todo]
        a, b = _sample_in_area(rng, r, img_size, region, t), _sample_in_area(rng, r, img_size, region, t)
        d = b - a  # (m, 2)
        ok = (np.abs(d).min(axis=1) >= r) & (np.hypot(d[:, 0], d[:, 1]) >= 2 * r + 2)
        centers[todo[ok]] = np.stack([a[ok], b[ok]], axis=1)
        todo = todo[~ok]
        if len(todo) == 0:
            break
    else:
        raise ValueError(
            f"could not place two separated circles of radius {radii.max()} in "
            f"region={region!r} of a {img_size}x{img_size} image"
        )
    # Mirroring both circles about a midline flips the sign of one offset and keeps every constraint.
    negatives = np.asarray(NEGATIVE_SIGNS)[rng.integers(len(NEGATIVE_SIGNS), size=n)]
    signs = np.where(labels[:, None] == 1, np.asarray(POSITIVE_SIGNS), negatives)  # (n, 2)
    flip = np.sign(centers[:, 1] - centers[:, 0]) != signs  # (n, 2) per axis
    return np.where(flip[:, None, :], img_size - centers, centers)


def circle_masks(centers: torch.Tensor, radii: torch.Tensor, img_size: int) -> torch.Tensor:
    """Pixels ``(N, H, W)`` that circles ``centers (N, K, 2)``, ``radii (N,)`` may ink (ring holes included)."""
    grid = torch.arange(img_size, dtype=torch.float32) + 0.5  # (H,) pixel centres
    dy, dx = (grid[None, None, :] - centers[..., i, None].float() for i in (0, 1))  # (N, K, H), (N, K, W)
    dist2 = dy[..., :, None] ** 2 + dx[..., None, :] ** 2  # (N, K, H, W)
    return (dist2 < (radii.float()[:, None, None, None] + 0.5) ** 2).any(dim=1)  # (N, H, W)


def render_circles(centers: torch.Tensor, radii: torch.Tensor, img_size: int, task: str) -> torch.Tensor:
    """Noiseless anti-aliased images ``(N, H, W)`` in [0, 1] of the two circles ``(N, 2, 2)`` of each sample: filled
    discs for ``"diagonal"``; the second a ring ``RING_WIDTH`` px wide for ``"relative"``. Circles must not overlap."""
    check_choice("task", task, TASKS)
    n = len(centers)
    out = torch.zeros(n * img_size * img_size)
    if n == 0:
        return out.view(0, img_size, img_size)
    side = min(2 * int(radii.max()) + 3, img_size)  # P: covers every pixel within r + 0.5
    offsets, r = torch.arange(side), radii.float()[:, None, None]  # (P,), (N, 1, 1)
    first_pixel = torch.arange(n)[:, None, None] * img_size * img_size  # (N, 1, 1)
    for k in range(2):
        c = centers[:, k].float()  # (N, 2)
        corner = (c.floor().long() - side // 2).clamp(0, img_size - side)  # (N, 2) patch top-left
        rows, cols = corner[:, 0, None] + offsets, corner[:, 1, None] + offsets  # (N, P) each
        dy, dx = rows + 0.5 - c[:, 0, None], cols + 0.5 - c[:, 1, None]  # (N, P) each
        dist = torch.sqrt(dy[:, :, None] ** 2 + dx[:, None, :] ** 2)  # (N, P, P)
        if task == "relative" and k == 1:  # a band of width RING_WIDTH whose outer edge is the radius
            ink = (RING_WIDTH / 2 + 0.5 - (dist - (r - RING_WIDTH / 2)).abs()).clamp(0, 1)
        else:
            ink = (r + 0.5 - dist).clamp(0, 1)  # (N, P, P)
        index = first_pixel + rows[:, :, None] * img_size + cols[:, None, :]  # (N, P, P)
        out.index_add_(0, index.flatten(), ink.flatten())
    return out.view(n, img_size, img_size)


class TwoCirclesDataset(Dataset):
    """In-memory two-circles images, deterministic in ``seed``: float32 ``(C, H, W)``, ink 1 on 0 plus Gaussian noise
    of std ``noise``; int64 labels, exactly balanced. ``centers`` ``(N, 2, 2)`` ``(row, col)`` (circle 0: the disc A,
    or in the lower-numbered quadrant); ``radii`` ``(N,)``, uniform in the inclusive ``radius``, shared by both."""

    def __init__(
        self,
        *,
        num_samples: int,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 1,
        radius: tuple[int, int] = (3, 5),
        noise: float = 0.05,
        task: Task = "diagonal",
        region: CircleRegion = "all",
        seed: int = 0,
    ) -> None:
        rng = seeded_rng(num_samples, seed)
        img_size = check_circle_options(
            task=task, img_size=img_size, in_chans=in_chans, radius=radius, noise=noise, region=region
        )  # [32, 32] -> 32
        self.task, self.region, self.img_size, self.in_chans = task, region, img_size, in_chans
        self.radius, self.noise, self.seed = tuple(radius), float(noise), seed
        labels, radii = balanced_labels(rng, num_samples), rng.integers(radius[0], radius[1] + 1, size=num_samples)
        sample = _sample_diagonal if task == "diagonal" else _sample_relative
        centers = sample(rng, labels, radii, img_size, region, region_threshold(img_size, radius))  # (N, 2, 2)
        self.labels, self.radii = torch.from_numpy(labels).long(), torch.from_numpy(radii).long()  # (N,) each
        self.centers = torch.from_numpy(centers).float()  # (N, 2, 2)
        images = render_circles(self.centers, self.radii, img_size, task)  # (N, H, W)
        self.images = noisy_images(images, noise=noise, in_chans=in_chans, rng=rng)  # (N, C, H, W)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def circle_mask(self, i: int) -> torch.Tensor:
        """Pixels ``(H, W)`` covered by either circle of sample ``i`` (ring holes included)."""
        return circle_masks(self.centers[i : i + 1], self.radii[i : i + 1], self.img_size)[0]


class TwoCirclesDataModule(SyntheticDataModule):
    """Train, val and test splits of ``TwoCirclesDataset`` (``SyntheticDataModule``)."""

    def __init__(
        self,
        *,
        task: Task = "diagonal",
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 1,
        radius: tuple[int, int] = (3, 5),
        noise: float = 0.05,
        num_train: int = 10_000,
        num_val: int = 1_000,
        num_test: int = 2_000,
        train_region: CircleRegion = "all",
        test_region: CircleRegion = "all",
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for region_name, region in (("train_region", train_region), ("test_region", test_region)):
            check_choice(region_name, region, CircleRegion)
            check_circle_options(
                task=task, img_size=img_size, in_chans=in_chans, radius=radius, noise=noise, region=region
            )
        self.check_sizes(
            num_train=num_train,
            num_val=num_val,
            num_test=num_test,
            seed=seed,
            batch_size=batch_size,
            num_workers=num_workers,
        )
        self.save_hyperparameters()

    @property
    def class_names(self) -> list[str]:
        """Label 1 is the relation (`diagonal`: circles top-left and bottom-right; `relative`: A above-left of B)."""
        return CLASS_NAMES[self.hparams.task]

    def make_split(self, split: str, num_samples: int, region: str) -> TwoCirclesDataset:
        hp = self.hparams
        return TwoCirclesDataset(
            num_samples=num_samples,
            img_size=hp.img_size,
            in_chans=hp.in_chans,
            radius=tuple(hp.radius),
            noise=hp.noise,
            task=hp.task,
            region=region,
            seed=self.split_seeds()[split],
        )
