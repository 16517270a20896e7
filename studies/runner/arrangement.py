"""Arrangement pairs: is the line through two identical discs tilted clockwise or counter-clockwise?

Each image holds two identical discs (``DISC_SIZE`` x ``DISC_SIZE`` boxes, never touching). Their
displacement ``d = (d_row, d_col)`` has a major and a minor component; the line through the pair is
tilted from its nearest axis (the columns' if ``|d_col| > |d_row|``, the rows' otherwise).
Label 1 (``counterclockwise``), as seen on the screen (rows going down): a mostly horizontal pair
rising to the right, or a mostly vertical pair leaning right going down; label 0 (``clockwise``):
the mirror images. Pairs within ``MARGIN`` px of an axis or of a diagonal are never drawn, so every
label is unambiguous (``label_of`` is the rule). The label depends on ``d`` alone and not on its
sign: translating the pair keeps it, and so does swapping the two discs.

Why this relation, not "horizontal vs vertical" or "A left of B". A relation of positions that
is label-free in each disc's position *and* in the midpoint must leave the second moments of ``d``
the same in both classes: along any direction ``u``, ``E[(u.a)^2] + E[(u.b)^2] = 2 E[(u.m)^2] +
E[(u.d)^2] / 2`` for discs at ``a``, ``b``, midpoint ``m``, ``d = b - a``. Horizontal vs vertical
breaks it (``E[d_col^2 - d_row^2]`` is positive in one class, negative in the other: a first draw of
it gave 64% from one disc's pixel and 69% from the midpoint); "A left of B" breaks the first moment
(``E[col_A | A left] < E[col_B | A left] = E[col_A | B left]``). The tilt keeps them: each class
holds mostly horizontal and mostly vertical pairs alike, and the classes are mirror images.

Sampling, per sample (the label first, then the geometry given the label):

1. ``major`` uniform in ``[span_lo - DISC_SIZE, span_hi - DISC_SIZE]``, ``minor`` uniform in
   ``[MARGIN, major - MARGIN]``; the nearest axis (rows or columns) by a fair coin; the major
   component's sign by a fair coin, the minor's then set by the label;
2. the pair's bounding box placed uniformly where it fits in the region;
3. the pair kept with probability ``w[a] w[b] / max(w)^2`` (``placement_weights``), else drawn again.

Without step 3 one disc's pixel gives the label away near the borders (53-54% in the audit, and
55% for a linear readout of both discs' pixels): a disc on the left border has its partner to its
right, and the two tilts use the room along the border differently. The weights make the
disc marginal of each class the same mirror-symmetric map, to 1e-6, so one disc's position carries
nothing, by construction. What else holds by construction: a left-right mirror maps one class onto
the other (the clockwise class is drawn with the mirrored weights), so every statistic that a
mirror does not change has the same law in both classes: the span and the centre distance, the
ink (two discs of ``DISC_PIXELS``), the number of parts. In a square region each class is also
unchanged by a quarter turn, so which quadrants the two discs occupy is label-free too (an
unordered pair of quadrants and its mirror image are quarter turns of each other). The midpoint
is not fixed by construction; the shortcut audit (``studies/arrangement``) measures it with the rest.

``span`` is the side of the smallest square that holds both boxes, ``max(|d_row|, |d_col|) +
DISC_SIZE`` (as for ``same_different``): what a convolutional unit must see to hold both discs.
``max_span`` bounds it (train on short spans), ``min_span`` too (test beyond them). In a region
narrower than it is tall (``left``, ``right``: 5/8 of the columns, as for ``same_different``) the span
is bounded by the narrow side, for both nearest axes alike.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from vit.checks import check_choice, check_int, check_size
from vit.data.base import SyntheticDataModule, balanced_labels, check_pixel_options, noisy_images, seeded_rng
from vit.data.same_different import column_range
from vit.training.checkpoint.schema import allow_datamodule

Region = Literal["all", "left", "right"]

DISC_SIZE = 5
GAP = 1  # empty pixels at least between the two boxes
MARGIN = 2  # px at least between the displacement and an axis, and between its two components
CLASS_NAMES = ("clockwise", "counterclockwise")


def make_disc() -> np.ndarray:
    """The ``(DISC_SIZE, DISC_SIZE)`` bool disc: the box without its four corners."""
    disc = np.ones((DISC_SIZE, DISC_SIZE), dtype=bool)
    disc[[0, 0, -1, -1], [0, -1, 0, -1]] = False
    return disc


DISC_PIXELS = int(make_disc().sum())


def label_of(displacement: np.ndarray) -> np.ndarray:
    """The rule, from displacements ``(..., 2)`` (row, col): 0 clockwise, 1 counter-clockwise, -1 ambiguous.

    The pair's line is tilted from its nearest axis (the columns' if ``|d_col| > |d_row|``); on the
    screen (rows down) a mostly horizontal line is counter-clockwise when it rises to the right
    (``d_row * d_col < 0``), a mostly vertical one when it leans right going down (``d_row * d_col > 0``).
    Ambiguous: within ``MARGIN`` of an axis or of a diagonal.
    """
    dr, dc = displacement[..., 0], displacement[..., 1]
    major, minor = np.maximum(np.abs(dr), np.abs(dc)), np.minimum(np.abs(dr), np.abs(dc))
    ccw = (np.abs(dc) > np.abs(dr)) ^ (dr * dc > 0)
    return np.where((minor >= MARGIN) & (major - minor >= MARGIN), ccw.astype(np.int64), -1)


def span_limits(img_size: int | tuple[int, int], region: str) -> tuple[int, int]:
    """The smallest and largest span a pair can have in ``region``: the narrow side bounds both classes."""
    height, width = check_size("img_size", img_size)
    c_lo, c_hi = column_range(region, width, DISC_SIZE)
    return 2 * DISC_SIZE + GAP, min(height, c_hi - c_lo + DISC_SIZE)


def _displacements(lo: int, hi: int) -> list[tuple[tuple[int, int], float]]:
    """Every counter-clockwise displacement ``(d_row, d_col)`` with spans in ``[lo, hi]`` and its probability
    (step 1)."""
    majors = range(lo - DISC_SIZE, hi - DISC_SIZE + 1)
    out = []
    for major in majors:
        for minor in range(MARGIN, major - MARGIN + 1):
            p = 1 / (len(majors) * (major - 2 * MARGIN + 1) * 4)
            for sign in (-1, 1):  # the major component's; the minor's follows from the label
                # along the columns, the rows
                out += [((-sign * minor, sign * major), p), ((sign * major, sign * minor), p)]
    return out


@functools.lru_cache(maxsize=16)
def placement_weights(rows: int, cols: int, lo: int, hi: int) -> np.ndarray:
    """``(rows, cols)`` weights of a disc's top-left corner (region coordinates) for counter-clockwise pairs (step 3).

    A pair at ``a``, ``b`` is kept with probability ``w[a] w[b] / max(w)^2``: iterative proportional fitting
    (each step multiplies ``w`` by the square root of target over marginal) makes the disc marginal of the kept
    pairs the mean of the uniform placement's marginal and its mirror image, to ``1e-6``; the clockwise class uses
    the mirrored weights, so both classes end with that same marginal.
    """
    pairs = [(d, p / ((rows - abs(d[0])) * (cols - abs(d[1])))) for d, p in _displacements(lo, hi)]

    def marginal(w: np.ndarray) -> np.ndarray:
        m, total = np.zeros_like(w), 0.0
        for (dr, dc), q in pairs:
            ra, ca = slice(max(0, -dr), rows - max(0, dr)), slice(max(0, -dc), cols - max(0, dc))  # the first disc
            rb, cb = slice(max(0, dr), rows - max(0, -dr)), slice(max(0, dc), cols - max(0, -dc))  # the second
            mass = q * w[ra, ca] * w[rb, cb]
            m[ra, ca] += mass
            m[rb, cb] += mass
            total += mass.sum()
        return m / total

    w = np.ones((rows, cols))
    uniform = marginal(w)
    target = (uniform + uniform[:, ::-1]) / 2
    support = target > 0  # long spans leave the middle of the image to neither disc: no weight to fit there
    for _ in range(1000):
        ratio = np.ones_like(w)
        ratio[support] = target[support] / marginal(w)[support]
        if np.abs(ratio - 1).max() < 1e-6:
            return w / w.max()
        w *= np.sqrt(ratio)
    raise RuntimeError(f"placement weights did not converge for rows={rows}, cols={cols}, spans [{lo}, {hi}]")


def sample_pairs(rng: np.random.Generator, labels: np.ndarray, img_size: int | tuple[int, int], region: str = "all",
                 min_span: int | None = None, max_span: int | None = None) -> np.ndarray:
    """Top-left corners ``(n, 2, 2)`` (sample, disc, (row, col)) of pairs with the given ``labels``;
    see the module doc."""
    height, width = check_size("img_size", img_size)
    c_lo, c_hi = column_range(region, width, DISC_SIZE)
    lo, hi = span_limits(img_size, region)
    lo, hi = max(lo, min_span or lo), min(hi, max_span or hi)
    if lo > hi:
        raise ValueError(f"no span in [{min_span}, {max_span}] fits region={region!r} of a {height}x{width} image: "
                         f"expected spans within [{span_limits(img_size, region)[0]}, "
                         f"{span_limits(img_size, region)[1]}]")
    rows, cols = height - DISC_SIZE + 1, c_hi - c_lo + 1
    weights = placement_weights(rows, cols, lo, hi)
    weights = np.stack([weights[:, ::-1], weights])  # (2, rows, cols): clockwise pairs are the mirror images
    out = np.empty((len(labels), 2, 2), dtype=np.int64)
    todo = np.arange(len(labels))
    for _ in range(1000):
        y, n = labels[todo], len(todo)
        major = rng.integers(lo - DISC_SIZE, hi - DISC_SIZE + 1, size=n)
        minor = rng.integers(MARGIN, major - MARGIN + 1)
        # the nearest axis: the columns' (mostly horizontal) or the rows'
        along_cols = rng.integers(2, size=n).astype(bool)
        major_sign = rng.choice([-1, 1], size=n)
        # d_row * d_col < 0 for a counter-clockwise horizontal pair, > 0 for a counter-clockwise vertical one.
        minor_sign = major_sign * np.where(along_cols == (y == 1), -1, 1)
        big, small = major * major_sign, minor * minor_sign
        d = np.where(along_cols[:, None], np.stack([small, big], 1), np.stack([big, small], 1))  # (n, 2)
        # The pair's bounding box uniform where it fits (region coordinates); the first disc is the corner d points
        # away from.
        row0 = rng.integers(0, rows - np.abs(d[:, 0]))
        col0 = rng.integers(0, cols - np.abs(d[:, 1]))
        first = np.stack([row0 + np.maximum(-d[:, 0], 0), col0 + np.maximum(-d[:, 1], 0)], 1)
        second = first + d
        keep = rng.random(n) < weights[y, first[:, 0], first[:, 1]] * weights[y, second[:, 0], second[:, 1]]
        out[todo[keep]] = np.stack([first[keep], second[keep]], 1) + [0, c_lo]
        todo = todo[~keep]
        if len(todo) == 0:
            return out
    raise RuntimeError("rejection sampling did not finish")  # acceptance is at least 1 / max(w)^2 ~ 1/6


def render(positions: np.ndarray, img_size: int | tuple[int, int]) -> np.ndarray:
    """Noiseless images ``(n, H, W)`` float32: 1 on the two discs, 0 elsewhere."""
    n, disc = len(positions), make_disc()
    images = np.zeros((n, *check_size("img_size", img_size)), dtype=np.float32)
    idx, offs = np.arange(n)[:, None, None], np.arange(DISC_SIZE)
    for k in range(2):
        rows = positions[:, k, 0, None, None] + offs[None, :, None]  # (n, S, 1)
        cols = positions[:, k, 1, None, None] + offs[None, None, :]  # (n, 1, S)
        images[idx, rows, cols] = disc
    return images


class ArrangementDataset(Dataset):
    """In-memory arrangement images, deterministic in ``seed``; see the module doc.

    Images are float32 ``(C, H, W)``: background 0, ink 1, plus Gaussian noise of std ``noise``.
    Labels are int64 (0 clockwise, 1 counter-clockwise), exactly balanced. Metadata: ``positions``
    ``(N, 2, 2)`` top-left corners of the two discs, ``span`` ``(N,)``.
    """

    def __init__(self, *, num_samples: int, img_size: int | tuple[int, int] = 32, in_chans: int = 1,
                 noise: float = 0.05, region: Region = "all", min_span: int | None = None,
                 max_span: int | None = None, seed: int = 0) -> None:
        rng = seeded_rng(num_samples, seed)
        check_options(img_size=img_size, in_chans=in_chans, noise=noise, region=region)
        self.img_size, self.in_chans, self.noise = img_size, in_chans, float(noise)
        self.region, self.seed = region, seed
        labels = balanced_labels(rng, num_samples)
        positions = sample_pairs(rng, labels, img_size, region, min_span, max_span)
        images = torch.from_numpy(render(positions, img_size))  # (N, H, W)
        self.labels = torch.from_numpy(labels).long()
        self.positions = torch.from_numpy(positions)
        self.span = (self.positions[:, 1] - self.positions[:, 0]).abs().amax(dim=1) + DISC_SIZE  # (N,)
        self.images = noisy_images(images, noise=noise, in_chans=in_chans, rng=rng)  # (N, C, H, W)

    def __len__(self) -> int:
        return len(self.labels)

    def token_labels(self, patch_size: int) -> torch.Tensor:
        """`(N, num_patches)` int64: 1 at the patches that hold a disc's centre pixel, 0 elsewhere
        (what a token probe reads)."""
        height, width = check_size("img_size", self.img_size)
        cols = width // patch_size
        labels = torch.zeros((len(self), (height // patch_size) * cols), dtype=torch.long)
        centres = self.positions + DISC_SIZE // 2  # (N, 2, 2)
        labels.scatter_(1, (centres[..., 0] // patch_size) * cols + centres[..., 1] // patch_size, 1)
        return labels

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def check_options(*, img_size: int | tuple[int, int], in_chans: int, noise: float, region: str) -> None:
    """Validate the image options (ValueError naming the value and what is allowed)."""
    check_choice("region", region, Region)
    check_size("img_size", img_size, 4 * DISC_SIZE)
    check_pixel_options(in_chans=in_chans, noise=noise)


class ArrangementDataModule(SyntheticDataModule):
    """Train, val and test splits of ``ArrangementDataset``, each from its own seed derived from ``seed``.

    Train and val are placed in ``train_region`` with spans up to ``train_max_span``; test in
    ``test_region`` with spans from ``test_min_span`` (the translation and the distance tests).
    """

    def __init__(self, *, img_size: int | tuple[int, int] = 32, in_chans: int = 1, noise: float = 0.05,
                 num_train: int = 10_000, num_val: int = 1_000, num_test: int = 2_000, train_region: Region = "all",
                 test_region: Region = "all", train_max_span: int | None = None, test_min_span: int | None = None,
                 seed: int = 0, batch_size: int = 128, num_workers: int = 0) -> None:
        super().__init__()
        for name, region in (("train_region", train_region), ("test_region", test_region)):
            check_choice(name, region, Region)
        check_options(img_size=img_size, in_chans=in_chans, noise=noise, region=train_region)
        self.check_sizes(num_train=num_train, num_val=num_val, num_test=num_test, seed=seed, batch_size=batch_size,
                         num_workers=num_workers)
        for name, value in (("train_max_span", train_max_span), ("test_min_span", test_min_span)):
            if value is not None:
                check_int(name, value, 2 * DISC_SIZE + GAP)
        self.save_hyperparameters()

    @property
    def class_names(self) -> list[str]:
        """Label 0: side by side (horizontal); label 1: one above the other (vertical)."""
        return list(CLASS_NAMES)

    def make_split(self, split: str, num_samples: int, region: str) -> ArrangementDataset:
        hp = self.hparams
        spans = {"min_span": hp.test_min_span} if split == "test" else {"max_span": hp.train_max_span}
        return ArrangementDataset(num_samples=num_samples, img_size=hp.img_size, in_chans=hp.in_chans, noise=hp.noise,
                                  region=region, seed=self.split_seeds()[split], **spans)


allow_datamodule(ArrangementDataModule)  # its checkpoints open through vit.load and attention blocking
