"""A shuffled training order that a checkpoint can restore in the middle of an epoch.

Lightning 2.6 restores the model, optimizer and loop counters from a checkpoint, but not where the training
DataLoader was in its epoch: a plain `DataLoader(shuffle=True)` starts a fresh permutation, so a run resumed
mid-epoch sees other batches than an uninterrupted one. (Its hook for "stateful" loaders does not help: the first
iterator is created before the loader state is loaded whenever `configure_optimizers` reads
`trainer.estimated_stepping_batches`, as `ImageClassifier` does, and the prefetched batch counts as consumed.)
Two pieces restore the position:

* `ResumableSampler`: the permutation of an epoch is a pure function of `(seed, epoch)` (a `DistributedSampler`,
  so under DDP each process takes its own stride of it and Lightning leaves it in place), and it can start
  `k` samples into an epoch.
* `ResumableTrainingData`: a data-module mixin whose `state_dict` records the position from the trainer's
  counters when a checkpoint is written; `load_state_dict` runs before the training DataLoader is built,
  which then starts there.

Exactness needs the same batch size, number of processes and seed as the interrupted run.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler

from vit.checks import check_int


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` with shuffling that can start mid-epoch after `resume_at`.

    The order of epoch `e` is `randperm(len(dataset))` from a generator seeded with `seed + e`; process `rank`
    of `num_replicas` takes every `num_replicas`-th index of it (Lightning calls `set_epoch` every epoch).
    `repeats > 1` is repeated augmentation (Hoffer et al. 2020; DeiT's `RASampler`, which Lee et al. 2021 train
    with): each index appears `repeats` times in a row, so its copies go to consecutive processes (or batches)
    and are augmented differently, and the epoch keeps the dataset's length, covering the first `1 / repeats`
    of the permutation.
    """

    def __init__(self, dataset: Sized, *, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 repeats: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        check_int("repeats", repeats, 1)
        self.repeats = repeats
        self._skip = 0

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
    """The run's seed (`seed_everything`, read back from `PL_GLOBAL_SEED`), 0 when none was set.

    Lightning seeds the samplers it inserts for DDP the same way, so the order does not depend on how many
    random numbers model initialisation happened to draw.
    """
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def training_position(trainer) -> dict[str, int]:
    """`{"epoch", "batches_done"}` of the next training batch, from the trainer's loop counters.

    Called while a checkpoint is written: after a training step (`on_train_batch_end`) the step's batch counts as
    done; after the last batch of an epoch the position is the next epoch's start.
    """
    epoch = trainer.current_epoch
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    if done >= trainer.num_training_batches:
        epoch, done = epoch + 1, 0
    return {"epoch": int(epoch), "batches_done": int(done)}


class ResumableTrainingData:
    """Mixin for a LightningDataModule (put it first in the bases) whose training order survives a resume.

    The data module builds its training DataLoader with `sampler=self.train_sampler(dataset, batch_size)` and
    `generator=self.loader_generator()`; Lightning saves the mixin's `state_dict` in checkpoints and restores it.
    """

    _resume_position: dict[str, int] | None = None

    def train_sampler(self, dataset: Sized, batch_size: int, repeats: int = 1) -> ResumableSampler:
        """The training sampler: this process's share of the epoch's permutation, from a restored position if any."""
        # Outside a Trainer (a notebook, a test) the data module is one process of one.
        trainer = getattr(self, "trainer", None)
        world_size, rank = getattr(trainer, "world_size", 1), getattr(trainer, "global_rank", 0)
        sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=shuffle_seed(), repeats=repeats)
        if self._resume_position is not None:
            position, self._resume_position = self._resume_position, None
            sampler.resume_at(position["epoch"], position["batches_done"] * batch_size)
        return sampler

    @staticmethod
    def loader_generator() -> torch.Generator:
        """A generator of its own for the DataLoader, which draws its worker seed from it.

        From the global torch RNG instead, whether an iterator is created before or after a checkpoint is restored
        would shift the random numbers (dropout, drop-path) of every later step.
        """
        return torch.Generator().manual_seed(shuffle_seed())

    def state_dict(self) -> dict:
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.state.fn != "fit":
            return {}
        # The number of processes is recorded so that a resume with another one is refused up front
        # (vit.training.cli): each process's share of an epoch, and so the position, depends on it.
        return {"train_position": training_position(trainer), "world_size": int(trainer.world_size)}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume_position = state_dict.get("train_position")
        if self._resume_position is not None:
            # Lightning warns that a plain DataLoader cannot resume mid-epoch; this one can.
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
