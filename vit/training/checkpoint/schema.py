"""The checkpoint's schema: what a checkpoint of this project holds, checked whole before anything is built.

`validate(raw, source)` gives a `Checkpoint` or one `CheckpointError` naming the key. Schema 2 holds `state_dict`
(finite tensors of exactly the recorded architecture's names and shapes), `hyper_parameters` (an allowed backbone),
`datamodule_hyper_parameters`, `inputs`, `class_names`, Lightning's bookkeeping and the trainer state: all plain data
of bounded size, every argument in its class's signature, of its annotation's type, sizes within `LIMITS`. With
`training=False` (inference: only the backbone is built) the classifier's and data module's arguments are checked for
their size but not against their classes, which import Lightning; the doors that build either read with `training`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import typing
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.version import InvalidVersion, Version
from torch import nn

import vit.data
import vit.models
from vit.checks import check_size, describe, matches
from vit.data.images import CROP_MODES
from vit.models.vision_transformer import BOUNDS
from vit.training.checkpoint.trainer_state import check_trainer_state
from vit.training.checkpoint.values import SCHEMA_VERSION as VERSION
from vit.training.checkpoint.values import CheckpointError, construct, is_int, is_number, not_allowed, shown, walk

# What LightningCLI writes beside every argument it instantiated; opening a checkpoint never calls it.
LIGHTNING_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"
CLASSIFIER_PATHS = ("vit.training.classifier.ImageClassifier", "vit.training.ImageClassifier")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
TRAINER_KEYS = ("loops", "callbacks", "optimizer_states", "lr_schedulers", "MixedPrecision")
BOOKKEEPING = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name", "datamodule_hparams_name",
               "schema_version")
# Upper bounds of sizes a checkpoint or model folder may record: beyond them the model or its data would not fit in
# memory. The model's own sizes are the constructor's `BOUNDS` (one declaration), so whatever it builds also opens.
LIMITS = {"img_size": 4096, "num_heads": 256, "patch_size": 1024, "patch_kernel": 1024, "num_train": 1_000_000,
          "num_val": 1_000_000, "num_test": 1_000_000, "batch_size": 65_536, "num_workers": 256,
          "repeated_augmentation": 64,
          **{key: bounds[1] for key, bounds in BOUNDS.items() if len(bounds) == 2 and isinstance(bounds[1], int)}}
MAX_IMAGE_BYTES = 2**32  # one float32 input image: 4096 x 4096 pixels of 64 channels
MAX_BUFFER_BYTES = 2**30  # what the architecture holds beside its weights (fixed tables, masks)


def _public_classes(package, base: type) -> dict[str, type]:
    """`{class path: class}` of the `base` subclasses a package exports, under `package.Name` and their module."""
    found = {}
    for name in package.__all__:
        cls = getattr(package, name)
        if isinstance(cls, type) and issubclass(cls, base):
            found[f"{package.__name__}.{name}"] = found[f"{cls.__module__}.{name}"] = cls
    return found


BACKBONES = _public_classes(vit.models, nn.Module)
# {class path: class, or its module}: vit.data's data modules by name, imported (Lightning with them) by `data_module`.
DATA_MODULES: dict[str, type | str] = {path: module for name, module in vit.data.MODULES.items() if
                                       name.endswith("DataModule") for path in (f"vit.data.{name}", f"{module}.{name}")}


def data_module(class_path: str) -> type:
    """The data module class a checkpoint names by `class_path` (one of `DATA_MODULES`)."""
    found = DATA_MODULES[class_path]
    return found if isinstance(found, type) else getattr(importlib.import_module(found), class_path.rsplit(".")[-1])


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint that passed `validate`: `raw` the validated dict, `source` the path or URL as messages show it."""

    source: str
    raw: dict = field(repr=False)
    backbone_class: type[nn.Module]
    backbone_args: dict
    settings: dict  # ImageClassifier's arguments other than the backbone
    data_class: type | None  # None also when not read for `training`
    data_args: dict
    inputs: dict
    class_names: list[str]
    training: bool = True  # whether `settings` and `data_args` were checked against their classes


def validate(raw: Any, source: str, training: bool = True) -> Checkpoint:
    """The `Checkpoint` of `raw` (what `torch.load` read from `source`), or `CheckpointError` naming the first key."""
    try:
        return _validate(raw, source, training)
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint {source}: {err}") from None


def _validate(raw: Any, source: str, training: bool) -> Checkpoint:
    if not isinstance(raw, dict):
        raise CheckpointError(f"it holds a {type(raw).__name__}, not the mapping a Lightning checkpoint is")
    for _ in walk(raw, "", tensors=True):  # plain data of bounded size and depth, everywhere
        pass
    for key in ("state_dict", "hyper_parameters", "inputs", "class_names", "pytorch-lightning_version"):
        if key not in raw:
            raise CheckpointError(f"it has no {key!r}: it was not written by train.py of this version "
                                  "(a plain state dict loads in Python with `model.load_state_dict(...)`)")
    version = raw.get("schema_version")
    if type(version) is not int or version != VERSION:
        raise CheckpointError(f"schema_version={shown(version)} is not allowed: this version of readable-vit reads "
                              f"checkpoints of schema {VERSION} (its weights load in Python with "
                              "`model.load_state_dict(...)`)")
    backbone_class, backbone_args, settings = _model(raw["hyper_parameters"], training)
    data_path, data_args = _data(raw.get("datamodule_hyper_parameters"), training)
    data_key = data_path and data_path.rsplit(".")[-1]  # Lightning's key for the data module's own state
    known = {*BOOKKEEPING, *TRAINER_KEYS, "state_dict", "hyper_parameters", "datamodule_hyper_parameters",
             "inputs", "class_names", data_key}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"it has a key {shown(unknown[0])} that this project does not write; refused")
    for key in ("epoch", "global_step"):
        if not is_int(raw.get(key, 0)):
            raise not_allowed(key, raw[key], "an int >= 0")
    for key in ("hparams_name", "datamodule_hparams_name"):
        if key in raw and not isinstance(raw[key], (str, type(None))):
            raise not_allowed(key, raw[key], "a string")
    _lightning_version(raw["pytorch-lightning_version"])
    num_classes = _architecture(raw["state_dict"], backbone_class, backbone_args, settings)
    inputs = check_inputs(raw["inputs"], backbone_args)
    class_names = check_names(raw["class_names"], num_classes)
    check_trainer_state(raw, data_key)
    return Checkpoint(source=source, raw=raw, backbone_class=backbone_class, backbone_args=backbone_args,
                      settings=settings, data_class=data_module(data_path) if data_path and training else None,
                      data_args=data_args, inputs=inputs, class_names=class_names, training=training)


def _lightning_version(value: Any) -> None:
    """2.0 or later: Lightning migrates older checkpoints (rewriting the validated dict), and fails on a bad one."""
    try:
        version = Version(value) if isinstance(value, str) else None
    except InvalidVersion:
        version = None
    if version is None or version < Version("2.0"):
        raise not_allowed("pytorch-lightning_version", value, "the version of Lightning (2.0 or later) that wrote "
                          "the checkpoint")


def _signature(cls: type) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """`cls`'s constructor parameters and annotations, with its base's where its `**kwargs` go (as jsonargparse)."""
    parameters, hints = {}, {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object or klass.__module__.startswith(("torch.", "lightning.")):
            continue
        own = inspect.signature(klass.__init__).parameters
        parameters = {**{k: p for k, p in own.items() if k != "self"}, **parameters}
        hints = {**typing.get_type_hints(klass.__init__), **hints}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
            break
    return parameters, hints


def _allow(allowed: dict[str, type], cls: type, base: type, what: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"{cls!r} is not {what} class")
    allowed[f"{cls.__module__}.{cls.__name__}"] = cls


def allow_backbone(cls: type[nn.Module]) -> None:
    """Let checkpoints name `cls` (by its module path) as their backbone: for a class that a study defines and
    imports before it opens its checkpoints. A checkpoint only ever names a registered class: nothing is imported."""
    _allow(BACKBONES, cls, nn.Module, "an nn.Module")


def allow_datamodule(cls: type) -> None:
    """`allow_backbone` for a data module a study defines."""
    import lightning as L

    _allow(DATA_MODULES, cls, L.LightningDataModule, "a LightningDataModule")


def _arguments(cls: type | None, given: Mapping, key: str, skip: tuple[str, ...] = ()) -> dict:
    """`given` checked against `cls.__init__` (unless `cls` is None): names that exist, values of the annotated type;
    sizes within `LIMITS`."""
    parameters, hints = _signature(cls) if cls is not None else ({}, {})
    args = {}
    for name, value in given.items():
        if name in skip:
            continue
        if cls is not None and (name not in parameters or parameters[name].kind in (
                inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)):
            raise CheckpointError(f"{key}.{name}: {cls.__name__} has no argument {name!r}; refused")
        if cls is not None and not matches(value, hints.get(name, Any)):
            raise not_allowed(f"{key}.{name}", value, describe(hints.get(name, Any)))
        limit = LIMITS.get(name)
        sizes = value if isinstance(value, (list, tuple)) else [value]
        if limit is not None and any(isinstance(v, int) and not 0 <= v <= limit for v in sizes):
            raise not_allowed(f"{key}.{name}", value, f"at most {limit}")
        args[name] = value
    return args


def _section(hparams: Any, key: str) -> Mapping:
    """`hparams` if it is a mapping whose `_instantiator` (if any) is Lightning's."""
    if not isinstance(hparams, Mapping):
        raise CheckpointError(f"{key} is a {type(hparams).__name__}, not a mapping")
    value = hparams.get("_instantiator", LIGHTNING_INSTANTIATOR)
    if value != LIGHTNING_INSTANTIATOR:
        raise CheckpointError(f"{key}._instantiator={shown(value)} is not allowed: a checkpoint may only name "
                              f"{LIGHTNING_INSTANTIATOR!r} (which opening it never calls); refused")
    return hparams


def _model(hparams: Any, training: bool) -> tuple[type[nn.Module], dict, dict]:
    hparams = _section(hparams, "hyper_parameters")
    if hparams.get("_class_path", CLASSIFIER_PATHS[0]) not in CLASSIFIER_PATHS:
        raise CheckpointError(f"hyper_parameters._class_path={shown(hparams['_class_path'])} is not allowed: the "
                              f"model of a checkpoint is {CLASSIFIER_PATHS[0]}; refused")
    cls, backbone_args = check_backbone(hparams.get("backbone"), "hyper_parameters.backbone")
    if training:
        from vit.training.classifier import ImageClassifier
    settings = _arguments(ImageClassifier if training else None, hparams, "hyper_parameters",
                          skip=("backbone", "_instantiator", "_class_path"))
    return cls, backbone_args, settings


def check_backbone(spec: Any, key: str = "vit.backbone") -> tuple[type[nn.Module], dict]:
    """`(class, arguments)` of a backbone recorded as `{"class_path", "init_args"}`: a class of `BACKBONES`, its
    arguments in its signature and of their annotated types, sizes within `LIMITS`; nothing is imported or built."""
    if not isinstance(spec, Mapping) or set(spec) - {"class_path", "init_args"}:
        raise not_allowed(key, spec, "a mapping of class_path and init_args")
    cls = _owned(spec.get("class_path"), BACKBONES, f"{key}.class_path", "backbones")
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        raise not_allowed(f"{key}.init_args", init_args, "a mapping")
    return cls, _arguments(cls, init_args, f"{key}.init_args")


def check_data(spec: Any, key: str = "vit.data") -> tuple[type, dict]:
    """`(class, arguments)` of a data module recorded as `{"class_path", "init_args"}` (`check_backbone`'s rules,
    against `DATA_MODULES`); imports Lightning with the class."""
    if not isinstance(spec, Mapping) or set(spec) - {"class_path", "init_args"}:
        raise not_allowed(key, spec, "a mapping of class_path and init_args")
    path = spec.get("class_path")
    _owned(path, DATA_MODULES, f"{key}.class_path", "data modules")
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping):
        raise not_allowed(f"{key}.init_args", init_args, "a mapping")
    cls = data_module(path)
    return cls, _arguments(cls, init_args, f"{key}.init_args")


def _data(hparams: Any, training: bool) -> tuple[str | None, dict]:
    if hparams is None:
        return None, {}
    hparams = _section(hparams, "datamodule_hyper_parameters")
    path = hparams.get("_class_path")
    _owned(path, DATA_MODULES, "datamodule_hyper_parameters._class_path", "data modules")
    return path, _arguments(data_module(path) if training else None, hparams, "datamodule_hyper_parameters",
                            skip=("_class_path", "_instantiator"))


def _owned(class_path: Any, allowed: dict, key: str, what: str) -> type | str:
    if not isinstance(class_path, str) or class_path not in allowed:
        names = sorted({p for p in allowed if p.count(".") == 2})  # the short public paths
        raise CheckpointError(f"{key}={shown(class_path)} is not allowed: a checkpoint may name only the {what} of "
                              f"this project ({', '.join(names)}); refused without importing it")
    return allowed[class_path]


def meta_backbone(cls: type[nn.Module], args: Mapping) -> nn.Module:
    """The backbone `cls(**args)` built on the meta device: its names and shapes, without memory for its weights."""
    with torch.device("meta"):
        return construct(cls, args, f"its backbone {cls.__name__} cannot be built")


def _architecture(state: Any, cls: type[nn.Module], args: dict, settings: dict) -> int:
    """Compare the state dict with the architecture the hyperparameters describe; return its `num_classes`."""
    if not isinstance(state, dict) or not state:
        raise CheckpointError("its state_dict is not a mapping of names to tensors")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"state_dict has {shown(name)}: {type(tensor).__name__}, not a name and a tensor")
    model = meta_backbone(cls, args)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if buffers > MAX_BUFFER_BYTES:
        raise CheckpointError(f"its backbone {cls.__name__} would hold {buffers / 2**30:.1f} GiB of fixed tables "
                              f"(above {MAX_BUFFER_BYTES // 2**30} GiB); refused")
    expected = {f"backbone.{k}": v for k, v in model.state_dict().items()}
    if settings.get("ema_decay") is not None:
        expected.update({f"ema.module.{k}": v for k, v in model.state_dict().items()})
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        parts = ([f"{shown(missing[0], 80)} missing"] if missing else []) + (
            [f"{shown(unexpected[0], 80)} not in the model"] if unexpected else [])
        raise CheckpointError(f"state_dict does not fit the backbone its hyper_parameters record ({cls.__name__}): "
                              f"{len(missing)} tensor(s) missing, {len(unexpected)} unexpected; first: "
                              + ", ".join(parts))
    for name, reference in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != tuple(reference.shape):
            raise CheckpointError(f"state_dict.{name} has shape {tuple(tensor.shape)}, the architecture its "
                                  f"hyper_parameters record needs {tuple(reference.shape)}")
        if tensor.is_floating_point() != reference.is_floating_point():
            raise CheckpointError(f"state_dict.{name} is a {tensor.dtype} tensor, the architecture needs "
                                  f"{reference.dtype}")
        # In the model's dtype: a float64 1e300 is finite, and inf once loaded into a float32 parameter.
        if tensor.is_floating_point() and not torch.isfinite(tensor.to(reference.dtype)).all():
            raise CheckpointError(f"state_dict.{name} holds NaN or infinite values (as {reference.dtype})")
    num_classes = getattr(model, "num_classes", None)
    if not isinstance(num_classes, int):
        raise CheckpointError(f"its backbone {cls.__name__} has no int num_classes")
    return num_classes


def check_inputs(inputs: Any, backbone_args: Mapping) -> dict:
    """`inputs` (what a model records of its input) checked against the backbone's `img_size` and `in_chans`."""
    expected = {"img_size", "in_chans", "mean", "std", "interpolation"}
    if not isinstance(inputs, Mapping) or not expected <= set(inputs) <= expected | {"crop_pct", "crop_mode"}:
        raise not_allowed("inputs", inputs, f"a mapping of {sorted(expected)} (and crop_pct, crop_mode)", 120)
    crop, crop_mode = inputs.get("crop_pct", 1.0), inputs.get("crop_mode", "squash")
    if not is_number(crop, 0, above=True) or crop > 1:
        raise not_allowed("inputs.crop_pct", crop, "a number in (0, 1]: the share of the resized image kept")
    if crop_mode not in CROP_MODES:
        raise not_allowed("inputs.crop_mode", crop_mode, f"one of {list(CROP_MODES)}")
    try:
        size = list(check_size("inputs.img_size", inputs["img_size"]))
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    chans = inputs["in_chans"]
    if not is_int(chans, 1, LIMITS["in_chans"]):
        raise not_allowed("inputs.in_chans", chans, f"an int in [1, {LIMITS['in_chans']}]")
    if max(size) > LIMITS["img_size"]:
        raise not_allowed("inputs.img_size", size, f"sides of at most {LIMITS['img_size']}")
    if 4 * chans * size[0] * size[1] > MAX_IMAGE_BYTES:  # one image is decoded and run whole, even alone
        raise CheckpointError(f"inputs of {chans} x {size[0]} x {size[1]} would take "
                              f"{4 * chans * size[0] * size[1] / 2**30:.1f} GiB per image as float32 (at most "
                              f"{MAX_IMAGE_BYTES // 2**30} GiB)")
    if "img_size" in backbone_args and list(check_size("img_size", backbone_args["img_size"])) != size:
        raise CheckpointError(f"inputs.img_size={size} disagrees with the backbone's img_size="
                              f"{shown(backbone_args['img_size'])}")
    if "in_chans" in backbone_args and backbone_args["in_chans"] != chans:
        raise CheckpointError(f"inputs.in_chans={chans} disagrees with the backbone's in_chans="
                              f"{backbone_args['in_chans']}")
    mean, std = inputs["mean"], inputs["std"]
    if (mean is None) != (std is None):
        raise CheckpointError(f"inputs.mean={shown(mean)} and inputs.std={shown(std)}: expected both null "
                              "(raw pixels) or both numbers")
    for key, values, low, what in (("mean", mean, -math.inf, "finite numbers"), ("std", std, 0, "finite numbers > 0")):
        if values is not None and not (isinstance(values, (list, tuple)) and len(values) == chans
                                       and all(is_number(v, low, above=True) for v in values)):
            raise not_allowed(f"inputs.{key}", values, f"{chans} {what} (one per channel)")
    if inputs["interpolation"] not in INTERPOLATIONS:
        raise not_allowed("inputs.interpolation", inputs["interpolation"], f"one of {list(INTERPOLATIONS)}")
    return {"img_size": size, "in_chans": chans, "mean": None if mean is None else [float(v) for v in mean],
            "std": None if std is None else [float(v) for v in std], "interpolation": inputs["interpolation"],
            **({"crop_pct": float(crop)} if crop != 1 else {}), **({"crop_mode": crop_mode} if crop_mode != "squash"
                                                                     else {})}


def check_names(names: Any, num_classes: int) -> list[str]:
    """`class_names`: one printable, distinct name per class."""
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names)):
        raise not_allowed("class_names", names, "a list of non-empty strings")
    if len(names) != num_classes or len(set(names)) != len(names):
        raise CheckpointError(f"class_names holds {len(names)} name(s) ({len(set(names))} distinct); the model has "
                              f"{num_classes} classes")
    long = next((n for n in names if len(n) > 256), None)
    if long is not None:
        raise CheckpointError(f"class_names has a name of {len(long)} characters (at most 256)")
    for i, name in enumerate(names):
        # Names are printed and written to CSV files: a blank name, a control character (a terminal escape) or a
        # bidirectional override (text shown in another order than stored) would make a row read as another.
        hidden = [c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
        if not name.strip() or hidden:
            why = "is blank" if not name.strip() else f"holds the invisible character U+{ord(hidden[0]):04X}"
            raise CheckpointError(f"class_names[{i}]={name!r} is not allowed: it {why}")
    shown_as = {}
    for name in names:  # NFC and NFD spellings of "café" look the same but differ as strings
        twin = shown_as.setdefault(unicodedata.normalize("NFC", name), name)
        if twin != name:
            raise CheckpointError(f"class_names holds {twin!r} twice, spelt with other Unicode code points (the "
                                  "same name after NFC normalisation)")
    return list(names)
