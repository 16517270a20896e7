"""What a model folder's `config.json` says: timm's keys for a model timm can compute (`timm_args`), this project's
under `"vit"` (`describe`), the run's own record for a model card (`training_record`); and `from_checkpoint`, the
folder's contents for a checkpoint a run is about to save."""

from __future__ import annotations

import re
from collections.abc import Mapping
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
              pos_embed="learn", init_values=None)
# timm's one registered ViT whose name states no size: every argument it sets is in `model_args`.
GENERIC_ARCHITECTURE = "test_vit"
_TIMM_POOL = {"cls": "token", "mean": "avg", "map": "map"}
# The longest `pretrained` looked at for a base model: `hf-hub:`, an `org/name` of 96 + 1 + 96 characters, `@revision`.
MAX_SOURCE_CHARS = 256


class ArtifactError(CheckpointError):
    """A model folder that cannot be opened, or a model that timm cannot compute; one line naming the value."""


def timm_args(model: nn.Module) -> dict:
    """The arguments of the timm model that computes what `model` computes (its `VisionTransformer`, or its `Eva`
    for rotary positions); `ArtifactError` naming the option when none does."""
    from timm.layers import LayerScale
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
    if model.rope is not None:
        return _eva_args(model)
    scaled = isinstance(model.blocks[0].ls1, LayerScale)
    if model.pos_embed_type == "relative":
        return _relpos_args(model, scaled)
    return dict(init_values=1.0 if scaled else None,  # only whether there is a scale: its values are the weights'
                img_size=list(embed.img_size), patch_size=embed.patch_size, in_chans=embed.in_chans,
                num_classes=model.num_classes, embed_dim=model.embed_dim, depth=len(model.blocks),
                num_heads=attn.num_heads, mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim,
                qkv_bias=attn.qkv.bias is not None, qk_norm=not isinstance(attn.q_norm, nn.Identity),
                class_token=model.cls_token is not None, global_pool=_TIMM_POOL[model.pool],
                fc_norm=model.use_fc_norm, reg_tokens=model.num_reg_tokens, no_embed_class=model.no_embed_class,
                pos_embed="none" if model.pos_embed is None else "learn", dynamic_img_size=False)


# timm's registered RoPE ViTs (its `Eva` class) by rotary variant: `model_args` set every size.
_EVA_ROPE = {"axial": ("vit_small_patch16_rope_224", "cat"), "mixed": ("vit_small_patch16_rope_mixed_224", "mixed")}


def _eva_args(model: nn.Module) -> dict:
    """timm's `Eva` arguments of a rotary-position ViT: no position table, RoPE in every block's attention."""
    from torch import nn

    attn = model.blocks[0].attn
    if model.pool == "map":
        raise ArtifactError("pool='map' with rotary positions cannot be exported: timm's Eva pools by token or avg")
    return dict(img_size=list(model.patch_embed.img_size), patch_size=model.patch_embed.patch_size,
                in_chans=model.patch_embed.in_chans, num_classes=model.num_classes, embed_dim=model.embed_dim,
                depth=len(model.blocks), num_heads=attn.num_heads,
                mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim, qkv_bias=attn.qkv.bias is not None,
                qk_norm=not isinstance(attn.q_norm, nn.Identity), class_token=model.cls_token is not None,
                global_pool=_TIMM_POOL[model.pool], use_fc_norm=model.use_fc_norm,
                num_reg_tokens=model.num_reg_tokens,
                init_values=None if model.blocks[0].gamma_1 is None else 1.0,  # the values are the weights'
                attn_type="rope", use_abs_pos_emb=False, use_rot_pos_emb=True,
                rope_type=_EVA_ROPE[model.rope.kind][1], rope_temperature=model.rope.temperature,
                rope_grid_indexing="xy", dynamic_img_size=False)


_RELPOS = "vit_relpos_medium_patch16_cls_224"  # timm's relative-position ViT; `model_args` set every size


def _relpos_args(model: nn.Module, scaled: bool) -> dict:
    """timm's `VisionTransformerRelPos` arguments (its `RelPosBias` table) of a relative-position ViT."""
    from torch import nn

    attn = model.blocks[0].attn
    if not scaled:
        raise ArtifactError("pos_embed='relative' without init_values cannot be exported: timm's relative-position "
                            "ViT always has layer scale (ls1.gamma); train with init_values")
    if model.pool == "map":
        raise ArtifactError("pool='map' with relative positions cannot be exported: timm's relative-position ViT "
                            "pools by token or avg")
    return dict(img_size=list(model.patch_embed.img_size), patch_size=model.patch_embed.patch_size,
                in_chans=model.patch_embed.in_chans, num_classes=model.num_classes, embed_dim=model.embed_dim,
                depth=len(model.blocks), num_heads=attn.num_heads,
                mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim, qkv_bias=attn.qkv.bias is not None,
                qk_norm=not isinstance(attn.q_norm, nn.Identity), class_token=model.cls_token is not None,
                global_pool=_TIMM_POOL[model.pool], fc_norm=model.use_fc_norm, init_values=1.0,
                rel_pos_type="bias")


def architecture(args: dict) -> str:
    """timm's name of a plain ViT of these sizes, at the model's image size or 224, else `GENERIC_ARCHITECTURE`; for
    rotary positions its RoPE ViT of that variant (the sizes are `model_args`')."""
    import timm

    if args.get("use_rot_pos_emb"):
        return next(name for name, kind in _EVA_ROPE.values() if kind == args["rope_type"])
    if args.get("rel_pos_type"):
        return _RELPOS
    family = _FAMILIES.get((args["embed_dim"], args["depth"], args["num_heads"]))
    if family is None or any(args[key] != value for key, value in _PLAIN.items()):
        return GENERIC_ARCHITECTURE
    height, width = args["img_size"]
    sizes = ([height] if height == width else []) + [224, 384]
    names = [f"vit_{family}_patch{args['patch_size']}_{size}" for size in sizes]
    return next((name for name in names if timm.is_model(name)), GENERIC_ARCHITECTURE)


def data_config(inputs: Mapping) -> dict:
    """timm's data config of `inputs`: the image squashed to the model's size, or with a `crop_pct` resized and
    centre-cropped (timm's `crop_mode="center"`), then normalised (raw pixels: mean 0, std 1), as
    `vit.data.images.build_transform` does."""
    channels = inputs["in_chans"]
    mean, std = (inputs["mean"], inputs["std"]) if inputs["mean"] is not None else ([0.0] * channels, [1.0] * channels)
    return dict(input_size=[channels, *inputs["img_size"]], mean=list(mean), std=list(std),
                interpolation=inputs["interpolation"], crop_pct=inputs.get("crop_pct", 1.0),
                crop_mode=inputs.get("crop_mode", "squash"))


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
