"""What every data module here shares: train / val / test / predict loaders over its three splits; and what the
generated two-class tasks share: the seed, the balanced labels and the pixel noise."""

from __future__ import annotations

import signal

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from torch.utils.data import DataLoader, Dataset

from vit.checks import check_choice, check_float, check_int, check_size
from vit.data.images import usable_workers
from vit.data.resumable import ResumableTrainingData


class DataNotFoundError(FileNotFoundError):
    """A data module's files are missing and could not be fetched; the command line reports it in one line."""


class SplitDataModule(ResumableTrainingData, L.LightningDataModule):
    """A data module with `train_set`, `val_set` and `test_set` (built by `setup`; `predict` serves the test split).
    With `mixup` set, training batches `(x, y)` become `(x_mixed, y, y_soft)` on device (`y_soft`: mixed targets)."""

    mixup: Mixup | None = None
    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None
    #: How an image of another size is resized to `img_size` for the model (torchvision's `InterpolationMode` value).
    interpolation: str = "bilinear"

    @property
    def img_size(self) -> int | tuple[int, int]:
        """The images' size in pixels, a side or `(H, W)`, linked into the backbone's `img_size` by the CLI."""
        return self.hparams.img_size

    @property
    def in_chans(self) -> int:
        """The images' channels, linked into the backbone's `in_chans` by the CLI."""
        return self.hparams.in_chans

    @property
    def normalization(self) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """Per-channel ``(mean, std)`` applied after scaling pixels to [0, 1]; ``None``: the pixels as they are."""
        return None

    @property
    def class_names(self) -> list[str]:
        """The name of each label, index by index: what a model folder records and the dashboards show."""
        raise NotImplementedError(f"{type(self).__name__} must name its classes (class_names)")

    def missing_files(self) -> list[str]:
        """The files `prepare_data` has yet to fetch (CIFAR's download); none for data that is made or given."""
        return []

    def run_files(self) -> dict[str, str]:
        """Files of this data for the run folder (name: text), written beside `config.yaml` as the run starts: what
        another run needs to use the same data. None by default."""
        return {}

    def inputs(self) -> dict:
        """How an image becomes the model's input, as plain values a checkpoint records for inference."""
        (height, width), norm = check_size("img_size", self.img_size), self.normalization
        return {
            "img_size": [height, width],
            "in_chans": int(self.in_chans),
            "mean": None if norm is None else [float(v) for v in norm[0]],
            "std": None if norm is None else [float(v) for v in norm[1]],
            "interpolation": self.interpolation,
        }

    def split_seeds(self) -> dict[str, int]:
        """The seed of each split, spawned from the ``seed`` hyperparameter (``numpy.random.SeedSequence``)."""
        children = np.random.SeedSequence(self.hparams.seed).spawn(3)
        return {split: int(child.generate_state(1)[0]) for split, child in zip(("train", "val", "test"), children)}

    def _loader(
        self,
        dataset: Dataset,
        train: bool,
        *,
        drop_last: bool = False,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        repeats: int = 1,
    ) -> DataLoader:
        """A loader of `dataset` (the hparams' `batch_size`, `num_workers`), ordered by `train_sampler` when `train`."""
        workers, batch_size = usable_workers(asked := self.hparams.num_workers), self.hparams.batch_size
        sampler = self.train_sampler(dataset, batch_size, repeats) if train else None
        if train and workers < asked:  # said once a run, not for each loader
            rank_zero_info(f"num_workers={asked} is capped at {workers}, the number of cores this process may use")
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            generator=self.loader_generator(),
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
            persistent_workers=persistent_workers and workers > 0,
            worker_init_fn=leave_signals_to_main,
        )

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Mix training batches on the device (when `mixup` is set): `(x, y)` -> `(x_mixed, y, y_soft)`."""
        # Not the model summary's example input (a bare tensor, `ImageClassifier.example_input_array`).
        if self.mixup is None or self.trainer is None or not self.trainer.training or isinstance(batch, torch.Tensor):
            return batch
        x_mixed, y_soft = self.mixup(*batch)  # mixes x in place; y_soft (B, num_classes), rows sum to 1
        return x_mixed, batch[1], y_soft

    @staticmethod
    def _split(name: str, split: Dataset | None) -> Dataset:
        if split is None:
            raise RuntimeError(f"{name} is not set up: call setup() with the matching stage before asking for a loader")
        return split

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("train_set", self.train_set), train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("val_set", self.val_set), train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._split("test_set", self.test_set), train=False)

    predict_dataloader = test_dataloader


def leave_signals_to_main(worker_id: int) -> None:
    """A loader worker leaves SIGINT and SIGTERM (Ctrl-C, `timeout`, SLURM signal a whole job) to the main process,
    which ends its step, then stops the workers; it is seeded as Lightning seeds workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pl_worker_init_function(worker_id)


class SyntheticDataModule(SplitDataModule):
    """A generated two-class task: ``make_split`` draws each split from its own seed, train and val in ``train_region``,
    test in ``test_region``."""

    num_classes = 2

    @staticmethod
    def check_sizes(
        *, num_train: int, num_val: int, num_test: int, seed: int, batch_size: int, num_workers: int
    ) -> None:
        """Raise `ValueError` naming the first split size, seed or loader setting that is not an int in range."""
        for name, value, minimum in (
            ("num_train", num_train, 1),
            ("num_val", num_val, 1),
            ("num_test", num_test, 1),
            ("seed", seed, 0),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            check_int(name, value, minimum)

    def make_split(self, split: str, num_samples: int, region: str) -> Dataset:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if stage in ("fit", None) and self.train_set is None:
            self.train_set = self.make_split("train", hp.num_train, hp.train_region)
        if stage in ("fit", "validate", None) and self.val_set is None:
            self.val_set = self.make_split("val", hp.num_val, hp.train_region)
        if stage in ("test", "predict", None) and self.test_set is None:
            self.test_set = self.make_split("test", hp.num_test, hp.test_region)


def check_pixel_options(*, in_chans: int, noise: float) -> None:
    """Validate a generated image's channels (1 or 3) and pixel noise std (>= 0); ValueError naming the value."""
    check_int("in_chans", in_chans, 1, 3)  # an int (not a bool), then one of the two image modes
    check_choice("in_chans", in_chans, (1, 3))
    check_float("noise", noise, 0.0)


def seeded_rng(num_samples: int, seed: int) -> np.random.Generator:
    """The generator a synthetic data set draws everything from, once `num_samples` (>= 1) and `seed` (>= 0) pass."""
    check_int("num_samples", num_samples, 1)
    check_int("seed", seed, 0)
    return np.random.default_rng(seed)


def balanced_labels(rng: np.random.Generator, num_samples: int) -> np.ndarray:
    """`(N,)` labels 0 and 1 in a random order, exactly balanced (the counts differ by one when N is odd)."""
    return rng.permutation(np.arange(num_samples) % 2)


def noisy_images(images: torch.Tensor, *, noise: float, in_chans: int, rng: np.random.Generator) -> torch.Tensor:
    """Noiseless float images `(N, H, W)` plus Gaussian noise of std `noise` (in place; seeded by one more draw of
    `rng`, so called after every other draw), repeated on `in_chans` channels: `(N, C, H, W)`, a stride-0 view."""
    if noise > 0:
        generator = torch.Generator().manual_seed(int(rng.integers(2**63)))
        images += noise * torch.randn(images.shape, generator=generator)
    return images[:, None].expand(-1, in_chans, -1, -1)  # (N, C, H, W)
