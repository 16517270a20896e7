"""What a validated checkpoint builds: this project's model from plain values, and for generated data its data module.

Nothing here reads a file or judges a value: `vit.training.checkpoint.read` has read and validated
the checkpoint whole (`schema.Checkpoint`), and these functions only call the allowlisted classes
with the values it checked. The backbone's `pretrained` weights are never loaded again (the
checkpoint's weights replace them); a data module is built only for generated data (its test
images are made, not read from a folder the checkpoint names).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import lightning as L
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context
from torch import nn

from vit.checks import constructor_message, first_line
from vit.data.base import SyntheticDataModule
from vit.training.checkpoint.errors import CheckpointError
from vit.training.checkpoint.schema import LIGHTNING_INSTANTIATOR, Checkpoint
from vit.training.classifier import ImageClassifier

MAX_TEST_SET_BYTES = 2**29  # a generated test split built from a checkpoint, as float32 pixels


def build_backbone(checkpoint: Checkpoint) -> nn.Module:
    """The checkpoint's backbone, untrained, from its recorded class and arguments."""
    return _call(checkpoint.backbone_class, checkpoint.backbone_args, "backbone", checkpoint.source)


def build_classifier(checkpoint: Checkpoint, *, inference: bool = True) -> ImageClassifier:
    """The checkpoint's `ImageClassifier`, its `hparams` as recorded (so the checkpoints it writes record them too).

    With `inference`, the trained weights are loaded, in eval mode on the CPU: the moving average
    in `backbone` when the run kept one (`inference_state`), `compile` off (the same numbers without
    the compile time). Without, the model is built untrained, with every recorded setting, for
    `train.py`, where Lightning restores the weights (and the run) from the same validated dict.
    """
    settings = {**checkpoint.settings, "pretrained": None}  # the checkpoint's weights replace them: nothing fetched
    if inference:
        settings.pop("compile", None)
        settings.pop("ema_decay", None)  # the average is the model
    backbone = build_backbone(checkpoint)
    hparams = {"backbone": {"class_path": checkpoint.hyper_parameters["backbone"]["class_path"],
                            "init_args": dict(checkpoint.backbone_args)}, **settings}
    try:
        with _given_hyperparameters_context(hparams=hparams, instantiator=LIGHTNING_INSTANTIATOR):
            model = ImageClassifier(backbone, **settings)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {checkpoint.source}: its model settings cannot be used: "
                              f"{first_line(err)}") from None
    model.class_names = list(checkpoint.class_names)
    if not inference:
        return model
    missing, unexpected = model.load_state_dict(inference_state(checkpoint.state_dict), strict=False)
    if missing or unexpected:  # validate compared the names already: this is a bug, not a bad file
        raise RuntimeError(f"{checkpoint.source}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()


def inference_state(state_dict: Mapping) -> dict:
    """The weights a command runs: with EMA on (`ImageClassifier(ema_decay=...)`), the moving average
    `ema.module.*` as `backbone.*` (the trained weights are left out); without, the state dict unchanged."""
    prefix = "ema.module."
    if not any(key.startswith(prefix) for key in state_dict):
        return dict(state_dict)
    state = {key: value for key, value in state_dict.items() if not key.startswith(("backbone.", prefix))}
    state.update({"backbone." + key.removeprefix(prefix): value for key, value in state_dict.items()
                  if key.startswith(prefix)})
    return state


def build_datamodule(checkpoint: Checkpoint) -> L.LightningDataModule:
    """The checkpoint's data module, for its test images: only generated data (`SyntheticDataModule`s), whose
    images are drawn from the recorded seed. A data module that reads files (CIFAR, an image folder) is
    refused: a checkpoint does not choose which folders of this machine are read."""
    cls = checkpoint.data_class
    if cls is None:
        raise CheckpointError(f"checkpoint {checkpoint.source} does not record its data module")
    if not issubclass(cls, SyntheticDataModule):
        raise CheckpointError(f"checkpoint {checkpoint.source} was trained on files ({cls.__name__}); its test "
                              "images are not rebuilt from a checkpoint")
    values = checkpoint.data_args.get("num_test", 1) * checkpoint.inputs["in_chans"] * math.prod(
        checkpoint.inputs["img_size"])
    if values * 4 > MAX_TEST_SET_BYTES:
        raise CheckpointError(f"checkpoint {checkpoint.source}: its test split (num_test="
                              f"{checkpoint.data_args.get('num_test')}) would take {values * 4 / 2**30:.1f} GiB to "
                              f"generate (limit {MAX_TEST_SET_BYTES // 2**20} MiB)")
    return _call(cls, checkpoint.data_args, "data module", checkpoint.source)


def _call(cls: type, kwargs: Mapping, what: str, source: str):
    """`cls(**kwargs)`, with a constructor's refusal reported as a `CheckpointError` naming `what`."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {source}: its {what} {cls.__name__} cannot be built here: "
                              f"{first_line(ValueError(constructor_message(str(err))))}") from None


def open_model(path_or_url: str | os.PathLike) -> tuple[ImageClassifier, Checkpoint]:
    """`(model, checkpoint)` of a checkpoint path or URL: read and validated whole (`read`), then the trained model
    in eval mode on the CPU. Every door that runs a checkpoint's model opens it here."""
    from vit.training.checkpoint import read

    checkpoint = read(path_or_url)
    return build_classifier(checkpoint), checkpoint
