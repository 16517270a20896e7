"""Same-different pairs: are the two shapes the same? A relation with no position shortcut.
Each image holds two of ``NUM_SHAPES`` strokes (``make_shapes``), placed independently anywhere, boxes never touching.
Label 1: the same pattern twice; label 0: two different ones (Kim, Ricci & Serre 2018). Each shape alone is uniform in
both classes, so a score ``h(a) + h(b)`` of the two shapes seen separately (a CNN with global average pooling) is
bounded by ``bag_of_shapes_ceiling`` (66.7% for 4 shapes).

``span``, the side of the smallest square that holds both boxes, is ``max(|d_row|, |d_col|) + SHAPE_SIZE``. ``region``:
``"all"`` places boxes anywhere, ``"left"`` / ``"right"`` in the left / right ``5/8`` of the columns."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from vit.checks import check_choice, check_int, check_size
from vit.data.base import SyntheticDataModule, balanced_labels, check_pixel_options, noisy_images, seeded_rng

Region = Literal["all", "left", "right"]

NUM_SHAPES = 4
SHAPE_SIZE = 5
SHAPE_PIXELS = 5
GAP = 1  # empty pixels at least between the two boxes


def make_shapes() -> np.ndarray:
    """The task's ``(NUM_SHAPES, SHAPE_SIZE, SHAPE_SIZE)`` bool patterns: the four strokes."""
    shapes = np.zeros((NUM_SHAPES, SHAPE_SIZE, SHAPE_SIZE), dtype=bool)
    mid = SHAPE_SIZE // 2
    shapes[0, mid, :] = True  # horizontal stroke
    shapes[1, :, mid] = True  # vertical stroke
    shapes[2] = np.eye(SHAPE_SIZE, dtype=bool)  # main diagonal
    shapes[3] = np.eye(SHAPE_SIZE, dtype=bool)[::-1]  # anti-diagonal
    return shapes


def bag_of_shapes_ceiling(num_shapes: int = NUM_SHAPES) -> float:
    """Best accuracy of any rule ``h(shape_a) + h(shape_b) > t`` on balanced same/different pairs: the best ``h`` marks
    ``m`` shapes, a pair "same" iff both are in them: ``max_m m / (2K) + (1 - m (m - 1) / (K (K - 1))) / 2``."""
    k = num_shapes
    return max(0.5, *(m / (2 * k) + (1 - m * (m - 1) / (k * (k - 1))) / 2 for m in range(1, k + 1)))


def column_range(region: str, width: int, size: int) -> tuple[int, int]:
    """Inclusive range of a box's left column for ``region`` in an image ``width`` columns wide."""
    band = width * 5 // 8
    return {"all": (0, width - size), "left": (0, band - size), "right": (width - band, width - size)}[region]


def sample_positions(
    rng: np.random.Generator, n: int, img_size: int | tuple[int, int], region: str = "all", size: int = SHAPE_SIZE
) -> np.ndarray:
    """Top-left corners ``(n, 2, 2)`` (sample, shape, (row, col)) of two non-touching boxes, uniform in ``region``."""
    height, width = check_size("img_size", img_size)
    c_lo, c_hi = column_range(region, width, size)
    out, todo = np.empty((n, 2, 2), dtype=np.int64), np.arange(n)
    for _ in range(1000):
        rows = rng.integers(0, height - size + 1, size=(len(todo), 2))
        cols = rng.integers(c_lo, c_hi + 1, size=(len(todo), 2))
        ok = np.maximum(np.abs(rows[:, 1] - rows[:, 0]), np.abs(cols[:, 1] - cols[:, 0])) >= size + GAP
        out[todo[ok]] = np.stack([rows[ok], cols[ok]], axis=-1)
        todo = todo[~ok]
        if len(todo) == 0:
            return out
    raise ValueError(f"could not place two {size}x{size} shapes in region={region!r} of a {height}x{width} image")


def render(
    positions: np.ndarray, shape_ids: np.ndarray, shapes: np.ndarray, img_size: int | tuple[int, int]
) -> np.ndarray:
    """Noiseless images ``(n, H, W)`` float32: 1 where a shape is on, 0 elsewhere."""
    n, size = len(positions), shapes.shape[-1]
    images = np.zeros((n, *check_size("img_size", img_size)), dtype=np.float32)
    idx, offs = np.arange(n)[:, None, None], np.arange(size)
    for k in range(2):
        rows = positions[:, k, 0, None, None] + offs[None, :, None]  # (n, S, 1)
        cols = positions[:, k, 1, None, None] + offs[None, None, :]  # (n, 1, S)
        images[idx, rows, cols] = shapes[shape_ids[:, k]]
    return images


class SameDifferentDataset(Dataset):
    """In-memory same-different images, deterministic in ``seed``: float32 ``(C, H, W)``, ink 1 on 0 plus Gaussian noise
    of std ``noise``; int64 labels (1: same), exactly balanced; ``positions`` (top-left), ``shape_ids``, ``span``."""

    def __init__(
        self,
        *,
        num_samples: int,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 1,
        noise: float = 0.05,
        region: Region = "all",
        held_out_shape: int | None = None,
        with_held_out: bool = False,
        seed: int = 0,
    ) -> None:
        rng = seeded_rng(num_samples, seed)
        check_stroke_options(img_size=img_size, in_chans=in_chans, noise=noise, region=region)
        if held_out_shape is not None:
            check_int("held_out_shape", held_out_shape, 0, NUM_SHAPES - 1)
        elif with_held_out:
            raise ValueError("with_held_out=True needs a held_out_shape (0-3): the pattern every pair then holds")
        self.img_size, self.in_chans, self.noise = img_size, in_chans, float(noise)
        self.region, self.seed, self.shapes = region, seed, make_shapes()
        positions, labels = sample_positions(rng, num_samples, img_size, region), balanced_labels(rng, num_samples)
        if held_out_shape is None:
            first = rng.integers(NUM_SHAPES, size=num_samples)
            other = (first + rng.integers(1, NUM_SHAPES, size=num_samples)) % NUM_SHAPES  # uniform over the others
        else:
            kept = np.array([k for k in range(NUM_SHAPES) if k != held_out_shape])
            if with_held_out:  # every pair holds the held-out pattern: twice ("same") or beside a kept one
                first = np.full(num_samples, held_out_shape)
                other = kept[rng.integers(len(kept), size=num_samples)]
            else:  # the held-out pattern never appears
                i = rng.integers(len(kept), size=num_samples)
                first, other = kept[i], kept[(i + rng.integers(1, len(kept), size=num_samples)) % len(kept)]
        shape_ids = np.stack([first, np.where(labels == 1, first, other)], axis=1)
        if held_out_shape is not None:  # which of the two slots holds which pattern: a fair coin
            swap = rng.integers(2, size=num_samples).astype(bool)
            shape_ids[swap] = shape_ids[swap, ::-1]
        images = torch.from_numpy(render(positions, shape_ids, self.shapes, img_size))  # (N, H, W)
        self.labels = torch.from_numpy(labels).long()
        self.positions = torch.from_numpy(positions)
        self.shape_ids = torch.from_numpy(shape_ids)
        self.span = (self.positions[:, 1] - self.positions[:, 0]).abs().amax(dim=1) + SHAPE_SIZE  # (N,)
        self.images = noisy_images(images, noise=noise, in_chans=in_chans, rng=rng)  # (N, C, H, W)

    def __len__(self) -> int:
        return len(self.labels)

    def token_labels(self, patch_size: int) -> torch.Tensor:
        """`(N, num_patches)` int64: each stroke's pattern id at the patch holding its centre pixel, -1 elsewhere."""
        height, width = check_size("img_size", self.img_size)
        rows, cols = height // patch_size, width // patch_size
        labels = torch.full((len(self), rows * cols), -1, dtype=torch.long)
        centres = self.positions + SHAPE_SIZE // 2  # (N, 2, 2): (row, col) of each stroke's centre
        tokens = (centres[..., 0] // patch_size) * cols + centres[..., 1] // patch_size  # (N, 2)
        labels.scatter_(1, tokens, self.shape_ids)
        return labels

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def check_stroke_options(*, img_size: int | tuple[int, int], in_chans: int, noise: float, region: str) -> None:
    """Validate the image options (ValueError naming the value and what is allowed)."""
    check_choice("region", region, Region)
    check_size("img_size", img_size, 4 * SHAPE_SIZE)  # a side, or [H, W]
    check_pixel_options(in_chans=in_chans, noise=noise)


class SameDifferentDataModule(SyntheticDataModule):
    """Train, val and test splits of ``SameDifferentDataset``. With ``held_out_shape`` (0-3), train and val never show
    that pattern and every test pair holds it, so only a model that compares the strokes passes."""

    def __init__(
        self,
        *,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 1,
        noise: float = 0.05,
        num_train: int = 10_000,
        num_val: int = 1_000,
        num_test: int = 2_000,
        train_region: Region = "all",
        test_region: Region = "all",
        held_out_shape: int | None = None,
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if held_out_shape is not None:
            check_int("held_out_shape", held_out_shape, 0, NUM_SHAPES - 1)
        for name, region in (("train_region", train_region), ("test_region", test_region)):
            check_choice(name, region, Region)
        check_stroke_options(img_size=img_size, in_chans=in_chans, noise=noise, region=train_region)
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
        """Label 0: two different patterns; label 1: the same pattern twice."""
        return ["different", "same"]

    def make_split(self, split: str, num_samples: int, region: str) -> SameDifferentDataset:
        hp = self.hparams
        return SameDifferentDataset(
            num_samples=num_samples,
            img_size=hp.img_size,
            in_chans=hp.in_chans,
            noise=hp.noise,
            region=region,
            held_out_shape=hp.get("held_out_shape"),
            with_held_out=split == "test" and hp.get("held_out_shape") is not None,
            seed=self.split_seeds()[split],
        )
