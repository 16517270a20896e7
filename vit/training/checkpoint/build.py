"""What a validated checkpoint builds: this project's model and its input transform (a model's data module:
`vit.artifact.test_data`). Only allowlisted classes are called, with checked values; nothing is fetched."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn
from torchvision.transforms import v2

from vit.checks import first_line
from vit.data.images import build_transform
from vit.training.checkpoint.schema import LIGHTNING_INSTANTIATOR, Checkpoint
from vit.training.checkpoint.values import CheckpointError, construct

if TYPE_CHECKING:  # imported where used: reading a checkpoint for inference imports no Lightning

    from vit.training.classifier import ImageClassifier

def inference_transform(inputs: dict) -> v2.Compose:
    """The transform of `Checkpoint.inputs` (what a checkpoint records of its input): PIL image -> the model's input."""
    normalization = None if inputs["mean"] is None else (inputs["mean"], inputs["std"])
    try:
        return build_transform(inputs["img_size"], inputs["in_chans"], normalization, inputs["interpolation"],
                               inputs.get("crop_pct", 1.0), inputs.get("crop_mode", "squash"))
    except ValueError as err:
        raise CheckpointError(f"the checkpoint's inputs cannot be used: {err}") from err


def build_backbone(checkpoint: Checkpoint) -> nn.Module:
    """The checkpoint's backbone, untrained, from its recorded class and arguments."""
    cls = checkpoint.backbone_class
    return construct(cls, checkpoint.backbone_args, f"checkpoint {checkpoint.source}: its backbone {cls.__name__} "
                     "cannot be built here")


def trained_backbone(checkpoint: Checkpoint) -> nn.Module:
    """The checkpoint's backbone with the weights a command runs (`inference_state`), in eval mode on the CPU."""
    backbone = build_backbone(checkpoint)
    state = inference_state(checkpoint.raw["state_dict"])
    backbone.load_state_dict({key.removeprefix("backbone."): value for key, value in state.items()})
    return backbone.eval()


def build_classifier(checkpoint: Checkpoint) -> ImageClassifier:
    """The checkpoint's `ImageClassifier`, untrained, for `train.py` to restore (`trained_backbone` for inference)."""
    from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters_context

    from vit.training.classifier import ImageClassifier

    if not checkpoint.training:
        raise ValueError("build_classifier needs a checkpoint read with training=True")
    settings = {**checkpoint.settings, "pretrained": None}  # the checkpoint's weights replace them: nothing fetched
    hparams = {"backbone": {"class_path": checkpoint.raw["hyper_parameters"]["backbone"]["class_path"],
                            "init_args": dict(checkpoint.backbone_args)}, **settings}
    try:
        with _given_hyperparameters_context(hparams=hparams, instantiator=LIGHTNING_INSTANTIATOR):
            model = ImageClassifier(build_backbone(checkpoint), **settings)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {checkpoint.source}: its model settings cannot be used: "
                              f"{first_line(err)}") from None
    model.class_names = list(checkpoint.class_names)
    return model


def inference_state(state_dict: Mapping) -> dict:
    """The weights a command runs: with EMA on, the moving average `ema.module.*` as `backbone.*`; else all."""
    prefix = "ema.module."
    if not any(key.startswith(prefix) for key in state_dict):
        return dict(state_dict)
    state = {key: value for key, value in state_dict.items() if not key.startswith(("backbone.", prefix))}
    state.update({"backbone." + key.removeprefix(prefix): value for key, value in state_dict.items()
                  if key.startswith(prefix)})
    return state
