"""The command line: LightningCLI over `ImageClassifier` and any LightningDataModule in `vit.data`."""

from __future__ import annotations

import sys
from typing import Literal

import lightning as L
import torch
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from vit.classifier import ImageClassifier
from vit.data.cifar import CIFARNotFoundError


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
            save_config_kwargs={"overwrite": False},
            args=args,
        )
    except CIFARNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
