"""The trained model as a folder of its own, in the Hugging Face Hub / timm layout: `model.safetensors` and
`config.json`. Each checkpoint a run saves gets one beside it (`last.ckpt` -> `last/`); timm
(`create_model("local-dir:<folder>", pretrained=True)`), transformers (`pipeline("image-classification", model=...)`)
and `vit.load` open it.

    artifact = vit.artifact.read("runs/two_circles/vit/version_0/checkpoints/last")
    artifact.model, artifact.inputs, artifact.class_names

Neither file can carry code. `config.json` holds timm's keys where timm can compute the model (`architecture`,
`num_classes`, `num_features`, `global_pool`, `model_args`, `pretrained_cfg`, `label_names`) and this project's under
`"vit"`: the backbone by its registry name and arguments, `inputs` (size, channels, normalisation, interpolation),
`class_names`, the data module by name and arguments, `format_version`. Reading looks the backbone up in this
project's registry, checks its arguments against the constructor (`schema.check_backbone`, which reads the model's
own bounds), compares every tensor's name and shape on the meta device from the safetensors header before memory is
spent, and checks the weights finite in the model's dtype. `model.safetensors` holds the weights the commands run: the
EMA average when the run kept one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vit.checks import CheckpointError

if TYPE_CHECKING:  # imported where used: `vit.export --help` reads this module and loads no torch
    import torch
    from torch import nn

FORMAT_VERSION = 1  # of the "vit" section of config.json
CONFIG, WEIGHTS = "config.json", "model.safetensors"
MAX_CONFIG_BYTES = 16 * 2**20  # 100,000 class names of 100 characters fit; a config.json is a few KB
# timm's plain ViTs (`vit_{family}_patch{P}_{S}`) by width, depth and heads.
_FAMILIES = {(192, 12, 3): "tiny", (384, 12, 6): "small", (768, 12, 12): "base", (1024, 24, 16): "large",
             (1280, 32, 16): "huge"}
# What a plain timm ViT has besides its sizes: a model that differs here is not the one the name describes.
_PLAIN = dict(mlp_ratio=4.0, qkv_bias=True, qk_norm=False, class_token=True, reg_tokens=0, no_embed_class=False,
              pos_embed="learn")
# timm's one registered ViT whose name states no size: every argument it sets is in `model_args`.
GENERIC_ARCHITECTURE = "test_vit"
_TIMM_POOL = {"cls": "token", "mean": "avg", "map": "map"}
# The longest `pretrained` looked at for a base model: `hf-hub:`, an `org/name` of 96 + 1 + 96 characters, `@revision`.
MAX_SOURCE_CHARS = 256


class ArtifactError(CheckpointError):
    """A model folder that cannot be opened, or a model that timm cannot compute; one line naming the value."""


@dataclass(frozen=True)
class Artifact:
    """An opened model: `model` (eval mode, on the CPU), `inputs` (as `vit.data` records them: `img_size`,
    `in_chans`, `mean`, `std`, `interpolation`), `class_names`, `source` (as messages name it), `data` (the data
    module as `{"class_path", "init_args"}`, unchecked until `test_data` builds it; None if not recorded),
    `training` (what the run says of itself, for a model card: `training_record`), `config` (config.json as read;
    empty for a checkpoint without a model folder)."""

    model: nn.Module
    inputs: dict
    class_names: list[str]
    source: str
    data: dict | None = None
    training: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)


def folder_of(checkpoint: str | os.PathLike) -> Path:
    """The model folder beside a checkpoint file: its name without `.ckpt` (`last.ckpt` -> `last`)."""
    return Path(checkpoint).with_suffix("")


def timm_args(model: nn.Module) -> dict:
    """The arguments of timm's `VisionTransformer` that compute what `model` computes; `ArtifactError` if none do."""
    from torch import nn

    from vit.models import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise ArtifactError(f"the backbone is a {type(model).__name__}; only a VisionTransformer exports to timm")
    embed, attn = model.patch_embed, model.blocks[0].attn
    kernel = embed.proj.kernel_size[0]
    if kernel != embed.patch_size:
        raise ArtifactError(f"patch_kernel={kernel} cannot be exported: timm's patch embedding has a kernel equal "
                            f"to the patch size ({embed.patch_size})")
    if attn.attn_score != "scaled_dot":
        raise ArtifactError(f"attn_score={attn.attn_score!r} cannot be exported: timm's attention is 'scaled_dot' "
                            "only")
    return dict(img_size=list(embed.img_size), patch_size=embed.patch_size, in_chans=embed.in_chans,
                num_classes=model.num_classes, embed_dim=model.embed_dim, depth=len(model.blocks),
                num_heads=attn.num_heads, mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim,
                qkv_bias=attn.qkv.bias is not None, qk_norm=not isinstance(attn.q_norm, nn.Identity),
                class_token=model.cls_token is not None, global_pool=_TIMM_POOL[model.pool],
                fc_norm=model.use_fc_norm, reg_tokens=model.num_reg_tokens, no_embed_class=model.no_embed_class,
                pos_embed="none" if model.pos_embed is None else "learn", dynamic_img_size=False)


def architecture(args: dict) -> str:
    """timm's name of a plain ViT of these sizes, at the model's image size or 224; else `GENERIC_ARCHITECTURE`."""
    import timm

    family = _FAMILIES.get((args["embed_dim"], args["depth"], args["num_heads"]))
    if family is None or any(args[key] != value for key, value in _PLAIN.items()):
        return GENERIC_ARCHITECTURE
    height, width = args["img_size"]
    sizes = ([height] if height == width else []) + [224, 384]
    names = [f"vit_{family}_patch{args['patch_size']}_{size}" for size in sizes]
    return next((name for name in names if timm.is_model(name)), GENERIC_ARCHITECTURE)


def data_config(inputs: Mapping) -> dict:
    """timm's data config of `inputs`: the image squashed to the model's size (no crop), then normalised (raw pixels:
    mean 0, std 1), as `vit.data.images.build_transform` does."""
    channels = inputs["in_chans"]
    mean, std = (inputs["mean"], inputs["std"]) if inputs["mean"] is not None else ([0.0] * channels, [1.0] * channels)
    return dict(input_size=[channels, *inputs["img_size"]], mean=list(mean), std=list(std),
                interpolation=inputs["interpolation"], crop_pct=1.0, crop_mode="squash")


def describe(model: nn.Module, backbone: Mapping, inputs: Mapping, class_names: list[str],
             data: Mapping | None = None) -> dict:
    """config.json of `model`, built from `backbone` (`{"class_path", "init_args"}`) with `inputs` and `class_names`;
    `data`: the data module as `{"class_path", "init_args"}`. timm's keys only where timm can compute the model."""
    own = {"format_version": FORMAT_VERSION, "backbone": {"class_path": backbone["class_path"],
                                                          "init_args": dict(backbone["init_args"])},
           "inputs": dict(inputs), "class_names": list(class_names), "data": dict(data) if data else None}
    config: dict[str, Any] = {"num_classes": model.num_classes, "label_names": list(class_names)}
    try:
        args = timm_args(model)
    except ArtifactError as err:  # a model of this project that timm has no class for: this project opens it alone
        own["timm"] = str(err)
    else:
        # timm passes num_classes itself (from "num_classes"); a second one in model_args is "multiple values".
        model_args = {key: value for key, value in args.items() if key != "num_classes"}
        config.update(architecture=architecture(args), num_features=model.num_features,
                      global_pool=args["global_pool"], model_args=model_args)
    config["pretrained_cfg"] = {**data_config(inputs), "num_classes": model.num_classes,
                                "fixed_input_size": True, "first_conv": "patch_embed.proj", "classifier": "head"}
    return {**config, "vit": own}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.safetensors`'s tensors: the state dict, and a fixed position table too (timm's `pos_embed` is a
    parameter; this project's sin/cos tables are buffers that the state dict leaves out)."""
    import torch

    state = dict(model.state_dict())
    fixed = getattr(model, "pos_embed", None)
    if isinstance(fixed, torch.Tensor) and "pos_embed" not in state:
        state["pos_embed"] = fixed
    return {key: value.detach().contiguous().clone() for key, value in state.items()}


def from_checkpoint(checkpoint: Mapping) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """`(config, tensors)` of the model a run's checkpoint dict holds, or None for a backbone built in Python (no
    class path recorded: nothing says how to build it again). The dict is this process's own, about to be saved."""
    from vit.training.checkpoint.build import inference_state
    from vit.training.checkpoint.schema import BACKBONES

    backbone = (checkpoint.get("hyper_parameters") or {}).get("backbone")
    if not isinstance(backbone, Mapping) or backbone.get("class_path") not in BACKBONES:
        return None
    import torch

    cls = BACKBONES[backbone["class_path"]]
    with torch.random.fork_rng(devices=[]):  # its random init must not move the run's random stream (resume = same)
        model = cls(**backbone["init_args"])
    state = inference_state(checkpoint["state_dict"])
    model.load_state_dict({key.removeprefix("backbone."): value for key, value in state.items()
                           if key.startswith("backbone.")})
    data = checkpoint.get("datamodule_hyper_parameters") or {}
    data = {"class_path": data["_class_path"], "init_args": {k: v for k, v in data.items() if not k.startswith("_")}
            } if "_class_path" in data else None
    config = describe(model, backbone, checkpoint["inputs"], checkpoint["class_names"], data)
    config["vit"]["training"] = training_record(checkpoint)
    return config, weights(model)


def training_record(checkpoint: dict) -> dict:
    """What the checkpoint says of its training, for the model card: run facts, `model` settings, `metrics` (finite
    scores only: config.json is strict JSON)."""
    data, hparams = checkpoint.get("datamodule_hyper_parameters") or {}, checkpoint.get("hyper_parameters") or {}
    record = {"data_module": data.get("_class_path"), "seed": data.get("seed"),
              "epoch": checkpoint.get("epoch"), "global_step": checkpoint.get("global_step"),
              "dataset": hub_dataset(data), "base_model": hub_base_model(hparams.get("pretrained"))}
    record = {key: value for key, value in record.items()
              if isinstance(value, (str, int)) and not isinstance(value, bool)}
    settings = {key: value for key, value in hparams.items()
                if not key.startswith("_") and key != "backbone" and isinstance(value, (str, int, float, bool, list))}
    if settings:
        record["model"] = settings
    metrics = {f"{state['monitor']} ({label})": _score(state.get(key))
               for state in (checkpoint.get("callbacks") or {}).values()
               if isinstance(state, dict) and isinstance(state.get("monitor"), str)
               for key, label in (("best_model_score", "best"), ("current_score", "at this checkpoint"))}
    metrics = {name: value for name, value in metrics.items() if value is not None}
    if metrics:
        record["metrics"] = metrics
    return record


def _score(value: object) -> float | None:
    """A monitored score as a finite float (a number or a one-element tensor), else None."""
    import math

    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def hub_dataset(data: dict) -> str | None:
    """The Hub id of the public dataset a data module's hyperparameters name (CIFAR-10: `cifar10`), else None."""
    cifar = data.get("_class_path") == "vit.data.cifar.CIFARDataModule"
    return data["dataset"] if cifar and data.get("dataset") in ("cifar10", "cifar100") else None


def hub_base_model(pretrained: object) -> str | None:
    """The Hub id of the weights `ImageClassifier(pretrained=...)` started from: a hub id without `hf-hub:` and
    `@revision`, a timm name as its repo (`timm/<name>.<tag>`); None for a local file, a name timm does not know, or
    anything that is not one line a Hub id could be (`is_hub_id`): the model card's front matter carries no other."""
    from timm.models import get_pretrained_cfg

    from vit.models.weights import source_kind

    if not isinstance(pretrained, str) or not 0 < len(pretrained) <= MAX_SOURCE_CHARS or not pretrained.isprintable():
        return None
    try:
        kind = source_kind(pretrained)
    except OSError:  # a name the file system cannot look up (one part longer than it allows): no Hub id either
        return None
    if kind == "hub":
        base = re.sub(r"^hf[-_]hub:", "", pretrained, flags=re.IGNORECASE).split("@", 1)[0]
        return base if is_hub_id(base) else None
    try:
        cfg = get_pretrained_cfg(pretrained) if kind == "name" else None
    except RuntimeError:  # a tag timm does not have
        return None
    return cfg.hf_hub_id if cfg is not None and is_hub_id(cfg.hf_hub_id) else None


def is_hub_id(text: object) -> bool:
    """Whether `text` is a Hub repo id as the Hub spells them: `name` or `org/name`, ASCII letters, digits, `-`, `_`
    and `.`, at most 96 characters each (huggingface_hub's own check); never a path, never two lines."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(text, str) or not text or not text.isascii():
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


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
            _fsync(tmp / name, os.O_RDONLY)
        old = folder.parent / f".{folder.name}.{secrets.token_hex(8)}.old"
        if folder.exists():  # a folder cannot be replaced by a rename: the old one steps aside first
            os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be fsynced
        _fsync(folder.parent, os.O_RDONLY)
    return folder


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
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
        return "vit" in json.loads(config.read_bytes()[:MAX_CONFIG_BYTES])
    except (OSError, ValueError, TypeError):
        return False


def remove(folder: str | os.PathLike) -> None:
    """Delete the model folder beside a checkpoint Lightning no longer keeps; anything else is left alone."""
    folder = Path(folder)
    if is_artifact(folder):
        shutil.rmtree(folder)


def read(folder: str | os.PathLike) -> Artifact:
    """The model in a folder `write` (or `vit.export`) wrote, built from this project's classes only; `ArtifactError`
    naming the file and value that cannot be used."""
    from vit.models.weights import PretrainedError

    folder = Path(folder)
    config = read_config(folder)
    own = config.get("vit")
    try:
        if own is not None:
            model, inputs, names = _build(own, folder)
        else:
            model, inputs, names = _build_timm_export(config, folder)
    except (CheckpointError, PretrainedError) as err:
        raise ArtifactError(f"model folder {folder}: {err}") from None
    training = own.get("training") if isinstance(own, dict) else None
    data = own.get("data") if isinstance(own, dict) else None
    return Artifact(model.eval(), inputs, names, str(folder), data if isinstance(data, dict) else None,
                    training if isinstance(training, dict) else {}, config)


def read_config(folder: Path) -> dict:
    """config.json of `folder` as a dict: a regular file of at most `MAX_CONFIG_BYTES`, strict JSON (no NaN)."""
    from vit.models.weights import open_regular_file

    if not folder.is_dir():
        what = "does not exist" if not os.path.lexists(folder) else "is not a folder"
        raise ArtifactError(f"model folder {folder} {what}")
    path = folder / CONFIG
    if not os.path.lexists(path):
        raise ArtifactError(f"model folder {folder} has no {CONFIG}: it is not a model folder (a run writes one "
                            "beside each checkpoint, vit.export writes one)")
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


def _build(own: Any, folder: Path) -> tuple[nn.Module, dict, list[str]]:
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
    return model, inputs, names


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


# timm's `VisionTransformer` arguments that `vit.export` writes, as this project's `VisionTransformer` spells them.
_FROM_TIMM = {"img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
              "qk_norm", "fc_norm", "reg_tokens", "no_embed_class"}


def _build_timm_export(config: dict, folder: Path) -> tuple[nn.Module, dict, list[str]]:
    """A folder without a "vit" section: a plain timm ViT as `vit.export` of an earlier version wrote it (its
    `model_args`), rebuilt as this project's `VisionTransformer`; its input from `pretrained_cfg`."""
    from vit.training.checkpoint.schema import check_inputs, check_names
    from vit.training.checkpoint.values import not_allowed

    args = config.get("model_args")
    if not isinstance(args, dict) or config.get("architecture") is None:
        raise CheckpointError("config.json has neither this project's 'vit' section nor timm's 'architecture' and "
                              "'model_args': open a timm model with timm.create_model")
    unknown = sorted(set(args) - _FROM_TIMM - {"global_pool", "class_token", "pos_embed", "dynamic_img_size",
                                                "num_classes"})
    if unknown:
        raise CheckpointError(f"config.json's model_args has {unknown[0]!r}, which this project's VisionTransformer "
                              "does not have")
    pool = {value: key for key, value in _TIMM_POOL.items()}.get(args.get("global_pool", "token"))
    if pool is None or args.get("class_token", True) != (pool == "cls") or args.get("dynamic_img_size", False):
        raise not_allowed("model_args", {k: args.get(k) for k in ("global_pool", "class_token", "dynamic_img_size")},
                          "global_pool token (with class_token), avg or map, and no dynamic_img_size", 200)
    position = {"learn": "learned", "none": "none"}.get(args.get("pos_embed", "learn"))
    if position is None:
        raise not_allowed("model_args.pos_embed", args.get("pos_embed"), "learn or none")
    num_classes = config.get("num_classes", args.get("num_classes"))
    kwargs = {key: args[key] for key in _FROM_TIMM if key in args}
    kwargs.update(pool=pool, pos_embed=position, num_classes=num_classes)
    cfg = config.get("pretrained_cfg")
    if not isinstance(cfg, dict):
        raise not_allowed("pretrained_cfg", cfg, "a mapping")
    size = cfg.get("input_size")
    if not (isinstance(size, list) and len(size) == 3):
        raise not_allowed("pretrained_cfg.input_size", size, "[channels, height, width]")
    if cfg.get("crop_pct", 1.0) != 1.0 or cfg.get("crop_mode", "squash") != "squash":
        raise CheckpointError(f"pretrained_cfg crops (crop_pct={cfg.get('crop_pct')}, crop_mode="
                              f"{cfg.get('crop_mode')!r}): this project resizes the whole image; open it with timm")
    plain = [0.0] * size[0], [1.0] * size[0]
    raw = cfg.get("mean") == plain[0] and cfg.get("std") == plain[1]
    inputs = check_inputs({"img_size": size[1:], "in_chans": size[0], "mean": None if raw else cfg.get("mean"),
                           "std": None if raw else cfg.get("std"), "interpolation": cfg.get("interpolation")},
                          {"img_size": kwargs.get("img_size", size[1:]), "in_chans": kwargs.get("in_chans", size[0])})
    from vit.training.checkpoint.schema import check_backbone

    cls, kwargs = check_backbone({"class_path": "vit.models.VisionTransformer", "init_args": kwargs})
    model = _load_weights(cls, kwargs, folder)
    names = config.get("label_names") or [str(i) for i in range(model.num_classes)]
    return model, inputs, check_names(names, model.num_classes)


def locate(source: str | os.PathLike) -> Path | None:
    """The model folder a door was given: the folder itself, the folder beside a `.ckpt` (a link to a checkpoint
    counts as the checkpoint it names), or an `hf-hub:org/name[@revision]` id's files fetched through
    `huggingface_hub` (its cache first; offline, only the cache). None for a checkpoint without a model folder (one
    written before this format) and for URLs: those are read as checkpoints."""
    text = os.fspath(source)
    if text.lower().startswith(("hf-hub:", "hf_hub:")):
        return _hub_folder(text[len("hf-hub:"):])
    if "://" in text:
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    beside = folder_of(path.resolve()) if path.suffix == ".ckpt" else None
    return beside if beside is not None and (beside / CONFIG).is_file() else None


def _hub_folder(repo: str) -> Path:
    """The local folder holding a Hub repo's config.json and model.safetensors (downloaded only where allowed)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id, _, revision = repo.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=[CONFIG, WEIGHTS]))
    except HFValidationError as err:
        raise ArtifactError(f"hf-hub:{repo} is not a Hub id (org/name[@revision]): {str(err).splitlines()[0]}"
                            ) from None
    except LocalEntryNotFoundError:
        raise ArtifactError(f"hf-hub:{repo} is not in the local Hugging Face cache and the Hub cannot be reached "
                            "(offline, or HF_HUB_OFFLINE=1): download it where the network allows "
                            f"(`hf download {repo_id}`), or give its folder") from None
    except OSError as err:  # the Hub's own errors (no such repo, gated, HTTP) are OSErrors
        raise ArtifactError(f"hf-hub:{repo} cannot be fetched: {str(err).splitlines()[0][:300]}") from None


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
    return Artifact(trained_backbone(checkpoint), checkpoint.inputs, list(checkpoint.class_names), checkpoint.source,
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
