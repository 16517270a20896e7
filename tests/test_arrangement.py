"""Arrangement pairs: the tilt rule on every sample, translation and mirror symmetry, balance, seeds, spans."""

import math

import numpy as np
import pytest
import torch
from scipy import ndimage

from studies.runner.arrangement import (
    DISC_PIXELS,
    DISC_SIZE,
    MARGIN,
    ArrangementDataModule,
    ArrangementDataset,
    label_of,
    placement_weights,
    sample_pairs,
)
from studies.runner.shortcuts import bayes_accuracy


def _tilt_by_angle(d_row: int, d_col: int) -> int:
    """The rule written independently: the line's angle on the screen (rows go down), its nearest axis, the sign of the
    tilt from it. 1: counter-clockwise, 0: clockwise."""
    angle = math.degrees(math.atan2(-d_row, d_col)) % 180  # [0, 180): a line, not a vector
    nearest = min((0, 90, 180), key=lambda a: abs(angle - a))
    assert abs(abs(angle - nearest) - 45) > 1e-9, "on a diagonal"
    return int(angle - nearest > 0)


def test_the_label_is_the_tilt_of_the_line_on_every_sample():
    ds = ArrangementDataset(num_samples=3000, noise=0.0, seed=3)
    d = (ds.positions[:, 1] - ds.positions[:, 0]).tolist()
    assert [_tilt_by_angle(*v) for v in d] == ds.labels.tolist()
    assert (label_of(np.array(d)) == ds.labels.numpy()).all()
    major, minor = np.abs(d).max(1), np.abs(d).min(1)
    assert (minor >= MARGIN).all() and (major - minor >= MARGIN).all()  # never ambiguous


def test_the_recorded_positions_are_the_discs_in_the_pixels():
    ds = ArrangementDataset(num_samples=300, noise=0.0, seed=1)
    assert torch.all(ds.images.sum((1, 2, 3)) == 2 * DISC_PIXELS)
    for i in range(len(ds)):
        blobs, n = ndimage.label(ds.images[i, 0].numpy() > 0.5)
        assert n == 2, i  # two discs, never touching
        centres = sorted(tuple(round(v) for v in ndimage.center_of_mass(blobs > 0, blobs, k)) for k in (1, 2))
        assert centres == sorted(tuple(p) for p in (ds.positions[i] + DISC_SIZE // 2).tolist()), i


def test_translating_or_swapping_a_pair_keeps_its_label_and_a_mirror_flips_it():
    rng = np.random.default_rng(0)
    ds = ArrangementDataset(num_samples=2000, seed=2)
    d = (ds.positions[:, 1] - ds.positions[:, 0]).numpy()
    y = label_of(d)
    shift = rng.integers(-10, 11, size=(len(d), 2))
    a = rng.integers(0, 20, size=(len(d), 2))
    assert (label_of((a + d + shift) - (a + shift)) == y).all()  # translation: the displacement is unchanged
    assert (label_of(-d) == y).all()  # the two discs swapped
    assert (label_of(d * [1, -1]) == 1 - y).all() and (label_of(d * [-1, 1]) == 1 - y).all()  # mirrors
    assert (label_of(np.stack([d[:, 1], -d[:, 0]], 1)) == y).all()  # a quarter turn


def test_the_right_test_set_is_the_left_one_moved_12_pixels():
    # The translation test: the same pairs 12 px further right, so the label is the same sample by sample.
    left = ArrangementDataset(num_samples=300, region="left", noise=0.0, seed=3)
    right = ArrangementDataset(num_samples=300, region="right", noise=0.0, seed=3)
    assert torch.equal(right.positions, left.positions + torch.tensor([0, 12]))
    assert torch.equal(right.labels, left.labels) and torch.equal(right.span, left.span)
    assert torch.equal(right.images[..., 12:], left.images[..., :20]) and not right.images[..., :12].any()
    assert left.positions[..., 1].max() + DISC_SIZE <= 20 and left.span.max() <= 20


def test_classes_are_balanced_overall_and_within_each_axis_and_span():
    ds = ArrangementDataset(num_samples=20_000, seed=5)
    y, d = ds.labels, (ds.positions[:, 1] - ds.positions[:, 0]).abs()
    assert int(y.sum()) == 10_000
    horizontal = d[:, 1] > d[:, 0]
    for part in (horizontal, ~horizontal):
        assert abs(y[part].float().mean() - 0.5) < 0.035
    # Equal in law by construction (a mirror maps one class onto the other); the tolerances are ~5 standard errors
    # of a difference of two means over 10,000 samples each (span sd ~6 px; a share's sd 0.5).
    assert abs(ds.span[y == 1].float().mean() - ds.span[y == 0].float().mean()) < 0.45
    assert abs(horizontal[y == 1].float().mean() - horizontal[y == 0].float().mean()) < 0.035


def test_same_seed_same_images_other_seed_other_pairs():
    a, b = ArrangementDataset(num_samples=200, seed=7), ArrangementDataset(num_samples=200, seed=7)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels) and torch.equal(a.positions, b.positions)
    c = ArrangementDataset(num_samples=200, seed=8)
    assert (c.positions != a.positions).flatten(1).any(1).float().mean() > 0.95


def test_datamodule_splits_are_separate_draws_with_their_span_limits():
    dm = ArrangementDataModule(
        num_train=2000, num_val=500, num_test=1000, train_max_span=16, test_min_span=17, batch_size=64
    )
    dm.setup()
    assert dm.class_names == ["clockwise", "counterclockwise"]
    seeds = dm.split_seeds()
    assert len(set(seeds.values())) == 3 and dm.train_set.seed == seeds["train"] and dm.test_set.seed == seeds["test"]
    assert int(dm.train_set.span.max()) == 16 and int(dm.val_set.span.max()) <= 16
    assert int(dm.test_set.span.min()) == 17 and int(dm.test_set.span.max()) == 32
    d = (dm.train_set.positions[:, 1] - dm.train_set.positions[:, 0]).abs()
    assert torch.equal(dm.train_set.span, d.amax(1) + DISC_SIZE)
    train = {tuple(p) for p in dm.train_set.positions.flatten(1).tolist()}
    assert not train & {tuple(p) for p in dm.test_set.positions.flatten(1).tolist()}  # spans apart: no pair shared
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (64, 1, 32, 32) and y.dtype == torch.int64


def test_token_labels_mark_the_two_disc_centres():
    ds = ArrangementDataset(num_samples=100, seed=0)
    labels = ds.token_labels(4)
    assert labels.shape == (100, 64) and torch.equal(labels.sum(1), torch.full((100,), 2))
    c = ds.positions[0] + DISC_SIZE // 2
    assert {int(r // 4 * 8 + col // 4) for r, col in c.tolist()} == set(torch.nonzero(labels[0]).flatten().tolist())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"train_region": "top"}, "train_region='top' is not allowed"),
        ({"train_max_span": 8}, "train_max_span=8 is not allowed"),
        ({"noise": -1.0}, "noise=-1.0 is not allowed"),
    ],
)
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrangementDataModule(**kwargs)


def test_a_span_that_does_not_fit_the_region_is_refused():
    with pytest.raises(ValueError, match=r"no span in \[24, None\] fits region='left'"):
        ArrangementDataset(num_samples=10, region="left", min_span=24)


def _exact_marginal(rows: int, cols: int, span: int, weights: np.ndarray) -> np.ndarray:
    """The disc marginal of the counter-clockwise pairs of ``span``, enumerated independently of the sampler: every
    counter-clockwise displacement of that span (the rule, not the sampler's list), its probability under steps 1-2,
    every placement, each pair weighted by ``w[a] w[b]``."""
    major = span - DISC_SIZE
    m = np.zeros((rows, cols))
    for dr in range(-(rows - 1), rows):
        for dc in range(-(cols - 1), cols):
            if label_of(np.array([dr, dc])) != 1 or max(abs(dr), abs(dc)) != major:
                continue
            p = 1 / ((major - 2 * MARGIN + 1) * 4) / ((rows - abs(dr)) * (cols - abs(dc)))
            for r in range(max(0, -dr), rows - max(0, dr)):
                for c in range(max(0, -dc), cols - max(0, dc)):
                    mass = p * weights[r, c] * weights[r + dr, c + dc]
                    m[r, c] += mass
                    m[r + dr, c + dc] += mass
    return m / m.sum()


@pytest.mark.parametrize("rows, cols, span", [(16, 16, 11), (16, 16, 20), (28, 28, 25), (28, 28, 32), (28, 16, 20)])
def test_placement_weights_give_both_classes_the_same_disc_marginal_within_each_span(rows, cols, span):
    # The clockwise class is the mirror image of the counter-clockwise one, so its marginal is the mirror image: the
    # two agree when the counter-clockwise marginal is mirror-symmetric, span by span (so in every bin of spans a table
    # scores). Without the weights they do not.
    ccw = _exact_marginal(rows, cols, span, placement_weights(rows, cols, span))
    assert np.abs(ccw - ccw[:, ::-1]).max() <= 1e-6 * ccw.max()
    plain = _exact_marginal(rows, cols, span, np.ones((rows, cols)))
    assert np.abs(plain - plain[:, ::-1]).max() > 0.1 * plain.max()


def test_placement_weights_are_the_closest_reweighting_and_keep_a_quarter_turn():
    # log w antisymmetric under the mirror (the form of the least-divergence solution); in a square region a quarter
    # turn keeps each class, so which quadrants the discs occupy stays label-free.
    for span in (11, 18, 25, 32):
        w = placement_weights(28, 28, span)
        support = w > 0
        assert np.array_equal(support, support[:, ::-1])
        assert np.allclose((w * w[:, ::-1])[support], 1.0, rtol=1e-9)
        assert np.allclose(w, np.rot90(w), rtol=1e-9, atol=0)
    # At span 32 (a 32-px image), a disc one row below the top-left corner is always the upper disc of a pair falling
    # to the right (clockwise): left out in both classes, so it tells nothing.
    w = placement_weights(28, 28, 32)
    assert w[1, 0] == 0 and w[1, -1] == 0 and w[0, 0] > 0


def test_sampled_pairs_follow_the_weights_span_by_span():
    labels = np.arange(4000) % 2
    pos = sample_pairs(np.random.default_rng(0), labels, 32, min_span=29, max_span=30)
    span = np.abs(pos[:, 1] - pos[:, 0]).max(1) + DISC_SIZE
    assert set(span.tolist()) == {29, 30} and abs((span == 29).mean() - 0.5) < 0.04  # the span uniform
    for s in (29, 30):
        w = placement_weights(28, 28, s)
        for y, weights in ((1, w), (0, w[:, ::-1])):  # the clockwise pairs: the mirror images
            p = pos[(span == s) & (labels == y)]
            assert (weights[p[..., 0], p[..., 1]] > 0).all()
            assert (label_of(p[:, 1] - p[:, 0]) == y).all()


def test_one_disc_says_nothing_about_the_tilt_on_long_spans_of_a_draw_of_every_span():
    # What a per-span table scores: images of every span, the long ones picked out. One disc (chosen at random) per
    # image, the majority label of its position learned on one draw, scored on another: chance (a balance over all
    # spans pooled leaves ~58% here).
    keys, ys = [], []
    for seed in (1, 2):
        ds = ArrangementDataset(num_samples=30_000, noise=0.0, seed=seed)
        long = ds.span.numpy() >= 25
        centre = ds.positions.numpy()[long] + DISC_SIZE // 2  # (n, 2, 2)
        disc = centre[np.arange(len(centre)), np.random.default_rng(seed).integers(2, size=len(centre))]
        keys.append(disc[:, 0] * 32 + disc[:, 1])
        ys.append(ds.labels.numpy()[long])
    assert len(ys[1]) > 10_000
    assert bayes_accuracy(keys[0], ys[0], keys[1], ys[1]) < 0.53  # +-1 point is the 95% interval at 10,000 images
