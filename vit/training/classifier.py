"""The Lightning system: an image classifier around any `(B, C, H, W) -> logits` backbone."""

from __future__ import annotations

import math
import random
import warnings

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torchmetrics.classification import MulticlassAccuracy


class NonFiniteError(FloatingPointError):
    """The training loss, or a weight about to be checkpointed, is NaN or infinite."""


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Learning-rate multiplier: linear from ~0 to 1 over `warmup_steps`, then cosine down to `min_lr_ratio`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups_weight_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight matrices (and conv kernels) decay; norms, biases, positions, CLS do not.

    Decaying a LayerNorm gain or a bias pulls it towards 0, which is not a prior anyone wants;
    the position embedding and CLS token are embeddings, not weights, by the same argument.
    """
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name in skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ImageClassifier(L.LightningModule):
    """Cross-entropy training of `backbone` with AdamW and a per-step warmup + cosine schedule.

    Args:
        backbone: the network; in YAML, `class_path: vit.models.VisionTransformer` (or `ResNet`)
            with its `init_args`. It must have a `num_classes` attribute.
        lr: peak learning rate, reached after `warmup_epochs`.
        weight_decay: AdamW decoupled weight decay, applied to weight matrices only.
        warmup_epochs: linear warmup length (may be fractional); stepped per iteration.
        min_lr_ratio: the cosine ends at `lr * min_lr_ratio`.
        label_smoothing: applied to hard labels and to the soft (Mixup/CutMix) targets alike.
        compile: `torch.compile` the backbone for training and evaluation. The compiled wrapper is
            kept outside the module tree, so checkpoint keys stay `backbone.*`.

    A batch is `(x, y)`, or `(x, y, y_soft)` when the data module mixes images (Mixup/CutMix):
    then the loss uses the soft targets and the training accuracy the hard labels `y`.

    Faults: a NaN or infinite training loss raises `NonFiniteError` naming the step, before that
    step's update, and a checkpoint is never written with non-finite weights. Checkpoints carry
    the random-number states (torch, CUDA, numpy, Python), restored when `fit` resumes, so that
    dropout and drop-path draw what an uninterrupted run would have drawn.
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        label_smoothing: float = 0.0,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr={lr} must be > 0")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs={warmup_epochs} must be >= 0")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
        num_classes = getattr(backbone, "num_classes", None)
        if not isinstance(num_classes, int):
            raise ValueError(f"backbone {type(backbone).__name__} must have an int attribute `num_classes`")
        # Under LightningCLI the backbone arrives with its config (class_path + init_args), which is
        # what a checkpoint needs to rebuild it without the YAML; a module built in Python can't be
        # a hyperparameter, so it is left out (reload then passes `backbone=` again).
        built_by_cli = _given_hyperparameters.get() is not None
        self.save_hyperparameters(ignore=None if built_by_cli else ["backbone"])
        self.backbone = backbone
        self._compiled = None
        self._rng_states_to_restore: dict | None = None
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.compile:
            if self._compiled is None:
                # object.__setattr__ keeps the compiled wrapper out of the module tree and the state dict.
                object.__setattr__(self, "_compiled", torch.compile(self.backbone))
            return self._compiled(x)
        return self.backbone(x)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # F.cross_entropy takes class indices (B,) or class probabilities (B, K); smoothing applies to both.
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, *soft = batch
        logits = self(x)
        loss = self._loss(logits, soft[0] if soft else y)
        # One all-reduce gives every process the mean loss: it is what gets logged, and a non-finite
        # loss on any process stops all of them at the same step (one stopping alone would leave
        # the others waiting forever in the gradient all-reduce).
        mean_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        if not torch.isfinite(mean_loss):
            raise NonFiniteError(self._non_finite_loss_message(mean_loss.item(), batch_idx))
        self.train_acc(logits, y)
        self.log("train/loss", mean_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], on_step=True, on_epoch=False)
        return loss

    def _non_finite_loss_message(self, value: float, batch_idx: int) -> str:
        saved = []
        for callback in self.trainer.checkpoint_callbacks:
            for path in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")):
                if path and path not in saved:
                    saved.append(path)
        kept = f"The checkpoints written before it are kept: {', '.join(saved)}." if saved else "No checkpoint had been written yet."
        return (
            f"train/loss is {value} at training step {self.global_step} (epoch {self.current_epoch}, batch {batch_idx}); "
            f"training stopped before this step's update. {kept} "
            f"Lower the learning rate (model.lr={self.hparams.lr}), add warmup, or look for broken inputs."
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint["state_dict"]
        tensors = [t for t in state.values() if t.is_floating_point()]
        if tensors and not torch.stack([t.isfinite().all() for t in tensors]).all():
            bad = next(name for name, t in state.items() if t.is_floating_point() and not t.isfinite().all())
            raise NonFiniteError(
                f"{bad} holds NaN or infinite values at training step {self.global_step}; the checkpoint was not "
                "written, so the last one on disk is still a good one"
            )
        checkpoint["rng_states"] = _rng_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._rng_states_to_restore = checkpoint.get("rng_states")

    def on_fit_start(self) -> None:
        # train/loss is logged already averaged over the processes (see training_step), so Lightning's
        # advice to add sync_dist=True (a second all-reduce per step) does not apply to it.
        warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('train/loss'",
                                category=PossibleUserWarning)

    def on_train_start(self) -> None:
        # Only when `fit` resumes from a checkpoint; a model merely loaded with weights starts afresh.
        if self.trainer.ckpt_path is not None and self._rng_states_to_restore is not None:
            _set_rng_states(self._rng_states_to_restore)
        self._rng_states_to_restore = None

    def _eval_step(self, batch, split: str, metric: MulticlassAccuracy) -> None:
        x, y = batch[0], batch[1]
        logits = self(x)
        metric(logits, y)
        self.log(f"{split}/loss", self._loss(logits, y), on_epoch=True, prog_bar=split == "val", sync_dist=True)
        self.log(f"{split}/acc", metric, on_epoch=True, prog_bar=split == "val")

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, "test", self.test_acc)

    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Class probabilities `(B, num_classes)`."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).softmax(dim=-1)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(param_groups_weight_decay(self.backbone, hp.weight_decay), lr=hp.lr, betas=hp.betas)
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        max_epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else 1
        warmup_steps = min(total_steps, round(hp.warmup_epochs * total_steps / max_epochs))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=hp.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _rng_states() -> dict:
    """The global random-number states, as tensors and plain values (loadable with `weights_only=True`)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
