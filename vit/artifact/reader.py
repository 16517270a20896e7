"""Building the model of a model folder from this project's classes only (`read`), and the one function every
inference door opens a model with (`load`), whatever it was given."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit.artifact.config import _TIMM_POOL, FORMAT_VERSION, WEIGHTS, ArtifactError, training_record
from vit.artifact.files import locate, read_config
from vit.checks import CheckpointError

if TYPE_CHECKING:
    import torch
    from torch import nn

@dataclass(frozen=True)
class Artifact:
    """An opened model: `model` (eval mode, on the CPU), `inputs` (as `vit.data` records them: `img_size`,
    `in_chans`, `mean`, `std`, `interpolation`), `class_names`, `source` (as messages name it), `data` (the data
    module as `{"class_path", "init_args"}`, unchecked until `test_data` builds it; None if not recorded),
    `training` (what the run says of itself, for a model card: `training_record`), `config` (config.json as read;
    empty for a checkpoint without a model folder), `backbone` (`{"class_path", "init_args"}` as checked: what
    `train.py` records as the run's model)."""

    model: nn.Module
    inputs: dict
    class_names: list[str]
    source: str
    backbone: dict
    data: dict | None = None
    training: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def read(folder: str | os.PathLike) -> Artifact:
    """The model in a folder `write` (or `vit.export`) wrote, built from this project's classes only; `ArtifactError`
    naming the file and value that cannot be used."""
    from vit.models.weights import PretrainedError

    folder = Path(folder)
    config = read_config(folder)
    own = config.get("vit")
    try:
        if own is not None:
            model, inputs, names, backbone = _build(own, folder)
        else:
            model, inputs, names, backbone = _build_timm_export(config, folder)
    except (CheckpointError, PretrainedError) as err:
        raise ArtifactError(f"model folder {folder}: {err}") from None
    training = own.get("training") if isinstance(own, dict) else None
    data = own.get("data") if isinstance(own, dict) else None
    return Artifact(model.eval(), inputs, names, str(folder), backbone, data if isinstance(data, dict) else None,
                    training if isinstance(training, dict) else {}, config)


def _build(own: Any, folder: Path) -> tuple[nn.Module, dict, list[str], dict]:
    """The model of config.json's "vit" section, its weights from model.safetensors."""
    from vit.training.checkpoint.schema import check_backbone, check_inputs, check_names
    from vit.training.checkpoint.values import not_allowed, shown

    if not isinstance(own, dict):
        raise not_allowed("vit", own, "a mapping")
    version = own.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise CheckpointError(f"vit.format_version={shown(version)} is not allowed: this version of readable-vit "
                              f"reads model folders of format {FORMAT_VERSION}")
    for key in ("backbone", "inputs", "class_names"):
        if key not in own:
            raise CheckpointError(f"config.json's vit section has no {key!r}")
    cls, args = check_backbone(own["backbone"])
    inputs = check_inputs(own["inputs"], args)
    model = _load_weights(cls, args, folder)
    names = check_names(own["class_names"], model.num_classes)
    return model, inputs, names, {"class_path": own["backbone"]["class_path"], "init_args": args}


def _load_weights(cls: type[nn.Module], args: Mapping, folder: Path) -> nn.Module:
    """`cls(**args)` with model.safetensors loaded strictly: names, shapes and kinds compared on the meta device from
    the file's header, then the data read (bounded by the header) and checked finite in the model's dtype."""
    import torch

    from vit.models.weights import load_state_dict, weight_shapes
    from vit.training.checkpoint.schema import MAX_BUFFER_BYTES, meta_backbone

    source = folder / WEIGHTS
    skeleton = meta_backbone(cls, args)  # names and shapes, no memory
    expected = dict(skeleton.state_dict())
    fixed = {name for name, _ in skeleton.named_buffers()} - set(expected)
    buffers = sum(b.numel() * b.element_size() for b in skeleton.buffers())
    # Tables the model computes itself (sin/cos positions, masks) are in no file: the file's size does not bound them.
    if buffers > MAX_BUFFER_BYTES:
        raise CheckpointError(f"its backbone {cls.__name__} would hold {buffers / 2**30:.1f} GiB of fixed tables "
                              f"(above {MAX_BUFFER_BYTES // 2**30} GiB); refused")
    _compare(weight_shapes(source, str(source)), expected, fixed)
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


def _compare(found: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], fixed: set[str]) -> None:
    """Raise unless the file has exactly the model's tensors (and, optionally, its fixed tables), of their shapes."""
    from vit.training.checkpoint.values import shown

    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - fixed)
    if missing or unexpected:
        first = f"{shown(missing[0], 80)} missing" if missing else f"{shown(unexpected[0], 80)} not in the model"
        raise CheckpointError(f"{WEIGHTS} does not fit the backbone config.json records: {len(missing)} tensor(s) "
                              f"missing, {len(unexpected)} unexpected; first: {first}")
    for name, reference in expected.items():  # in the model's order: the first a reader would look for
        tensor = found[name]
        if tuple(tensor.shape) != tuple(reference.shape):
            raise CheckpointError(f"{WEIGHTS}: {name} has shape {tuple(tensor.shape)}, the backbone config.json "
                                  f"records needs {tuple(reference.shape)}")
        if tensor.is_floating_point() != reference.is_floating_point():
            raise CheckpointError(f"{WEIGHTS}: {name} is a {tensor.dtype} tensor, the backbone needs "
                                  f"{reference.dtype}")


# The timm `VisionTransformer` arguments a config.json's `model_args` may set: sizes and switches, never a callable, a
# file (`checkpoint_path`) or a download (`pretrained_cfg_overlay`), which `timm.create_model` would also take.
_TIMM_MODEL_ARGS = {"img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
                    "qk_norm", "init_values", "class_token", "global_pool", "fc_norm", "reg_tokens",
                    "no_embed_class", "pos_embed", "dynamic_img_size"}


def _build_timm_export(config: dict, folder: Path) -> tuple[nn.Module, dict, list[str], dict]:
    """A folder without a "vit" section: a timm ViT's (its Hub repo, or `vit.export` of an earlier version), rebuilt
    as this project's `VisionTransformer` from timm's model of that `architecture` and `model_args`, built on the
    meta device; its input from `pretrained_cfg`, its class names from `label_names` (else ImageNet's, for a model
    of ImageNet's classes)."""
    from vit.training.checkpoint.schema import check_backbone, check_inputs, check_names
    from vit.training.checkpoint.values import not_allowed

    architecture, args = config.get("architecture"), config.get("model_args") or {}
    if not isinstance(architecture, str) or not isinstance(args, dict):
        raise CheckpointError("config.json has neither this project's 'vit' section nor timm's 'architecture': it "
                              "is not a model folder of this project or timm")
    unknown = sorted(set(args) - _TIMM_MODEL_ARGS - {"num_classes"})
    if unknown:
        raise CheckpointError(f"config.json's model_args has {unknown[0]!r}, which this project does not pass to "
                              "timm's VisionTransformer")
    num_classes = config.get("num_classes", args.get("num_classes"))
    kwargs = _from_timm(architecture, {**args, "num_classes": num_classes})
    cfg = config.get("pretrained_cfg")
    if not isinstance(cfg, dict):
        raise not_allowed("pretrained_cfg", cfg, "a mapping")
    size = cfg.get("input_size")
    if not (isinstance(size, list) and len(size) == 3):
        raise not_allowed("pretrained_cfg.input_size", size, "[channels, height, width]")
    plain = [0.0] * size[0], [1.0] * size[0]
    raw = cfg.get("mean") == plain[0] and cfg.get("std") == plain[1]
    inputs = check_inputs({"img_size": size[1:], "in_chans": size[0], "mean": None if raw else cfg.get("mean"),
                           "std": None if raw else cfg.get("std"), "interpolation": cfg.get("interpolation"),
                           "crop_pct": cfg.get("crop_pct", 0.875), "crop_mode": cfg.get("crop_mode", "center")},
                          kwargs)  # timm's defaults where the config is silent
    cls, kwargs = check_backbone({"class_path": "vit.models.VisionTransformer", "init_args": kwargs})
    model = _load_weights(cls, kwargs, folder)
    names = config.get("label_names") or _imagenet_names(cfg, model.num_classes)
    backbone = {"class_path": "vit.models.VisionTransformer", "init_args": kwargs}
    return model, inputs, check_names(names, model.num_classes), backbone


def _from_timm(architecture: str, args: dict) -> dict:
    """This project's `VisionTransformer` arguments for timm's `architecture` with `args`, read from timm's model
    built on the meta device (no memory, nothing downloaded); `CheckpointError` for a model of another class."""
    import timm
    import torch
    from timm.layers import LayerScale
    from timm.models import VisionTransformer as TimmVisionTransformer
    from torch import nn

    if not timm.is_model(architecture):
        raise CheckpointError(f"config.json's architecture {architecture!r} is not a model timm knows")
    with torch.device("meta"):
        try:
            model = timm.create_model(architecture, pretrained=False, **args)
        except (TypeError, ValueError, AssertionError, RuntimeError) as err:
            raise CheckpointError(f"timm cannot build {architecture} with config.json's model_args: "
                                  f"{str(err).splitlines()[0][:200] if str(err) else type(err).__name__}") from None
    if type(model) is not TimmVisionTransformer:
        raise CheckpointError(f"config.json's architecture {architecture} is a timm {type(model).__name__}; this "
                              "project opens timm's VisionTransformer from its folder (its RoPE and relative-position "
                              "ViTs through this project's own model folders)")
    pool = {value: key for key, value in _TIMM_POOL.items()}.get(model.global_pool)
    if pool is None or (pool == "cls") != (model.cls_token is not None) or model.dynamic_img_size:
        raise CheckpointError(f"{architecture}: global_pool={model.global_pool!r} with class_token="
                              f"{model.cls_token is not None} and dynamic_img_size={model.dynamic_img_size} is not "
                              "this project's: global_pool token (with a CLS token), avg or map, a fixed image size")
    attn = model.blocks[0].attn
    return dict(img_size=list(model.patch_embed.img_size), patch_size=model.patch_embed.patch_size[0],
                in_chans=model.patch_embed.proj.in_channels, num_classes=model.num_classes,
                embed_dim=model.embed_dim, depth=len(model.blocks), num_heads=attn.num_heads,
                mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim, qkv_bias=attn.qkv.bias is not None,
                qk_norm=not isinstance(attn.q_norm, nn.Identity), pool=pool,
                fc_norm=not isinstance(model.fc_norm, nn.Identity), reg_tokens=model.num_reg_tokens,
                no_embed_class=model.no_embed_class, pos_embed="learned" if model.pos_embed is not None else "none",
                init_values=1.0 if isinstance(model.blocks[0].ls1, LayerScale) else None)  # the values: the weights'


def _imagenet_names(cfg: dict, num_classes: int) -> list[str]:
    """timm's ImageNet class descriptions for a model of ImageNet's classes (the one repeated, "crane", with its
    WordNet id), else `"0"`, `"1"`, ..."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset({**cfg, "num_classes": num_classes})
    if subset is None:
        return [str(i) for i in range(num_classes)]
    info = ImageNetInfo(subset)
    names, ids = info.label_descriptions(), info.label_names()
    return [f"{name} ({wnid})" if names.count(name) > 1 else name for name, wnid in zip(names, ids)]


def load(source: str | os.PathLike) -> Artifact:
    """The model a door was given (`locate`): a model folder, a checkpoint's model folder, an `hf-hub:` id; else a
    checkpoint file or URL (written before model folders, or without its folder) through the checkpoint reader."""
    from vit.training.checkpoint import read as read_checkpoint
    from vit.training.checkpoint.build import trained_backbone

    folder = locate(source)
    if folder is not None:
        return read(folder)
    checkpoint = read_checkpoint(source, training=False)
    recorded = checkpoint.raw.get("datamodule_hyper_parameters") or {}
    data = {"class_path": recorded["_class_path"], "init_args": dict(checkpoint.data_args)} if (
        "_class_path" in recorded) else None
    backbone = {"class_path": checkpoint.raw["hyper_parameters"]["backbone"]["class_path"],
                "init_args": dict(checkpoint.backbone_args)}
    return Artifact(trained_backbone(checkpoint), checkpoint.inputs, list(checkpoint.class_names), checkpoint.source,
                    backbone,
                    data, training_record(checkpoint.raw))


MAX_TEST_SET_BYTES = 2**29  # a generated test split built from a model's record, as float32 pixels


def test_data(model: Artifact):
    """The data module a model was trained on, for its test images: generated data only (a model names no folder),
    its class from this project's registry and its arguments checked, its test split bounded in size."""
    import math

    from vit.data.base import SyntheticDataModule
    from vit.training.checkpoint.schema import check_data
    from vit.training.checkpoint.values import construct

    if model.data is None:
        raise CheckpointError(f"{model.source} does not record its data module")
    cls, args = check_data(model.data)
    if not issubclass(cls, SyntheticDataModule):
        raise CheckpointError(f"{model.source} was trained on files ({cls.__name__}); its test images are not "
                              "rebuilt from a model")
    values = args.get("num_test", 1) * model.inputs["in_chans"] * math.prod(model.inputs["img_size"])
    if values * 4 > MAX_TEST_SET_BYTES:
        raise CheckpointError(f"{model.source}: its test split (num_test={args.get('num_test')}) would take "
                              f"{values * 4 / 2**30:.1f} GiB to generate (limit {MAX_TEST_SET_BYTES // 2**20} MiB)")
    return construct(cls, args, f"{model.source}: its data module {cls.__name__} cannot be built here")
