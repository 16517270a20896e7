"""A trained model rebuilt from a checkpoint: only what this project owns, from plain values, with nothing fetched.

A checkpoint is data. `train.py` records in it, beside the weights:

- `hyper_parameters`: the `ImageClassifier` settings and the backbone as `{"class_path": ..., "init_args": ...}`;
- `datamodule_hyper_parameters`: the data module's `_class_path` and its arguments;
- `inputs`: what turns an image into the model's input (`vit.data.base.SplitDataModule.inputs`);
- `class_names`;
- in `state_dict`, with `ema_decay` on, the moving average as `ema.module.*` beside the trained `backbone.*`:
  the model built for inference runs the average (`inference_state`).

Lightning's `load_from_checkpoint` hands the hyperparameters to jsonargparse, which imports and
calls any class path it meets, nested ones included (an untyped argument accepts anything): a
checkpoint could run code that way whatever `weights_only` says. Here a checkpoint builds only the
backbones of `vit.models` and the data modules of `vit.data`, named in their public paths, called
with numbers, strings, booleans, `None`, and lists and mappings of those. Anything else is refused
with a `CheckpointError` naming the key, before anything is built:

- a class outside those lists, in `backbone.class_path` or the data module's `_class_path`;
- a class path anywhere inside the values (`{"class_path": ...}` under an argument);
- an `_instantiator` other than LightningCLI's own (`lightning.pytorch.cli.instantiate_module`, which
  this module never calls);
- any value that is not plain data.

The backbone's `pretrained` weights are never loaded again: the checkpoint's weights replace them,
and a hub id or a file named in a checkpoint must not make whoever opens it reach the network or
depend on a file of the machine it was trained on. The data module is not rebuilt for inference
either: `inputs` says the image size, channels, normalisation and interpolation, so an image-folder
checkpoint works without its training folder.

`train.py --ckpt_path` goes through the same check (`check_hyperparameters`), and merges the
checkpoint's hyperparameters into the config as today's classes take them (`current_hyperparameters`:
an option the model no longer has, recorded at the value that is now the only one, is left out).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import lightning as L
from torch import nn

import vit.data
import vit.models
from vit.checks import constructor_message, first_line
from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.checkpointing import CheckpointError, fetch_checkpoint, read_checkpoint
from vit.training.classifier import ImageClassifier

# What LightningCLI writes in every checkpoint of a subclass-mode argument; loading never calls it.
LIGHTNING_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"
PLAIN = (bool, int, float, str, type(None))


def _public_classes(package, base: type) -> dict[str, type]:
    """`{class path: class}` of the `base` subclasses a package exports, under `package.Name` and their module's path."""
    found = {}
    for name in package.__all__:
        cls = getattr(package, name)
        if isinstance(cls, type) and issubclass(cls, base):
            found[f"{package.__name__}.{name}"] = found[f"{cls.__module__}.{name}"] = cls
    return found


BACKBONES = _public_classes(vit.models, nn.Module)
DATA_MODULES = _public_classes(vit.data, L.LightningDataModule)
# Options `VisionTransformer` no longer has (the recipe screen tried them and dropped them), with the value every
# checkpoint written while it had them records unless the run chose otherwise: at that value the model is the
# one built today, so the option is left out; at another, the model cannot be rebuilt.
RETIRED_OPTIONS = {"stem": "patch", "qk_init": "normal"}


def check_plain(value: Any, key: str) -> None:
    """Raise `CheckpointError` naming `key` unless `value` is plain data that names no class."""
    if isinstance(value, PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{key}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, item in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{key} has a key {k!r} that is not a string")
            if k in ("class_path", "_class_path", "_instantiator", "__class__"):
                raise CheckpointError(f"{key}.{k}={str(item)[:80]!r}: a checkpoint may not name a class inside a value; "
                                      "refused without building anything")
            check_plain(item, f"{key}.{k}")
        return
    raise CheckpointError(f"{key} holds a {type(value).__name__}, not plain data (numbers, strings, booleans, "
                          "lists and mappings of those); refused")


def _check_instantiator(section: Mapping, key: str) -> None:
    instantiator = section.get("_instantiator")
    if instantiator is not None and instantiator != LIGHTNING_INSTANTIATOR:
        raise CheckpointError(f"{key}._instantiator={str(instantiator)[:80]!r} is not allowed: a checkpoint may only "
                              f"name {LIGHTNING_INSTANTIATOR!r} (which is never called when it is opened); refused")


def _owned(class_path: object, allowed: dict[str, type], key: str, what: str) -> type:
    if not isinstance(class_path, str) or class_path not in allowed:
        names = sorted({p for p in allowed if p.count(".") == 2})  # the short public paths
        raise CheckpointError(f"{key}={str(class_path)[:80]!r} is not allowed: a checkpoint may name only the {what} "
                              f"of this project ({', '.join(names)}); refused without importing it")
    return allowed[class_path]


def check_hyperparameters(checkpoint: Mapping) -> None:
    """Raise `CheckpointError` unless the checkpoint's hyperparameters name only this project's classes and hold
    plain values (see the module doc); the message names the first key that is not."""
    if "_instantiator" in checkpoint:
        _check_instantiator(checkpoint, "checkpoint")
    model = checkpoint.get("hyper_parameters") or {}
    _check_instantiator(model, "hyper_parameters")
    if "_class_path" in model and model["_class_path"] not in ("vit.training.classifier.ImageClassifier",
                                                               "vit.training.ImageClassifier"):
        raise CheckpointError(f"hyper_parameters._class_path={str(model['_class_path'])[:80]!r} is not allowed: "
                              "the model of a checkpoint is vit.training.classifier.ImageClassifier; refused")
    for key, value in model.items():
        if key in ("_instantiator", "_class_path"):
            continue
        if key == "backbone" and isinstance(value, Mapping):
            _owned(value.get("class_path"), BACKBONES, "hyper_parameters.backbone.class_path", "backbones")
            unknown = set(value) - {"class_path", "init_args"}
            if unknown:
                raise CheckpointError(f"hyper_parameters.backbone has {sorted(unknown)}: expected class_path and "
                                      "init_args only; refused")
            init_args = value.get("init_args") or {}
            if not isinstance(init_args, Mapping):
                raise CheckpointError("hyper_parameters.backbone.init_args is not a mapping; refused")
            check_plain(init_args, "hyper_parameters.backbone.init_args")
        else:
            check_plain(value, f"hyper_parameters.{key}")
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    if data:
        _check_instantiator(data, "datamodule_hyper_parameters")
        _owned(data.get("_class_path"), DATA_MODULES, "datamodule_hyper_parameters._class_path", "data modules")
        for key, value in data.items():
            if key not in ("_instantiator", "_class_path"):
                check_plain(value, f"datamodule_hyper_parameters.{key}")
    for key in ("inputs", "class_names"):
        if key in checkpoint:
            check_plain(checkpoint[key], key)


def current_hyperparameters(checkpoint: Mapping, source: str) -> dict:
    """The checkpoint's `hyper_parameters` as today's classes take them: a `RETIRED_OPTIONS` entry at its old
    default left out of a `VisionTransformer`'s arguments; at another value, a `CheckpointError` naming it."""
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    spec = hparams.get("backbone")
    if not isinstance(spec, Mapping) or BACKBONES.get(spec.get("class_path")) is not vit.models.VisionTransformer:
        return hparams
    init_args = dict(spec.get("init_args") or {})
    for name, default in RETIRED_OPTIONS.items():
        value = init_args.pop(name, default)
        if value != default:
            raise CheckpointError(f"checkpoint {source}: its backbone was built with {name}={value!r}, an option the "
                                  f"recipe screen tried and VisionTransformer no longer has; only {name}={default!r} "
                                  "(the model as it is now) can be rebuilt")
    hparams["backbone"] = {**spec, "init_args": init_args}
    return hparams


def _call(cls: type, kwargs: Mapping, what: str, source: str):
    """`cls(**kwargs)`, with a wrong or unknown argument reported as a `CheckpointError` naming `what`."""
    accepted = inspect.signature(cls).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        raise CheckpointError(f"checkpoint {source}: its {what} {cls.__name__} does not take {unknown} "
                              "(was it written by another version of this project?)")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, OSError) as err:
        raise CheckpointError(f"checkpoint {source}: its {what} {cls.__name__} cannot be built here: "
                              f"{first_line(ValueError(constructor_message(str(err))))}") from err


def build_backbone(checkpoint: Mapping, source: str) -> nn.Module:
    """The checkpoint's backbone, untrained: its class and arguments, `pretrained` left out (see the module doc)."""
    spec = current_hyperparameters(checkpoint, source).get("backbone")
    if not isinstance(spec, Mapping):
        raise CheckpointError(f"checkpoint {source} does not record its backbone (it was not trained with train.py), "
                              "so the model cannot be rebuilt from it")
    cls = BACKBONES[spec["class_path"]]
    init_args = dict(spec.get("init_args") or {})
    if "pretrained" in init_args:
        init_args["pretrained"] = None
    return _call(cls, init_args, "backbone", source)


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


def build_classifier(checkpoint: Mapping, source: str) -> ImageClassifier:
    """The trained `ImageClassifier` of a checkpoint read by `read_checkpoint`, in eval mode on the CPU; its
    `backbone` holds the moving average of the weights when the run kept one (`inference_state`)."""
    check_hyperparameters(checkpoint)
    try:
        check_finite_weights(checkpoint["state_dict"], int(checkpoint.get("global_step", 0)))
    except NonFiniteError as err:
        raise CheckpointError(f"checkpoint {source} is unusable: {str(err).split(';')[0]}") from err
    backbone = build_backbone(checkpoint, source)
    # compile left out: the same numbers, without the compile time; ema_decay too: the average is the model.
    settings = {k: v for k, v in checkpoint["hyper_parameters"].items()
                if k in inspect.signature(ImageClassifier).parameters and k not in ("backbone", "compile", "ema_decay")}
    try:
        model = ImageClassifier(backbone, **settings)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {source}: its model settings cannot be used: {first_line(err)}") from err
    try:
        model.load_state_dict(inference_state(checkpoint["state_dict"]))
    except (RuntimeError, ValueError) as err:  # weights that do not fit the model the checkpoint records
        raise CheckpointError(f"checkpoint {source} cannot be loaded into the model it records: {first_line(err)}") from err
    model.on_load_checkpoint(checkpoint)
    return model.eval()


def build_datamodule(checkpoint: Mapping, source: str) -> L.LightningDataModule:
    """The checkpoint's data module (for its test split): one of `vit.data`'s, from its recorded plain arguments."""
    check_hyperparameters(checkpoint)
    data = dict(checkpoint.get("datamodule_hyper_parameters") or {})
    if "_class_path" not in data:
        raise CheckpointError(f"checkpoint {source} does not record its data module (it was not trained with "
                              "train.py)")
    cls = DATA_MODULES[data.pop("_class_path")]
    data.pop("_instantiator", None)
    return _call(cls, data, "data module", source)


def input_description(checkpoint: Mapping, source: str) -> dict:
    """What turns an image into the model's input: `img_size` `[H, W]`, `in_chans`, `mean` and `std` (or None:
    raw pixels in [0, 1]) and `interpolation`, as the checkpoint records it.

    A checkpoint written before `inputs` was recorded rebuilds its data module to learn them, which
    needs that data module's files (an image folder's root) on this machine.
    """
    inputs = checkpoint.get("inputs")
    if inputs is None:
        try:
            inputs = build_datamodule(checkpoint, source).inputs()
        except CheckpointError as err:
            raise CheckpointError(f"{err}. It was written before checkpoints recorded their inputs, so its data module, "
                                  "which says the image size, channels and normalisation, must be built here") from err
    expected = {"img_size", "in_chans", "mean", "std", "interpolation"}
    if not isinstance(inputs, Mapping) or set(inputs) != expected:
        raise CheckpointError(f"checkpoint {source}: its inputs {str(inputs)[:120]} are not a mapping of "
                              f"{sorted(expected)}")
    return dict(inputs)


def open_checkpoint(ckpt_path: str | os.PathLike) -> tuple[ImageClassifier, dict, dict]:
    """`(model, inputs, checkpoint)` of a checkpoint path or URL: the trained model in eval mode on the CPU,
    its `input_description`, and the checkpoint dict itself. Every command that opens a checkpoint calls this."""
    local = fetch_checkpoint(ckpt_path)
    checkpoint = read_checkpoint(local)
    model = build_classifier(checkpoint, str(ckpt_path))  # checks the hyperparameters before building anything
    return model, input_description(checkpoint, str(ckpt_path)), checkpoint
