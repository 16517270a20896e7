"""The dashboard callbacks of interpretation: rollout overlays, relevance scores, test predictions and mistakes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from vit.checks import check_choice, check_int
from vit.data.base import SplitDataModule
from vit.explain.methods import SCALES, ColourScale
from vit.explain.plot import display_image, overlay, rollout_grid
from vit.explain.relevance import METHODS, Method, relevance, usable_methods
from vit.explain.rollout import HEAD_FUSIONS, HeadFusion
from vit.explain.scores import pointing_game, relevance_mass
from vit.training.classifier import explained_network, index_names
from vit.training.contract import HasRegionMasks, class_names_of
from vit.training.dashboard import RankedPredictions, epoch_title, figure_to_array, log_image

METHOD_TITLES = {"grad_rollout": "grad rollout"}  # a column's title; the others are titled by their name


class RolloutImages(L.Callback):
    """Every `every_n_epochs` epochs (and after the last one), log the backbone's relevance overlays (`rollout_grid`) of
    the first validation images, round-robin over their labels, one column per method; methods it cannot run are left
    out with one warning. `class_names` title the rows (default: the model's, else indices)."""

    def __init__(
        self,
        *,
        every_n_epochs: int = 1,
        num_images: int = 8,
        methods: Sequence[Method] = ("rollout", "grad_rollout"),
        head_fusion: HeadFusion = "mean",
        discard_ratio: float = 0.0,
        class_names: Sequence[str] | None = None,
        scale: ColourScale = "row",
        tag: str = "val/rollout",
        dpi: int = 64,
    ) -> None:
        super().__init__()
        check_int("every_n_epochs", every_n_epochs, 1)
        check_int("num_images", num_images, 1)
        methods = tuple(methods)
        if not methods or any(m not in METHODS for m in methods):
            raise ValueError(f"methods={list(methods)!r} must be a non-empty list of {list(METHODS)}")
        check_choice("head_fusion", head_fusion, HEAD_FUSIONS)
        if not 0.0 <= discard_ratio < 1.0:
            raise ValueError(f"discard_ratio={discard_ratio} must be in [0, 1)")
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r} must be one of {list(SCALES)}")
        check_int("dpi", dpi, 1)
        self.every_n_epochs, self.num_images, self.methods, self.scale = every_n_epochs, num_images, methods, scale
        self.head_fusion, self.discard_ratio, self.tag, self.dpi = head_fusion, discard_ratio, tag, dpi
        self.class_names = list(class_names) if class_names is not None else None
        self._model_names: list[str] | None = None  # the LightningModule's, used when class_names is None
        self.images: Tensor | None = None  # (num_images, C, H, W) on the CPU, once chosen
        self.labels: Tensor | None = None  # (num_images,)
        self.logged_epochs: list[int] = []
        self._candidates: list[tuple[Tensor, Tensor]] = []
        self._warned = False

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        collected = sum(len(y) for _, y in self._candidates)
        if self.images is None and dataloader_idx == 0 and collected < 4 * self.num_images:
            self._candidates.append((batch[0].detach().cpu(), batch[1].detach().cpu()))

    def _choose_images(self) -> None:
        x, y = (torch.cat(parts) for parts in zip(*self._candidates))  # (M, C, H, W), (M,)
        self._candidates = []
        # Round-robin over the classes in order of first appearance, so every class gets a row.
        per_class = [(y == c).nonzero().flatten().tolist() for c in dict.fromkeys(y.tolist())]
        order = [idx[k] for k in range(len(y)) for idx in per_class if k < len(idx)]
        chosen = torch.tensor(order[: self.num_images])
        self.images, self.labels = x[chosen].clone(), y[chosen].clone()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not _due(trainer, self.every_n_epochs):
            return
        if self.images is None:
            if not self._candidates:
                return
            self._choose_images()
        if not trainer.is_global_zero:
            return
        model, self._model_names = explained_network(pl_module), class_names_of(pl_module)
        usable = usable_methods(model, self.methods, skip=True)
        if len(usable) < len(self.methods) and not self._warned:
            left_out = [m for m in self.methods if m not in usable]
            rank_zero_warn(
                f"RolloutImages: {type(model).__name__} has no attention layers and `patch_embed`, so "
                + (f"{left_out} are left out." if usable else "no rollout images are logged for it.")
            )
            self._warned = True
        if not usable:
            return
        with trainer.precision_plugin.forward_context():  # autocast as in validation, if any
            figure = self.render(model, trainer.precision_plugin.convert_input(self.images))
        figure.suptitle(epoch_title(trainer.current_epoch, trainer.global_step))
        log_image(trainer, self.tag, figure_to_array(figure, self.dpi))
        self.logged_epochs.append(trainer.current_epoch)

    def render(self, model: nn.Module, images: Tensor | None = None):
        """The overlay grid of the chosen images (or `images`, e.g. in the model's precision) for `model`."""
        if self.images is None:
            raise RuntimeError("no images chosen yet: they are taken from the first validation batches")
        x = (self.images if images is None else images).to(next(model.parameters()).device)
        rollout_options = {"head_fusion": self.head_fusion, "discard_ratio": self.discard_ratio}
        maps = {
            METHOD_TITLES.get(method, method): relevance(
                model, x, method, **(rollout_options if method == "rollout" else {})
            ).cpu()
            for method in usable_methods(model, self.methods, skip=True)
        }
        with torch.no_grad():
            probs = model(x).float().softmax(-1).cpu()  # (B, num_classes)
        confidence, predicted = probs.max(-1)
        names = self.class_names or self._model_names or index_names(probs.shape[-1])
        titles = [
            f"label {names[int(label)]}\npredicted {names[int(pred)]} ({p:.2f})"
            for label, pred, p in zip(self.labels, predicted, confidence)
        ]
        return rollout_grid(self.images, maps, titles=titles, scale=self.scale)


class RelevanceScores(L.Callback):
    """Every `every_n_epochs` epochs (and after the last), log `val/pointing_game/<method>` and `relevance_mass` of the
    first validation images against their `circle_mask(i)`; what cannot be scored is skipped with one warning."""

    def __init__(
        self,
        *,
        methods: Sequence[str] = ("rollout", "chefer", "gradcam"),
        num_images: int = 64,
        every_n_epochs: int = 1,
    ) -> None:
        super().__init__()
        for method in methods:
            check_choice("methods", method, Method)
        check_int("num_images", num_images, 1)
        check_int("every_n_epochs", every_n_epochs, 1)
        self.methods, self.num_images, self.every_n_epochs = tuple(methods), num_images, every_n_epochs
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not _due(trainer, self.every_n_epochs):
            return
        data = trainer.datamodule
        val = data.val_set if isinstance(data, SplitDataModule) else None
        if not isinstance(val, HasRegionMasks):
            self._warn_once(
                "masks",
                "RelevanceScores: the validation set has no ground-truth masks (circle_mask); nothing is scored.",
            )
            return
        n = min(self.num_images, len(val))
        x = torch.stack([val[i][0] for i in range(n)]).to(pl_module.device)
        masks = torch.stack([val.circle_mask(i) for i in range(n)])
        model = explained_network(pl_module)
        usable = usable_methods(model, self.methods, skip=True)
        for method in self.methods:
            if method not in usable:
                self._warn_once(
                    method, f"RelevanceScores: {type(model).__name__} has no attention layers; '{method}' is skipped."
                )
                continue
            maps = relevance(model, x, method).cpu()
            pl_module.log(f"val/pointing_game/{method}", pointing_game(maps, masks).mean(), sync_dist=False)
            pl_module.log(f"val/relevance_mass/{method}", relevance_mass(maps, masks).mean(), sync_dist=False)


class _TestPredictions(L.Callback):
    """`kept`: rank 0's test predictions (`RankedPredictions` of `test_step`'s logits) when `_loggers` can show them."""

    def __init__(self, kept: RankedPredictions, class_names: Sequence[str] | None, *, to_wandb: bool) -> None:
        super().__init__()
        self.kept, self.to_wandb = kept, to_wandb  # to_wandb: the W&B loggers, or every other one
        self.class_names = list(class_names) if class_names is not None else None

    def _loggers(self, trainer: L.Trainer) -> list:
        return [logger for logger in trainer.loggers if isinstance(logger, WandbLogger) == self.to_wandb]

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.kept.reset()

    def on_test_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if dataloader_idx != 0 or not trainer.is_global_zero or not self._loggers(trainer):
            return
        if not isinstance(outputs, Tensor):
            raise TypeError(
                f"{type(self).__name__} needs test_step to return the logits (B, num_classes); "
                f"{type(pl_module).__name__}.test_step returned {type(outputs).__name__}"
            )
        self.kept.update(batch[0], batch[1], outputs)

    def _class_names(self, pl_module: L.LightningModule) -> list[str]:
        """The names of the classes drawn: the callback's own `class_names`, else the model's, else the indices."""
        return self.class_names or class_names_of(pl_module) or index_names(self.kept.num_classes)


class TestPredictionsTable(_TestPredictions):
    """After `test`, log a W&B table of at most `num_rows` test images, the mistakes first: `image`, `true`,
    `predicted`, `probability` and, for a backbone with attention, the `rollout` overlay. Needs a W&B logger."""

    def __init__(
        self, *, num_rows: int = 64, class_names: Sequence[str] | None = None, tag: str = "test/predictions"
    ) -> None:
        check_int("num_rows", num_rows, 1)
        super().__init__(RankedPredictions(num_rows), class_names, to_wandb=True)
        self.num_rows, self.tag = num_rows, tag
        self.columns: list[str] = []  # of the last table logged

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loggers, kept = self._loggers(trainer), self.kept
        if kept.images is None or not loggers or not trainer.is_global_zero:
            return
        import wandb

        model = explained_network(pl_module, evaluated=True)
        maps = None
        if usable_methods(model, ("rollout",), skip=True):
            x = kept.images.to(next(model.parameters()).device)
            with trainer.precision_plugin.forward_context():
                maps = relevance(model, trainer.precision_plugin.convert_input(x), "rollout").float().cpu()
        names = self._class_names(pl_module)
        self.columns = ["image", "true", "predicted", "probability"] + (["rollout"] if maps is not None else [])
        rows = [
            [
                wandb.Image(_to_uint8(display_image(image))),
                names[int(kept.labels[i])],
                names[int(kept.predicted[i])],
                float(kept.probability[i]),
                *([] if maps is None else [wandb.Image(_to_uint8(overlay(image, maps[i])))]),
            ]
            for i, image in enumerate(kept.images)
        ]
        for logger in loggers:
            logger.log_table(key=self.tag, columns=self.columns, data=rows, step=trainer.global_step)
        kept.reset()


class TestMistakesGrid(_TestPredictions):
    """After `test`, log a grid of the `num_images` most confident mistakes, `columns` to a row, to non-W&B loggers."""

    def __init__(
        self,
        *,
        num_images: int = 16,
        columns: int = 8,
        class_names: Sequence[str] | None = None,
        tag: str = "test/mistakes",
        dpi: int = 100,
    ) -> None:
        for name, value in (("num_images", num_images), ("columns", columns), ("dpi", dpi)):
            check_int(name, value, 1)
        super().__init__(RankedPredictions(num_images, mistakes_only=True), class_names, to_wandb=False)
        self.columns, self.tag, self.dpi = columns, tag, dpi

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if len(self.kept) and trainer.is_global_zero:
            names = self._class_names(pl_module)
            figure = self.render(lambda index: names[int(index)])
            log_image(trainer, self.tag, figure_to_array(figure, self.dpi), loggers=self._loggers(trainer))

    def render(self, name=str):
        """The grid of the kept mistakes as a matplotlib Figure; `name` turns a class index into its title."""
        from matplotlib.figure import Figure

        kept, cell = self.kept, 1.6
        columns = min(self.columns, len(kept))
        rows = math.ceil(len(kept) / columns)
        figure = Figure(figsize=(cell * columns, cell * rows + 0.5), layout="constrained")
        axes = figure.subplots(rows, columns, squeeze=False)
        for i, ax in enumerate(axes.flat):
            ax.set_axis_off()
            if i < len(kept):
                ax.imshow(display_image(kept.images[i]), interpolation="nearest")
                ax.set_title(
                    f"true {name(kept.labels[i])}\npredicted {name(kept.predicted[i])}"
                    f" ({float(kept.probability[i]):.2f})",
                    fontsize="small",
                )
        figure.suptitle(f"the {len(kept)} most confident of {kept.mistakes} mistakes in {kept.seen} test images")
        return figure


def _due(trainer: L.Trainer, every_n_epochs: int) -> bool:
    """Whether a callback that runs every `every_n_epochs` epochs and after the last one runs at this epoch's end."""
    epoch = trainer.current_epoch + 1  # epochs done, counting this one
    return epoch % every_n_epochs == 0 or epoch == trainer.max_epochs


def _to_uint8(image: np.ndarray) -> np.ndarray:
    """`(H, W, 3)` floats in [0, 1] -> uint8, as W&B stores images."""
    return (image * 255.0).round().clip(0, 255).astype("uint8")
