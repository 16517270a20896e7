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
)


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
    dm = ArrangementDataModule(num_train=2000, num_val=500, num_test=1000, train_max_span=16, test_min_span=17,
                               batch_size=64)
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


@pytest.mark.parametrize("kwargs, match", [
    ({"train_region": "top"}, "train_region='top' is not allowed"),
    ({"train_max_span": 8}, "train_max_span=8 is not allowed"),
    ({"noise": -1.0}, "noise=-1.0 is not allowed"),
])
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrangementDataModule(**kwargs)


def test_a_span_that_does_not_fit_the_region_is_refused():
    with pytest.raises(ValueError, match=r"no span in \[24, None\] fits region='left'"):
        ArrangementDataset(num_samples=10, region="left", min_span=24)


def test_placement_weights_give_both_classes_the_same_disc_marginal():
    # Enumerated independently of the sampler: every counter-clockwise displacement of a 20x20 image (the rule, not the
    # sampler's list), its probability under steps 1-2, every placement, each pair weighted by w[a] w[b]; then the
    # clockwise class as the mirror image. The disc marginals of the two classes agree; without the weights they do not.
    rows = cols = 16
    lo, hi = 11, 20
    w = placement_weights(rows, cols, lo, hi)
    majors = hi - lo + 1

    def marginal(weights):
        m = np.zeros((rows, cols))
        for dr in range(-(rows - 1), rows):
            for dc in range(-(cols - 1), cols):
                major = max(abs(dr), abs(dc))
                if label_of(np.array([dr, dc])) != 1 or not lo <= major + DISC_SIZE <= hi:
                    continue
                p = 1 / (majors * (major - 2 * MARGIN + 1) * 4) / ((rows - abs(dr)) * (cols - abs(dc)))
                for r in range(max(0, -dr), rows - max(0, dr)):
                    for c in range(max(0, -dc), cols - max(0, dc)):
                        mass = p * weights[r, c] * weights[r + dr, c + dc]
                        m[r, c] += mass
                        m[r + dr, c + dc] += mass
        return m / m.sum()

    ccw = marginal(w)
    assert np.allclose(ccw, ccw[:, ::-1], rtol=1e-5, atol=0)  # the clockwise class's marginal is the mirror image
    plain = marginal(np.ones_like(w))
    assert np.abs(plain / plain[:, ::-1] - 1).max() > 0.1
