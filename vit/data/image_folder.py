"""Your own images: one sub-folder per class (torchvision's `ImageFolder` layout), as a LightningDataModule.

    my_images/cats/001.jpg, my_images/dogs/002.png, ...            a seeded train/val/test split
    my_images/train/cats/..., my_images/val/cats/..., [test/...]   the splits as given

A split without a folder of its own is drawn from the training images; which file went where is `split_files`
and `split.json` in the run folder (`run_files`, written by the run). `setup` lists the files by name and reads
none (0.23 s for 40,000 photos, `benchmarks/folder_start.py`); a file that fails to decode is skipped when a loader
reads it, named once and counted per epoch (`UnreadableImages`)."""

from __future__ import annotations

import json
import os
import warnings
from functools import partial, partialmethod
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from vit.checks import check_choice, check_float, check_int, check_size
from vit.data.base import SplitDataModule
from vit.data.files import first_skipped, list_files, text_name, visible_folders
from vit.data.images import ListedImageFolder, UnreadableImageError, build_transform, decode_image, image_extensions
from vit.data.readable_split import NoReadableImageError, ReadableSplit
from vit.data.transforms import MEAN_STD, AutoAugmentName, batch_mixup, train_transform

Normalization = Literal["imagenet", "inception", "none"]  # "none": pixels in [0, 1]; else `MEAN_STD`'s
SPLITS = ("train", "val", "test")
LAYOUTS = (
    "root/<class>/<image> (split into train, val and test by val_fraction and test_fraction) or "
    "root/train/<class>/<image> with optional root/val/ and root/test/ beside it"
)


class ImageFolderDataModule(SplitDataModule):
    """Train / val / test splits of a folder of class folders, resized to `img_size` (a side, or `[H, W]`).

    Args:
        root: with `train/` inside, `train/`, `val/` and `test/` are used as given (each missing one split off
            `train/`); otherwise `root`'s class folders are split three ways.
        val_fraction: share of the images held out for validation when there is no `val/` (seeded by `seed`).
        test_fraction: share held out for the test when there is no `test/`, after the validation images. 0 makes
            the validation split the test split too (a score biased upward).
        normalization: the mean/std the pretrained weights expect: "imagenet", "inception" (0.5/0.5) or "none".
        random_resized_crop: `RandomResizedCrop` for training (else a resize), then `train_transform`'s
            augmentations (ImageNet's policy for "autoaugment")."""

    def __init__(
        self,
        *,
        root: str,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 4,
        normalization: Normalization = "imagenet",
        random_resized_crop: bool = True,
        horizontal_flip: bool = True,
        auto_augment: AutoAugmentName = "none",
        randaugment_num_ops: int = 2,
        randaugment_magnitude: int = 9,
        random_erasing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
    ) -> None:
        super().__init__()
        size = self._check_options(
            img_size, in_chans, val_fraction, test_fraction, seed, batch_size, num_workers, normalization
        )
        self.save_hyperparameters()
        self.root = Path(root)
        self.skipped: dict[str, str] = {}  # {path: why} of what the listing left out (`setup`)
        self.unread: dict[str, str] = {}  # {path: why} of the listed files that failed to decode when read
        self.split_files: dict[str, list[str]] = {}  # split -> its files, relative to root (set up by `setup`)
        self._build_transforms(
            size,
            in_chans,
            random_resized_crop,
            horizontal_flip=horizontal_flip,
            auto_augment=auto_augment,
            randaugment_num_ops=randaugment_num_ops,
            randaugment_magnitude=randaugment_magnitude,
            random_erasing=random_erasing,
        )
        self._decode = partial(decode_image, size=size)
        self._scan_classes()  # fail now, before any training: num_classes is linked into the model
        self.mixup = batch_mixup(
            self.num_classes,
            batch_size=batch_size,
            mixup_alpha=mixup_alpha,
            cutmix_alpha=cutmix_alpha,
            mixup_prob=mixup_prob,
            mixup_switch_prob=mixup_switch_prob,
        )

    @staticmethod
    def _check_options(
        img_size: int | tuple[int, int],
        in_chans: int,
        val_fraction: float,
        test_fraction: float,
        seed: int,
        batch_size: int,
        num_workers: int,
        normalization: Normalization,
    ) -> tuple[int, int]:
        """Check the sizes, fractions, counts and normalization given to `__init__`; return `img_size` as (H, W)."""
        size = check_size("img_size", img_size, 8)  # (H, W)
        check_choice("in_chans", in_chans, (1, 3))
        check_float("val_fraction", val_fraction, 0.0, 1.0, low_open=True, high_open=True)
        check_float("test_fraction", test_fraction, 0.0, 1.0, high_open=True)
        if val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction + test_fraction = {val_fraction + test_fraction:g} leaves no image to "
                "train on: their sum must be below 1"
            )
        for name, value, low in (("seed", seed, 0), ("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            check_int(name, value, low)
        check_choice("normalization", normalization, Normalization)
        if in_chans == 1 and normalization != "none":  # Normalize would broadcast one channel to three
            raise ValueError(
                f"normalization={normalization!r} is a mean and std for 3 (RGB) channels, but in_chans=1: "
                "use normalization='none' for one channel"
            )
        return size

    def _build_transforms(
        self,
        size: tuple[int, int],
        in_chans: int,
        random_resized_crop: bool,
        *,
        horizontal_flip: bool,
        auto_augment: AutoAugmentName,
        randaugment_num_ops: int,
        randaugment_magnitude: int,
        random_erasing: float,
    ) -> None:
        """Set `eval_transform` (resize and normalize) and `train_transform` (crop or resize, then augment)."""
        self.eval_transform = build_transform(size, in_chans, self.normalization)  # what vit.predict uses
        to_tensor = [step for step in self.eval_transform.transforms if not isinstance(step, v2.Resize)]
        crop = v2.RandomResizedCrop(size, antialias=True) if random_resized_crop else v2.Resize(size, antialias=True)
        self.train_transform = train_transform(
            [crop],
            to_tensor,
            policy=v2.AutoAugmentPolicy.IMAGENET,
            horizontal_flip=horizontal_flip,
            auto_augment=auto_augment,
            randaugment_num_ops=randaugment_num_ops,
            randaugment_magnitude=randaugment_magnitude,
            random_erasing=random_erasing,
        )

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel `(mean, std)` applied after scaling pixels to [0, 1] (what `vit.predict` reuses)."""
        return None if self.hparams.normalization == "none" else MEAN_STD[self.hparams.normalization]

    @property
    def class_names(self) -> list[str]:
        """The class folders' names as text (`text_name`), in sorted order: label i is the i-th."""
        return list(self.classes)

    def _folder(self, split: str) -> Path | None:
        folder = self.root / split
        return folder if folder.is_dir() else None

    def _scan_classes(self) -> None:
        if not self.root.is_dir():
            raise FileNotFoundError(f"root={str(self.root)!r} is not a folder")
        folders = visible_folders(self.root)
        # A class named val/ beside the others, or a split named valid/, would train on the wrong labels.
        splits = [name for name in SPLITS if name in folders]
        if splits and "train" not in splits:
            raise ValueError(
                f"{self.root} has {' and '.join(s + '/' for s in splits)} but no train/, so it fits "
                f"neither layout: expected {LAYOUTS}"
            )
        others = [name for name in folders if name not in SPLITS]
        if "train" in folders and others:
            raise ValueError(
                f"{self.root} has train/ beside other folders ({', '.join(o + '/' for o in others)}), "
                f"so it fits neither layout: expected {LAYOUTS}"
            )
        base = self._folder("train") or self.root
        self._folders = visible_folders(base)
        self.classes = [text_name(name) for name in self._folders]
        if not self.classes:
            raise ValueError(f"{base} holds no class folders: expected one sub-folder of images per class")
        if len(self.classes) < 2:
            raise ValueError(f"{base} holds one class folder ({self.classes[0]}): a classifier needs at least two")
        if len(set(self.classes)) < len(self.classes):  # a folder named with a literal "\xff" beside one with the byte
            same = sorted({name for name in self.classes if self.classes.count(name) > 1})
            raise ValueError(
                f"{base} holds class folders whose names read the same as text ({same}): rename one of each"
            )
        self.num_classes = len(self.classes)

    def _listing(self, folder: Path) -> list[tuple[str, int]]:
        """`(path, label)` of every file under `folder`'s class folders named as an image (`image_extensions`), none
        read; what is left out goes to `skipped`. `NoReadableImageError` for a class folder without one."""
        if visible_folders(folder) != self._folders:
            found = [text_name(name) for name in visible_folders(folder)]
            raise ValueError(text_name(f"{folder} has the classes {found}, but the training folder has {self.classes}"))
        listed, left_out = list_files([os.path.join(folder, name) for name in self._folders])
        self.skipped.update(left_out)
        samples = []
        for label, (name, files) in enumerate(zip(self._folders, listed)):
            images = []
            for path in files:
                if (ending := os.path.splitext(path)[1].lower()) in image_extensions():
                    images.append(path)
                else:
                    self.skipped[path] = f"not named as an image ({ending or 'no extension'})"
            if not images:
                class_folder = os.path.join(folder, name)
                inside = {p: why for p, why in sorted(self.skipped.items()) if p.startswith(class_folder + os.sep)}
                left = {os.path.relpath(p, class_folder): why for p, why in inside.items()}
                shown = "; ".join(first_skipped(left, "{name}: {why}", limit=3)) or "no files"
                raise NoReadableImageError(
                    text_name(
                        f"class folder {class_folder} has no image file ({shown}): every class folder needs at "
                        "least one"
                    )
                )
            samples += [(path, label) for path in images]
        return samples

    def _images(
        self, folder: Path, samples: list[tuple[str, int]], transform, indices=None, substitute: bool = True
    ) -> ReadableSplit:
        """The split of `samples` at `indices` (all by default), each file decoded and transformed when read; a file
        that fails to decode is replaced by the next one (`substitute`: training) or left out of its batch."""
        full = ListedImageFolder(str(folder), self._folders, samples, transform=transform, loader=self._decode)
        return ReadableSplit(full, list(range(len(samples))) if indices is None else indices, substitute)

    def _given(self, folder: Path) -> ReadableSplit:
        """An evaluation split given as a folder of its own."""
        return self._images(folder, self._listing(folder), self.eval_transform, substitute=False)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self._make_splits()
        trainer = self.trainer  # counted and named at each epoch's end, by a callback of this data's own
        if trainer is not None and not any(
            isinstance(c, UnreadableImages) and c.data is self for c in trainer.callbacks
        ):
            trainer.callbacks.append(UnreadableImages(self))

    def _make_splits(self) -> None:
        train_dir, val_dir, test_dir = self._folder("train"), self._folder("val"), self._folder("test")
        source = train_dir or self.root
        samples = self._listing(source)
        n = len(samples)
        n_val = 0 if val_dir is not None else max(1, round(self.hparams.val_fraction * n))
        n_test = (
            0
            if test_dir is not None or self.hparams.test_fraction == 0
            else max(1, round(self.hparams.test_fraction * n))
        )
        if n - n_val - n_test < 1:
            raise ValueError(
                f"{source} has {n} image file(s): too few to hold out {n_val} for validation and {n_test} for the test"
            )
        # The order of the listing and this permutation alone decide the split: the same folder and seed, the same.
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.hparams.seed)).tolist()
        val_idx, test_idx, train_idx = order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]
        self.train_set = self._images(source, samples, self.train_transform, train_idx if n_val or n_test else None)
        held_out = self._images(source, samples, self.eval_transform).dataset  # val and test, as the model sees them
        self.val_set = (
            self._given(val_dir) if val_dir is not None else ReadableSplit(held_out, val_idx, substitute=False)
        )
        if test_dir is not None:
            self.test_set = self._given(test_dir)
        else:
            self.test_set = ReadableSplit(held_out, test_idx, substitute=False) if n_test else self.val_set
        splits = (("train", self.train_set), ("val", self.val_set), ("test", self.test_set))
        self.split_files = {name: self._relative(dataset) for name, dataset in splits}
        if self.skipped:
            relative = {os.path.relpath(p, self.root): why for p, why in sorted(self.skipped.items())}
            listed = "; ".join(first_skipped(relative, "{name}: {why}"))
            warnings.warn(text_name(f"skipped {len(self.skipped)} file(s) under {self.root}: {listed}"), stacklevel=3)
            if any(why.startswith("not named as an image") for why in self.skipped.values()):  # what is allowed
                endings = ", ".join(sorted(image_extensions()))
                warnings.warn(f"an image folder lists a file as an image by its name's ending: {endings}", stacklevel=3)

    def folder_of(self, split: str) -> ListedImageFolder:
        """The folder `split` is a part of, its files' `failures` counted in every process."""
        return {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split].dataset

    def report_unread(self, split: str, before: torch.Tensor) -> int:
        """How many files of `split` failed to decode since its folder's `failures` were `before`; each not named
        before is named in one warning, with why (decoded again here: a worker counts, the reason stays there)."""
        part = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]
        dataset, indices = part.dataset, torch.as_tensor(part.indices, dtype=torch.long)  # (n,)
        failed = [dataset.samples[i][0] for i in indices[dataset.failures[indices] != before[indices]].tolist()]
        new = {path: self._why_unread(path) for path in failed if path not in self.unread}
        if new:
            self.unread.update(new)
            relative = {os.path.relpath(path, self.root): why for path, why in sorted(new.items())}
            how = "each replaced by the next image of the split" if part.substitute else "each left out of its batch"
            warnings.warn(
                text_name(
                    f"skipped {len(new)} unreadable image(s) of the {split} split under {self.root}, {how}: "
                    f"{'; '.join(first_skipped(relative, '{name}: {why}'))}"
                ),
                stacklevel=2,
            )
        return len(failed)

    def _why_unread(self, path: str) -> str:
        """Why `path` does not decode (`decode_image`'s reason), or that it did not when the loader read it."""
        try:
            self._decode(path)
        except UnreadableImageError as err:
            return err.reason
        return "could not be decoded when the loader read it (it decodes now)"

    def _relative(self, split: ReadableSplit) -> list[str]:
        """The files of `split`, as text relative to `root`, in its order."""
        prefix, samples = os.path.join(self.root, ""), split.dataset.samples  # listed as `root/...`: a slice is
        return [  # relpath's answer at a tenth of its cost, half of setup's on a big folder
            text_name(path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, self.root))
            for path in (samples[i][0] for i in split.indices)
        ]

    def run_files(self) -> dict[str, str]:
        """`split.json`: `{"root", "train", "val", "test"}`, each split's files under `root`."""
        return {"split.json": json.dumps({"root": text_name(str(self.root)), **self.split_files}, indent=1)}

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        batch_size = self.hparams.batch_size
        drop_last = train and self.mixup is not None  # timm mixes a batch with its flip: every batch even-sized
        if drop_last and len(dataset) < batch_size:  # else no batch at all, and training would silently do nothing
            raise ValueError(
                f"batch_size={batch_size} is larger than the {len(dataset)} training images, and with "
                "Mixup/CutMix the last incomplete batch is dropped"
            )
        return super()._loader(dataset, train, drop_last=drop_last, pin_memory=True)


class UnreadableImages(L.Callback):
    """Each epoch's count of files that failed to decode, per split, logged as `{split}/skipped_images` when there are
    any (this process's count); each such file is named once, in a warning (`report_unread`). `setup` adds it.

    Counted from one epoch's end to the next: a loader's workers read ahead of the epoch's first step."""

    def __init__(self, data: ImageFolderDataModule) -> None:
        self.data, self._seen = data, {}  # split -> its folder's `failures` when last counted

    def _end(self, split: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        failures = self.data.folder_of(split).failures
        before, self._seen[split] = self._seen.get(split, torch.zeros_like(failures)), failures.clone()
        if count := self.data.report_unread(split, before):
            pl_module.log(f"{split}/skipped_images", float(count), on_epoch=True, reduce_fx="sum")

    on_train_epoch_end = partialmethod(_end, "train")
    on_validation_epoch_end = partialmethod(_end, "val")
    on_test_epoch_end = partialmethod(_end, "test")
