"""A shuffled training order that a checkpoint can restore in the middle of an epoch.
`ResumableSampler`'s permutation is a pure function of `(seed, epoch)` and can start `k` samples into an epoch;
`ResumableTrainingData`'s `state_dict` records the position (the same batch size, processes and seed resume exactly)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from vit.checks import check_int


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` with shuffling (seeded with `seed + epoch`) that can start mid-epoch after `resume_at`.
    `repeats > 1` is repeated augmentation (DeiT's `RASampler`): each index `repeats` times in a row, same length."""

    def __init__(
        self, dataset: Sized, *, num_replicas: int = 1, rank: int = 0, seed: int = 0, repeats: int = 1
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        check_int("repeats", repeats, 1)
        self.repeats, self._skip = repeats, 0

    def resume_at(self, epoch: int, num_samples: int) -> None:
        """Start the next iteration (only) in epoch `epoch`, after this process's first `num_samples` samples."""
        if epoch < 0 or not 0 <= num_samples <= self.num_samples:
            raise ValueError(f"cannot resume at epoch={epoch}, sample {num_samples} of {self.num_samples}")
        self.set_epoch(epoch)
        self._skip = num_samples

    def __iter__(self) -> Iterator[int]:
        if self.repeats == 1:
            indices = list(super().__iter__())
        else:
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            repeated = order.repeat_interleave(self.repeats)[: self.total_size].tolist()  # (total_size,)
            indices = repeated[self.rank : self.total_size : self.num_replicas]  # this process's share
        start, self._skip = self._skip, 0
        return iter(indices[start:])


def shuffle_seed() -> int:
    """The run's seed (`seed_everything` sets `PL_GLOBAL_SEED`), 0 when none was set."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def training_position(trainer) -> dict[str, int]:
    """`{"epoch", "batches_done"}` of the next training batch, from the trainer's loop counters."""
    epoch = trainer.current_epoch
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if done >= trainer.num_training_batches:
        epoch, done = epoch + 1, 0
    return {"epoch": int(epoch), "batches_done": int(done)}


class ResumableTrainingData:
    """Mixin for a LightningDataModule (first in the bases) whose training order survives a resume: its training
    DataLoader takes `sampler=self.train_sampler(dataset, batch_size)` and `generator=self.loader_generator()`."""

    _resume_position: dict[str, int] | None = None
    trainer: Any = None  # LightningDataModule's: the Trainer using this module, None before one does

    def _processes(self) -> tuple[int, int]:
        """`(world size, this process's rank)`: one process until a Trainer uses this module."""
        return (1, 0) if self.trainer is None else (int(self.trainer.world_size), int(self.trainer.global_rank))

    def train_sampler(self, dataset: Sized, batch_size: int, repeats: int = 1) -> ResumableSampler:
        """The training sampler: this process's share of the epoch's permutation, from a restored position if any."""
        world_size, rank = self._processes()
        sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=shuffle_seed(), repeats=repeats)
        if self._resume_position is not None:
            position, self._resume_position = self._resume_position, None
            sampler.resume_at(position["epoch"], position["batches_done"] * batch_size)
        return sampler

    @staticmethod
    def loader_generator() -> torch.Generator:
        """The DataLoader's own generator, so that the global torch RNG does not depend on when an iterator starts."""
        return torch.Generator().manual_seed(shuffle_seed())

    def state_dict(self) -> dict:
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        # The position depends on the number of processes: vit.training.cli refuses a resume with another one.
        return {"train_position": training_position(trainer), "world_size": int(trainer.world_size)}

    def load_state_dict(self, state_dict: dict) -> None:
        written, now = state_dict.get("world_size", 1), self._processes()[0]
        if written != now:
            # Each process's share of the epoch depends on their number: the run cannot continue where it stopped.
            raise ValueError(
                f"the data position was written by {written} process(es) and this run has {now}: resume "
                f"with {written} (trainer.devices x trainer.num_nodes)"
            )
        position = state_dict.get("train_position")
        if position is not None and not (
            isinstance(position, dict)
            and set(position) == {"epoch", "batches_done"}
            and all(type(v) is int and v >= 0 for v in position.values())
        ):
            raise ValueError(f"the data position {str(position)[:80]} is not an epoch and a batch count (ints >= 0)")
        self._resume_position = position
        if self._resume_position is not None:
            # Lightning warns that a plain DataLoader cannot resume mid-epoch; this one can.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
