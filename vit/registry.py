"""What a saved model may name and record, checked before anything is built.

A model folder (and a run's `config.yaml` when it resumes) names its backbone and data module by class path and
arguments. Only classes registered here can be named, so a file chooses values, never code (timm's rule in
`_factory.py`). Arguments are checked against the constructor's signature and annotations, sizes against the
model's own `BOUNDS` (one declaration: what the constructor builds also opens). The recorded inputs and class
names are checked here too, because every door prints or transforms them.
"""

from __future__ import annotations

import importlib
import inspect
import math
import typing
import unicodedata
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import vit.data
import vit.models
from vit.checks import CheckpointError, check_size
from vit.data.images import CROP_MODES, build_transform
from vit.messages import first_line
from vit.models.contract import Backbone
from vit.models.vision_transformer import BOUNDS
from vit.signatures import constructor_message, describe, matches

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")

# Sizes beyond which a model or its data would not fit in memory. The model's own sizes come from its `BOUNDS`.
LIMITS = {
    "img_size": 4096,
    "num_heads": 256,
    "patch_size": 1024,
    "patch_kernel": 1024,
    "num_train": 1_000_000,
    "num_val": 1_000_000,
    "num_test": 1_000_000,
    "batch_size": 65_536,
    "num_workers": 256,
    "repeated_augmentation": 64,
    **{key: bounds[1] for key, bounds in BOUNDS.items() if len(bounds) == 2 and isinstance(bounds[1], int)},
}
MAX_IMAGE_BYTES = 2**32  # one float32 input image: 4096 x 4096 pixels of 64 channels
# Tables a model computes itself (sin/cos positions, masks) are in no file, so the file's size does not bound them.
MAX_BUFFER_BYTES = 2**30
MAX_NAME_CHARS = 256


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a message quotes a value, never a megabyte of it (nor a list nested
    too deeply to print)."""
    try:
        text = repr(value)
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def not_allowed(key: str, value: Any, expected: str) -> CheckpointError:
    """The error for `key=value`: "<key>=<value> is not allowed: expected <expected>"."""
    return CheckpointError(f"{key}={shown(value)} is not allowed: expected {expected}")


def _public_classes(package, base: type) -> dict[str, type]:
    """`{class path: class}` of the `base` subclasses a package exports, under `package.Name` and their module."""
    found = {}
    for name in package.__all__:
        cls = getattr(package, name)
        if isinstance(cls, type) and issubclass(cls, base):
            found[f"{package.__name__}.{name}"] = cls
            found[f"{cls.__module__}.{name}"] = cls
    return found


BACKBONES = _public_classes(vit.models, Backbone)
# {class path: class, or its module}: the data modules are imported (Lightning with them) only when one is named.
DATA_MODULES: dict[str, type | str] = {
    path: module
    for name, module in vit.data.MODULES.items()
    if name.endswith("DataModule")
    for path in (f"vit.data.{name}", f"{module}.{name}")
}


def data_module(class_path: str) -> type:
    """The data module class registered under `class_path` (one of `DATA_MODULES`)."""
    found = DATA_MODULES[class_path]
    if isinstance(found, type):
        return found
    return getattr(importlib.import_module(found), class_path.rsplit(".")[-1])


def allow_backbone(cls: type[nn.Module]) -> None:
    """Let model folders name `cls` (by its module path): for a class a study defines and imports first."""
    if not (isinstance(cls, type) and issubclass(cls, Backbone)):
        raise TypeError(f"{cls!r} is not a vit.models.contract.Backbone class")
    BACKBONES[f"{cls.__module__}.{cls.__name__}"] = cls


def allow_datamodule(cls: type) -> None:
    """`allow_backbone` for a data module a study defines."""
    import lightning as L

    if not (isinstance(cls, type) and issubclass(cls, L.LightningDataModule)):
        raise TypeError(f"{cls!r} is not a LightningDataModule class")
    DATA_MODULES[f"{cls.__module__}.{cls.__name__}"] = cls


def signature(cls: type) -> tuple[dict[str, inspect.Parameter], dict[str, Any]]:
    """`cls`'s constructor parameters and annotations, with its base's where its `**kwargs` go (as jsonargparse)."""
    parameters: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object or klass.__module__.startswith(("torch.", "lightning.")):
            continue
        own = inspect.signature(klass.__init__).parameters
        parameters = {**{k: p for k, p in own.items() if k != "self"}, **parameters}
        hints = {**typing.get_type_hints(klass.__init__), **hints}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
            break
    return parameters, hints


def check_arguments(cls: type, given: Mapping, key: str) -> dict:
    """`given` checked against `cls.__init__`: names it has, values of the annotated types, sizes within `LIMITS`."""
    parameters, hints = signature(cls)
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    for name, value in given.items():
        if name not in parameters or parameters[name].kind in variadic:
            raise CheckpointError(f"{key}.{name}: {cls.__name__} has no argument {name!r}; refused")
        if not matches(value, hints.get(name, Any)):
            raise not_allowed(f"{key}.{name}", value, describe(hints.get(name, Any)))
        limit = LIMITS.get(name)
        sizes = value if isinstance(value, (list, tuple)) else [value]
        if limit is not None and any(isinstance(v, int) and not 0 <= v <= limit for v in sizes):
            raise not_allowed(f"{key}.{name}", value, f"at most {limit}")
    return dict(given)


def _named(spec: Any, allowed: Mapping, key: str, what: str) -> tuple[str, Mapping]:
    """`(class_path, init_args)` of `{"class_path", "init_args"}` naming one of `allowed`; nothing is imported."""
    if not isinstance(spec, Mapping) or set(spec) - {"class_path", "init_args"}:
        raise not_allowed(key, spec, "a mapping of class_path and init_args")
    path, init_args = spec.get("class_path"), spec.get("init_args") or {}
    if not isinstance(path, str) or path not in allowed:
        names = ", ".join(sorted({p for p in allowed if p.count(".") == 2}))  # the short public paths
        raise CheckpointError(
            f"{key}.class_path={shown(path)} is not allowed: a saved model may name only the {what} of this project "
            f"({names}); refused without importing it"
        )
    if not isinstance(init_args, Mapping):
        raise not_allowed(f"{key}.init_args", init_args, "a mapping")
    return path, init_args


def check_backbone(spec: Any, key: str = "vit.backbone") -> tuple[type[nn.Module], dict]:
    """`(class, arguments)` of a backbone recorded as `{"class_path", "init_args"}`, checked; nothing is built."""
    path, init_args = _named(spec, BACKBONES, key, "backbones")
    cls = BACKBONES[path]
    return cls, check_arguments(cls, init_args, f"{key}.init_args")


def check_data(spec: Any, key: str = "vit.data") -> tuple[type, dict]:
    """`check_backbone` for a data module, against `DATA_MODULES`; imports Lightning with the class."""
    path, init_args = _named(spec, DATA_MODULES, key, "data modules")
    cls = data_module(path)
    return cls, check_arguments(cls, init_args, f"{key}.init_args")


def construct(cls: type, kwargs: Mapping, failure: str) -> Any:
    """`cls(**kwargs)`, a constructor's refusal (`ValueError`, `TypeError`) raised as "<failure>: <its message>"."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{failure}: {first_line(ValueError(constructor_message(str(err))))}") from None


def build_backbone(cls: type[nn.Module], args: Mapping) -> nn.Module:
    """`cls(**args)` for saved weights to be loaded into: its random init does not move the caller's random stream
    (a run saving a checkpoint, a user who seeded before `vit.load`)."""
    with torch.random.fork_rng(devices=[]):
        return construct(cls, args, f"its backbone {cls.__name__} cannot be built")


def meta_backbone(cls: type[nn.Module], args: Mapping) -> nn.Module:
    """`cls(**args)` on the meta device (names and shapes, no memory), refused if its fixed tables are too large."""
    with torch.device("meta"):
        model = construct(cls, args, f"its backbone {cls.__name__} cannot be built")
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if buffers > MAX_BUFFER_BYTES:
        raise CheckpointError(
            f"its backbone {cls.__name__} would hold {buffers / 2**30:.1f} GiB of fixed tables "
            f"(above {MAX_BUFFER_BYTES // 2**30} GiB); refused"
        )
    return model


def _numbers(values: Any, count: int, low: float) -> bool:
    """Whether `values` is a list of `count` finite numbers above `low`."""
    return (
        isinstance(values, (list, tuple))
        and len(values) == count
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and low < v < math.inf for v in values)
    )


def check_inputs(inputs: Any, backbone_args: Mapping) -> dict:
    """`inputs` (size, channels, normalisation, interpolation, crop: what a transform needs) checked, and checked
    against the backbone's `img_size` and `in_chans`; returned as plain values."""
    expected = {"img_size", "in_chans", "mean", "std", "interpolation"}
    if not isinstance(inputs, Mapping) or not expected <= set(inputs) <= expected | {"crop_pct", "crop_mode"}:
        raise not_allowed("inputs", inputs, f"a mapping of {sorted(expected)} (and crop_pct, crop_mode)")
    crop = inputs.get("crop_pct", 1.0)
    crop_mode = inputs.get("crop_mode", "squash")
    if not _numbers([crop], 1, 0) or crop > 1:
        raise not_allowed("inputs.crop_pct", crop, "a number in (0, 1]: the share of the resized image kept")
    if crop_mode not in CROP_MODES:
        raise not_allowed("inputs.crop_mode", crop_mode, f"one of {list(CROP_MODES)}")
    try:
        size = list(check_size("inputs.img_size", inputs["img_size"]))
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    chans = inputs["in_chans"]
    if not (type(chans) is int and 1 <= chans <= LIMITS["in_chans"]):
        raise not_allowed("inputs.in_chans", chans, f"an int in [1, {LIMITS['in_chans']}]")
    if max(size) > LIMITS["img_size"]:
        raise not_allowed("inputs.img_size", size, f"sides of at most {LIMITS['img_size']}")
    if 4 * chans * size[0] * size[1] > MAX_IMAGE_BYTES:  # one image is decoded and run whole, even alone
        raise CheckpointError(f"inputs of {chans} x {size[0]} x {size[1]} would take more than 4 GiB per image")
    for name, ours in (("img_size", size), ("in_chans", chans)):
        theirs = backbone_args.get(name)
        if theirs is not None and (list(check_size(name, theirs)) if name == "img_size" else theirs) != ours:
            raise CheckpointError(f"inputs.{name}={ours} disagrees with the backbone's {name}={shown(theirs)}")
    mean, std = inputs["mean"], inputs["std"]
    if (mean is None) != (std is None):
        raise CheckpointError(f"inputs.mean={shown(mean)}, inputs.std={shown(std)}: expected both null or both numbers")
    if mean is not None and not _numbers(mean, chans, -math.inf):
        raise not_allowed("inputs.mean", mean, f"{chans} finite numbers (one per channel)")
    if std is not None and not _numbers(std, chans, 0):
        raise not_allowed("inputs.std", std, f"{chans} finite numbers > 0 (one per channel)")
    if inputs["interpolation"] not in INTERPOLATIONS:
        raise not_allowed("inputs.interpolation", inputs["interpolation"], f"one of {list(INTERPOLATIONS)}")
    checked = {
        "img_size": size,
        "in_chans": chans,
        "mean": None if mean is None else [float(v) for v in mean],
        "std": None if std is None else [float(v) for v in std],
        "interpolation": inputs["interpolation"],
    }
    if crop != 1:
        checked["crop_pct"] = float(crop)
    if crop_mode != "squash":
        checked["crop_mode"] = crop_mode
    return checked


def inference_transform(inputs: Mapping):
    """The transform of checked `inputs`: a PIL image (or a CHW tensor) -> the model's input."""
    normalization = None if inputs["mean"] is None else (inputs["mean"], inputs["std"])
    crop = inputs.get("crop_pct", 1.0)
    crop_mode = inputs.get("crop_mode", "squash")
    return build_transform(
        inputs["img_size"], inputs["in_chans"], normalization, inputs["interpolation"], crop, crop_mode
    )


def check_names(names: Any, num_classes: int) -> list[str]:
    """`class_names`: one printable, distinct name per class."""
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, str) and n for n in names)):
        raise not_allowed("class_names", names, "a list of non-empty strings")
    if len(names) != num_classes or len(set(names)) != len(names):
        raise CheckpointError(
            f"class_names holds {len(names)} name(s) ({len(set(names))} distinct); the model has {num_classes} classes"
        )
    seen: dict[str, str] = {}
    for i, name in enumerate(names):
        # Names are printed and written to CSV files: a blank name, a control character (a terminal escape) or a
        # bidirectional override (text shown in another order than stored) would make a row read as another.
        hidden = [c for c in name if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
        if len(name) > MAX_NAME_CHARS or not name.strip() or hidden:
            why = (
                f"is longer than {MAX_NAME_CHARS} characters"
                if len(name) > MAX_NAME_CHARS
                else "is blank"
                if not name.strip()
                else f"holds the invisible character U+{ord(hidden[0]):04X}"
            )
            raise CheckpointError(f"class_names[{i}]={shown(name)} is not allowed: it {why}")
        # NFC and NFD spellings of "café" look the same but differ as strings.
        twin = seen.setdefault(unicodedata.normalize("NFC", name), name)
        if twin != name:
            raise CheckpointError(f"class_names holds {twin!r} twice, spelt with other Unicode code points")
    return list(names)


MAX_TEST_SET_BYTES = 2**29  # a generated test split built from a model's record, as float32 pixels


def test_data(spec: Any, inputs: Mapping, source: str) -> Any:
    """The data module a saved model records (`spec`), for its test images: generated data only (a model names no
    folder), its class registered and its arguments checked, its test split bounded in size."""
    from vit.data.base import SyntheticDataModule

    if spec is None:
        raise CheckpointError(f"{source} does not record its data module")
    cls, args = check_data(spec)
    if not issubclass(cls, SyntheticDataModule):
        raise CheckpointError(f"{source} was trained on files ({cls.__name__}); its test images are not rebuilt")
    values = args.get("num_test", 1) * inputs["in_chans"] * math.prod(inputs["img_size"])
    if values * 4 > MAX_TEST_SET_BYTES:
        raise CheckpointError(
            f"{source}: its test split (num_test={args.get('num_test')}) would take {values * 4 / 2**30:.1f} GiB to "
            f"generate (limit {MAX_TEST_SET_BYTES // 2**20} MiB)"
        )
    return construct(cls, args, f"{source}: its data module {cls.__name__} cannot be built here")
