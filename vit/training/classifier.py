"""The Lightning system: an image classifier around any `(B, C, H, W) -> logits` backbone."""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Literal

import lightning as L
import timm.optim
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError, MulticlassConfusionMatrix

from vit.checks import check_choice, check_float, check_size
from vit.data.base import SplitDataModule
from vit.models.contract import Backbone, Classifies, ExemptsFromDecay, GroupsLayers
from vit.models.pretrained import load_pretrained
from vit.training.contract import DeclaresInputs, class_names_of
from vit.training.optim import SCHEDULES, check_restored, freeze, group_rates, warmup_schedule
from vit.training.record import training_record


def format_test_results(metrics: dict[str, float], where: str = "") -> str:
    """The printed summary of a test: accuracy (then `where`, e.g. the checkpoint), top-5, ECE, per-class accuracy."""
    scored = f" on {int(metrics['test/images'])} images" if "test/images" in metrics else ""
    lines = [f"test/acc = {metrics['test/acc']:.4f}{scored}" + (f"  ({where})" if where else "")]
    lines += [f"{key} = {metrics[key]:.4f}" for key in ("test/top5_acc", "test/ece") if key in metrics]
    per_class = {
        key.removeprefix("test/class_acc/"): value
        for key, value in metrics.items()
        if key.startswith("test/class_acc/")
    }
    if per_class:
        width = max(map(len, per_class))
        lines.append("accuracy per class:")
        lines += [f"  {name:<{width}}  {value:.4f}" for name, value in per_class.items()]
    return "\n".join(lines)


def index_names(num_classes: int) -> list[str]:
    """The class names of a model that knows none: `["0", "1", ...]`."""
    return [str(i) for i in range(num_classes)]


def check_class_names(names: object, num_classes: int, source: str) -> list[str]:
    """`names` under the one rule a saved model's names follow (`vit.registry.check_names`: distinct, printable,
    one per class), its refusal a `ValueError` naming `source`: a run whose names a model folder could not hold is
    refused as it starts, not when its first checkpoint is saved."""
    from vit.registry import check_names

    try:
        return check_names(names, num_classes)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


class ImageClassifier(L.LightningModule):
    """Cross-entropy training of `backbone` with a timm optimizer (AdamW by default) and a timm schedule (warmup +
    cosine by default), stepped per optimizer update.

    Args:
        backbone: the network, with a `num_classes` attribute; in YAML, `class_path: vit.models.VisionTransformer`
            (or `ResNet`) with its `init_args`.
        pretrained: weights the `VisionTransformer` starts from: a timm model name, a hub id or a local file; it fills
            the backbone's unset `embed_dim`, `depth`, `num_heads`. Never loaded again from a checkpoint.
        opt: the optimizer by timm's name (`timm.optim.list_optimizers()`: adamw, sgd (with Nesterov momentum 0.9),
            lamb, lion, ...), built by `timm.optim.create_optimizer_v2` over this model's parameter groups; `betas`
            go to those that take them.
        lr: peak learning rate, reached after `warmup_epochs`.
        warmup_epochs: linear warmup length (may be fractional): update t of W at `lr * (t + 1) / W`.
        weight_decay: AdamW decoupled weight decay, applied to weight matrices only.
        sched: the schedule after the warmup, by timm's name (`vit.training.optim.SCHEDULES`): "cosine" (or
            "tanh") to `lr * min_lr_ratio` at the last update, "step" (times `decay_rate` every `decay_epochs`),
            "constant".
        min_lr_ratio: the cosine ends at `lr * min_lr_ratio` (each group's, with layer decay).
        decay_epochs, decay_rate: the "step" schedule's interval (may be fractional) and factor.
        label_smoothing: applied to hard labels and to the soft (Mixup/CutMix) targets alike.
        compile: `torch.compile` the backbone in place (`nn.Module.compile`), so checkpoint keys stay `backbone.*`.
        trainable: what fine-tuning trains: "all"; "head" (a linear probe); or an int k, the last k blocks with the
            final norm (`norm` or `fc_norm`) and the head. Frozen parameters get no gradient and are not optimized.
        layer_decay: layer-wise learning-rate decay d in (0, 1] (BEiT; MAE), off by default: of L = depth + 2 layers
            (stem, blocks, head: `group_matcher`), layer i trains at `lr * d ** (L - 1 - i)` (timm's `lr_scale`).
        ema_decay: keep an exponential moving average of the backbone (timm's `ModelEmaV3`), off by default.
            Validation, test and prediction use it; checkpoints hold it as `ema.module.*` beside `backbone.*`.

    `class_names` (`["0", "1", ...]` until known) comes from the data module and travels in every checkpoint
    beside `"inputs"` (the data module's `inputs()`), so a checkpoint opens for inference alone. A batch is
    `(x, y)`, or `(x, y, y_soft)` with Mixup/CutMix: the loss then uses the soft targets, the accuracy `y`."""

    _saved_schedule: dict | None = None  # a resumed checkpoint's schedule state (`on_load_checkpoint`)

    def __init__(
        self,
        backbone: nn.Module,
        *,
        pretrained: str | None = None,
        opt: str = "adamw",
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        sched: str = "cosine",
        min_lr_ratio: float = 0.0,
        decay_epochs: float = 30.0,
        decay_rate: float = 0.1,
        label_smoothing: float = 0.0,
        compile: bool = False,
        trainable: Literal["all", "head"] | int = "all",
        layer_decay: float | None = None,
        ema_decay: float | None = None,
    ) -> None:
        super().__init__()
        num_classes = self._check_options(
            backbone, lr, weight_decay, betas, warmup_epochs, min_lr_ratio, label_smoothing, layer_decay, ema_decay
        )
        check_choice("sched", sched, SCHEDULES)
        check_float("decay_epochs", decay_epochs, 0.0, low_open=True)
        check_float("decay_rate", decay_rate, 0.0, 1.0)
        if opt not in timm.optim.list_optimizers():  # timm's registry: its names, lower case
            raise ValueError(
                f"opt={opt!r} is not allowed: expected one of timm's optimizers (timm.optim.list_optimizers(): "
                "adamw, sgd, momentum, lamb, lion, adopt, ...)"
            )
        # LightningCLI's backbone is recorded as class_path + init_args; a module built in Python is not recorded.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Attribute 'backbone' is an instance of `nn.Module`")
            self.save_hyperparameters()
        if isinstance(self.hparams.get("backbone"), nn.Module):
            self.save_hyperparameters(ignore=["backbone"])
        if pretrained:
            load_pretrained(backbone, pretrained)
        self.backbone = backbone
        freeze(backbone, trainable)
        self.ema = ModelEmaV3(backbone, decay=ema_decay).requires_grad_(False) if ema_decay is not None else None
        if self.ema is not None:  # timm leaves its copy in eval mode; evaluation sets the mode it runs in
            self.ema.module.train(backbone.training)
        if compile:
            self.backbone.compile()
        self.train_acc, self.val_acc, self.test_acc = (
            MulticlassAccuracy(num_classes, average="micro") for _ in range(3)
        )
        self.test_top5 = MulticlassAccuracy(num_classes, top_k=5, average="micro") if num_classes > 5 else None
        self.test_ece = MulticlassCalibrationError(num_classes=num_classes, n_bins=15, norm="l1")
        self.test_confusion = MulticlassConfusionMatrix(num_classes=num_classes)
        self.class_names = index_names(num_classes)

    @staticmethod
    def _check_options(
        backbone: nn.Module,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        warmup_epochs: float,
        min_lr_ratio: float,
        label_smoothing: float,
        layer_decay: float | None,
        ema_decay: float | None,
    ) -> int:
        """Check the optimizer, schedule, layer decay and EMA options against `backbone`; return its `num_classes`."""
        check_float("lr", lr, 0.0, low_open=True)
        check_float("weight_decay", weight_decay, 0.0)
        check_float("warmup_epochs", warmup_epochs, 0.0)
        check_float("label_smoothing", label_smoothing, 0.0, 1.0, high_open=True)
        check_float("min_lr_ratio", min_lr_ratio, 0.0, 1.0)
        if layer_decay is not None:
            check_float("layer_decay", layer_decay, 0.0, 1.0, low_open=True)
            if not isinstance(backbone, GroupsLayers):
                raise ValueError(
                    f"layer_decay={layer_decay} needs a backbone with timm's `group_matcher` (its "
                    f"layers); {type(backbone).__name__} has none"
                )
        if ema_decay is not None:
            check_float("ema_decay", ema_decay, 0.0, 1.0, high_open=True)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas={betas!r} is not allowed: expected two numbers in [0, 1)")
        for i, beta in enumerate(betas):
            check_float(f"betas[{i}]", beta, 0.0, 1.0, high_open=True)
        num_classes = backbone.num_classes if isinstance(backbone, Classifies) else None
        if not isinstance(num_classes, int):
            raise ValueError(f"backbone {type(backbone).__name__} must have an int attribute `num_classes`")
        return num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # F.cross_entropy takes class indices (B,) or class probabilities (B, K); smoothing applies to both.
        return F.cross_entropy(logits, target, label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y, *soft = batch
        logits = self(x)
        loss = self._loss(logits, soft[0] if soft else y)
        # Averaged over processes (no host sync): what is logged, and what every process checks for NaN.
        mean_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        # One `self.log` a step: each costs Lightning 0.5-1 ms of CPU, a sixth of a tiny ViT step (docs/benchmarks.md).
        # train/acc is logged once an epoch (`on_train_epoch_end`), the rates only on the steps the loggers write.
        self.train_acc.update(logits, y)
        self.log("train/loss", mean_loss, on_step=True, on_epoch=True, prog_bar=True)
        # Lightning's own step-logging callbacks (LearningRateMonitor, DeviceStatsMonitor) ask the same question.
        if self.trainer._logger_connector.should_update_logs or self.trainer.fast_dev_run:
            self.log_dict(group_rates(self.trainer.optimizers[0]), on_step=True, on_epoch=False)
        return {"loss": loss, "mean_loss": mean_loss}

    def on_train_epoch_end(self) -> None:
        self.log("train/acc", self.train_acc)  # computed over the epoch, then reset by Lightning

    def on_fit_start(self) -> None:
        # train/loss is logged already averaged over processes: Lightning's sync_dist advice does not apply.
        warnings.filterwarnings(
            "ignore", message=r"It is recommended to use `self.log\('train/loss'", category=PossibleUserWarning
        )
        decay, steps = self.hparams.get("ema_decay"), self.trainer.estimated_stepping_batches
        if decay is None or self.trainer.fast_dev_run or steps == float("inf"):
            return
        if (horizon := 1 / (1 - decay)) > steps:
            rank_zero_warn(
                f"ema_decay={decay} averages over ~{round(horizon)} optimizer steps, but this run makes "
                f"{int(steps)}: validation, test and the checkpoint use the average, which stays near the "
                "initial weights; lower ema_decay or train longer"
            )

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:  # once per optimizer step, after it (also under gradient accumulation)
            self.ema.update(self.backbone)

    @property
    def evaluated(self) -> nn.Module:
        """The backbone that validation, test and prediction run: the moving average when `ema_decay` is set."""
        return self.ema.module if self.ema is not None else self.backbone

    def _eval_step(self, batch, split: str, metric: MulticlassAccuracy) -> torch.Tensor:
        logits = self.evaluated(batch[0])
        metric(logits, batch[1])
        self.log(f"{split}/loss", self._loss(logits, batch[1]), on_epoch=True, prog_bar=split == "val", sync_dist=True)
        self.log(f"{split}/acc", metric, on_epoch=True, prog_bar=split == "val")
        return logits

    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The logits `(B, num_classes)`, for callbacks (`vit.training.dashboard.ConfusionMatrix`)."""
        return self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The logits `(B, num_classes)`, for callbacks (`vit.explain.callbacks.TestPredictionsTable`)."""
        logits, y = self._eval_step(batch, "test", self.test_acc), batch[1]
        # Probabilities, not logits: torchmetrics would take logits that happen to lie in [0, 1] for probabilities.
        self.test_ece(logits.float().softmax(dim=-1), y)
        self.log("test/ece", self.test_ece, on_epoch=True)
        if self.test_top5 is not None:
            self.test_top5(logits, y)
            self.log("test/top5_acc", self.test_top5, on_epoch=True)
        self.test_confusion.update(logits.argmax(dim=-1), y)
        return logits

    def on_test_epoch_end(self) -> None:
        counts = self.test_confusion.compute()  # (K, K), rows true classes; summed over processes
        self.test_confusion.reset()
        per_class = counts.diagonal() / counts.sum(dim=1)  # NaN for a class without test images
        self.log("test/images", counts.sum().float())  # how many were scored (summed over processes already)
        for name, accuracy in zip(self.class_names, per_class.tolist()):
            if accuracy == accuracy:  # not NaN
                self.log(f"test/class_acc/{name}", accuracy)

    def setup(self, stage: str) -> None:
        """Take the class names of the trainer's data module, when it has them."""
        data = self.trainer.datamodule if self._trainer is not None else None
        if isinstance(data, SplitDataModule):  # this project's data modules declare their inputs and class names
            height, width = check_size("data.img_size", data.img_size)
            self.example_input_array = torch.zeros(1, data.in_chans, height, width)  # for TensorBoard's graph
        # A user's own LightningDataModule may name its classes too (vit.training.contract.NamesClasses).
        names = class_names_of(data)
        if names is not None:
            self.class_names = check_class_names(
                names, len(self.class_names), f"{type(self.trainer.datamodule).__name__}.class_names"
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["class_names"] = list(self.class_names)
        data = self.trainer.datamodule if self._trainer is not None else None
        if isinstance(data, DeclaresInputs):  # SplitDataModule, or a user's module that declares the same
            checkpoint["inputs"] = data.inputs()
        checkpoint["training_record"] = training_record(checkpoint)  # for the model folder's card

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        names = check_class_names(checkpoint["class_names"], len(self.class_names), "the checkpoint's class_names")
        if self._trainer is not None and names != self.class_names:
            # The metrics count the data module's labels; different names mean they differ from training's.
            warnings.warn(
                f"the checkpoint's class names {names[:10]} differ from the data module's "
                f"{self.class_names[:10]}: the reports use the data module's",
                stacklevel=2,
            )
        else:
            self.class_names = names
        # The schedule's state as saved: Lightning loads it into the schedule as it is; `on_train_start` checks it.
        self._saved_schedule = next(iter(checkpoint.get("lr_schedulers") or []), None)

    def on_train_start(self) -> None:
        # After Lightning restored everything (asking for the step count earlier would build the training data
        # before its position is restored): a resumed schedule is checked before its first step.
        if self.trainer.ckpt_path is None:
            return
        for name, value in (("global_step", self.trainer.global_step), ("current_epoch", self.trainer.current_epoch)):
            if not 0 <= value < 2**63:  # Lightning makes int64 tensors of them as it logs and checkpoints
                raise ValueError(f"the restored loop gives {name}={value}, beyond what a step or epoch count can be")
        if self.trainer.lr_scheduler_configs:
            self._resume_schedule(self.trainer.lr_scheduler_configs[0].scheduler)

    def _resume_schedule(self, live: Scheduler) -> None:
        """Check the saved schedule on a stand-in of this run's (its optimizer holds one tiny parameter per group of
        this model's) through the run's remaining updates, so that a state the run cannot go on from fails now, not
        at the update where it would; then set `live` to this config's schedule at the restored update (the same
        as the saved one unless the config changed, e.g. a longer `max_epochs`)."""
        rates = [{k: v for k, v in group.items() if k in ("lr", "lr_scale")} for group in self.optimizer().param_groups]
        stand_in = self.schedule(torch.optim.SGD([{**rate, "params": [torch.zeros(1)]} for rate in rates]))
        fresh, saved, step = stand_in.state_dict(), self._saved_schedule, self.trainer.global_step
        check_restored(
            stand_in, saved if isinstance(saved, dict) else {}, step, int(self.trainer.estimated_stepping_batches)
        )
        if saved != fresh:
            rank_zero_info(
                f"The learning-rate schedule goes on from update {step} as this config sets it, not as saved"
            )
        live.load_state_dict(fresh)
        live.step_update(num_updates=step)

    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Class probabilities `(B, num_classes)`."""
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.evaluated(x).softmax(dim=-1)

    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer (`opt`, by timm's factory) of the trainable parameters, in the groups `configure_optimizers`
        uses."""
        # Weight decay on weight matrices only: not on norms, biases, or `no_weight_decay()` (position, CLS token).
        hp = self.hparams
        skip = self.backbone.no_weight_decay() if isinstance(self.backbone, ExemptsFromDecay) else set()
        if hp.get("layer_decay") is None:
            groups = param_groups_weight_decay(self.backbone, hp.weight_decay, no_weight_decay_list=skip)
        else:
            groups = param_groups_layer_decay(
                self.backbone, hp.weight_decay, no_weight_decay_list=skip, layer_decay=hp.layer_decay
            )
        opt = hp.get("opt", "adamw")  # runs from before the option trained with AdamW
        takes_betas = "betas" in inspect.signature(timm.optim.get_optimizer_class(opt)).parameters
        extra = {"betas": tuple(hp.betas)} if takes_betas else {}
        return timm.optim.create_optimizer_v2(groups, opt=opt, lr=hp.lr, weight_decay=hp.weight_decay, **extra)

    def schedule(self, optimizer: torch.optim.Optimizer) -> Scheduler:
        """The warmup + `sched` schedule of `optimizer` over this run's updates (epochs turned into updates at this
        run's updates per epoch)."""
        hp, trainer = self.hparams, self.trainer
        total_steps = max(1, int(trainer.estimated_stepping_batches))  # sets up the training data: batches known
        per_epoch = total_steps / (trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else 1)
        if math.isfinite(trainer.num_training_batches):  # not where `max_steps` ends the run before `max_epochs`
            per_epoch = max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
        return warmup_schedule(
            optimizer,
            sched=hp.get("sched", "cosine"),  # runs from before the option: the cosine
            warmup_steps=min(total_steps, round(hp.warmup_epochs * per_epoch)),
            total_steps=total_steps,
            min_lr_ratio=hp.min_lr_ratio,
            decay_steps=max(1, round(hp.get("decay_epochs", 30.0) * per_epoch)),
            decay_rate=hp.get("decay_rate", 0.1),
        )

    def lr_scheduler_step(self, scheduler: Scheduler, metric=None) -> None:
        # timm's schedules are a function of the update count: the rate of the next update, after `global_step`.
        scheduler.step_update(num_updates=self.global_step)

    def configure_optimizers(self):
        optimizer = self.optimizer()
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.schedule(optimizer), "interval": "step"}}


def explained_network(module: nn.Module, *, evaluated: bool = False) -> nn.Module:
    """The network the explain callbacks read in `module`: an `ImageClassifier`'s backbone (its `evaluated` weights,
    the EMA's when there is one, if `evaluated`), else `module` itself when it is a `Backbone`, else its first child
    that is one (a user's LightningModule wrapping a backbone), else `module` (which the methods then refuse, in
    one line naming its type)."""
    if isinstance(module, ImageClassifier):
        return module.evaluated if evaluated else module.backbone
    if isinstance(module, Backbone):
        return module
    return next((child for child in module.children() if isinstance(child, Backbone)), module)
