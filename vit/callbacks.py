"""Lightning callbacks that put what a classifier looks at on the dashboard.

`RolloutImages` logs attention-rollout overlays of a fixed set of validation images every few
epochs; `ConfusionMatrix` logs the validation confusion matrix when training ends. Both log to
whichever loggers the trainer has: W&B (`wandb.Image`), TensorBoard (`add_image`) or CSV (PNG
files in the run's folder).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassConfusionMatrix

from vit.rollout import HEAD_FUSIONS, METHODS, HeadFusion, Method, patch_relevance, rollout_grid

METHOD_TITLES = {"rollout": "rollout", "grad_rollout": "grad rollout"}


class RolloutImages(L.Callback):
    """Every `every_n_epochs` epochs (and after the last one), log rollout overlays of fixed images.

    The images are the first validation images, taken round-robin over their labels so that every
    class seen there shows up (positives and negatives on two-circles), and stay the same for the
    whole run, so the dashboard shows how one set of maps changes with training. Each logged image
    is a grid: one row per image (titled with label, prediction and its probability) and one
    column per method in `methods`, computed with `vit.rollout.patch_relevance` on the backbone
    (`pl_module.backbone`, else the module itself), whatever its `pool`.

    Backbones whose `forward` has no `return_attn` argument (the CNN) are skipped with a single
    warning.

    Args:
        every_n_epochs: log after epochs n, 2n, ... and after the last epoch (`max_epochs`).
        num_images: rows of the grid.
        methods: "rollout" and/or "grad_rollout" (for the predicted class).
        head_fusion, discard_ratio: options of "rollout"; see `vit.rollout.attention_rollout`.
        class_names: names for the titles; by default the class indices.
        tag: the name of the image on the dashboard.
        dpi: resolution of the rendered grid (each cell is 2 x 2 inches).
    """

    def __init__(
        self,
        *,
        every_n_epochs: int = 1,
        num_images: int = 8,
        methods: Sequence[Method] = ("rollout", "grad_rollout"),
        head_fusion: HeadFusion = "mean",
        discard_ratio: float = 0.0,
        class_names: Sequence[str] | None = None,
        tag: str = "val/rollout",
        dpi: int = 64,
    ) -> None:
        super().__init__()
        if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(f"every_n_epochs={every_n_epochs!r} must be an int >= 1")
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"num_images={num_images!r} must be an int >= 1")
        methods = tuple(methods)
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise ValueError(f"methods={list(methods)!r} must be a non-empty list of {list(METHODS)}")
        if head_fusion not in HEAD_FUSIONS:
            raise ValueError(f"head_fusion={head_fusion!r} must be one of {list(HEAD_FUSIONS)}")
        if not 0.0 <= discard_ratio < 1.0:
            raise ValueError(f"discard_ratio={discard_ratio} must be in [0, 1)")
        if dpi < 1:
            raise ValueError(f"dpi={dpi} must be >= 1")
        self.every_n_epochs = every_n_epochs
        self.num_images = num_images
        self.methods = methods
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio
        self.class_names = list(class_names) if class_names is not None else None
        self.tag = tag
        self.dpi = dpi
        self.images: Tensor | None = None  # (num_images, C, H, W) on the CPU, once chosen
        self.labels: Tensor | None = None  # (num_images,)
        self.logged_epochs: list[int] = []
        self._candidates: list[tuple[Tensor, Tensor]] = []
        self._warned = False

    # --- choosing the images ------------------------------------------------------------------

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        # Collect candidates from the batches validation loads anyway: no extra pass over the data.
        if self.images is not None or dataloader_idx != 0:
            return
        if sum(len(y) for _, y in self._candidates) < 4 * self.num_images:
            self._candidates.append((batch[0].detach().cpu(), batch[1].detach().cpu()))

    def _choose_images(self) -> None:
        x = torch.cat([x for x, _ in self._candidates])  # (M, C, H, W)
        y = torch.cat([y for _, y in self._candidates])  # (M,)
        self._candidates = []
        # Round-robin over the classes in order of first appearance, so every class gets a row.
        classes = list(dict.fromkeys(y.tolist()))
        per_class = [(y == c).nonzero().flatten().tolist() for c in classes]
        order = [idx[k] for k in range(len(y)) for idx in per_class if k < len(idx)]
        chosen = torch.tensor(order[: self.num_images])
        self.images, self.labels = x[chosen].clone(), y[chosen].clone()

    # --- logging ------------------------------------------------------------------------------

    def _due(self, trainer: L.Trainer) -> bool:
        epoch = trainer.current_epoch + 1  # epochs done, counting this one
        return epoch % self.every_n_epochs == 0 or epoch == trainer.max_epochs

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._due(trainer):
            return
        if self.images is None:
            if not self._candidates:
                return
            self._choose_images()
        if not trainer.is_global_zero:
            return
        model = getattr(pl_module, "backbone", pl_module)
        if not supports_rollout(model):
            if not self._warned:
                rank_zero_warn(
                    f"RolloutImages: {type(model).__name__} has no `forward(x, return_attn=True)` and "
                    "`patch_embed`, so no rollout images are logged for it."
                )
                self._warned = True
            return
        with trainer.precision_plugin.forward_context():  # autocast as in validation, if any
            figure = self.render(model, trainer.precision_plugin.convert_input(self.images))
        log_image(trainer, self.tag, figure_to_array(figure, self.dpi))
        self.logged_epochs.append(trainer.current_epoch)

    def render(self, model: nn.Module, images: Tensor | None = None):
        """The overlay grid of the chosen images for `model`, as a matplotlib Figure.

        `images` are the chosen images as the model should get them (e.g. in its precision); by
        default the chosen images as they are.
        """
        if self.images is None:
            raise RuntimeError("no images chosen yet: they are taken from the first validation batches")
        x = (self.images if images is None else images).to(next(model.parameters()).device)
        maps = {}
        for method in self.methods:
            options = {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio} if method == "rollout" else {}
            maps[METHOD_TITLES[method]] = patch_relevance(model, x, method=method, **options).cpu()
        with torch.no_grad():
            probs = model(x).float().softmax(-1).cpu()  # (B, num_classes)
        confidence, predicted = probs.max(-1)
        titles = [
            f"y={self._name(int(label))} pred={self._name(int(pred))} ({p:.2f})"
            for label, pred, p in zip(self.labels, predicted, confidence)
        ]
        return rollout_grid(self.images, maps, titles=titles)

    def _name(self, index: int) -> str:
        return self.class_names[index] if self.class_names is not None else str(index)


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


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def supports_rollout(model: nn.Module) -> bool:
    """Whether `model` follows the rollout contract: `model(x, return_attn=True)` and `patch_embed`."""
    return "return_attn" in inspect.signature(model.forward).parameters and hasattr(model, "patch_embed")


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
