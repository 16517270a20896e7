"""Opening a model folder (`read`), and the one function every inference door opens a model with (`load`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit.artifact.config import FORMAT_VERSION, WEIGHTS, ArtifactError, read_config
from vit.artifact.files import locate
from vit.checks import CheckpointError

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Artifact:
    """An opened model: `model` (eval mode, on the CPU), `inputs` (`img_size`, `in_chans`, `mean`, `std`,
    `interpolation`, crop), `class_names`, `source` (as messages name it), `backbone` (`{"class_path",
    "init_args"}` as checked), `data` (the data module, checked only when `test_data` builds it), `training` (what
    the run says of itself, for a model card), `config` (config.json as read)."""

    model: nn.Module
    inputs: dict
    class_names: list[str]
    source: str
    backbone: dict
    data: dict | None = None
    training: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def load(source: str | os.PathLike) -> Artifact:
    """The model a door was given (`files.locate`: a model folder, a checkpoint's, a Hub id, a timm name, a URL)."""
    return read(locate(source))


def read(folder: str | os.PathLike) -> Artifact:
    """The model in a model folder, built from this project's registered classes (`vit.registry`) with checked
    arguments; `ArtifactError` naming the folder and the value that cannot be used."""
    from vit.models.timm_compat import own_section
    from vit.models.weights import PretrainedError
    from vit.registry import check_backbone, check_inputs, check_names, not_allowed, shown

    folder = Path(folder)
    config = read_config(folder)
    try:
        own = config["vit"] if "vit" in config else own_section(config)
        if not isinstance(own, dict) or not {"backbone", "inputs", "class_names"} <= set(own):
            raise not_allowed("vit", own, "a mapping of format_version, backbone, inputs and class_names")
        if type(own.get("format_version")) is not int or own["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"vit.format_version={shown(own.get('format_version'))} is not allowed: this version of "
                f"readable-vit reads model folders of format {FORMAT_VERSION}"
            )
        cls, args = check_backbone(own["backbone"])
        inputs = check_inputs(own["inputs"], args)
        model = _load_weights(cls, args, folder)
        names = check_names(own["class_names"], model.num_classes)
    except (CheckpointError, PretrainedError) as err:
        raise ArtifactError(f"model folder {folder}: {err}") from None
    backbone = {"class_path": own["backbone"]["class_path"], "init_args": args}
    data, training = own.get("data"), own.get("training")
    return Artifact(
        model.eval(),
        inputs,
        names,
        str(folder),
        backbone,
        data if isinstance(data, dict) else None,
        training if isinstance(training, dict) else {},
        config,
    )


def _load_weights(cls: type[nn.Module], args: dict, folder: Path) -> nn.Module:
    """`cls(**args)` with model.safetensors loaded strictly: names, shapes and kinds compared on the meta device with
    the file's header before memory is spent, then the data read and checked finite in the model's dtype."""
    import torch

    from vit.models.weights import load_state_dict, weight_shapes
    from vit.registry import meta_backbone, shown

    source = folder / WEIGHTS
    skeleton = meta_backbone(cls, args)
    expected = dict(skeleton.state_dict())
    fixed = {name for name, _ in skeleton.named_buffers()} - set(expected)  # a sin/cos table timm reads as pos_embed
    found = weight_shapes(source, str(source))
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected) - fixed)
    if missing or unexpected:
        first = f"{shown(missing[0], 80)} missing" if missing else f"{shown(unexpected[0], 80)} not in the model"
        raise CheckpointError(
            f"{WEIGHTS} does not fit the backbone config.json records: {len(missing)} tensor(s) missing, "
            f"{len(unexpected)} unexpected; first: {first}"
        )
    for name, reference in expected.items():  # in the model's order: the first a reader would look for
        tensor = found[name]
        if tuple(tensor.shape) != tuple(reference.shape):
            raise CheckpointError(
                f"{WEIGHTS}: {name} has shape {tuple(tensor.shape)}, the backbone config.json records needs "
                f"{tuple(reference.shape)}"
            )
        if tensor.is_floating_point() != reference.is_floating_point():
            raise CheckpointError(f"{WEIGHTS}: {name} is a {tensor.dtype} tensor, the backbone needs {reference.dtype}")
    state = load_state_dict(source, str(source))
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten: the caller's random stream is kept
        model = cls(**args)
    converted = {}
    for name, reference in model.state_dict().items():
        tensor = state[name].to(reference.dtype)  # in the model's dtype: a float64 1e300 is inf as float32
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{WEIGHTS}: {name} holds NaN or infinite values (as {reference.dtype})")
        converted[name] = tensor
    model.load_state_dict(converted)
    return model


def test_data(model: Artifact) -> Any:
    """The data module a model was trained on, for its test images (`vit.registry.test_data`)."""
    from vit.registry import test_data as build

    return build(model.data, model.inputs, model.source)
