"""Callbacks of the command line: exact resumes, a stop on a signal or a non-finite loss, progress lines in a log."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vit.checks import check_int
from vit.training.run_lock import printable


def rng_states() -> dict:
    """The global random-number states, as tensors and plain values (loadable with `weights_only=True`)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return states


class NonFiniteError(FloatingPointError):
    """The training loss, or a weight about to be checkpointed, is NaN or infinite."""


class Preempted(Exception):
    """Training was stopped by a signal after a checkpoint of the current step was written."""

    def __init__(self, signum: int, step: int, ckpt_path: str | None) -> None:
        self.signum, self.step, self.ckpt_path = signum, step, ckpt_path
        where = f"{printable(ckpt_path)} holds step {step}" if ckpt_path else "no checkpoint could be written"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after training step {step}: {where}. Resume with "
            "the same command and --ckpt_path last (or --ckpt_path <that file>)"
        )


class StopOnSignal(L.Callback):
    """On SIGTERM or SIGINT (SLURM, `timeout`, Ctrl-C), finish the step, write `last.ckpt` and raise `Preempted`; a
    second Ctrl-C interrupts at once, a SIGTERM during validation stops there (`last.ckpt`: the last finished step)."""

    _sigint, _previous_handler = False, None  # a Ctrl-C was received; the SIGINT handler to restore

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sigint = False
        try:
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:  # not the main thread: leave SIGINT alone
            self._previous_handler = None

    def _on_sigint(self, signum, frame) -> None:
        if self._sigint:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._sigint = True

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handler()

    def received(self, trainer: L.Trainer) -> int | None:
        """The signal that asks training to stop, or None (SIGTERM: Lightning's notice, shared between processes)."""
        if trainer.received_sigterm:
            return signal.SIGTERM
        return signal.SIGINT if self._sigint else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if (signum := self.received(trainer)) is not None:
            self._restore_handler()
            raise Preempted(signum, trainer.global_step, save_last_checkpoint(trainer))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore_handler()
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            save_last_checkpoint(trainer)  # validation was stopped: the last finished step is kept


def _model_checkpoints(trainer: L.Trainer) -> list[ModelCheckpoint]:
    """The run's `ModelCheckpoint`s (`trainer.checkpoint_callbacks` may hold other `Checkpoint` kinds)."""
    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]


def save_last_checkpoint(trainer: L.Trainer) -> str | None:
    """Write `last.ckpt` now, where the run's `ModelCheckpoint` keeps it; return its path."""
    keepers = [cb for cb in _model_checkpoints(trainer) if cb.save_last and cb.dirpath]
    if keepers:
        cb = keepers[0]
        path = cb.last_model_path or os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        for cb in keepers:
            cb.last_model_path = path  # part of the saved state, as ModelCheckpoint does before saving
    else:
        path = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints", "last.ckpt")
    trainer.save_checkpoint(path, False)  # the whole training state (not weights only), as ModelCheckpoint saves
    return path


class RestoreRNGState(L.Callback):
    """Save the random-number states (torch, CUDA, numpy, Python) in every checkpoint; restore them as `fit` resumes."""

    _to_restore: dict | None = None  # the checkpoint's states, restored as training starts

    def state_dict(self) -> dict[str, Any]:
        return rng_states()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._to_restore = state_dict or None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None and (states := self._to_restore) is not None:
            torch.set_rng_state(states["torch"])
            n = states["numpy"]
            np.random.set_state(
                (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
            )
            version, internal, gauss = states["python"]
            random.setstate((version, tuple(internal), gauss))
            if "cuda" in states and torch.cuda.is_available():
                torch.cuda.set_rng_state(states["cuda"])
        self._to_restore = None


class StopOnNonFinite(L.Callback):
    """Stop training when `train/loss` becomes NaN or infinite, and never checkpoint what came after it. The losses
    stay on the device and are checked every `check_every_n_steps` steps, at each epoch's end and before each
    checkpoint: `training_step`'s `mean_loss` (all-reduced: every process stops at the same step), else `loss`."""

    def __init__(self, check_every_n_steps: int = 50) -> None:
        check_int("check_every_n_steps", check_every_n_steps, 1)
        self.check_every_n_steps = check_every_n_steps
        self._pending: list[tuple[torch.Tensor, int, int, int]] = []  # (loss on device, step, epoch, batch)
        self._step = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._step = trainer.global_step  # the optimizer step this batch's loss feeds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        loss = outputs.get("mean_loss", outputs["loss"]) if isinstance(outputs, dict) else outputs
        self._pending.append((loss.detach(), self._step, trainer.current_epoch, batch_idx))
        if len(self._pending) >= self.check_every_n_steps:
            self.check(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.check(trainer)
        check_finite_weights(checkpoint["state_dict"], trainer.global_step)

    def check(self, trainer: L.Trainer) -> None:
        """Raise `NonFiniteError` if a loss since the last check was NaN or infinite (one host sync)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.stack([loss.float() for loss, *_ in pending]).tolist()
        for value, (_, step, epoch, batch_idx) in zip(values, pending):
            if not np.isfinite(value):
                raise NonFiniteError(non_finite_loss_message(trainer, value, step, epoch, batch_idx))


def non_finite_loss_message(trainer: L.Trainer, value: float, step: int, epoch: int, batch_idx: int) -> str:
    """The one line of a non-finite loss: where it happened, the checkpoints on disk to go back to, what to change."""
    kept = saved_checkpoints(trainer)
    kept = (
        f"The checkpoints written before it are kept: {', '.join(map(printable, kept))}."
        if kept
        else "No checkpoint had been written yet."
    )
    lr = trainer.lightning_module.hparams.get("lr")
    return (
        f"train/loss is {value} at training step {step} (epoch {epoch}, batch {batch_idx}); "
        f"training stopped at step {trainer.global_step}, and nothing from this step on was checkpointed. {kept} "
        f"Lower the learning rate (model.lr={lr}), add warmup, or look for broken inputs."
    )


def saved_checkpoints(trainer: L.Trainer) -> list[str]:
    """The run's checkpoints that are on disk now: each `ModelCheckpoint`'s last and best, and the `last.ckpt` a
    signal writes. Only files: a `ModelCheckpoint` names its file before writing it, so when the write is the one
    stopped (a non-finite loss found as it saves), its `best_model_path` / `last_model_path` name nothing."""
    paths = [path for cb in _model_checkpoints(trainer) for path in (cb.last_model_path, cb.best_model_path)]
    paths.append(os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints", "last.ckpt"))
    found: dict[str, str] = {}  # in order, each file once however its path is written
    for path in paths:
        if path and os.path.isfile(path):
            found.setdefault(os.path.realpath(path), path)
    return list(found.values())


def check_finite_weights(state_dict: dict[str, torch.Tensor], step: int) -> None:
    """Raise `NonFiniteError` naming the first tensor of `state_dict` holding NaN or infinity."""
    tensors = {name: t for name, t in state_dict.items() if t.is_floating_point()}
    if tensors and not torch.stack([t.isfinite().all() for t in tensors.values()]).all():  # one host sync
        bad = next(name for name, t in tensors.items() if not t.isfinite().all())
        raise NonFiniteError(
            f"{bad} holds NaN or infinite values at training step {step}; the checkpoint was not "
            "written, so those on disk hold the weights from before it"
        )


class PlainProgress(L.Callback):
    """Progress for a log file, where a bar would write carriage returns: a line every `every_n_seconds` and at each
    epoch's end (`Epoch 1: 8/8 batches, step 16, 41.20 it/s, train/loss_step=0.6931, ...`; it/s: training only)."""

    def __init__(self, every_n_seconds: float = 30.0) -> None:
        self.every_n_seconds = every_n_seconds

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = self._last_batch = self._last_line = time.monotonic()
        self._batches = self._done = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._batches, self._done, self._last_batch = self._batches + 1, batch_idx + 1, time.monotonic()
        if self._last_batch - self._last_line >= self.every_n_seconds:
            self.on_train_epoch_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_line, rate = time.monotonic(), self._batches / max(self._last_batch - self._start, 1e-9)
        if trainer.is_global_zero:
            metrics = "".join(f", {k}={v:.4g}" for k, v in trainer.progress_bar_metrics.items())
            print(
                f"Epoch {trainer.current_epoch}: {self._done}/{trainer.num_training_batches} batches, step "
                f"{trainer.global_step}, {rate:.2f} it/s{metrics}",
                flush=True,
            )


class FirstStep(L.Callback):
    """`done` once the first training step has finished, its schedule step included (Lightning steps the schedule
    after `on_train_batch_end`): until then a failure is the restored state's (`cli.fit`)."""

    done = False
    _stepped = False

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        self._stepped = True

    def _after_a_step(self, trainer: L.Trainer, *args) -> None:
        self.done = self.done or self._stepped

    on_train_batch_start = on_train_epoch_end = on_validation_start = _after_a_step
