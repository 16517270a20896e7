"""Filling the dashboard: images to every logger, the confusion matrix, the tables of runs, ranked test predictions."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from PIL import Image
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix

from vit.checks import check_int
from vit.prediction_csv import free_path
from vit.training.contract import class_names_of
from vit.training.run_dir import RunConfig


class ConfusionMatrix(L.Callback):
    """When training ends, log the confusion matrix (rows true classes) of `fit`'s last validation pass, from the
    logits `validation_step` returns. `class_names`: the axis labels (by default the model's, else the indices);
    `test_tag`: the name of W&B's own confusion matrix of the test set, logged at the end of `test`."""

    def __init__(
        self,
        *,
        class_names: Sequence[str] | None = None,
        tag: str = "val/confusion_matrix",
        test_tag: str = "test/confusion_matrix",
        dpi: int = 100,
    ) -> None:
        super().__init__()
        check_int("dpi", dpi, 1)
        self.class_names = list(class_names) if class_names is not None else None
        self.tag, self.test_tag, self.dpi, self._test_true, self._test_predicted = tag, test_tag, dpi, [], []
        self.matrix: Tensor | None = None  # (num_classes, num_classes)
        self._counts: MulticlassConfusionMatrix | None = None
        self._epoch = self._step = 0

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._counts, self._epoch, self._step = None, trainer.current_epoch, trainer.global_step

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit" or dataloader_idx != 0:
            return
        if not isinstance(outputs, Tensor):
            raise TypeError(
                f"ConfusionMatrix needs validation_step to return the logits (B, num_classes); "
                f"{type(pl_module).__name__}.validation_step returned {type(outputs).__name__}"
            )
        if self._counts is None:
            self._counts = MulticlassConfusionMatrix(outputs.shape[-1]).to(outputs.device)
        self._counts.update(outputs.argmax(-1), batch[1])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._counts is None:
            rank_zero_warn("ConfusionMatrix: no validation batches, so no confusion matrix is logged.")
            return
        self.matrix = self._counts.compute().cpu()  # synchronised across processes
        if trainer.is_global_zero:
            figure = self.figure(
                f"the last validation, {epoch_title(self._epoch, self._step)}",
                self.class_names or class_names_of(pl_module),
            )
            log_image(trainer, self.tag, figure_to_array(figure, self.dpi))

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._test_true, self._test_predicted = [], []

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        # W&B's interactive matrix of the test set; the other loggers have the test metrics.
        if isinstance(outputs, Tensor) and dataloader_idx == 0 and _loggers(trainer, WandbLogger):
            self._test_predicted += outputs.argmax(-1).tolist()
            self._test_true += batch[1].tolist()

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._test_true or not trainer.is_global_zero:
            return
        import wandb

        names = self.class_names or class_names_of(pl_module)
        chart = wandb.plot.confusion_matrix(
            y_true=self._test_true,
            preds=self._test_predicted,
            class_names=names,
            title="test confusion matrix (rank 0's share)",
        )
        for logger in _loggers(trainer, WandbLogger):
            logger.experiment.log({self.test_tag: chart})

    def figure(self, title: str, class_names: Sequence[str] | None = None):
        """`self.matrix` drawn by torchmetrics, on a Figure of its own (not pyplot's, which would keep it alive)."""
        from matplotlib.figure import Figure

        K = self.matrix.shape[0]
        side = min(12.0, 2.0 + 0.45 * K)
        fig = Figure(figsize=(side + 1.0, side), layout="constrained")
        ax = fig.subplots()
        # Counts written in up to 20 classes; beyond that they do not fit their cells.
        self._counts.plot(self.matrix, ax=ax, add_text=K <= 20, labels=class_names)
        accuracy = self.matrix.trace().item() / max(1, self.matrix.sum().item())
        ax.set_title(f"confusion matrix, accuracy {accuracy:.4f}\n{title}", fontsize="medium")
        return fig


class HParamsTable(L.Callback):
    """Fill the tables of runs: TensorBoard's HParams tab, one row per run, its settings (at the start) beside its
    final metrics (`metrics`, each as `hp/<name with / as _>`); W&B's summary and files (`describe_wandb_run`)."""

    def __init__(self, *, metrics: Sequence[str] = ("val/acc", "val/loss", "test/acc", "test/loss")) -> None:
        super().__init__()
        self.metrics, self._started = list(metrics), False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started:  # a `test` after `fit` is the same run
            return
        self._started = True
        datamodule, seed = trainer.datamodule, os.environ.get("PL_GLOBAL_SEED")  # set by seed_everything
        hparams = {**pl_module.hparams_initial, **(datamodule.hparams_initial if datamodule is not None else {})}
        settings = {
            **{name: value for name, value in hparams.items() if not name.startswith("_")},
            "seed_everything": int(seed) if seed is not None else None,
            "trainer": {"max_epochs": trainer.max_epochs, "precision": str(trainer.precision)},
        }
        for logger in _loggers(trainer, TensorBoardLogger):
            logger.log_metrics({hp_tag(name): math.nan for name in self.metrics}, step=trainer.global_step)
            write_session_start(logger, settings, step=trainer.global_step)
        for logger in _loggers(trainer, WandbLogger) if trainer.is_global_zero else []:
            describe_wandb_run(logger.experiment, trainer)

    on_test_start = on_fit_start

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._log(trainer, "val/")

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer, "test/")

    def _log(self, trainer: L.Trainer, prefix: str) -> None:
        values = {
            hp_tag(name): float(trainer.callback_metrics[name])
            for name in self.metrics
            if name.startswith(prefix) and name in trainer.callback_metrics
        }
        for logger in _loggers(trainer, TensorBoardLogger) if values else []:
            logger.log_metrics(values, step=trainer.global_step)


class RankedPredictions:
    """The test predictions a predictions view shows, kept batch by batch: the mistakes, most confident first,
    then (unless `mistakes_only`) the correct predictions in test order; at most `size` of them, in `images`
    `(n, C, H, W)`, `labels`, `predicted` and `probability` (of the predicted class), each `(n,)` on the CPU."""

    def __init__(self, size: int, *, mistakes_only: bool = False) -> None:
        check_int("size", size, 1)
        self.size, self.mistakes_only = size, mistakes_only
        self.reset()

    def reset(self) -> None:
        self.images: Tensor | None = None  # None until the first batch
        self.num_classes: int | None = None
        self.labels = self.predicted = torch.empty(0, dtype=torch.long)
        self.probability = torch.empty(0)
        self.seen = self.mistakes = 0  # test images and mistakes so far, kept or not
        self._order = torch.empty(0, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.labels)

    def update(self, images: Tensor, labels: Tensor, logits: Tensor) -> None:
        """Add a batch: `images` `(B, C, H, W)`, `labels` `(B,)`, the model's `logits` `(B, num_classes)`."""
        x, y, self.num_classes = images.detach().cpu(), labels.detach().cpu().long(), logits.shape[-1]
        probability, predicted = (t.cpu() for t in logits.detach().float().softmax(-1).max(-1))  # (B,), (B,)
        wrong = predicted != y
        # The sort key: a mistake's is -1 - probability (in [-2, -1)), a correct one's its index in the test set (>= 0).
        order = torch.where(
            wrong, -probability.double() - 1.0, torch.arange(self.seen, self.seen + len(y), dtype=torch.float64)
        )
        self.seen, self.mistakes = self.seen + len(y), self.mistakes + int(wrong.sum())
        if self.mistakes_only:
            x, y, predicted, probability, order = x[wrong], y[wrong], predicted[wrong], probability[wrong], order[wrong]
        images = x if self.images is None else torch.cat([self.images, x])
        labels, predicted = torch.cat([self.labels, y]), torch.cat([self.predicted, predicted])
        probability, order = torch.cat([self.probability, probability]), torch.cat([self._order, order])
        keep = order.argsort(stable=True)[: self.size]  # stable: equal confidence keeps test order
        self.images, self.labels, self.predicted = images[keep].clone(), labels[keep], predicted[keep]
        self.probability, self._order = probability[keep], order[keep]


@rank_zero_only  # as Lightning's own log_hyperparams: the other ranks' loggers have no file writer
def write_session_start(logger: TensorBoardLogger, settings: dict[str, Any], step: int = 0) -> None:
    """Write a run's row of TensorBoard's HParams table (its settings), and no experiment summary, so that the
    columns come from every run's row (hence `default_hp_metric: false` in the configs: it writes a summary)."""
    from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
    from torch.utils.tensorboard.summary import hparams

    params = logger._sanitize_params(_flatten_dict(_convert_params(settings)))  # as log_hyperparams flattens
    logger.experiment._get_file_writer().add_summary(hparams(params, {})[1], step)  # [1]: the session start


def describe_wandb_run(run, trainer: L.Trainer) -> None:
    """W&B's summary of `val/loss` and of each metric a checkpoint or early stop monitors: its best value (by the
    callback's `mode`), not its last. The run's files: the `config.yaml` and `run_info.json` `RunConfig` wrote."""
    monitored = [c for c in trainer.callbacks if isinstance(c, (ModelCheckpoint, EarlyStopping)) and c.monitor]
    for name, mode in {"val/loss": "min", **{c.monitor: c.mode for c in monitored}}.items():
        # An exact name's definition replaces the "*" one of Lightning's WandbLogger, so its x-axis is repeated.
        run.define_metric(name, step_metric="trainer/global_step", step_sync=True, summary=mode)
    for config in (c for c in trainer.callbacks if isinstance(c, RunConfig) and c._run_dir is not None):
        stem, ext = os.path.splitext(config.config_filename)
        for name in (f"{stem}{config._suffix}{ext}", f"run_info{config._suffix}.json"):
            run.save(str(config._run_dir / name), base_path=str(config._run_dir), policy="now")


def hp_tag(metric: str) -> str:
    """The HParams table's name for a logged metric: `val/acc` -> `hp/val_acc`."""
    return "hp/" + metric.replace("/", "_")


def _loggers(trainer: L.Trainer, kind: type) -> list:
    return [logger for logger in trainer.loggers if isinstance(logger, kind)]


def epoch_title(epoch: int, step: int) -> str:
    """When a figure was drawn, named as the checkpoints are: `after epoch 00 (step 8)` for `epoch00-....ckpt`."""
    return f"after epoch {epoch:02d} (step {step})"


def figure_to_array(figure, dpi: int = 100) -> np.ndarray:
    """Render a matplotlib Figure to an RGB `(H, W, 3)` uint8 array (no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.set_dpi(dpi)
    FigureCanvasAgg(figure).draw()  # the canvas becomes figure.canvas
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


_unsupported_warned: set[str] = set()


def log_image(trainer: L.Trainer, tag: str, image: np.ndarray, loggers: Sequence | None = None) -> None:
    """Log an RGB `(H, W, 3)` uint8 image to every W&B, TensorBoard and CSV logger of `trainer` (or of `loggers`)
    at the current step; CSV: `<log_dir>/images/<tag with / as _>-step<step>.png`, never overwritten."""
    step = trainer.global_step
    for logger in trainer.loggers if loggers is None else loggers:
        if isinstance(logger, DummyLogger):  # fast_dev_run: nothing is logged
            continue
        if isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[image], step=step)
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, image, global_step=step, dataformats="HWC")
        elif isinstance(logger, CSVLogger):
            folder = Path(logger.log_dir) / "images"
            folder.mkdir(parents=True, exist_ok=True)
            # A resumed run can log the same step again: both are kept.
            Image.fromarray(image).save(free_path(folder / f"{tag.replace('/', '_')}-step{step:06d}.png"))
        elif type(logger).__name__ not in _unsupported_warned:
            _unsupported_warned.add(type(logger).__name__)
            rank_zero_warn(f"{type(logger).__name__} is not supported for images ({tag}); use W&B, TensorBoard or CSV.")
