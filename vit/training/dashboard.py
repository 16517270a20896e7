"""Putting pictures on the dashboard: figures to arrays, one image to every logger, the confusion matrix.

Images go to whichever loggers the trainer has: W&B (`wandb.Image`), TensorBoard (`add_image`) or
CSV (PNG files in the run's folder).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics.classification import MulticlassConfusionMatrix


class ConfusionMatrix(L.Callback):
    """When training ends, log the confusion matrix of the final weights on the validation set.

    Computed with torchmetrics' `MulticlassConfusionMatrix` over the validation batches the trainer
    uses (`limit_val_batches` applies); rows are true classes, columns predictions, cells counts.
    The counts are kept in `matrix` `(num_classes, num_classes)` after fit.

    Args:
        class_names: axis labels; by default the class indices.
        tag: the name of the image on the dashboard.
        dpi: resolution of the rendered figure.
    """

    def __init__(self, *, class_names: Sequence[str] | None = None, tag: str = "val/confusion_matrix", dpi: int = 100) -> None:
        super().__init__()
        if dpi < 1:
            raise ValueError(f"dpi={dpi} must be >= 1")
        self.class_names = list(class_names) if class_names is not None else None
        self.tag = tag
        self.dpi = dpi
        self.matrix: Tensor | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # on_train_end, not on_fit_end: the model is still on its device and the processes joined.
        loaders = trainer.val_dataloaders
        num_batches = trainer.num_val_batches
        if loaders is None or not num_batches or num_batches[0] == 0:
            rank_zero_warn("ConfusionMatrix: no validation batches, so no confusion matrix is logged.")
            return
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        model = getattr(pl_module, "backbone", pl_module)
        num_classes = model.num_classes if isinstance(getattr(model, "num_classes", None), int) else None
        was_training = pl_module.training
        pl_module.eval()
        metric = None
        try:
            with torch.inference_mode():
                for batch_idx, batch in enumerate(loader):
                    if batch_idx >= num_batches[0]:
                        break
                    x, y = batch[0].to(pl_module.device), batch[1].to(pl_module.device)
                    with trainer.precision_plugin.forward_context():
                        logits = pl_module(trainer.precision_plugin.convert_input(x))  # (B, num_classes)
                    if metric is None:
                        metric = MulticlassConfusionMatrix(num_classes or logits.shape[-1]).to(pl_module.device)
                    metric.update(logits.argmax(-1), y)
            if metric is None:
                rank_zero_warn("ConfusionMatrix: the validation loader gave no batches, so no confusion matrix is logged.")
                return
            self.matrix = metric.compute().cpu()  # synchronised across processes
        finally:
            pl_module.train(was_training)
        if trainer.is_global_zero:
            figure = confusion_matrix_figure(
                self.matrix, self.class_names, title=f"validation, final weights after {trainer.current_epoch} epochs"
            )
            log_image(trainer, self.tag, figure_to_array(figure, self.dpi))


def confusion_matrix_figure(matrix: Tensor, class_names: Sequence[str] | None = None, title: str = ""):
    """A matplotlib Figure of a `(K, K)` count matrix (rows true, columns predicted), counts written in."""
    from matplotlib.figure import Figure

    K = matrix.shape[0]
    names = list(class_names) if class_names is not None else [str(k) for k in range(K)]
    if len(names) != K:
        raise ValueError(f"class_names has {len(names)} names for a {K}x{K} confusion matrix")
    side = min(12.0, 2.0 + 0.45 * K)
    fig = Figure(figsize=(side + 1.0, side), layout="constrained")
    ax = fig.subplots()
    counts = matrix.cpu().numpy()
    image = ax.imshow(counts, cmap="Blues")
    fig.colorbar(image, ax=ax, shrink=0.8)
    if K <= 20:
        ax.set_xticks(range(K), names, rotation=45 if max(map(len, names)) > 3 else 0, ha="right")
        ax.set_yticks(range(K), names)
        threshold = counts.max() / 2
        for i in range(K):
            for j in range(K):
                colour = "white" if counts[i, j] > threshold else "black"
                ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", color=colour, fontsize="small")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    accuracy = counts.trace() / max(1, counts.sum())
    ax.set_title(f"confusion matrix, accuracy {accuracy:.4f}" + (f"\n{title}" if title else ""), fontsize="medium")
    return fig


def figure_to_array(figure, dpi: int = 100) -> np.ndarray:
    """Render a matplotlib Figure to an RGB `(H, W, 3)` uint8 array (no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


_unsupported_warned: set[str] = set()


def log_image(trainer: L.Trainer, tag: str, image: np.ndarray) -> None:
    """Log an RGB `(H, W, 3)` uint8 image to every logger of `trainer`, at the current global step.

    W&B: `wandb.Image` under `tag`; TensorBoard: `add_image(tag, ...)`; CSV: a PNG file
    `<log_dir>/images/<tag with / as _>-step<step>.png` (never overwriting an existing file).
    Other loggers get a one-time warning.
    """
    step = trainer.global_step
    for logger in trainer.loggers:
        if isinstance(logger, DummyLogger):  # fast_dev_run: nothing is logged
            continue
        if isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[image], step=step)
        elif isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, image, global_step=step, dataformats="HWC")
        elif isinstance(logger, CSVLogger):
            _save_png(Path(logger.log_dir) / "images", f"{tag.replace('/', '_')}-step{step:06d}", image)
        elif type(logger).__name__ not in _unsupported_warned:
            _unsupported_warned.add(type(logger).__name__)
            rank_zero_warn(f"{type(logger).__name__} is not supported for images ({tag}); use W&B, TensorBoard or CSV.")


def _save_png(folder: Path, stem: str, image: np.ndarray) -> Path:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    path, n = folder / f"{stem}.png", 1
    while path.exists():  # a resumed run can log the same step again: keep both
        path, n = folder / f"{stem}-{n}.png", n + 1
    Image.fromarray(image).save(path)
    return path
