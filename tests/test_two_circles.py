"""The two-circles data: labels readable from the pixels, balance, seeds, splits, regions, errors."""

import hashlib
import re

import numpy as np
import pytest
import torch

from vit.data import TwoCirclesDataModule, TwoCirclesDataset
from vit.data.two_circles import (
    NEGATIVE_PAIRS,
    circle_masks,
    distance_to_area_side,
    region_threshold,
    render_circles,
)

IMG = 32
HALF = IMG // 2


@pytest.fixture(scope="module")
def diagonal() -> TwoCirclesDataset:
    return TwoCirclesDataset(num_samples=2000, task="diagonal", noise=0.0, seed=1)


@pytest.fixture(scope="module")
def relative() -> TwoCirclesDataset:
    return TwoCirclesDataset(num_samples=300, task="relative", noise=0.0, seed=2)


def quadrant_ink(images: torch.Tensor) -> torch.Tensor:
    """Ink mass ``(N, 4)`` per quadrant, ordered TL, TR, BL, BR, of grey images ``(N, H, W)``."""
    n = len(images)
    return images.reshape(n, 2, HALF, 2, HALF).sum(dim=(2, 4)).reshape(n, 4)


def components(ink: torch.Tensor) -> torch.Tensor:
    """4-connected components ``(N, H, W)`` of boolean images, labelled by a positive int."""
    n, h, w = ink.shape
    ids = (torch.arange(h * w).view(1, h, w) + 1).expand(n, -1, -1)
    labels = torch.where(ink, ids, 0)
    while True:  # spread the largest id through each component until nothing changes
        padded = torch.nn.functional.pad(labels, (1, 1, 1, 1))
        neighbours = torch.stack(
            [padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2], padded[:, 1:-1, 2:], labels]
        ).amax(dim=0)
        spread = torch.where(ink, neighbours, 0)
        if torch.equal(spread, labels):
            return labels
        labels = spread


def test_diagonal_labels_follow_the_inked_quadrants(diagonal):
    images = diagonal.images[:, 0]  # (N, H, W)
    inked = quadrant_ink(images) > 0  # (N, 4)
    # Exactly two quadrants hold any ink at all: no circle crosses a midline.
    assert (inked.sum(dim=1) == 2).all()
    # Each inked quadrant holds a whole circle (area of a disc of the smallest radius, 3).
    assert (quadrant_ink(images)[inked] > 0.9 * np.pi * 3**2).all()
    from_pixels = (inked[:, 0] & inked[:, 3]).long()  # TL and BR
    assert torch.equal(from_pixels, diagonal.labels)


def test_diagonal_negatives_use_the_five_other_pairs_uniformly(diagonal):
    inked = quadrant_ink(diagonal.images[:, 0]) > 0
    negatives = inked[diagonal.labels == 0]
    pairs = [tuple(np.flatnonzero(row).tolist()) for row in negatives.numpy()]
    counts = {pair: pairs.count(pair) for pair in NEGATIVE_PAIRS}
    assert sum(counts.values()) == len(negatives)  # never the positive pair
    expected = len(negatives) / len(NEGATIVE_PAIRS)  # 200 each
    assert all(abs(c - expected) < 0.25 * expected for c in counts.values()), counts


def test_relative_labels_follow_disc_above_left_of_ring(relative):
    images = relative.images[:, 0]  # (N, H, W)
    labels = components(images > 0)
    grid = torch.arange(IMG, dtype=torch.float32) + 0.5
    for i in range(len(relative)):
        ids = labels[i].unique()
        ids = ids[ids > 0]
        assert len(ids) == 2, f"sample {i}: {len(ids)} blobs"
        blobs = {}
        for blob_id in ids:
            ink = torch.where(labels[i] == blob_id, images[i], 0)
            centre = torch.stack([(ink.sum(1) * grid).sum(), (ink.sum(0) * grid).sum()]) / ink.sum()
            row, col = centre.long()
            # A filled disc is lit at its centre, a ring is dark there.
            blobs["disc" if images[i, row, col] > 0.5 else "ring"] = centre
        assert set(blobs) == {"disc", "ring"}, f"sample {i}"
        torch.testing.assert_close(torch.stack([blobs["disc"], blobs["ring"]]), relative.centers[i], atol=0.05, rtol=0)
        above_left = bool(blobs["disc"][0] < blobs["ring"][0] and blobs["disc"][1] < blobs["ring"][1])
        assert above_left == bool(relative.labels[i]), f"sample {i}"


def test_relative_circles_are_apart_with_a_margin_on_each_axis(relative):
    offset = relative.centers[:, 1] - relative.centers[:, 0]  # (N, 2)
    r = relative.radii.float()
    assert (offset.abs().amin(dim=1) >= r).all()
    assert (offset.norm(dim=1) >= 2 * r + 2).all()
    # The three negative sign patterns all occur, in roughly equal numbers.
    signs = torch.sign(offset[relative.labels == 0])
    _, counts = torch.unique(signs, dim=0, return_counts=True)
    assert len(counts) == 3 and counts.min() > 0.6 * counts.max()


def test_circle_mask_is_the_inked_area(diagonal, relative):
    masks = circle_masks(diagonal.centers, diagonal.radii, IMG)  # (N, H, W)
    assert torch.equal(masks, diagonal.images[:, 0] > 0)
    assert torch.equal(diagonal.circle_mask(7), masks[7])
    # A ring's mask covers the whole object, its dark hole included.
    mask = relative.circle_mask(0)
    assert not (relative.images[0, 0][~mask] > 0).any()
    ring_row, ring_col = relative.centers[0, 1].long()
    assert mask[ring_row, ring_col] and relative.images[0, 0, ring_row, ring_col] == 0


@pytest.mark.parametrize("task", ["diagonal", "relative"])
@pytest.mark.parametrize("num_samples", [100, 101])
def test_classes_are_balanced(task, num_samples):
    labels = TwoCirclesDataset(num_samples=num_samples, task=task).labels
    assert labels.dtype == torch.int64
    assert set(labels.tolist()) == {0, 1}
    assert abs(int(labels.sum()) * 2 - num_samples) <= 1


def test_noise_is_additive_gaussian_with_the_given_std():
    ds = TwoCirclesDataset(num_samples=500, noise=0.1, seed=3)
    clean = render_circles(ds.centers, ds.radii, IMG, "diagonal")
    residual = ds.images[:, 0] - clean
    assert abs(residual.std().item() - 0.1) < 0.002
    assert abs(residual.mean().item()) < 0.002


def test_three_channels_repeat_the_grey_image():
    ds = TwoCirclesDataset(num_samples=20, in_chans=3)
    image, label = ds[0]
    assert image.shape == (3, IMG, IMG) and image.dtype == torch.float32
    assert torch.equal(image[0], image[1]) and torch.equal(image[0], image[2])
    assert label.dtype == torch.int64


@pytest.mark.parametrize("task", ["diagonal", "relative"])
def test_same_seed_same_data_other_seed_other_data(task):
    a, b, c = (TwoCirclesDataset(num_samples=200, task=task, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.centers, b.centers) and torch.equal(a.radii, b.radii)
    assert not torch.equal(a.images, c.images)
    assert not torch.equal(a.centers, c.centers)


@pytest.mark.parametrize("task", ["diagonal", "relative"])
def test_regions_split_centre_positions(task):
    t = region_threshold(IMG, (3, 5))
    seen = {}
    for region in ("all", "inner", "border"):
        ds = TwoCirclesDataset(num_samples=1000, task=task, region=region, seed=4)
        e = distance_to_area_side(ds.centers, IMG, task)  # (N, 2)
        assert (e >= ds.radii[:, None]).all()  # every circle stays inside its area
        seen[region] = e
    assert (seen["inner"] >= t).all()
    assert (seen["border"] < t).all()
    # "all" covers both: it has centres on either side of the threshold.
    assert (seen["all"] >= t).any() and (seen["all"] < t).any()


def test_region_threshold_for_the_default_images():
    # Halfway between the closest approach of a radius-5 circle and the middle of a quadrant.
    assert region_threshold(32, (3, 5)) == (5 + 8) / 2


def image_hashes(ds: TwoCirclesDataset) -> set[str]:
    return {hashlib.sha1(img.contiguous().numpy().tobytes()).hexdigest() for img in ds.images}


@pytest.mark.parametrize("task", ["diagonal", "relative"])
def test_datamodule_splits_are_sized_and_disjoint(task):
    dm = TwoCirclesDataModule(task=task, noise=0.0, num_train=700, num_val=300, num_test=400)
    dm.setup("fit")
    dm.setup("test")
    assert [len(dm.train_set), len(dm.val_set), len(dm.test_set)] == [700, 300, 400]
    # Equal sizes: splits that shared a seed would then be identical, not merely overlapping.
    dm = TwoCirclesDataModule(task=task, noise=0.0, num_train=500, num_val=500, num_test=500)
    dm.setup("fit")
    dm.setup("test")
    train, val, test = (image_hashes(s) for s in (dm.train_set, dm.val_set, dm.test_set))
    assert len(train) == len(val) == len(test) == 500  # no duplicate inside a split either
    assert not (train & val) and not (train & test) and not (val & test)


def test_validation_split_does_not_depend_on_train_size():
    small, big = (TwoCirclesDataModule(num_train=n, num_val=100, num_test=10) for n in (100, 200))
    small.setup("validate")
    big.setup("validate")
    assert torch.equal(small.val_set.images, big.val_set.images)


def test_datamodule_regions_apply_to_their_splits():
    dm = TwoCirclesDataModule(num_train=200, num_val=100, num_test=200, train_region="inner", test_region="border")
    dm.setup("fit")
    dm.setup("test")
    t = region_threshold(IMG, (3, 5))
    for split in (dm.train_set, dm.val_set):
        assert (distance_to_area_side(split.centers, IMG, "diagonal") >= t).all()
    assert (distance_to_area_side(dm.test_set.centers, IMG, "diagonal") < t).all()


def test_datamodule_properties_before_setup():
    dm = TwoCirclesDataModule(img_size=24, in_chans=3, radius=(2, 4))
    assert (dm.num_classes, dm.img_size, dm.in_chans) == (2, 24, 3)
    assert dm.hparams.radius == (2, 4) and dm.hparams.batch_size == 128


def test_each_dataloader_yields_image_batches():
    dm = TwoCirclesDataModule(in_chans=3, num_train=100, num_val=50, num_test=60, batch_size=16)
    dm.setup("fit")
    dm.setup("test")
    dm.setup("predict")
    loaders = [dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()]
    for loader in loaders:
        images, labels = next(iter(loader))
        assert images.shape == (16, 3, IMG, IMG) and images.dtype == torch.float32
        assert labels.shape == (16,) and labels.dtype == torch.int64
    assert len(dm.predict_dataloader().dataset) == 60  # predict serves the test split
    # Training batches are shuffled, evaluation batches keep the dataset order.
    torch.manual_seed(0)
    assert not torch.equal(torch.cat([b[0] for b in dm.train_dataloader()]), dm.train_set.images)
    assert torch.equal(torch.cat([b[0] for b in dm.val_dataloader()]), dm.val_set.images)


BAD_DATASET_ARGS = [
    (dict(task="square"), "task='square'"),
    (dict(region="middle"), "region='middle'"),
    (dict(num_samples=0), "num_samples=0"),
    (dict(img_size=6), "img_size=6"),
    (dict(img_size=33), "img_size=33"),
    (dict(in_chans=2), "in_chans=2"),
    (dict(noise=-0.1), "noise=-0.1"),
    (dict(seed=-1), "seed=-1"),
    (dict(radius=(3, 9)), "radius=(3, 9)"),  # a 32x32 quadrant holds radius <= 8
    (dict(radius=(3, 8), region="border"), "radius=(3, 8)"),  # no room left to move
    (dict(radius=(5, 3)), "radius=(5, 3)"),
    (dict(radius=(0, 3)), "radius=(0, 3)"),
    (dict(radius=(3, 4.5)), "radius=(3, 4.5)"),
    (dict(radius=3), "radius=3"),
    (dict(radius=(2, 4), task="relative"), "radius=(2, 4)"),  # a ring needs radius >= 3
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_DATASET_ARGS)
def test_bad_dataset_arguments_raise_naming_the_value(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        TwoCirclesDataset(**{"num_samples": 10, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(task="square"), "task='square'"),
        (dict(train_region="middle"), "train_region='middle'"),
        (dict(test_region="edge"), "test_region='edge'"),
        (dict(num_train=0), "num_train=0"),
        (dict(num_val=-5), "num_val=-5"),
        (dict(num_test=0), "num_test=0"),
        (dict(batch_size=0), "batch_size=0"),
        (dict(num_workers=-1), "num_workers=-1"),
        (dict(radius=(3, 8), test_region="inner"), "radius=(3, 8)"),
    ],
)
def test_bad_datamodule_arguments_raise_at_construction(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        TwoCirclesDataModule(**kwargs)


def test_allowed_values_are_listed_in_the_error():
    with pytest.raises(ValueError, match=re.escape("['all', 'inner', 'border']")):
        TwoCirclesDataset(num_samples=10, region="corner")
    with pytest.raises(ValueError, match=re.escape("['diagonal', 'relative']")):
        TwoCirclesDataset(num_samples=10, task="corner")
