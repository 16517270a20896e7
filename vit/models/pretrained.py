"""The builder of a pretrained `VisionTransformer`: `create_vit(source, ...)`, and `load_pretrained(model, source)`.
The weights (`vit.models.weights`) are fitted to the config with timm's utilities, as `timm.create_model(...,
pretrained=True)` does: position table, patch kernel and first convolution resampled or adapted; a head with another
`num_classes` stays fresh. The size left unset is read from the source (`resolve_shape`)."""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.models import adapt_input_conv
from torch import nn

from vit.checks import check_arguments, check_int
from vit.models.fit import check_kinds, check_names_and_shapes, in_model_dtypes
from vit.models.vision_transformer import BOUNDS, DEFAULT_SHAPE, VisionTransformer
from vit.models.weights import (
    UNKNOWN_NAME,
    PretrainedError,
    load_state_dict,
    read_json,
    source_kind,
    weight_shapes,
)

log = logging.getLogger(__name__)

# Keys of timm's ViT that this model does not have (`norm_pre` is an Identity without keys in the ViTs we load).
_TIMM_ONLY = ("head_drop.", "norm_pre.")
_BLOCK_KEY = re.compile(r"blocks\.([0-9]+)\.")
_HEAD_KEYS = ("head.weight", "head.bias")  # of another shape: another num_classes, left fresh
# The dimensions `adapt_state_dict` may change: the patch kernel's channels and size (D, C, P, P), the position
# table's token count (1, N, D). Every other dimension of every tensor must be the model's already.
_ADAPTED_DIMS = {"patch_embed.proj.weight": (1, 2, 3), "pos_embed": (1,)}


def resolve_shape(
    pretrained: str | os.PathLike | None, *, embed_dim: int | None, depth: int | None, num_heads: int | None
) -> dict[str, int]:
    """`embed_dim`, `depth` and `num_heads`: each as given, else the pretrained source's, else `DEFAULT_SHAPE`'s."""
    given = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads}
    missing = [name for name, value in given.items() if value is None]
    if not missing:
        return given
    found = pretrained_shape(pretrained, tuple(missing)) if pretrained else DEFAULT_SHAPE
    return {name: found[name] if value is None else value for name, value in given.items()}


def pretrained_shape(source: str | os.PathLike, wanted: tuple[str, ...] = tuple(DEFAULT_SHAPE)) -> dict[str, int]:
    """The `embed_dim`, `depth` and `num_heads` of the ViT that `source` holds, without downloading its weights: timm's
    architecture for a timm name, else the tensors' shapes and `num_heads` from a `config.json` beside the file.
    The sizes are within `BOUNDS`, and the file holds every block's attention weights of that width: a model built
    from them takes memory in proportion to the file's own bytes."""
    kind, text = source_kind(source), str(source)
    if kind == "hub" and text.split(":", 1)[-1].startswith("timm/"):  # timm's own repos are named after the model
        kind, text = "name", text.split(":", 1)[-1].removeprefix("timm/").split("@", 1)[0]
    if kind == "name":
        return _timm_shape(text)
    shapes = {key: tuple(tensor.shape) for key, tensor in weight_shapes(source).items()}  # a header's: no data read
    blocks = [int(match[1]) for key in shapes if (match := _BLOCK_KEY.match(key))]
    patch = shapes.get("patch_embed.proj.weight", ())
    if len(patch) != 4 or not blocks:
        raise PretrainedError(
            f"pretrained={text!r} holds no ViT weights (no patch_embed.proj.weight and blocks.N.*): "
            f"set {', '.join(wanted)} by hand"
        )
    found = {"embed_dim": patch[0], "depth": 1 + max(blocks)}
    heads = _config_heads(text)
    if heads is not None:
        found["num_heads"] = heads
    try:
        check_arguments(VisionTransformer, found, BOUNDS)
        if heads is not None:
            check_int("num_heads", heads, 1, found["embed_dim"])
    except ValueError as err:
        raise PretrainedError(f"pretrained={text!r}: the size its weights give is not allowed: {err}") from None
    width = found["embed_dim"]
    for i in range(found["depth"]):  # the fused query-key-value projection of every block, (3 * D, D)
        key = f"blocks.{i}.attn.qkv.weight"
        if shapes.get(key) != (3 * width, width):
            held = f"has shape {shapes[key]}" if key in shapes else "is missing"
            raise PretrainedError(
                f"pretrained={text!r}: {key} {held}, and the width embed_dim={width} of "
                f"patch_embed.proj.weight needs ({3 * width}, {width}): its shapes are not those of "
                f"one ViT of depth {found['depth']}"
            )
    if heads is None and "num_heads" in wanted:
        raise PretrainedError(
            f"pretrained={text!r}: the number of attention heads is not in the weights' shapes "
            f"(embed_dim={found['embed_dim']}, depth={found['depth']} are): set num_heads "
            "(--model.backbone.init_args.num_heads; timm's ViTs have embed_dim / 64)"
        )
    return found


def _config_heads(source: str) -> object:
    """`num_heads` from the `config.json` beside the weights (or in their folder): its `model_args`, else the timm
    `architecture` it names (a timm Hub repo's config.json names only that); None without one."""
    path = Path(source).expanduser()
    path = (path if path.is_dir() else path.parent) / "config.json"
    if not path.exists():
        return None
    config = read_json(path, f"pretrained={source!r}: {path}")
    args = config.get("model_args") if isinstance(config, dict) else None
    if isinstance(args, dict) and "num_heads" in args:
        return args["num_heads"]
    architecture = config.get("architecture") if isinstance(config, dict) else None
    if not isinstance(architecture, str):
        return None
    try:
        return _timm_shape(architecture)["num_heads"]
    except (PretrainedError, RuntimeError, ValueError, TypeError):  # no timm ViT this version knows: ask for num_heads
        return None


def _timm_shape(name: str) -> dict[str, int]:
    import timm

    try:
        with torch.device("meta"):  # no memory, no download: only the architecture is wanted
            model = timm.create_model(name, pretrained=False)
    except RuntimeError as err:
        if not str(err).startswith(("Unknown model", "Invalid pretrained tag")):
            raise
        raise PretrainedError(UNKNOWN_NAME.format(name)) from None
    # timm's ViT class (its DeiT and other variants subclass it): the layout `adapt_state_dict` maps onto this one.
    if not isinstance(model, timm.models.vision_transformer.VisionTransformer) or not len(model.blocks):
        raise PretrainedError(
            f"pretrained={name!r} is not a ViT of timm's layout ({type(model).__name__}): "
            "set embed_dim, depth and num_heads by hand"
        )
    return {"embed_dim": int(model.embed_dim), "depth": len(model.blocks), "num_heads": model.blocks[0].attn.num_heads}


def check_layout(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state`, unless its final LayerNorm sits on the other side of the pooling (`norm` against `fc_norm`)."""
    if isinstance(model, VisionTransformer):  # the only model here that puts a norm on either side of the pooling
        use_fc_norm = model.use_fc_norm
        has_norm, has_fc_norm = "norm.weight" in state, "fc_norm.weight" in state
        if use_fc_norm and has_norm and not has_fc_norm:
            raise PretrainedError(
                f"these weights normalise the tokens before the pooling (norm.weight, no fc_norm.weight) and this "
                f"model (pool={model.pool!r}) after it (fc_norm): set fc_norm=False to load them as they were trained "
                "(a pool='mean' checkpoint made before fc_norm existed is of this kind)"
            )
        if not use_fc_norm and has_fc_norm and not has_norm:
            raise PretrainedError(
                f"these weights normalise the pooled vector (fc_norm.weight, no norm.weight) and this model "
                f"(pool={model.pool!r}, fc_norm=False) the tokens before the pooling: set fc_norm=True to load them"
            )
    return state


def adapt_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`state` fitted to `model`'s config; returns it and the keys left to their fresh initialisation (the head)."""
    state = check_layout({k: v for k, v in state.items() if not k.startswith(_TIMM_ONLY)}, model)
    ours, fresh = model.state_dict(), []
    if "patch_embed.proj.weight" in state:
        weight = state["patch_embed.proj.weight"]  # (D, C, P, P)
        target = ours["patch_embed.proj.weight"]
        if weight.shape[1] != target.shape[1]:
            try:
                weight = adapt_input_conv(target.shape[1], weight)
            except (NotImplementedError, AssertionError, RuntimeError, ValueError):  # timm's refusals of a layout
                raise PretrainedError(
                    f"the pretrained patch kernel has {weight.shape[1]} input channels, which timm "
                    f"cannot adapt to in_chans={target.shape[1]} (it adapts 3 channels to any "
                    "number)"
                ) from None
        if weight.shape[-2:] != target.shape[-2:]:
            weight = resample_patch_embed(weight, list(target.shape[-2:]))
        state["patch_embed.proj.weight"] = weight
    if "pos_embed" in state:
        if model.pos_embed_type != "learned":
            raise PretrainedError(
                f"the pretrained weights have a learned position table, and this config has "
                f"pos_embed={model.pos_embed_type!r}: a learned table cannot become a fixed "
                "encoding. Use pos_embed='learned' to fine-tune these weights"
            )
        table = state["pos_embed"]  # (1, prefix + gh * gw, D); no prefix positions with no_embed_class
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        old_patches = table.shape[1] - prefix
        if table.shape != ours["pos_embed"].shape:
            side = math.isqrt(max(old_patches, 0))
            if old_patches < 1 or side * side != old_patches:
                raise PretrainedError(
                    f"the pretrained position table has {table.shape[1]} tokens, which is not {prefix} prefix "
                    f"token(s) plus a square grid; {_prefix_hint(table.shape[1], state, model)}"
                )
            state["pos_embed"] = resample_abs_pos_embed(
                table, new_size=list(model.patch_embed.grid_size), old_size=[side, side], num_prefix_tokens=prefix
            )
    for key in ("head.weight", "head.bias"):
        if key in state and key in ours and state[key].shape != ours[key].shape:
            del state[key]
            fresh.append(key)
    return state, fresh


def _prefix_hint(num_positions: int, state: dict[str, torch.Tensor], model: nn.Module) -> str:
    """What in the config decides how many prefix tokens have a position, and what the weights have."""
    cls = 1 if "cls_token" in state else 0
    regs = state["reg_token"].shape[1] if "reg_token" in state and state["reg_token"].ndim == 3 else 0
    placed = "none of them has a position (no_embed_class=True)"
    patches = num_positions - cls - regs
    if patches > 0 and math.isqrt(patches) ** 2 == patches and cls + regs:
        placed = "each has a position (no_embed_class=False)"
    return (
        f"the weights have {cls} CLS token(s) and {regs} register(s) and {placed}; this model has "
        f"num_prefix_tokens={model.num_prefix_tokens}, no_embed_class={model.no_embed_class}"
    )


def create_vit(
    pretrained: str | os.PathLike,
    *,
    embed_dim: int | None = None,
    depth: int | None = None,
    num_heads: int | None = None,
    **kwargs,
) -> nn.Module:
    """timm's `create_model(pretrained=True)` for this ViT: the weights `pretrained` names, unset sizes from them."""
    shape = resolve_shape(pretrained, embed_dim=embed_dim, depth=depth, num_heads=num_heads)
    with torch.device("meta"):  # names, shapes and dtypes without memory: the weights must fit before any is spent
        skeleton = VisionTransformer(**shape, **kwargs)
    state, fresh = fit_state_dict(skeleton, pretrained)
    model = VisionTransformer(**shape, **kwargs)
    _load(model, state, fresh, pretrained)
    return model


def load_pretrained(model: nn.Module, source: str | os.PathLike) -> None:
    """Load the weights named by `source` into `model`, adapted to its config (see the module docstring)."""
    state, fresh = fit_state_dict(model, source)
    _load(model, state, fresh, source)


def fit_state_dict(model: nn.Module, source: str | os.PathLike) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights named by `source` adapted to `model` (which may be on the meta device) in its dtypes, and the keys
    left fresh; `PretrainedError` unless every tensor is of its parameter's kind, fits, and is finite in its dtype."""
    state, ours, shown = load_state_dict(source), model.state_dict(), f"pretrained={str(source)!r}"
    check_kinds(state, ours, shown)
    _check_adaptable(shown, state, ours)  # before resampling, which assumes these dimensions
    state, fresh = adapt_state_dict(state, model)
    check_names_and_shapes(state, ours, shown, fresh=fresh)
    return in_model_dtypes(state, ours, shown), fresh


def _check_adaptable(source: str, state: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> None:
    """Refuse `state` before it is adapted unless the shapes it has in common with `ours` are equal, but the
    dimensions `adapt_state_dict` resamples and the head (which another number of classes leaves fresh)."""
    common = set(ours) & set(state) - set(_HEAD_KEYS)
    reshaped = sorted(k for k in common if not _adaptable(k, state[k].shape, ours[k].shape))
    if reshaped:
        details = [f"{k}: {tuple(state[k].shape)} in the weights, {tuple(ours[k].shape)} here" for k in reshaped[:4]]
        raise PretrainedError(
            f"{source} does not fit this config ({len(reshaped)} tensors differ): " + "; ".join(details)
        )


def _adaptable(key: str, theirs: torch.Size, ours: torch.Size) -> bool:
    """Whether `adapt_state_dict` can make the tensor `key` of shape `theirs` one of shape `ours`."""
    free = _ADAPTED_DIMS.get(key)
    if free is None:
        return theirs == ours
    return (
        len(theirs) == len(ours)
        and 0 not in theirs
        and all(a == b for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if i not in free)
    )


def _load(model: nn.Module, state: dict[str, torch.Tensor], fresh: list[str], source: str | os.PathLike) -> None:
    model.load_state_dict(state, strict=not fresh)
    if fresh:
        log.warning(
            "pretrained=%s: the classifier head has another number of classes; %s re-initialised",
            source,
            " and ".join(fresh),
        )
