"""Same-different pairs: labels read back from the pixels, no position or ink cue, the local-view ceiling."""

import itertools

import numpy as np
import pytest
import torch

from vit.data import SameDifferentDataModule, SameDifferentDataset
from vit.data.same_different import NUM_SHAPES, SHAPE_PIXELS, SHAPE_SIZE, bag_of_shapes_ceiling, make_shapes


def _shapes_from_pixels(image: np.ndarray) -> list[np.ndarray]:
    """The two inked boxes of a noiseless image, found by scanning for ink, as SHAPE_SIZE x SHAPE_SIZE crops."""
    ink = image > 0.5
    found, taken = [], np.zeros_like(ink)
    for r, c in zip(*np.nonzero(ink)):
        if taken[r, c]:
            continue
        # The box is located by matching the crop against the known patterns at every offset.
        for dr, dc in itertools.product(range(SHAPE_SIZE), repeat=2):
            r0, c0 = r - dr, c - dc
            if r0 < 0 or c0 < 0 or r0 + SHAPE_SIZE > ink.shape[0] or c0 + SHAPE_SIZE > ink.shape[1]:
                continue
            crop = ink[r0 : r0 + SHAPE_SIZE, c0 : c0 + SHAPE_SIZE]
            if crop.sum() == SHAPE_PIXELS and any((crop == p).all() for p in make_shapes()):
                found.append(crop)
                taken[r0 : r0 + SHAPE_SIZE, c0 : c0 + SHAPE_SIZE] |= crop
                break
    return found


def test_labels_agree_with_the_shapes_seen_in_the_pixels():
    ds = SameDifferentDataset(num_samples=200, noise=0.0, seed=3)
    for i in range(len(ds)):
        shapes = _shapes_from_pixels(ds.images[i, 0].numpy())
        assert len(shapes) == 2, i
        assert int(ds.labels[i]) == int((shapes[0] == shapes[1]).all()), i


def test_shapes_are_distinct_with_equal_ink_and_no_shifted_copies():
    shapes = make_shapes()
    assert shapes.shape == (NUM_SHAPES, SHAPE_SIZE, SHAPE_SIZE) and (shapes.sum((1, 2)) == SHAPE_PIXELS).all()
    for a, b in itertools.combinations(range(NUM_SHAPES), 2):
        for dr, dc in itertools.product(range(-SHAPE_SIZE + 1, SHAPE_SIZE), repeat=2):
            shifted = np.roll(shapes[b], (dr, dc), axis=(0, 1))
            wrapped = np.roll(shifted, (-dr, -dc), axis=(0, 1)).sum() != shifted.sum()
            assert wrapped or not (shifted == shapes[a]).all(), (a, b, dr, dc)


def test_every_image_has_the_same_ink_and_boxes_never_touch():
    ds = SameDifferentDataset(num_samples=500, noise=0.0, seed=1)
    assert torch.all(ds.images.sum((1, 2, 3)) == 2 * SHAPE_PIXELS)
    d = (ds.positions[:, 1] - ds.positions[:, 0]).abs()
    assert torch.all(d.amax(1) >= SHAPE_SIZE + 1)
    assert torch.equal(ds.span, d.amax(1) + SHAPE_SIZE)
    assert ds.labels.sum() == 250


def test_placement_is_independent_of_the_label():
    # Positions are drawn before the label, so they are the same draws whatever the labels are:
    # the mean position and span of each class agree within sampling noise.
    ds = SameDifferentDataset(num_samples=20_000, seed=5)
    pos, y = ds.positions.float(), ds.labels.bool()
    assert torch.allclose(pos[y].mean(0), pos[~y].mean(0), atol=0.4)
    assert abs(ds.span[y].float().mean() - ds.span[~y].float().mean()) < 0.4


def test_same_seed_same_images_and_regions_are_respected():
    a, b = SameDifferentDataset(num_samples=50, seed=7), SameDifferentDataset(num_samples=50, seed=7)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    left = SameDifferentDataset(num_samples=300, region="left", seed=0)
    right = SameDifferentDataset(num_samples=300, region="right", seed=0)
    assert int(left.positions[..., 1].max()) + SHAPE_SIZE <= 20  # left 5/8 of 32 columns
    assert int(right.positions[..., 1].min()) >= 12
    assert left.images[..., 20:].abs().max() < 0.5 and right.images[..., :12].abs().max() < 0.5


def test_the_right_test_set_is_the_left_one_moved_12_pixels():
    # The study's translation test scores the same weights on both: image for image the same pair,
    # 12 px further right, so the two accuracies are paired.
    left = SameDifferentDataset(num_samples=300, region="left", noise=0.0, seed=3)
    right = SameDifferentDataset(num_samples=300, region="right", noise=0.0, seed=3)
    assert torch.equal(right.positions, left.positions + torch.tensor([0, 12]))
    assert torch.equal(right.labels, left.labels) and torch.equal(right.shape_ids, left.shape_ids)
    assert torch.equal(right.span, left.span)
    assert torch.equal(right.images[..., 12:], left.images[..., :20]) and not right.images[..., :12].any()


def test_bag_of_shapes_ceiling_matches_a_brute_force():
    # Best accuracy over every score table h in {-1, 0, 1}^K and threshold t of "same iff h(a) + h(b) > t"
    # (and its mirror), on balanced pairs: same pairs 1/(2K) each, ordered different pairs 1/(2K(K-1)) each.
    for k in (3, 4, 5):
        best = 0.5
        for h in itertools.product((-1, 0, 1), repeat=k):
            scores_same = [2 * h[i] for i in range(k)]
            scores_diff = [h[i] + h[j] for i in range(k) for j in range(k) if i != j]
            for t in np.arange(-2.5, 2.6, 0.5):
                acc = sum(s > t for s in scores_same) / (2 * k) + sum(s <= t for s in scores_diff) / (2 * k * (k - 1))
                best = max(best, acc, 1 - acc)
        assert bag_of_shapes_ceiling(k) == pytest.approx(best), k
    assert bag_of_shapes_ceiling(8) == pytest.approx(0.642857, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"train_region": "top"}, "train_region='top' is not allowed"),
        ({"in_chans": 2}, "in_chans=2 is not allowed"),
        ({"img_size": 12}, "img_size=12"),
        ({"noise": -1.0}, "noise=-1.0 is not allowed"),
    ],
)
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SameDifferentDataModule(**kwargs)


def test_datamodule_splits_are_different_draws():
    dm = SameDifferentDataModule(num_train=64, num_val=32, num_test=32, batch_size=16)
    dm.setup()
    assert not torch.equal(dm.train_set.images[:32], dm.val_set.images)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 1, 32, 32) and y.dtype == torch.int64


def test_a_held_out_pattern_is_never_trained_on_and_in_every_test_pair():
    data = SameDifferentDataModule(num_train=2000, num_val=200, num_test=1000, held_out_shape=3, seed=5)
    data.setup("fit")
    data.setup("test")
    for split in (data.train_set, data.val_set):
        assert not (split.shape_ids == 3).any()
        assert set(split.shape_ids.flatten().tolist()) == {0, 1, 2}
        assert ((split.shape_ids[:, 0] == split.shape_ids[:, 1]) == (split.labels == 1)).all()
    test = data.test_set
    holds = test.shape_ids == 3
    assert holds.any(1).all()  # every pair holds it
    assert (holds.all(1) == (test.labels == 1)).all()  # twice exactly in the "same" pairs
    assert 0.4 < holds[test.labels == 0, 0].float().mean() < 0.6  # on either side, by a fair coin
    assert set(test.shape_ids[test.labels == 0].flatten().tolist()) == {0, 1, 2, 3}
    # the pixels show the patterns the metadata names
    shapes = make_shapes()
    for i in range(20):
        for k in range(2):
            r, c = test.positions[i, k].tolist()
            box = test.images[i, 0, r : r + SHAPE_SIZE, c : c + SHAPE_SIZE] > 0.5
            assert (box.numpy() == shapes[test.shape_ids[i, k]]).all()
    with pytest.raises(ValueError, match="held_out_shape=4"):
        SameDifferentDataModule(held_out_shape=4)
