"""The command line: LightningCLI over `ImageClassifier` and any LightningDataModule in `vit.data`."""

from __future__ import annotations

import os
import sys
from typing import Literal

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from vit.classifier import ImageClassifier
from vit.data.cifar import CIFARNotFoundError


class SaveConfig(SaveConfigCallback):
    """Save the resolved `config.yaml` in the run's own folder and log it as the run's config.

    TensorBoard and CSV runs have a folder per run (`trainer.log_dir`), where Lightning puts the
    file. Other loggers (W&B) have none, and Lightning would write every run's config to the same
    `save_dir/config.yaml`, refusing the second run; here it goes beside the run's checkpoints,
    `save_dir/name/version/config.yaml`. Loggers without a run folder also get the whole config
    through `log_hyperparams` (the W&B run's config).
    """

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved or not trainer.loggers or isinstance(trainer.loggers[0], (TensorBoardLogger, CSVLogger)):
            super().setup(trainer, pl_module, stage)
            return
        logger = trainer.loggers[0]
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        # The folder ModelCheckpoint uses for this logger's checkpoints, minus "checkpoints".
        run_dir = trainer.strategy.broadcast(
            os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version)
        )
        config_path = os.path.join(run_dir, self.config_filename)
        fs = get_filesystem(run_dir)
        exists = trainer.strategy.broadcast(fs.isfile(config_path) if trainer.is_global_zero else False)
        if exists and not self.overwrite:
            raise RuntimeError(f"{config_path} already exists; not overwriting the config of an earlier run")
        if trainer.is_global_zero:
            fs.makedirs(run_dir, exist_ok=True)
            self.parser.save(self.config, config_path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def save_config(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        config = self.config.clone().as_dict()
        config.pop("config", None)  # the paths of the YAML files given, not settings
        for logger in trainer.loggers:
            if not isinstance(logger, (TensorBoardLogger, CSVLogger)):
                logger.log_hyperparams(config)


class ViTCLI(LightningCLI):
    """LightningCLI that links the data's shape into the backbone and tests the best checkpoint after `fit`."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The data module knows the image size, channels and classes; the backbone must match them.
        for source, target in (("num_classes", "num_classes"), ("in_chans", "in_chans"), ("image_size", "img_size")):
            parser.link_arguments(f"data.{source}", f"model.backbone.init_args.{target}", apply_on="instantiate")
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After `fit`, run `test` on the best checkpoint (by the ModelCheckpoint monitor) and print test/acc.",
        )
        parser.add_argument(
            "--float32_matmul_precision",
            type=Literal["highest", "high", "medium"],
            default="high",
            help=(
                "torch.set_float32_matmul_precision, set before anything is built. 'high' lets float32 "
                "matmuls use TF32 tensor cores on NVIDIA GPUs (Ampere and newer); 'highest' keeps full "
                "float32; 'medium' allows bfloat16 internally (on CPUs too). Mixed-precision (bf16) "
                "matmuls are not affected."
            ),
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        torch.set_float32_matmul_precision(config.float32_matmul_precision)

    def after_fit(self) -> None:
        if not self.config.fit.get("test_after_fit", True) or self.trainer.fast_dev_run:
            return
        best = self.trainer.checkpoint_callback.best_model_path if self.trainer.checkpoint_callback else ""
        results = self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=best or None, verbose=False)
        if self.trainer.is_global_zero and results:
            acc = results[0].get("test/acc")
            where = best or "the final weights"
            print(f"test/acc = {acc:.4f}  ({where})" if acc is not None else f"test results: {results[0]}")


def main(args=None) -> ViTCLI:
    """Entry point of `train.py`: `python train.py {fit,validate,test,predict} --config FILE`.

    Missing data is a user's setup problem, not a bug: its message is printed without the traceback
    and the process exits with status 1 (`SystemExit(1)` when called in-process).
    """
    try:
        return ViTCLI(
            ImageClassifier,
            L.LightningDataModule,
            subclass_mode_data=True,
            save_config_callback=SaveConfig,
            save_config_kwargs={"overwrite": False},
            args=args,
        )
    except CIFARNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
