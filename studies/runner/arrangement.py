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

1. the span uniform over the allowed spans (``major = span - DISC_SIZE``);
2. given the span, a counter-clockwise pair from the law ``q`` of: ``minor`` uniform in
   ``[MARGIN, major - MARGIN]``, the nearest axis (rows or columns) by a fair coin, the major
   component's sign by a fair coin (the minor's then set by the label), the pair's bounding box
   uniform where it fits in the region; reweighted to ``q(a, b) w[a] w[b]`` by the span's
   ``placement_weights`` and drawn exactly from the list of the span's pairs (``pair_law``);
3. for label 0, the mirror image of that pair (columns reversed within the region).

Why the weights, and why per span. Under ``q`` alone one disc's position gives the label away near
the borders: a disc on the left border has its partner to its right, and the two tilts use the room
along the border differently; the longer the span, the more the discs hug the borders and corners.
The weights make the disc marginal of the counter-clockwise pairs of each span mirror-symmetric, to
1e-9, so the clockwise pairs (their mirror images) have the same marginal: one disc's position, and
every additive score of the two discs (a linear readout of the pixels), carries nothing within any
span, hence within any set of spans the tables score. Balanced over all spans pooled only, the
position would still tell the tilt within a bin of long spans. At the longest spans some positions
fit pairs of one tilt only (at span 32 in a 32-px image, a disc one row below the top-left corner
is always the upper disc of a pair falling to the right, a clockwise one): those positions get
weight 0 in both classes.

What else holds by construction: a left-right mirror maps one class onto the other, so every
statistic that a mirror does not change has the same law in both classes: the span (uniform) and
the centre distance, the ink (two discs of ``DISC_PIXELS``), the number of parts. In a square
region each class is also unchanged by a quarter turn (``q`` is, and so are the weights, which the
tests check), so which quadrants the two discs occupy is label-free too (an unordered pair of
quadrants and its mirror image are quarter turns of each other). The midpoint is not fixed by
construction; the shortcut audit (``studies/arrangement``) measures it with the rest, per span bin.

``span`` is the side of the smallest square that holds both boxes, ``max(|d_row|, |d_col|) +
DISC_SIZE`` (as for ``same_different``): what a convolutional unit must see to hold both discs.
``max_span`` bounds it (train on short spans), ``min_span`` too (test beyond them). In a region
narrower than it is tall (``left``, ``right``: 5/8 of the columns, as for ``same_different``) the span
is bounded by the narrow side, for both nearest axes alike.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch.utils.data import Dataset

from vit.checks import check_choice, check_int, check_size
from vit.data.base import SyntheticDataModule, balanced_labels, check_pixel_options, noisy_images, seeded_rng
from vit.data.same_different import Region, column_range  # the same halves as the relation task
from vit.registry import allow_datamodule

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


@functools.lru_cache(maxsize=64)
def counterclockwise_pairs(rows: int, cols: int, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every counter-clockwise pair of ``span`` whose top-left corners fit ``rows`` x ``cols`` (region coordinates):
    first disc ``(K, 2)``, displacement ``(K, 2)`` (row, col), and its probability ``(K,)`` under ``q`` (step 2)."""
    major = span - DISC_SIZE
    firsts, displacements, probs = [], [], []
    for minor in range(MARGIN, major - MARGIN + 1):
        for sign in (-1, 1):  # the major component's; the minor's follows from the label
            # along the columns (rising to the right), along the rows (leaning right going down)
            for dr, dc in ((-sign * minor, sign * major), (sign * major, sign * minor)):
                r, c = np.arange(max(0, -dr), rows - max(0, dr)), np.arange(max(0, -dc), cols - max(0, dc))
                first = np.stack(np.meshgrid(r, c, indexing="ij"), -1).reshape(-1, 2)  # every placement
                firsts.append(first)
                displacements.append(np.broadcast_to([dr, dc], first.shape))
                probs.append(np.full(len(first), 1 / ((major - 2 * MARGIN + 1) * 4 * len(first))))
    out = np.concatenate(firsts), np.concatenate(displacements), np.concatenate(probs)
    for a in out:
        a.flags.writeable = False  # cached: shared by every caller
    return out


def _disc_marginal(index: np.ndarray, mass: np.ndarray, size: int) -> np.ndarray:
    """``(size,)`` mass of the discs at the flat positions ``index`` ``(K, 2)`` of pairs of mass ``(K,)``."""
    return np.bincount(index[:, 0], mass, size) + np.bincount(index[:, 1], mass, size)


@functools.lru_cache(maxsize=64)
def placement_weights(rows: int, cols: int, span: int) -> np.ndarray:
    """``(rows, cols)`` weights of a disc's top-left corner (region coordinates) for the counter-clockwise pairs of
    ``span``: the pairs drawn with probability ``q(a, b) w[a] w[b]`` (normalised) have a mirror-symmetric disc
    marginal, so the clockwise pairs (their mirror images) have the same one.

    Of every such reweighting, the closest to ``q`` (least Kullback-Leibler divergence). Its weights have
    ``w[r, c] w[r, cols - 1 - c] = 1`` on their support, and iterative scaling finds them: each step adds half the
    log ratio of the mirrored marginal to the marginal to ``log w``, until they agree to ``1e-9``. The support is the
    positions that pairs of both tilts reach: a position that one tilt cannot reach at this span gets weight 0, and
    so does any that then loses all its pairs.
    """
    first, d, q = counterclockwise_pairs(rows, cols, span)
    index = np.stack([first, first + d], 1) @ [cols, 1]  # (K, 2) flat positions of both discs
    support = np.ones(rows * cols, dtype=bool)
    while True:
        kept = support[index].all(1)
        reached = _disc_marginal(index[kept], np.ones(kept.sum()), rows * cols).reshape(rows, cols) > 0
        reached &= reached[:, ::-1]
        if (reached.ravel() == support).all():
            break
        support = reached.ravel()
    if not support.any():
        raise ValueError(f"no counter-clockwise pair of span {span} fits a {rows}x{cols} region of top-left corners")
    log_w = np.where(support, 0.0, -np.inf).reshape(rows, cols)
    for _ in range(1000):
        w = np.exp(log_w).ravel()
        m = _disc_marginal(index, q * w[index[:, 0]] * w[index[:, 1]], rows * cols).reshape(rows, cols)
        gap = np.zeros((rows, cols))
        inside = support.reshape(rows, cols)
        gap[inside] = np.log(m[:, ::-1][inside] / m[inside])
        if np.abs(gap).max() < 1e-9:
            w = np.exp(log_w)
            w.flags.writeable = False  # cached: shared by every caller
            return w
        log_w += gap / 2
    raise RuntimeError(f"placement weights did not converge for rows={rows}, cols={cols}, span={span}")


@functools.lru_cache(maxsize=64)
def pair_law(rows: int, cols: int, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The counter-clockwise pairs of ``span`` as drawn (steps 1-2): first disc ``(K, 2)``, displacement ``(K, 2)``,
    and the cumulative probability ``(K,)`` of ``q(a, b) w[a] w[b]``, normalised."""
    first, d, q = counterclockwise_pairs(rows, cols, span)
    w = placement_weights(rows, cols, span)
    p = q * w[first[:, 0], first[:, 1]] * w[first[:, 0] + d[:, 0], first[:, 1] + d[:, 1]]
    cdf = np.cumsum(p) / p.sum()
    cdf.flags.writeable = False  # cached, as the pairs are
    return first, d, cdf


def sample_pairs(
    rng: np.random.Generator,
    labels: np.ndarray,
    img_size: int | tuple[int, int],
    region: str = "all",
    min_span: int | None = None,
    max_span: int | None = None,
) -> np.ndarray:
    """Top-left corners ``(n, 2, 2)`` (sample, disc, (row, col)) of pairs with the given ``labels``;
    see the module doc."""
    height, width = check_size("img_size", img_size)
    c_lo, c_hi = column_range(region, width, DISC_SIZE)
    lo, hi = span_limits(img_size, region)
    lo, hi = max(lo, min_span or lo), min(hi, max_span or hi)
    if lo > hi:
        raise ValueError(
            f"no span in [{min_span}, {max_span}] fits region={region!r} of a {height}x{width} image: "
            f"expected spans within [{span_limits(img_size, region)[0]}, "
            f"{span_limits(img_size, region)[1]}]"
        )
    rows, cols = height - DISC_SIZE + 1, c_hi - c_lo + 1
    span = rng.integers(lo, hi + 1, size=len(labels))  # step 1
    u = rng.random(len(labels))
    out = np.empty((len(labels), 2, 2), dtype=np.int64)
    for s in np.unique(span):
        at = np.flatnonzero(span == s)
        first, d, cdf = pair_law(rows, cols, int(s))
        k = np.minimum(np.searchsorted(cdf, u[at], side="right"), len(cdf) - 1)  # step 2: the pair whose mass holds u
        pair = np.stack([first[k], first[k] + d[k]], 1)  # (n_s, 2, 2)
        clockwise = labels[at] == 0
        pair[clockwise, :, 1] = cols - 1 - pair[clockwise, :, 1]  # step 3: the mirror image
        out[at] = pair + [0, c_lo]
    return out


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

    def __init__(
        self,
        *,
        num_samples: int,
        img_size: int | tuple[int, int] = 32,
        in_chans: int = 1,
        noise: float = 0.05,
        region: Region = "all",
        min_span: int | None = None,
        max_span: int | None = None,
        seed: int = 0,
    ) -> None:
        rng = seeded_rng(num_samples, seed)
        check_disc_options(img_size=img_size, in_chans=in_chans, noise=noise, region=region)
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


def check_disc_options(*, img_size: int | tuple[int, int], in_chans: int, noise: float, region: str) -> None:
    """Validate the image options (ValueError naming the value and what is allowed)."""
    check_choice("region", region, Region)
    check_size("img_size", img_size, 4 * DISC_SIZE)
    check_pixel_options(in_chans=in_chans, noise=noise)


class ArrangementDataModule(SyntheticDataModule):
    """Train, val and test splits of ``ArrangementDataset``, each from its own seed derived from ``seed``.

    Train and val are placed in ``train_region`` with spans up to ``train_max_span``; test in
    ``test_region`` with spans from ``test_min_span`` (the translation and the distance tests).
    """

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
        train_max_span: int | None = None,
        test_min_span: int | None = None,
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, region in (("train_region", train_region), ("test_region", test_region)):
            check_choice(name, region, Region)
        check_disc_options(img_size=img_size, in_chans=in_chans, noise=noise, region=train_region)
        self.check_sizes(
            num_train=num_train,
            num_val=num_val,
            num_test=num_test,
            seed=seed,
            batch_size=batch_size,
            num_workers=num_workers,
        )
        for name, value in (("train_max_span", train_max_span), ("test_min_span", test_min_span)):
            if value is not None:
                check_int(name, value, 2 * DISC_SIZE + GAP)
        self.save_hyperparameters()

    @property
    def class_names(self) -> list[str]:
        """Label 0: clockwise; label 1: counter-clockwise (the tilt of the line through the two discs)."""
        return list(CLASS_NAMES)

    def make_split(self, split: str, num_samples: int, region: str) -> ArrangementDataset:
        hp = self.hparams
        spans = {"min_span": hp.test_min_span} if split == "test" else {"max_span": hp.train_max_span}
        return ArrangementDataset(
            num_samples=num_samples,
            img_size=hp.img_size,
            in_chans=hp.in_chans,
            noise=hp.noise,
            region=region,
            seed=self.split_seeds()[split],
            **spans,
        )


allow_datamodule(ArrangementDataModule)  # its checkpoints open through vit.load and attention blocking
