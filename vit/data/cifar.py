"""CIFAR-10 / CIFAR-100 as a LightningDataModule, with the augmentations ViTs need on small data: decoded by
torchvision's CIFAR datasets, augmented per image in the DataLoader workers, mixed per batch (timm) on the device."""

import pickle
from pathlib import Path
from typing import Literal

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision import datasets
from torchvision.datasets.utils import check_integrity
from torchvision.transforms import v2

from vit.checks import check_choice, check_int, check_size
from vit.data.base import DataNotFoundError, SplitDataModule
from vit.data.transforms import (
    CIFAR_MEAN_STD,
    MEAN_STD,
    AutoAugmentName,
    DatasetName,
    batch_mixup,
    build_eval_transform,
    train_transform,
)

DATASETS: dict[str, type[datasets.CIFAR10]] = {"cifar10": datasets.CIFAR10, "cifar100": datasets.CIFAR100}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
DISPLAY_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}

# What torchvision reads from data_dir/<folder>/; used to say what is missing.
EXPECTED_FILES = {
    name: (cls.base_folder, [file for file, _ in (*cls.train_list, *cls.test_list)] + [cls.meta["filename"]])
    for name, cls in DATASETS.items()
}


class CIFARNotFoundError(DataNotFoundError):
    """The CIFAR files are not in `data_dir` and could not be downloaded."""


class CIFARCorruptedError(CIFARNotFoundError):
    """Some CIFAR files are in `data_dir` but unusable: unreadable, or not the official content."""


class CIFARDataModule(SplitDataModule):
    """CIFAR-10 or CIFAR-100: a seeded train/val split of the official training set (`val_size` images held out, never
    augmented), and its test set for `test` and `predict`. Training augmentations: `random_crop` (32x32 out of the image
    zero-padded by 4), then `train_transform`'s; the training loader drops its last incomplete batch.
    `repeated_augmentation=k` shows each image k times in a row. Missing files raise `CIFARNotFoundError`, unreadable or
    unofficial ones `CIFARCorruptedError`, before training.

    For a pretrained model: `img_size` upsamples the images (bicubic, after the augmentations) to its resolution (a
    side, or `[H, W]`), and `normalization` uses its statistics ("imagenet" or "inception") instead of "cifar"."""

    interpolation = "bicubic"  # the upsampling of `img_size` (`vit.data.transforms`)
    in_chans = 3

    def __init__(
        self,
        *,
        dataset: DatasetName = "cifar10",
        data_dir: str = "data",
        download: bool = True,
        val_size: int = 5000,
        seed: int = 0,
        batch_size: int = 128,
        num_workers: int = 4,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        random_crop: bool = True,
        horizontal_flip: bool = True,
        auto_augment: AutoAugmentName = "none",
        randaugment_num_ops: int = 2,
        randaugment_magnitude: int = 9,
        random_erasing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        img_size: int | tuple[int, int] = 32,
        normalization: Literal["cifar", "imagenet", "inception"] = "cifar",
        repeated_augmentation: int = 1,
    ) -> None:
        super().__init__()
        check_choice("dataset", dataset, DatasetName)
        check_int("val_size", val_size, 1)
        check_int("batch_size", batch_size, 1)
        check_int("num_workers", num_workers, 0)
        self.mixup = batch_mixup(
            NUM_CLASSES[dataset],
            batch_size=batch_size,
            mixup_alpha=mixup_alpha,
            cutmix_alpha=cutmix_alpha,
            mixup_prob=mixup_prob,
            mixup_switch_prob=mixup_switch_prob,
        )
        self.save_hyperparameters()
        self.dataset, self.data_dir, self.download, self.val_size = dataset, data_dir, download, val_size
        self.seed, self.batch_size, self.num_workers = seed, batch_size, num_workers
        self.pin_memory, self.persistent_workers = pin_memory, persistent_workers
        self.num_classes = NUM_CLASSES[dataset]
        size = check_size("img_size", img_size, 32)  # (H, W) from a side or [H, W]: the 32x32 images are only upsampled
        check_choice("normalization", normalization, ("cifar", "imagenet", "inception"))
        check_int("repeated_augmentation", repeated_augmentation, 1)
        self.eval_transform = build_eval_transform(dataset, size, self.normalization)
        self.train_transform = train_transform(
            [v2.RandomCrop(32, padding=4)] if random_crop else [],
            self.eval_transform.transforms,
            policy=v2.AutoAugmentPolicy.CIFAR10,
            horizontal_flip=horizontal_flip,
            auto_augment=auto_augment,
            randaugment_num_ops=randaugment_num_ops,
            randaugment_magnitude=randaugment_magnitude,
            random_erasing=random_erasing,
        )
        self._class_names: list[str] | None = None

    @property
    def class_names(self) -> list[str]:
        """The label names in the dataset's meta file, read as torchvision reads them once the files are checked."""
        if self._class_names is None:
            self._check_files()
            meta = DATASETS[self.dataset].meta  # {"filename", "key", "md5"}
            with open(self.folder / meta["filename"], "rb") as f:
                self._class_names = [str(name) for name in pickle.load(f, encoding="latin1")[meta["key"]]]
        return self._class_names

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel `(mean, std)` after scaling pixels to [0, 1]: the dataset's own, or timm's (`MEAN_STD`)."""
        name = self.hparams.normalization
        return CIFAR_MEAN_STD[self.dataset] if name == "cifar" else MEAN_STD[name]

    @property
    def folder(self) -> Path:
        """The folder torchvision reads, e.g. `data/cifar-10-batches-py`."""
        return Path(self.data_dir).absolute() / EXPECTED_FILES[self.dataset][0]

    def missing_files(self) -> list[str]:
        """Names of the expected files that are not in `folder`."""
        return [name for name in EXPECTED_FILES[self.dataset][1] if not (self.folder / name).is_file()]

    def unusable_files(self) -> dict[str, str]:
        """Expected files that are present but cannot be used, each with the reason."""
        dataset_cls, problems = DATASETS[self.dataset], {}
        for name, md5 in [
            *dataset_cls.train_list,
            *dataset_cls.test_list,
            (dataset_cls.meta["filename"], dataset_cls.meta["md5"]),
        ]:
            path = self.folder / name
            if not path.is_file():
                continue  # reported by missing_files
            try:
                if not check_integrity(str(path), md5):
                    problems[name] = (
                        "is not the official file (its MD5 differs): truncated, corrupted or from another dataset"
                    )
            except OSError as err:
                problems[name] = f"cannot be read ({err.strerror or err})"
        return problems

    def prepare_data(self) -> None:
        """Download the archive if `download` is true and it is not there yet; fail early if it is missing."""
        if self.download:
            try:  # torchvision checks the MD5 of the files first and fetches only when they do not match
                DATASETS[self.dataset](self.data_dir, train=True, download=True)
            except OSError as err:  # URLError, HTTPError, timeouts and DNS failures are all OSErrors
                if not self.missing_files() and self.unusable_files():
                    raise CIFARCorruptedError(
                        self._corrupted_message(f"Downloading fresh copies failed: {err}")
                    ) from err
                raise CIFARNotFoundError(self._not_found_message(f"The download failed: {err}")) from err
        self._check_files()

    def setup(self, stage: str | None = None) -> None:
        self._check_files()  # setup also runs where prepare_data did not (other ranks, notebooks)
        dataset_cls = DATASETS[self.dataset]
        if stage in ("fit", "validate", None) and self.train_set is None:
            # Two dataset objects over the same files: the validation images get the eval transforms.
            train_full = dataset_cls(self.data_dir, train=True, transform=self.train_transform)
            eval_full = dataset_cls(self.data_dir, train=True, transform=self.eval_transform)
            n = len(train_full)
            if self.val_size >= n:
                raise ValueError(
                    f"val_size={self.val_size} must be smaller than the {n} training images in {self.folder}"
                )
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
            self.val_set = Subset(eval_full, order[: self.val_size])
            self.train_set = Subset(train_full, order[self.val_size :])
        if stage in ("test", "predict", None) and self.test_set is None:
            self.test_set = dataset_cls(self.data_dir, train=False, transform=self.eval_transform)

    def train_dataloader(self) -> DataLoader:
        if len(self.train_set) < self.batch_size:  # drop_last would leave no batch, and training would do nothing
            raise ValueError(f"batch_size={self.batch_size} is larger than the {len(self.train_set)} training images")
        return super().train_dataloader()

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        # drop_last also keeps every training batch even-sized for Mixup/CutMix.
        return super()._loader(
            dataset,
            train,
            drop_last=train,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            repeats=self.hparams.repeated_augmentation,
        )

    def _check_files(self) -> None:
        if self.missing_files():
            hint = "" if self.download else "Nothing was downloaded: data.download is false."
            raise CIFARNotFoundError(self._not_found_message(hint))
        if self.unusable_files():
            raise CIFARCorruptedError(self._corrupted_message(""))

    def _corrupted_message(self, reason: str) -> str:
        data_dir = Path(self.data_dir).absolute()
        lines = [f"{DISPLAY_NAMES[self.dataset]} files in {self.folder} cannot be used:"]
        lines += [f"  {name} {problem}" for name, problem in self.unusable_files().items()]
        lines += [reason] if reason else []
        lines += [
            "To fix it, either:",
            f"  - download {DATASETS[self.dataset].url} and extract it into {data_dir} (replacing those files), or",
            f"  - delete {self.folder} and set `data.download: true` on a machine with network access.",
        ]
        return "\n".join(lines)

    def _not_found_message(self, reason: str) -> str:
        folder_name, files = EXPECTED_FILES[self.dataset]
        data_dir, missing = Path(self.data_dir).absolute(), self.missing_files()
        lines = [
            f"{DISPLAY_NAMES[self.dataset]} is not in {self.folder}"
            + (f" (missing: {', '.join(missing)})." if missing else "."),
            *([reason] if reason else []),
            f"Expected {folder_name}/ in data_dir={data_dir} holding: {', '.join(files)}.",
            "To get it, either:",
            f"  - download {DATASETS[self.dataset].url} and extract it into {data_dir}, or",
            "  - set `data.download: true` (command line: --data.download true) on a machine with network access.",
        ]
        return "\n".join(lines)
