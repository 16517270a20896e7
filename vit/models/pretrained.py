"""Pretrained weights for `VisionTransformer`: from a timm model name, a hub id or a local file, adapted to the config.

The architecture comes from the config; the weights are fitted to it with timm's own utilities,
as `timm.create_model(..., pretrained=True)` does for a new image size:

- the learned position table is resampled to this config's patch grid (bicubic, antialiased), the
  CLS token's position kept apart (`timm.layers.resample_abs_pos_embed`);
- the patch-embedding kernel is resampled to another patch size (`resample_patch_embed`, FlexiViT);
- `in_chans` other than 3: the first convolution is adapted (`timm.models.adapt_input_conv`);
- a classifier head whose `num_classes` differs is dropped and stays freshly initialised;
- fixed sin/cos encodings are not weights: they are regenerated for the grid. A pretrained
  *learned* table cannot become a fixed encoding, so loading one into a `sincos*` config is an error;
- `embed_dim`, `depth` and `num_heads` left unset are read from the source (`resolve_shape`): a timm
  name's architecture (built on the meta device, nothing downloaded), or a file's tensor shapes;
- the layout is checked first (`check_layout`): this project's MAP heads from before they took
  timm's names are renamed (exactly), and weights whose final LayerNorm sits on the other side of
  the pooling (`norm` against `fc_norm`) are refused with the option that fits them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Literal

import torch
from timm.layers import resample_abs_pos_embed, resample_patch_embed
from timm.models import adapt_input_conv
from torch import nn

from vit.models.vision_transformer import DEFAULT_SHAPE, VisionTransformer

log = logging.getLogger(__name__)

# Keys of timm's ViT that this model does not have (`norm_pre` is an Identity without keys in the ViTs we load).
_TIMM_ONLY = ("head_drop.", "norm_pre.")

_HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's source prefix, and its older spelling
_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt", ".ckpt", ".tar", ".npz")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")  # org/name[@revision]
_FORMATS = ".safetensors, or a torch.save file (.pth, .pt, .bin, .ckpt, .tar)"


class PretrainedError(ValueError):
    """Pretrained weights that cannot be had or do not fit the config."""




def resolve_shape(pretrained: str | os.PathLike | None, *, embed_dim: int | None, depth: int | None,
                  num_heads: int | None) -> dict[str, int]:
    """`embed_dim`, `depth` and `num_heads`: each as given, else the pretrained source's (`pretrained_shape`),
    else (no `pretrained`) `DEFAULT_SHAPE`'s. What is given wins, so weights that do not fit are still refused."""
    given = {"embed_dim": embed_dim, "depth": depth, "num_heads": num_heads}
    missing = [name for name, value in given.items() if value is None]
    if not missing:
        return given
    found = pretrained_shape(pretrained, tuple(missing)) if pretrained else DEFAULT_SHAPE
    return {name: found[name] if value is None else value for name, value in given.items()}


def pretrained_shape(source: str | os.PathLike, wanted: tuple[str, ...] = tuple(DEFAULT_SHAPE)) -> dict[str, int]:
    """The `embed_dim`, `depth` and `num_heads` of the ViT that `source` holds, without downloading its weights.

    A timm model name (with or without its tag) or a `timm/<name>` hub id: timm's architecture for the
    name, built on the meta device. A file (or a `vit.export` folder): `embed_dim` from
    `patch_embed.proj.weight` `(D, C, P, P)`, `depth` from the `blocks.N` keys; the number of heads
    is in no tensor's shape, so it comes from a `config.json` beside the file (timm's Hub layout,
    `model_args.num_heads`) or must be given: `PretrainedError` naming the option.
    """
    kind = source_kind(source)
    text = str(source)
    if kind == "hub" and text.split(":", 1)[-1].startswith("timm/"):  # timm's own repos are named after the model
        kind, text = "name", text.split(":", 1)[-1].removeprefix("timm/").split("@", 1)[0]
    if kind == "name":
        return _timm_shape(text)
    shapes = _weight_shapes(source, kind)
    if "patch_embed.proj.weight" not in shapes or not any(k.startswith("blocks.") for k in shapes):
        raise PretrainedError(f"pretrained={text!r} holds no ViT weights (no patch_embed.proj.weight and blocks.N.*): "
                              f"set {', '.join(wanted)} by hand")
    found = {"embed_dim": shapes["patch_embed.proj.weight"][0],
             "depth": 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))}
    config = Path(text).expanduser()
    config = (config if config.is_dir() else config.parent) / "config.json"
    heads = json.loads(config.read_text()).get("model_args", {}).get("num_heads") if config.is_file() else None
    if heads is not None:
        found["num_heads"] = int(heads)
    elif "num_heads" in wanted:
        raise PretrainedError(f"pretrained={text!r}: the number of attention heads is not in the weights' shapes "
                              f"(embed_dim={found['embed_dim']}, depth={found['depth']} are): set num_heads "
                              "(--model.backbone.init_args.num_heads; timm's ViTs have embed_dim / 64)")
    return found


def _timm_shape(name: str) -> dict[str, int]:
    import timm

    try:
        with torch.device("meta"):  # no memory, no download: only the architecture is wanted
            model = timm.create_model(name, pretrained=False)
    except RuntimeError as err:
        if not str(err).startswith(("Unknown model", "Invalid pretrained tag")):
            raise
        raise PretrainedError(f"pretrained={name!r} is neither a file nor a timm model name "
                              "(see timm.list_models(pretrained=True))") from None
    blocks = getattr(model, "blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks else None
    if getattr(model, "embed_dim", None) is None or getattr(attn, "num_heads", None) is None:
        raise PretrainedError(f"pretrained={name!r} is not a ViT of timm's layout ({type(model).__name__}): "
                              "set embed_dim, depth and num_heads by hand")
    return {"embed_dim": int(model.embed_dim), "depth": len(blocks), "num_heads": int(attn.num_heads)}


def _weight_shapes(source: str | os.PathLike, kind: str) -> dict[str, tuple[int, ...]]:
    """`{key: shape}` of the weights at `source`; a .safetensors file is read for its header only."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file():
        path = path / "model.safetensors"
    if kind == "file" and path.suffix == ".safetensors" and path.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118  (safe_open is no dict)
        except SafetensorError:
            pass  # load_state_dict says what is wrong with the file
    return {key: tuple(value.shape) for key, value in load_state_dict(source).items()}


def load_state_dict(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict named by `source` (see `source_kind`), checked to hold finite values only.

    A local file is `.safetensors`, or a `.pth`/`.bin` state dict or a checkpoint dict holding one,
    read with `weights_only=True`; a timm model name or hub id is downloaded by timm into its cache
    where the network allows.
    """
    kind = source_kind(source)
    if kind == "file":
        try:
            state = _read_file(Path(source).expanduser(), f"pretrained={str(source)!r}")
        except PretrainedError as err:
            if isinstance(source, str) and _REPO_ID.fullmatch(source) and not source.lower().endswith(_WEIGHT_SUFFIXES):
                # `org/name` is a Hub id unless a file or folder of that name exists; here one did.
                raise PretrainedError(f"{err}; it was read as a local path because {source} exists here: a Hugging "
                                      f"Face Hub id is written hf-hub:{source}") from None
            raise
    else:
        state = _download(str(source), kind)
    for key, tensor in state.items():
        # A NaN or infinity in the weights would only show up later as a NaN loss, blamed on the learning rate.
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise PretrainedError(f"pretrained={str(source)!r} is unusable: {key} holds NaN or infinite values "
                                  f"({bad} of {tensor.numel()})")
    return state


def source_kind(source: str | os.PathLike) -> Literal["file", "hub", "name"]:
    """How `source` is read: `"file"` (a path that exists, or one that looks like a path), `"hub"` (a
    Hugging Face Hub id, `hf-hub:timm/vit_small_patch16_224.augreg_in21k` or `timm/vit_small_...`),
    or `"name"` (a timm model name with an optional pretrained tag, `vit_small_patch16_224.augreg_in21k`)."""
    text = str(source)
    if not isinstance(source, str) or Path(text).expanduser().exists():
        return "file"
    if text.lower().startswith(_HUB_PREFIXES):
        return "hub"
    if text.lower().endswith(_WEIGHT_SUFFIXES):
        return "file"
    if _REPO_ID.fullmatch(text):  # one slash, no leading `.` or `/`: `org/name`, as the Hub spells its ids
        return "hub"
    if any(c in text for c in "/\\:~"):
        return "file"
    return "name"


def _read_file(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The state dict in a local file, or a `PretrainedError` saying what is wrong with the file."""
    if not path.exists():
        raise PretrainedError(f"{name}: there is no such file")
    if path.is_dir() and (path / "model.safetensors").is_file():  # a Hub-layout folder, as `vit.export` writes
        path = path / "model.safetensors"
    elif path.is_dir():
        raise PretrainedError(f"{name} is a folder without a model.safetensors, not a weights file "
                              "(.safetensors, .pth or .bin)")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise PretrainedError(f"{name} cannot be read ({err.strerror})") from None
    if size == 0:
        raise PretrainedError(f"{name} is empty (0 bytes)")
    if path.suffix.lower() == ".npz":
        raise _numpy_archive(name)
    if path.suffix == ".safetensors":
        return _read_safetensors(path, name, head, size)
    return _read_torch(path, name, head, size)


def _numpy_archive(name: str) -> PretrainedError:
    return PretrainedError(
        f"{name} is a NumPy .npz archive (JAX / big_vision weights), a format not supported here: expected {_FORMATS}. "
        "timm reads a big_vision ViT's .npz (timm.models.load_checkpoint(model, path)); save that model's "
        "state_dict() with safetensors.torch.save_file and pass the .safetensors file")


def _truncated(name: str, kind: str, size: int) -> PretrainedError:
    return PretrainedError(f"{name} is truncated: it starts like a {kind} file but its end is missing "
                           f"({size} bytes; was its download or copy interrupted?)")


def _read_safetensors(path: Path, name: str, head: bytes, size: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as err:
        reason = str(err).removeprefix("Error while deserializing header: ")
        # The file starts with the length of its JSON header: a plausible length that runs past the end,
        # or tensors that do, mean a file cut short rather than another kind of file.
        header = int.from_bytes(head, "little") if len(head) == 8 else None
        if header is not None and header < 100_000_000 and (8 + header > size or "not fully covered" in reason):
            raise _truncated(name, "safetensors", size) from None
        raise PretrainedError(f"{name} is not a safetensors file, or it is corrupted ({reason})") from None


def _read_torch(path: Path, name: str, head: bytes, size: int) -> dict[str, torch.Tensor]:
    # torch.save writes a zip archive (its table of contents at the end); files from before PyTorch 1.6 are a pickle.
    if head.startswith(b"PK\x03\x04"):
        if not zipfile.is_zipfile(path):
            raise _truncated(name, "torch.save", size)
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
        if members and all(m.endswith(".npy") for m in members):  # an .npz under another name
            raise _numpy_archive(name)
        if not any(m.endswith("data.pkl") for m in members):  # torch.save writes <name>/data.pkl, <name>/data/0, ...
            raise PretrainedError(f"{name} is a zip archive, but not one torch.save writes (it has no data.pkl): "
                                  f"expected {_FORMATS}")
    elif not head.startswith(b"\x80"):  # the pickle protocol opcode
        raise PretrainedError(f"{name} is not a PyTorch weights file (neither the zip archive torch.save writes "
                              f"nor a pickle): expected {_FORMATS}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise PretrainedError(
                f"{name} holds Python objects, not only tensors (it asks for {found[1]}); loading it could run "
                "arbitrary code, so it is refused. Pass a state dict saved with torch.save(model.state_dict(), path), "
                "or a .safetensors file"
            ) from None
        raise PretrainedError(f"{name} is not a PyTorch weights file, or it is corrupted") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError or OSError for damaged archives)
        raise PretrainedError(f"{name} cannot be loaded: it is corrupted ({_first_line(err)})") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PretrainedError(f"{name} does not hold a state dict (a mapping of names to tensors)")
    return {k.removeprefix("module.").removeprefix("backbone."): v for k, v in state.items()}


def _first_line(err: Exception) -> str:
    """`Type: first sentence` of an exception, short enough for a one-line message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0].split('. ')[0][:200]}" if text else type(err).__name__


def _download(source: str, kind: Literal["hub", "name"]) -> dict[str, torch.Tensor]:
    """The weights of a timm model name or hub id, as `timm.create_model(..., pretrained=True)` fetches them."""
    import timm

    # timm reads `hf-hub:org/name` (the repo's config.json names the architecture) and refuses a bare `org/name`.
    timm_name = "hf-hub:" + source.split(":", 1)[-1] if kind == "hub" else source
    try:
        return timm.create_model(timm_name, pretrained=True).state_dict()
    except RuntimeError as err:
        if kind == "name" and str(err).startswith("Unknown model"):
            raise PretrainedError(f"pretrained={source!r} is neither a file nor a timm model name "
                                  "(see timm.list_models(pretrained=True))") from None
        if kind == "name" and str(err).startswith("Invalid pretrained tag"):
            model = source.split(".", 1)[0]
            tags = [t.split(".", 1)[1] for t in timm.list_pretrained(f"{model}.*")]
            raise PretrainedError(f"pretrained={source!r}: timm has no pretrained tag {source.split('.', 1)[1]!r} "
                                  f"for {model}; it has {tags}") from None
        raise _download_error(source, kind, err) from None
    except Exception as err:  # noqa: BLE001  (huggingface_hub and urllib raise many kinds when offline)
        raise _download_error(source, kind, err) from None


def _download_error(source: str, kind: Literal["hub", "name"], err: Exception) -> PretrainedError:
    repo = "<org>/<name>"
    if kind == "hub":
        repo = source.split(":", 1)[-1].split("@", 1)[0]
    else:
        try:
            import timm

            repo = timm.models.get_pretrained_cfg(source).hf_hub_id or repo
        except Exception:  # noqa: BLE001  (the hint is a courtesy; the error below is what matters)
            pass
    taken = " (taken for a Hugging Face Hub id: there is no file of that name)" if _REPO_ID.fullmatch(source) else ""
    return PretrainedError(
        f"the weights of {source!r}{taken} could not be downloaded ({_first_line(err)}). "
        f"Without network, download the file on a machine that has it (`hf download {repo} model.safetensors "
        "--local-dir weights`) and pass the file instead: pretrained=weights/model.safetensors"
    )


def check_layout(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` in `model`'s layout where a rename makes it so exactly, else a `PretrainedError` naming the option.

    - A MAP head saved before it took timm's `AttentionPoolLatent` names (`attn_pool.probe`, a fused
      `attn_pool.attn.qkv`) is renamed: the probe is the latent, the query rows of `qkv` are `q`, the
      key and value rows `kv` (the same numbers, so the same outputs).
    - The final LayerNorm before the pooling (`norm.*`) and after it (`fc_norm.*`) are not
      interchangeable (a LayerNorm of the mean is not the mean of LayerNorms), so weights with the
      other one are refused. This is what a `pool: mean` checkpoint from before `fc_norm` existed
      meets: it normalised every token, then averaged; `fc_norm=False` rebuilds that model.
    Returns `state` itself when nothing is renamed.
    """
    use_fc_norm = getattr(model, "use_fc_norm", None)
    if use_fc_norm is not None:
        has_norm, has_fc_norm = "norm.weight" in state, "fc_norm.weight" in state
        if use_fc_norm and has_norm and not has_fc_norm:
            raise PretrainedError(
                f"these weights normalise the tokens before the pooling (norm.weight, no fc_norm.weight) and this "
                f"model (pool={model.pool!r}) after it (fc_norm): set fc_norm=False to load them as they were trained "
                "(a pool='mean' checkpoint made before fc_norm existed is of this kind)")
        if not use_fc_norm and has_fc_norm and not has_norm:
            raise PretrainedError(
                f"these weights normalise the pooled vector (fc_norm.weight, no norm.weight) and this model "
                f"(pool={model.pool!r}, fc_norm=False) the tokens before the pooling: set fc_norm=True to load them")
    if "attn_pool.probe" not in state or not hasattr(getattr(model, "attn_pool", None), "latent"):
        return state
    renamed = {}
    for key, value in state.items():
        if key == "attn_pool.probe":
            renamed["attn_pool.latent"] = value
        elif key.startswith("attn_pool.attn.qkv."):  # (3 * D, ...): the query rows, then the key and value rows
            q, kv = value.split([value.shape[0] // 3, 2 * value.shape[0] // 3])
            leaf = key.rsplit(".", 1)[1]
            renamed[f"attn_pool.q.{leaf}"], renamed[f"attn_pool.kv.{leaf}"] = q, kv
        elif key.startswith("attn_pool.attn."):  # proj, and the parameters of a learned score function
            renamed["attn_pool." + key.removeprefix("attn_pool.attn.")] = value
        else:
            renamed[key] = value
    return renamed


def adapt_state_dict(state: dict[str, torch.Tensor], model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`state` fitted to `model`'s config; returns it and the keys left to their fresh initialisation (the head)."""
    state = check_layout({k: v for k, v in state.items() if not k.startswith(_TIMM_ONLY)}, model)
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
        table = state["pos_embed"]  # (1, prefix + gh * gw, D); no prefix positions with no_embed_class
        prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
        old_patches = table.shape[1] - prefix
        if table.shape != ours["pos_embed"].shape:
            side = math.isqrt(old_patches)
            if side * side != old_patches:
                raise PretrainedError(
                    f"the pretrained position table has {table.shape[1]} tokens, which is not {prefix} prefix "
                    f"token(s) plus a square grid; {_prefix_hint(table.shape[1], state, model)}")
            state["pos_embed"] = resample_abs_pos_embed(table, new_size=list(model.patch_embed.grid_size),
                                                        old_size=[side, side], num_prefix_tokens=prefix)
    for key in ("head.weight", "head.bias"):
        if key in state and key in ours and state[key].shape != ours[key].shape:
            del state[key]
            fresh.append(key)
    return state, fresh


def _prefix_hint(num_positions: int, state: dict[str, torch.Tensor], model: nn.Module) -> str:
    """What in the config decides how many prefix tokens have a position, and what the weights have."""
    cls = 1 if "cls_token" in state else 0
    regs = state["reg_token"].shape[1] if "reg_token" in state else 0
    placed = "none of them has a position (no_embed_class=True)"
    if math.isqrt(num_positions - cls - regs) ** 2 == num_positions - cls - regs and cls + regs:
        placed = "each has a position (no_embed_class=False)"
    return (f"the weights have {cls} CLS token(s) and {regs} register(s) and {placed}; this model has "
            f"num_prefix_tokens={model.num_prefix_tokens}, no_embed_class={getattr(model, 'no_embed_class', False)}")


def create_vit(pretrained: str | os.PathLike, *, embed_dim: int | None = None, depth: int | None = None,
               num_heads: int | None = None, **kwargs) -> nn.Module:
    """A `VisionTransformer` with the weights named by `pretrained` (a timm model name, a hub id or a local file), as
    timm's `create_model(name, pretrained=True, **kwargs)`: the size left unset is the source's (`resolve_shape`),
    the other options are `kwargs`, and the weights are adapted to them (`load_pretrained`)."""
    shape = resolve_shape(pretrained, embed_dim=embed_dim, depth=depth, num_heads=num_heads)
    model = VisionTransformer(**shape, **kwargs)
    load_pretrained(model, pretrained)
    return model


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
                              f"({len(missing) + len(unexpected) + len(reshaped)} tensors differ): "
                              + "; ".join(details))
    model.load_state_dict(state, strict=not fresh)
    if fresh:
        log.warning("pretrained=%s: the classifier head has another number of classes; %s re-initialised",
                    source, " and ".join(fresh))
