"""A model folder's `config.json`: what it says (`describe`), what a run's checkpoint makes of it
(`from_checkpoint`), and reading it back as strict JSON (`read_config`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from vit.checks import CheckpointError

if TYPE_CHECKING:  # imported where used: `vit.export --help` reads this module and loads no torch
    import torch
    from torch import nn

FORMAT_VERSION = 1  # of the "vit" section of config.json
CONFIG, WEIGHTS = "config.json", "model.safetensors"
MAX_CONFIG_BYTES = 16 * 2**20  # 100,000 class names of 100 characters fit; a config.json is a few KB


class ArtifactError(CheckpointError):
    """A model folder that cannot be opened, or a model that cannot be written; one line naming the value."""


def describe(
    model: nn.Module, backbone: Mapping, inputs: Mapping, names: list[str], data: Mapping | None = None
) -> dict:
    """config.json of `model` (built from `backbone`, `{"class_path", "init_args"}`): timm's keys
    (`timm_compat.timm_config`), and this project's under "vit", enough to build it without timm."""
    from vit.models.timm_compat import timm_config

    backbone = {"class_path": backbone["class_path"], "init_args": dict(backbone["init_args"])}
    own = {"format_version": FORMAT_VERSION, "backbone": backbone, "inputs": dict(inputs), "class_names": list(names)}
    config = timm_config(model, inputs, names)
    if "timm" in config:  # why no timm model computes it
        own["timm"] = config.pop("timm")
    return {**config, "vit": {**own, "data": dict(data) if data else None}}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.safetensors`'s tensors: the state dict, and a fixed position table too (timm's `pos_embed` is a
    parameter; this project's sin/cos tables are buffers that the state dict leaves out)."""
    import torch

    state = dict(model.state_dict())
    fixed = getattr(model, "pos_embed", None)  # any backbone: only a ViT has one
    if isinstance(fixed, torch.Tensor) and "pos_embed" not in state:
        state["pos_embed"] = fixed
    return {key: value.detach().contiguous().clone() for key, value in state.items()}


def inference_state(state_dict: Mapping) -> dict:
    """The backbone's weights a command runs: with EMA on, the moving average (`ema.module.*`); else `backbone.*`."""
    prefix = "ema.module." if any(key.startswith("ema.module.") for key in state_dict) else "backbone."
    return {key.removeprefix(prefix): value for key, value in state_dict.items() if key.startswith(prefix)}


def from_checkpoint(checkpoint: Mapping) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """`(config, tensors)` of the model in a run's checkpoint dict, its record checked (`vit.registry`); None for a
    backbone built in Python (no class path recorded: nothing says how to build it again)."""
    import torch

    from vit.registry import BACKBONES, check_backbone, check_inputs, check_names, construct

    backbone = (checkpoint.get("hyper_parameters") or {}).get("backbone")
    if not isinstance(backbone, Mapping) or backbone.get("class_path") not in BACKBONES:
        return None
    cls, args = check_backbone(backbone, "hyper_parameters.backbone")
    inputs = check_inputs(checkpoint.get("inputs"), args)
    with torch.random.fork_rng(devices=[]):  # its random init must not move the run's random stream
        model = construct(cls, args, f"its backbone {cls.__name__} cannot be built")
    try:
        model.load_state_dict(inference_state(checkpoint.get("state_dict") or {}))
    except RuntimeError as err:  # torch's first line names the model, the rest the missing and unexpected keys
        keys = " ".join(str(err).split("\n", 1)[-1].split())[:300]
        raise CheckpointError(f"its state_dict does not fit its backbone {cls.__name__}: {keys}") from None
    names = check_names(checkpoint.get("class_names"), model.num_classes)
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    init_args = {key: value for key, value in data.items() if not key.startswith("_")}  # not Lightning's own keys
    data = {"class_path": data["_class_path"], "init_args": init_args} if "_class_path" in data else None
    config = describe(model, {"class_path": backbone["class_path"], "init_args": args}, inputs, names, data)
    record = checkpoint.get("training_record")  # what `ImageClassifier` records of its run
    config["vit"]["training"] = record if isinstance(record, dict) else {}
    return config, weights(model)


def read_config(folder: Path) -> dict:
    """config.json of `folder`: a regular file of at most `MAX_CONFIG_BYTES`, strict JSON (no NaN), a mapping."""
    from vit.models.weights import open_regular_file

    if not folder.is_dir():
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise ArtifactError(f"model folder {folder} {what}")
    path = folder / CONFIG
    if not os.path.lexists(path):
        raise ArtifactError(f"model folder {folder} has no {CONFIG}: it is not a model folder")
    try:
        with open_regular_file(path, str(path)) as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
    except ValueError as err:
        raise ArtifactError(str(err)) from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ArtifactError(f"{path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB; a model's config.json is a few KB")

    def no_constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON number")

    try:
        config = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as err:
        raise ArtifactError(f"{path} is not valid JSON: {str(err).splitlines()[0][:200]}") from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{path} holds a {type(config).__name__}, not the mapping a config.json is")
    return config
