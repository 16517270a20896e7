"""CIFARDataModule on small generated folders in CIFAR's own format: no network needed."""

import urllib.error
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision import datasets

from vit.data.cifar import (
    CIFAR_MEAN_STD,
    CIFARDataModule,
    CIFARNotFoundError,
)
from vit.data.resumable import ResumableSampler

NUM_TRAIN, NUM_TEST, VAL_SIZE = 60, 20, 12


@pytest.fixture
def make_dm(fake_cifar):
    """Build a CIFARDataModule on a generated folder; no augmentation unless asked, no workers."""

    def make(dataset="cifar10", **kwargs):
        options = dict(
            dataset=dataset,
            data_dir=str(fake_cifar(dataset, num_train=NUM_TRAIN, num_test=NUM_TEST)),
            download=False,
            val_size=VAL_SIZE,
            batch_size=8,
            num_workers=0,
            random_crop=False,
            horizontal_flip=False,
        )
        options.update(kwargs)
        return CIFARDataModule(**options)

    return make


def test_properties_known_right_after_init():
    dm10 = CIFARDataModule(dataset="cifar10")
    dm100 = CIFARDataModule(dataset="cifar100")
    assert (dm10.num_classes, dm10.img_size, dm10.in_chans) == (10, 32, 3)
    assert (dm100.num_classes, dm100.img_size, dm100.in_chans) == (100, 32, 3)
    assert dm100.hparams.dataset == "cifar100" and dm100.hparams.batch_size == 128


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_batches_are_normalised_float_images_with_int64_labels(make_dm, dataset):
    dm = make_dm(dataset, random_crop=True, horizontal_flip=True)
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64
    assert 0 <= y.min() and y.max() < dm.num_classes

    # The eval transform is exactly (pixel / 255 - mean) / std on torchvision's decoded pixels.
    eval_full = dm.val_set.dataset
    index = dm.val_set.indices[0]
    raw = torch.from_numpy(eval_full.data[index]).permute(2, 0, 1).float() / 255  # (3, 32, 32)
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR_MEAN_STD[dataset])
    image, label = dm.val_set[0]
    torch.testing.assert_close(image, (raw - mean) / std)
    assert label == eval_full.targets[index]


def test_splits_are_seeded_disjoint_and_cover_the_training_set(make_dm):
    dm = make_dm(seed=3)
    dm.setup()
    train_idx, val_idx = set(dm.train_set.indices), set(dm.val_set.indices)
    assert len(dm.train_set) == NUM_TRAIN - VAL_SIZE and len(dm.val_set) == VAL_SIZE
    assert train_idx.isdisjoint(val_idx) and train_idx | val_idx == set(range(NUM_TRAIN))
    assert len(dm.test_set) == NUM_TEST

    same_seed, other_seed = make_dm(seed=3), make_dm(seed=4)
    same_seed.setup("fit")
    other_seed.setup("fit")
    assert same_seed.val_set.indices == dm.val_set.indices
    assert other_seed.val_set.indices != dm.val_set.indices


def test_val_size_must_leave_training_images(make_dm):
    dm = make_dm(val_size=NUM_TRAIN)
    with pytest.raises(ValueError, match=f"val_size={NUM_TRAIN} must be smaller than the {NUM_TRAIN} training"):
        dm.setup("fit")


def test_validation_is_not_augmented_but_training_is(make_dm):
    dm = make_dm(random_crop=True, horizontal_flip=True, auto_augment="randaugment", random_erasing=0.5)
    dm.setup("fit")
    assert dm.val_set.dataset.transform is dm.eval_transform
    assert dm.train_set.dataset.transform is dm.train_transform

    first = torch.cat([x for x, _ in dm.val_dataloader()])
    second = torch.cat([x for x, _ in dm.val_dataloader()])
    torch.testing.assert_close(first, second, rtol=0, atol=0)

    torch.manual_seed(0)
    train_view = dm.train_set.dataset  # same files as validation, training transforms
    index = dm.val_set.indices[0]
    draws = [train_view[index][0] for _ in range(5)]
    assert any(not torch.equal(d, dm.val_set[0][0]) for d in draws)


def test_no_augmentation_means_train_equals_eval(make_dm):
    dm = make_dm(random_crop=False, horizontal_flip=False, auto_augment="none", random_erasing=0.0)
    dm.setup("fit")
    train_view, eval_view = dm.train_set.dataset, dm.val_set.dataset  # both over all training files
    for i in range(5):
        torch.testing.assert_close(train_view[i][0], eval_view[i][0], rtol=0, atol=0)


def _pil(dm, index=0):
    """A PIL image and its eval tensor, as torchvision's dataset produces them."""
    eval_full = datasets.CIFAR10(dm.data_dir, train=True)
    image = eval_full[index][0]
    return image, dm.eval_transform(image)


def test_horizontal_flip_gives_the_image_or_its_mirror(make_dm):
    dm = make_dm(horizontal_flip=True)
    image, reference = _pil(dm)
    torch.manual_seed(0)
    outputs = [dm.train_transform(image) for _ in range(20)]
    assert all(torch.equal(o, reference) or torch.equal(o, reference.flip(-1)) for o in outputs)
    assert any(torch.equal(o, reference) for o in outputs)
    assert any(torch.equal(o, reference.flip(-1)) for o in outputs)


def test_random_crop_is_a_shift_of_the_zero_padded_image(make_dm):
    dm = make_dm(random_crop=True)
    image, reference = _pil(dm)
    # Zero padding happens on uint8 pixels, so padded pixels normalise to -mean / std.
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR_MEAN_STD["cifar10"])
    padded = ((0 - mean) / std).expand(3, 40, 40).clone()
    padded[:, 4:36, 4:36] = reference
    shifts = {(dy, dx): padded[:, dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)}
    torch.manual_seed(0)
    found = set()
    for _ in range(20):
        out = dm.train_transform(image)
        matches = [s for s, crop in shifts.items() if torch.allclose(out, crop, atol=1e-6)]
        assert matches, "a random crop is not any 32x32 window of the 4-pixel zero-padded image"
        found.update(matches)
    assert len(found) > 1  # it does move


def test_random_erasing_zeroes_one_rectangle(make_dm):
    dm = make_dm(random_erasing=1.0)
    image, reference = _pil(dm)
    torch.manual_seed(0)
    out = dm.train_transform(image)
    changed = (out != reference).any(0)  # (32, 32)
    assert changed.any()
    assert torch.all(out[:, changed] == 0)
    rows, cols = changed.any(1).nonzero(), changed.any(0).nonzero()
    box = changed[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    # Erased pixels that happened to be 0 already count as unchanged, so allow a few holes.
    assert box.float().mean() > 0.9


@pytest.mark.parametrize(
    ("auto_augment", "transform_cls"),
    [("randaugment", "RandAugment"), ("trivialaugment", "TrivialAugmentWide"), ("autoaugment", "AutoAugment")],
)
def test_auto_augment_policies_change_the_image(make_dm, auto_augment, transform_cls):
    dm = make_dm(auto_augment=auto_augment, randaugment_num_ops=3, randaugment_magnitude=12)
    names = [type(t).__name__ for t in dm.train_transform.transforms]
    assert transform_cls in names
    policy = dm.train_transform.transforms[names.index(transform_cls)]
    if auto_augment == "randaugment":
        assert (policy.num_ops, policy.magnitude) == (3, 12)
    if auto_augment == "autoaugment":
        assert policy.policy.value == "cifar10"

    image, reference = _pil(dm)
    torch.manual_seed(0)
    outputs = [dm.train_transform(image) for _ in range(10)]
    assert all(o.shape == (3, 32, 32) and o.dtype == torch.float32 for o in outputs)
    assert any(not torch.equal(o, reference) for o in outputs)


def _training_batch(dm):
    dm.setup("fit")
    dm.trainer = SimpleNamespace(
        training=True, world_size=1, global_rank=0
    )  # the hook reads trainer.training; the sampler its processes
    torch.manual_seed(0)  # shuffling
    np.random.seed(0)  # timm draws the mixing weight and box with numpy
    x, y = next(iter(dm.train_dataloader()))
    return x, y


def test_mixup_mixes_images_and_returns_hard_and_soft_labels(make_dm):
    dm = make_dm(mixup_alpha=1.0)
    x, y = _training_batch(dm)
    x_original = x.clone()
    x_mixed, y_out, y_soft = dm.on_after_batch_transfer((x, y), 0)

    assert torch.equal(y_out, y)
    assert y_soft.shape == (8, 10) and y_soft.dtype == torch.float32
    torch.testing.assert_close(y_soft.sum(1), torch.ones(8))
    # Mixup is a blend with the flipped batch: both images and targets, with the same weight.
    y_flip = y.flip(0)
    row = int((y != y_flip).nonzero()[0])  # a row whose two labels differ shows the weight
    lam = y_soft[row, y[row]]
    assert 0 < lam < 1
    torch.testing.assert_close(y_soft, lam * F.one_hot(y, 10) + (1 - lam) * F.one_hot(y_flip, 10))
    torch.testing.assert_close(x_mixed, lam * x_original + (1 - lam) * x_original.flip(0))
    assert all(int(a) in (int(b), int(c)) for a, b, c in zip(y_soft.argmax(1), y, y_flip))


def test_cutmix_pastes_a_patch_of_the_flipped_batch(make_dm):
    dm = make_dm(cutmix_alpha=1.0)
    x, y = _training_batch(dm)
    x_original = x.clone()
    x_mixed, _, y_soft = dm.on_after_batch_transfer((x, y), 0)

    from_self = (x_mixed == x_original).all(1)  # (B, 32, 32)
    from_flip = (x_mixed == x_original.flip(0)).all(1)
    assert torch.all(from_self | from_flip)
    # The weight of the flipped labels is the area of the pasted patch.
    y_flip = y.flip(0)
    row = int((y != y_flip).nonzero()[0])
    pasted = (~from_self[row]).float().mean()
    assert 0 < pasted < 1
    torch.testing.assert_close(y_soft[row, y_flip[row]], pasted, atol=1e-6, rtol=0)
    torch.testing.assert_close(y_soft.sum(1), torch.ones(8))


def test_batches_pass_unchanged_outside_training_or_without_mixing(make_dm):
    dm = make_dm(mixup_alpha=1.0)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    for trainer in [None, SimpleNamespace(training=False, world_size=1, global_rank=0)]:
        dm.trainer = trainer
        assert dm.on_after_batch_transfer(batch, 0) is batch

    plain = make_dm()
    plain.trainer = SimpleNamespace(training=True, world_size=1, global_rank=0)
    assert plain.on_after_batch_transfer(batch, 0) is batch


def test_dataloaders_shuffle_and_drop_last_only_for_training(make_dm):
    dm = make_dm(num_workers=0, persistent_workers=True)
    dm.setup()
    train, val, test = dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()
    assert train.drop_last and not val.drop_last and not test.drop_last
    assert isinstance(train.sampler, ResumableSampler) and train.sampler.shuffle
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)
    assert not train.persistent_workers  # needs workers
    assert len(list(test)) == -(-NUM_TEST // 8)
    assert len(dm.predict_dataloader().dataset) == NUM_TEST

    with_workers = make_dm(num_workers=2)
    with_workers.setup("fit")
    assert with_workers.train_dataloader().persistent_workers

    too_big = make_dm(batch_size=64)
    too_big.setup("fit")
    with pytest.raises(ValueError, match="batch_size=64 is larger than the 48 training images"):
        too_big.train_dataloader()


def test_missing_data_without_download_names_folder_files_and_remedy(tmp_path):
    dm = CIFARDataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(CIFARNotFoundError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert str(tmp_path / "cifar-10-batches-py") in message
    for name in ["data_batch_1", "data_batch_5", "test_batch", "batches.meta"]:
        assert name in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert "data.download: true" in message
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(CIFARNotFoundError):
        dm.setup("fit")

    dm100 = CIFARDataModule(dataset="cifar100", data_dir=str(tmp_path), download=False)
    with pytest.raises(CIFARNotFoundError) as err100:
        dm100.prepare_data()
    message100 = str(err100.value)
    assert str(tmp_path / "cifar-100-python") in message100
    assert "train, test, meta" in message100
    assert "cifar-100-python.tar.gz" in message100


def test_failed_download_is_reported_as_missing_data(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(datasets.cifar, "download_and_extract_archive", no_network)
    dm = CIFARDataModule(data_dir=str(tmp_path), download=True)
    with pytest.raises(CIFARNotFoundError, match="The download failed: .*name resolution") as err:
        dm.prepare_data()
    assert str(tmp_path / "cifar-10-batches-py") in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dataset="cifar1000"), r"dataset='cifar1000'.*\['cifar10', 'cifar100'\]"),
        (dict(auto_augment="randaug"), r"auto_augment='randaug'.*'randaugment', 'trivialaugment'"),
        (dict(val_size=0), "val_size=0 is not allowed: expected an int >= 1"),
        (dict(batch_size=-1), "batch_size=-1 is not allowed: expected an int >= 1"),
        (dict(random_erasing=1.5), r"random_erasing=1.5 is not allowed: expected a finite number in \[0, 1\]"),
        (dict(mixup_prob=-0.1), r"mixup_prob=-0.1 is not allowed: expected a finite number in \[0, 1\]"),
        (dict(mixup_switch_prob=2.0), r"mixup_switch_prob=2.0 is not allowed: expected a finite number in \[0, 1\]"),
        (dict(mixup_alpha=-1.0), r"mixup_alpha=-1.0 is not allowed: expected a finite number in \[0, inf\)"),
        (dict(cutmix_alpha=-1.0), r"cutmix_alpha=-1.0 is not allowed: expected a finite number in \[0, inf\)"),
        (dict(mixup_alpha=0.8, batch_size=7), "batch_size=7 must be even"),
        (dict(randaugment_magnitude=31), r"randaugment_magnitude=31 is not allowed: expected an int in \[0, 30\]"),
    ],
)
def test_invalid_options_name_the_value_and_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CIFARDataModule(**kwargs)


class _RecordBatches(L.LightningModule):
    """A linear classifier that records the length of the batches each step receives."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(3 * 32 * 32, 10)
        self.seen = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(len(batch))
        x, y, y_soft = batch
        return F.cross_entropy(self.head(x.flatten(1)), y_soft, label_smoothing=0.1)

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(len(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_mixes_training_batches_only(make_dm):
    dm = make_dm(mixup_alpha=0.8, cutmix_alpha=1.0)
    model = _RecordBatches()
    trainer = L.Trainer(
        fast_dev_run=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen == {"train": [3, 3], "val": [2, 2]}


def test_repeated_augmentation_shows_each_image_k_times_in_an_epoch_of_the_same_length():
    data = list(range(12))
    sampler = ResumableSampler(data, seed=5, repeats=3)
    sampler.set_epoch(2)
    order = list(sampler)
    assert len(order) == 12  # the epoch keeps the dataset's length
    runs = [order[i : i + 3] for i in range(0, 12, 3)]
    assert all(len(set(r)) == 1 for r in runs) and len({r[0] for r in runs}) == 4  # 4 images, 3 copies each, in a row
    # The same images as the first quarter of the plain permutation of that epoch (DeiT's RASampler).
    plain = ResumableSampler(data, seed=5)
    plain.set_epoch(2)
    assert [r[0] for r in runs] == list(plain)[:4]
    # Two processes get the copies of one image alternately: each sees it, augmented on its own.
    shards = [list(ResumableSampler(data, seed=5, repeats=2, num_replicas=2, rank=r)) for r in (0, 1)]
    assert shards[0] == shards[1]
    # Resuming mid-epoch continues exactly.
    resumed = ResumableSampler(data, seed=5, repeats=3)
    resumed.resume_at(2, 7)
    assert list(resumed) == order[7:]


def test_upsampling_and_pretrained_normalisation_for_fine_tuning(make_dm):
    from timm.data import IMAGENET_INCEPTION_MEAN

    dm = make_dm(img_size=64, normalization="inception", random_crop=False, horizontal_flip=False)
    assert dm.img_size == 64 and dm.normalization[0] == tuple(IMAGENET_INCEPTION_MEAN)
    dm.setup("fit")
    x, _ = dm.val_set[0]
    assert x.shape == (3, 64, 64)
    plain = make_dm()
    plain.setup("fit")
    small, _ = plain.val_set[0]  # the same image, CIFAR-normalised at 32 x 32
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in CIFAR_MEAN_STD["cifar10"])
    pixels = small * std + mean  # back to [0, 1]
    up = F.interpolate(pixels[None], size=64, mode="bicubic", align_corners=False, antialias=True)[0]
    # Upsampled from the 8-bit image (not from the normalised tensor): equal up to rounding.
    assert (x * 0.5 + 0.5 - up).abs().mean() < 0.02
