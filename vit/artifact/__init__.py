"""The trained model as a folder of its own, in the Hugging Face Hub / timm layout: `model.safetensors` and
`config.json`. Each checkpoint a run saves gets one beside it (`last.ckpt` -> `last/`, `vit.artifact.io`); timm
(`create_model("local-dir:<folder>", pretrained=True)`), transformers (`pipeline("image-classification", ...)`) and
`vit.load` open it.

Neither file can carry code. `config.json` holds timm's keys where a timm model computes the same function
(`vit.models.timm_compat`) and this project's under "vit": the backbone by registered class path and arguments,
inputs, class names, the data module, what the run records of itself. Here: what it says (`describe`,
`from_checkpoint`), where one is (`locate`), writing one whole (`write`), removing one (only one this project wrote),
and opening one (`read`, checked through `vit.registry`; `load` for whatever a door was given: `vit.load` and the
commands call it)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vit.checks import CheckpointError
from vit.hub import hub_folder, timm_repo

if TYPE_CHECKING:  # imported where used: `vit.export --help` reads this module and loads no torch
    import torch
    from torch import nn

FORMAT_VERSION = 1  # of the "vit" section of config.json
CONFIG, WEIGHTS = "config.json", "model.safetensors"


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


def inference_state(state_dict: Mapping) -> dict:
    """The backbone's weights a command runs: with EMA on, the moving average (`ema.module.*`); else `backbone.*`."""
    prefix = "ema.module." if any(key.startswith("ema.module.") for key in state_dict) else "backbone."
    return {key.removeprefix(prefix): value for key, value in state_dict.items() if key.startswith(prefix)}


def from_checkpoint(checkpoint: Mapping) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """`(config, tensors)` of the model in a run's checkpoint dict, its record checked (`vit.registry`); None for a
    backbone built in Python (no class path recorded: nothing says how to build it again)."""
    from vit.models.timm_compat import timm_state_dict
    from vit.registry import BACKBONES, build_backbone, check_backbone, check_inputs, check_names

    backbone = (checkpoint.get("hyper_parameters") or {}).get("backbone")
    if not isinstance(backbone, Mapping) or backbone.get("class_path") not in BACKBONES:
        return None
    cls, args = check_backbone(backbone, "hyper_parameters.backbone")
    inputs = check_inputs(checkpoint.get("inputs"), args)
    model = build_backbone(cls, args)
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
    return config, timm_state_dict(model)


def read_config(folder: Path) -> dict:
    """config.json of `folder`: a regular file of strict JSON, bounded (`weight_files.read_json`), holding a mapping."""
    from vit.models.weights import PretrainedError, read_json

    if not folder.is_dir():
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise ArtifactError(f"model folder {folder} {what}")
    path = folder / CONFIG
    if not os.path.lexists(path):
        raise ArtifactError(f"model folder {folder} has no {CONFIG}: it is not a model folder")
    try:
        config = read_json(path, str(path))
    except PretrainedError as err:
        raise ArtifactError(str(err)) from None
    if not isinstance(config, dict):
        raise ArtifactError(f"{path} holds a {type(config).__name__}, not the mapping a config.json is")
    return config


def folder_of(checkpoint: str | os.PathLike) -> Path:
    """The model folder beside a checkpoint file: its name without `.ckpt` (`last.ckpt` -> `last`)."""
    return Path(checkpoint).with_suffix("")


def write(folder: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write `config.json` and `model.safetensors` into `folder`, whole: a reader sees the old folder or the new one
    (both files are written into a temporary folder beside it, fsynced, then renamed into place)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not is_artifact(folder)):
        raise ArtifactError(f"{folder} exists and is not a model folder this project wrote; it is left alone")
    tmp = folder.parent / f".{folder.name}.{secrets.token_hex(8)}.tmp"
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
        for name in (WEIGHTS, CONFIG):
            _fsync(tmp / name)
        old = folder.parent / f".{folder.name}.{secrets.token_hex(8)}.old"
        if folder.exists():  # a folder cannot be replaced by a rename: the old one steps aside first
            os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # the rename's entry; not every filesystem lets a folder be fsynced
        _fsync(folder.parent)
    return folder


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a folder too: its entries are written back as a file's data
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_artifact(folder: Path) -> bool:
    """Whether `folder` is a model folder this project wrote (a real folder whose config.json has a "vit" section):
    the only kind `remove` deletes."""
    config = folder / CONFIG
    if folder.is_symlink() or not folder.is_dir() or config.is_symlink() or not config.is_file():
        return False
    try:
        return "vit" in json.loads(config.read_bytes()[: 2**24])  # only this project writes it: a few KB
    except (OSError, ValueError, TypeError):
        return False


def remove(folder: str | os.PathLike) -> None:
    """Delete the model folder beside a checkpoint Lightning no longer keeps; anything else is left alone."""
    folder = Path(folder)
    if is_artifact(folder):
        shutil.rmtree(folder)


def locate(source: str | os.PathLike) -> Path:
    """The model folder a door was given: the folder itself; the folder beside a `.ckpt` (a link to a checkpoint
    counts as the checkpoint it names); an `hf-hub:org/name[@revision]` id or a timm model name with pretrained
    weights, through `huggingface_hub` (its cache first; offline, only the cache); an http(s) URL of a model folder,
    downloaded (`vit.artifact.download`). Anything else is refused in one line saying what to give."""
    text = os.fspath(source)
    if text.lower().startswith(("hf-hub:", "hf_hub:")):
        return hub_folder(text[len("hf-hub:") :], (CONFIG, WEIGHTS))
    if "://" in text:
        from vit.artifact.download import download_folder
        from vit.models.weights import MAX_CONFIG_BYTES, max_bytes

        return download_folder(text, {CONFIG: MAX_CONFIG_BYTES, WEIGHTS: max_bytes()})
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    repo = timm_repo(text) if not os.path.lexists(path) else None
    if repo is not None:
        return hub_folder(repo, (CONFIG, WEIGHTS))
    if path.suffix == ".ckpt" and path.is_file():
        beside = folder_of(path.resolve())
        if (beside / CONFIG).is_file():
            return beside
        raise ArtifactError(
            f"checkpoint {text} has no model folder beside it ({beside.name}/): it was written before model folders; "
            f"write one with `python -m vit.upgrade --ckpt_path {text}`"
        )
    exists = os.path.lexists(path)
    named = f"checkpoint {text}" if path.suffix == ".ckpt" else text
    raise ArtifactError(
        f"{named} {'is not a model folder or a .ckpt' if exists else 'does not exist'}: give a model folder "
        "(config.json + model.safetensors), a run's .ckpt, an hf-hub:org/name id, a timm model name with pretrained "
        "weights, or an http(s) URL of a model folder"
    )


@dataclass(frozen=True)
class Artifact:
    """An opened model: `model` (eval mode, on the CPU), `inputs` (`img_size`, `in_chans`, `mean`, `std`,
    `interpolation`, crop), `class_names`, `source` (as messages name it), `backbone` (`{"class_path",
    "init_args"}` as checked), `data` (the data module, checked only when `test_data` builds it), `training` (what
    the run says of itself, for a model card)."""

    model: nn.Module
    inputs: dict
    class_names: list[str]
    source: str
    backbone: dict
    data: dict | None = None
    training: dict = field(default_factory=dict)


def load(source: str | os.PathLike) -> Artifact:
    """The model a door was given (`files.locate`: a model folder, a checkpoint's, a Hub id, a timm name, a URL)."""
    return read(locate(source))


def read(folder: str | os.PathLike) -> Artifact:
    """The model in a model folder, built from this project's registered classes (`vit.registry`) with checked
    arguments; `ArtifactError` naming the folder and the value that cannot be used."""
    from vit.models.timm_compat import own_section
    from vit.models.weights import PretrainedError
    from vit.registry import check_backbone, check_inputs, check_names, not_allowed

    folder = Path(folder)
    config = read_config(folder)
    try:
        own = config["vit"] if "vit" in config else own_section(config)
        if not isinstance(own, dict) or not {"backbone", "inputs", "class_names"} <= set(own):
            raise not_allowed("vit", own, "a mapping of format_version, backbone, inputs and class_names")
        version = own.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:  # True == 1, and 1.0 == 1: neither is a version
            raise not_allowed("vit.format_version", version, f"{FORMAT_VERSION}, the format this version reads")
        cls, args = check_backbone(own["backbone"])
        inputs = check_inputs(own["inputs"], args)
        model = _load_weights(cls, args, folder)
        names = check_names(own["class_names"], model.num_classes)
    except (CheckpointError, PretrainedError) as err:
        raise ArtifactError(f"model folder {folder}: {err}") from None
    backbone = {"class_path": own["backbone"]["class_path"], "init_args": args}
    data, training = own.get("data"), own.get("training")
    data = data if isinstance(data, dict) else None
    training = training if isinstance(training, dict) else {}
    return Artifact(model.eval(), inputs, names, str(folder), backbone, data, training)


def _load_weights(cls: type[nn.Module], args: dict, folder: Path) -> nn.Module:
    """`cls(**args)` with model.safetensors loaded strictly (`vit.models.fit`): names, shapes and kinds compared on
    the meta device with the file's header before memory is spent, then the data read and checked finite."""
    from vit.models.fit import check_kinds, check_names_and_shapes, in_model_dtypes
    from vit.models.weights import load_state_dict, weight_shapes
    from vit.registry import build_backbone, meta_backbone

    source = folder / WEIGHTS
    skeleton = meta_backbone(cls, args)
    expected = dict(skeleton.state_dict())
    fixed = {name for name, _ in skeleton.named_buffers()} - set(expected)  # a sin/cos table timm reads as pos_embed
    found = {key: value for key, value in weight_shapes(source, str(source)).items() if key not in fixed}
    check_kinds(found, expected, WEIGHTS)
    check_names_and_shapes(found, expected, WEIGHTS, "the backbone config.json records")
    state = load_state_dict(source, str(source))
    model = build_backbone(cls, args)
    model.load_state_dict(in_model_dtypes(state, model.state_dict(), WEIGHTS))
    return model
