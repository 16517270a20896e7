"""This project's `VisionTransformer` and timm's models that compute the same function: `timm_args` (ours -> the
timm model and arguments that compute it, for config.json) and `from_timm` (a timm ViT -> our arguments). Parameter
names are timm's (`tests/test_timm_equivalence.py`), so the weights move as they are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vit.checks import CheckpointError

if TYPE_CHECKING:
    import torch
    from torch import nn


class NotInTimm(ValueError):
    """A model of this project that no timm model computes; the message names the option."""


# timm's plain ViTs (`vit_{family}_patch{P}_{S}`) by width, depth and heads.
_FAMILIES = {
    (192, 12, 3): "tiny",
    (384, 12, 6): "small",
    (768, 12, 12): "base",
    (1024, 24, 16): "large",
    (1280, 32, 16): "huge",
}
# What a plain timm ViT has besides its sizes: a model that differs here is not the one the name describes.
_PLAIN = dict(
    mlp_ratio=4.0,
    qkv_bias=True,
    qk_norm=False,
    class_token=True,
    reg_tokens=0,
    no_embed_class=False,
    pos_embed="learn",
    init_values=None,
)
# timm's one registered ViT whose name states no size: every argument it sets is in `model_args`.
GENERIC_ARCHITECTURE = "test_vit"
_TIMM_POOL = {"cls": "token", "mean": "avg", "map": "map"}


def _sizes(model: nn.Module) -> dict:
    """What every timm ViT class takes of this model alike: sizes, biases, QK-norm, the CLS token, the pooling."""
    from torch import nn

    embed, attn = model.patch_embed, model.blocks[0].attn
    return dict(
        img_size=list(embed.img_size),
        patch_size=embed.patch_size,
        in_chans=embed.in_chans,
        num_classes=model.num_classes,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=attn.num_heads,
        mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim,
        qkv_bias=attn.qkv.bias is not None,
        qk_norm=not isinstance(attn.q_norm, nn.Identity),
        class_token=model.cls_token is not None,
        global_pool=_TIMM_POOL[model.pool],
    )


def timm_args(model: nn.Module) -> dict:
    """The arguments of the timm model that computes what `model` computes (its `VisionTransformer`, or its `Eva`
    for rotary positions); `NotInTimm` naming the option when none does."""
    from timm.layers import LayerScale

    from vit.models import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise NotInTimm(f"the backbone is a {type(model).__name__}; only a VisionTransformer exports to timm")
    embed, attn = model.patch_embed, model.blocks[0].attn
    kernel = embed.proj.kernel_size[0]
    if kernel != embed.patch_size:
        raise NotInTimm(
            f"patch_kernel={kernel} cannot be exported: timm's patch embedding has a kernel equal "
            f"to the patch size ({embed.patch_size})"
        )
    if attn.attn_score != "scaled_dot":
        raise NotInTimm(f"attn_score={attn.attn_score!r} cannot be exported: timm's attention is 'scaled_dot' only")
    if model.rope is not None:
        return _eva_args(model)
    scaled = isinstance(model.blocks[0].ls1, LayerScale)
    if model.pos_embed_type == "relative":
        return _relpos_args(model, scaled)
    return dict(
        **_sizes(model),
        init_values=1.0 if scaled else None,  # only whether there is a scale: its values are the weights'
        fc_norm=model.use_fc_norm,
        reg_tokens=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
        pos_embed="none" if model.pos_embed is None else "learn",
        dynamic_img_size=False,
    )


# timm's registered RoPE ViTs (its `Eva` class) by rotary variant: `model_args` set every size.
_EVA_ROPE = {"axial": ("vit_small_patch16_rope_224", "cat"), "mixed": ("vit_small_patch16_rope_mixed_224", "mixed")}


def _eva_args(model: nn.Module) -> dict:
    """timm's `Eva` arguments of a rotary-position ViT: no position table, RoPE in every block's attention."""
    if model.pool == "map":
        raise NotInTimm("pool='map' with rotary positions cannot be exported: timm's Eva pools by token or avg")
    return dict(
        **_sizes(model),
        use_fc_norm=model.use_fc_norm,
        num_reg_tokens=model.num_reg_tokens,
        init_values=None if model.blocks[0].gamma_1 is None else 1.0,  # the values are the weights'
        attn_type="rope",
        use_abs_pos_emb=False,
        use_rot_pos_emb=True,
        rope_type=_EVA_ROPE[model.rope.kind][1],
        rope_temperature=model.rope.temperature,
        rope_grid_indexing="xy",
        dynamic_img_size=False,
    )


_RELPOS = "vit_relpos_medium_patch16_cls_224"  # timm's relative-position ViT; `model_args` set every size


def _relpos_args(model: nn.Module, scaled: bool) -> dict:
    """timm's `VisionTransformerRelPos` arguments (its `RelPosBias` table) of a relative-position ViT."""
    if not scaled:
        raise NotInTimm(
            "pos_embed='relative' without init_values cannot be exported: timm's relative-position "
            "ViT always has layer scale (ls1.gamma); train with init_values"
        )
    if model.pool == "map":
        raise NotInTimm(
            "pool='map' with relative positions cannot be exported: timm's relative-position ViT pools by token or avg"
        )
    return dict(
        **_sizes(model),
        fc_norm=model.use_fc_norm,
        init_values=1.0,
        rel_pos_type="bias",
    )


def data_config(inputs: Mapping) -> dict:
    """timm's data config of `inputs`: the image squashed to the model's size, or with a `crop_pct` resized and
    centre-cropped (timm's `crop_mode="center"`), then normalised (raw pixels: mean 0, std 1), as
    `vit.data.images.build_transform` does."""
    channels = inputs["in_chans"]
    mean, std = (inputs["mean"], inputs["std"]) if inputs["mean"] is not None else ([0.0] * channels, [1.0] * channels)
    return dict(
        input_size=[channels, *inputs["img_size"]],
        mean=list(mean),
        std=list(std),
        interpolation=inputs["interpolation"],
        crop_pct=inputs.get("crop_pct", 1.0),
        crop_mode=inputs.get("crop_mode", "squash"),
    )


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


# The timm `VisionTransformer` arguments a config.json's `model_args` may set: sizes and switches, never a callable, a
# file (`checkpoint_path`) or a download (`pretrained_cfg_overlay`), which `timm.create_model` would also take.
TIMM_MODEL_ARGS = {
    "img_size",
    "patch_size",
    "in_chans",
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "qkv_bias",
    "qk_norm",
    "init_values",
    "class_token",
    "global_pool",
    "fc_norm",
    "reg_tokens",
    "no_embed_class",
    "pos_embed",
    "dynamic_img_size",
}


def from_timm(architecture: str, args: dict) -> dict:
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
            raise CheckpointError(
                f"timm cannot build {architecture} with config.json's model_args: "
                f"{str(err).splitlines()[0][:200] if str(err) else type(err).__name__}"
            ) from None
    if type(model) is not TimmVisionTransformer:
        raise CheckpointError(
            f"config.json's architecture {architecture} is a timm {type(model).__name__}; this "
            "project opens timm's VisionTransformer from its folder (its RoPE and relative-position "
            "ViTs through this project's own model folders)"
        )
    pool = {value: key for key, value in _TIMM_POOL.items()}.get(model.global_pool)
    if pool is None or (pool == "cls") != (model.cls_token is not None) or model.dynamic_img_size:
        raise CheckpointError(
            f"{architecture}: global_pool={model.global_pool!r} with class_token="
            f"{model.cls_token is not None} and dynamic_img_size={model.dynamic_img_size} is not "
            "this project's: global_pool token (with a CLS token), avg or map, a fixed image size"
        )
    attn = model.blocks[0].attn
    return dict(
        img_size=list(model.patch_embed.img_size),
        patch_size=model.patch_embed.patch_size[0],
        in_chans=model.patch_embed.proj.in_channels,
        num_classes=model.num_classes,
        embed_dim=model.embed_dim,
        depth=len(model.blocks),
        num_heads=attn.num_heads,
        mlp_ratio=model.blocks[0].mlp.fc1.out_features / model.embed_dim,
        qkv_bias=attn.qkv.bias is not None,
        qk_norm=not isinstance(attn.q_norm, nn.Identity),
        pool=pool,
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        reg_tokens=model.num_reg_tokens,
        no_embed_class=model.no_embed_class,
        pos_embed="learned" if model.pos_embed is not None else "none",
        init_values=1.0 if isinstance(model.blocks[0].ls1, LayerScale) else None,
    )  # the values: the weights'


def imagenet_names(cfg: dict, num_classes: int) -> list[str]:
    """timm's ImageNet class descriptions for a model of ImageNet's classes (the one repeated, "crane", with its
    WordNet id), else `"0"`, `"1"`, ..."""
    from timm.data import ImageNetInfo, infer_imagenet_subset

    subset = infer_imagenet_subset({**cfg, "num_classes": num_classes})
    if subset is None:
        return [str(i) for i in range(num_classes)]
    info = ImageNetInfo(subset)
    names, ids = info.label_descriptions(), info.label_names()
    return [f"{name} ({wnid})" if names.count(name) > 1 else name for name, wnid in zip(names, ids)]


def own_section(config: dict) -> dict:
    """The "vit" section of a timm model folder's config.json (a timm Hub repo, or `vit.export` of an earlier
    version), from `architecture` and `model_args` (`from_timm`), `pretrained_cfg` (timm's defaults where it is
    silent) and `label_names` (else ImageNet's, for a model of ImageNet's classes); checked by the reader as any."""
    architecture, args, cfg = config.get("architecture"), config.get("model_args") or {}, config.get("pretrained_cfg")
    if not isinstance(architecture, str) or not isinstance(args, dict) or not isinstance(cfg, dict):
        raise CheckpointError(
            "config.json has neither this project's 'vit' section nor timm's 'architecture', 'model_args' and "
            "'pretrained_cfg': it is not a model folder of this project or timm"
        )
    unknown = sorted(set(args) - TIMM_MODEL_ARGS - {"num_classes"})
    if unknown:
        raise CheckpointError(f"config.json's model_args has {unknown[0]!r}, which this project does not pass to timm")
    kwargs = from_timm(architecture, {**args, "num_classes": config.get("num_classes", args.get("num_classes"))})
    size = cfg.get("input_size")
    if not (isinstance(size, list) and len(size) == 3 and isinstance(size[0], int)):
        raise CheckpointError(f"pretrained_cfg.input_size={size!r} is not allowed: expected [channels, height, width]")
    raw = cfg.get("mean") == [0.0] * size[0] and cfg.get("std") == [1.0] * size[0]
    inputs = {
        "img_size": size[1:],
        "in_chans": size[0],
        "mean": None if raw else cfg.get("mean"),
        "std": None if raw else cfg.get("std"),
        "interpolation": cfg.get("interpolation"),
        "crop_pct": cfg.get("crop_pct", 0.875),
        "crop_mode": cfg.get("crop_mode", "center"),
    }
    names = config.get("label_names") or imagenet_names(cfg, kwargs["num_classes"])
    backbone = {"class_path": "vit.models.VisionTransformer", "init_args": kwargs}
    return {"format_version": 1, "backbone": backbone, "inputs": inputs, "class_names": names}


def timm_config(model: nn.Module, inputs: Mapping, names: list[str]) -> dict:
    """timm's (and transformers' `TimmWrapper`'s) keys of a config.json for `model`: `architecture`, `model_args`,
    `pretrained_cfg` and the rest where a timm model computes the same function; else the input and classes only,
    and `timm` saying why (this project then opens the folder alone)."""
    config: dict = {"num_classes": model.num_classes, "label_names": list(names)}
    config["pretrained_cfg"] = {
        **data_config(inputs),
        "num_classes": model.num_classes,
        "fixed_input_size": True,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
    }
    try:
        args = timm_args(model)
    except NotInTimm as err:
        return {**config, "timm": str(err)}
    config["architecture"] = architecture(args)
    config["num_features"] = model.num_features
    config["global_pool"] = args["global_pool"]
    # timm passes num_classes itself (from "num_classes"): a second one in model_args is "multiple values".
    config["model_args"] = {key: value for key, value in args.items() if key != "num_classes"}
    return config


def timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s tensors as timm holds them, detached and contiguous for safetensors: the state dict, and a fixed
    position table too (timm's `pos_embed` is a parameter; this project's sin/cos tables are buffers, which the state
    dict leaves out). A backbone other than this ViT: its state dict."""
    from vit.models import VisionTransformer

    state = dict(model.state_dict())
    if isinstance(model, VisionTransformer) and model.pos_embed is not None and "pos_embed" not in state:
        state["pos_embed"] = model.pos_embed
    return {key: value.detach().contiguous().clone() for key, value in state.items()}
