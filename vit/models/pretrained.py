"""Pretrained weights for `VisionTransformer`: from a timm model name, a hub id or a local file, adapted to the config.

The architecture comes from the config; the weights are fitted to it with timm's own utilities,
as `timm.create_model(..., pretrained=True)` does for a new image size:

- the learned position table is resampled to this config's patch grid (bicubic, antialiased), the
  CLS token's position kept apart (`timm.layers.resample_abs_pos_embed`);
- the patch-embedding kernel is resampled to another patch size (`resample_patch_embed`, FlexiViT);
- `in_chans` other than 3: the first convolution is adapted (`timm.models.adapt_input_conv`);
- a classifier head whose `num_classes` differs is dropped and stays freshly initialised;
- fixed sin/cos encodings are not weights: they are regenerated for the grid. A pretrained
  *learned* table cannot become a fixed encoding, so loading one into a `sincos*` config is an error.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.models import adapt_input_conv
from torch import nn

log = logging.getLogger(__name__)

# Keys of timm's ViT that this model does not have, and what they are.
_TIMM_ONLY = ("fc_norm.", "head_drop.", "norm_pre.")


class PretrainedError(ValueError):
    """Pretrained weights that cannot be had or do not fit the config."""


def load_state_dict(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict named by `source`: a local file (`.safetensors`, `.pth`, `.bin`, a checkpoint dict),
    or else a timm model name or hub id (`vit_small_patch16_224.augreg_in21k`, `hf-hub:timm/...`), downloaded
    by timm into its cache where the network allows."""
    path = Path(source)
    if path.is_file():
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
        for key in ("state_dict", "model", "state_dict_ema"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
                break
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise PretrainedError(f"pretrained={str(source)!r} does not hold a state dict (a mapping of names to tensors)")
        return {k.removeprefix("module.").removeprefix("backbone."): v for k, v in state.items()}
    if path.suffix in (".safetensors", ".pth", ".bin", ".pt", ".ckpt") or os.sep in str(source):
        raise PretrainedError(f"pretrained={str(source)!r}: there is no such file")
    import timm

    try:
        return timm.create_model(str(source), pretrained=True).state_dict()
    except RuntimeError as err:
        if "Unknown model" in str(err):
            raise PretrainedError(f"pretrained={str(source)!r} is neither a file nor a timm model name "
                                  "(see timm.list_models(pretrained=True))") from None
        raise _download_error(source, err) from None
    except Exception as err:  # noqa: BLE001  (huggingface_hub and urllib raise many kinds when offline)
        raise _download_error(source, err) from None


def _download_error(source, err: Exception) -> PretrainedError:
    return PretrainedError(
        f"the weights of {source!r} could not be downloaded ({type(err).__name__}: {str(err).splitlines()[0][:200]}). "
        "Without network, download them elsewhere and pass the file: pretrained=/path/to/model.safetensors "
        "(e.g. `huggingface-cli download timm/<name> model.safetensors` on a machine with network access)"
    )


def adapt_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`state` fitted to `model`'s config; returns it and the keys left to their fresh initialisation (the head)."""
    state = {k: v for k, v in state.items() if not k.startswith(_TIMM_ONLY)}
    ours = model.state_dict()
    fresh = []
    if "patch_embed.proj.weight" in state:
        weight = state["patch_embed.proj.weight"]  # (D, C, P, P)
        target = ours["patch_embed.proj.weight"]
        if weight.shape[1] != target.shape[1]:
            weight = adapt_input_conv(target.shape[1], weight)
        if weight.shape[-2:] != target.shape[-2:]:
            weight = resample_patch_embed(weight, list(target.shape[-2:]))
        state["patch_embed.proj.weight"] = weight
    if "pos_embed" in state:
        if model.pos_embed_type != "learned":
            raise PretrainedError(
                f"the pretrained weights have a learned position table, and this config has pos_embed="
                f"{model.pos_embed_type!r}: a learned table cannot become a fixed encoding. Use pos_embed='learned' "
                "to fine-tune these weights"
            )
        table = state["pos_embed"]  # (1, prefix + gh * gw, D)
        prefix = model.num_prefix_tokens
        old_patches = table.shape[1] - prefix
        if table.shape != ours["pos_embed"].shape:
            side = math.isqrt(old_patches)
            if side * side != old_patches:
                raise PretrainedError(f"the pretrained position table has {table.shape[1]} tokens, which is not "
                                      f"{prefix} prefix token(s) plus a square grid")
            state["pos_embed"] = resample_abs_pos_embed(table, new_size=list(model.patch_embed.grid_size),
                                                        old_size=[side, side], num_prefix_tokens=prefix)
    for key in ("head.weight", "head.bias"):
        if key in state and key in ours and state[key].shape != ours[key].shape:
            del state[key]
            fresh.append(key)
    return state, fresh


def load_pretrained(model: nn.Module, source: str | os.PathLike) -> None:
    """Load the weights named by `source` into `model`, adapted to its config (see the module docstring)."""
    state, fresh = adapt_state_dict(load_state_dict(source), model)
    ours = model.state_dict()
    missing = sorted(set(ours) - set(state) - set(fresh))
    unexpected = sorted(set(state) - set(ours))
    reshaped = sorted(k for k in set(ours) & set(state) if ours[k].shape != state[k].shape)
    if missing or unexpected or reshaped:
        details = [f"{k}: {tuple(state[k].shape)} in the weights, {tuple(ours[k].shape)} here" for k in reshaped[:4]]
        details += [f"{k} missing from the weights" for k in missing[:4]]
        details += [f"{k} not in this model" for k in unexpected[:4]]
        raise PretrainedError(f"pretrained={str(source)!r} does not fit this config "
                              f"({len(missing) + len(unexpected) + len(reshaped)} tensors differ): " + "; ".join(details))
    model.load_state_dict(state, strict=not fresh)
    if fresh:
        log.warning("pretrained=%s: the classifier head has another number of classes; %s re-initialised",
                    source, " and ".join(fresh))
