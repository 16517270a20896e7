"""Pretrained weights as a state dict, from a local file (`vit.models.weight_files`, which reads and checks it), a
Hugging Face Hub id or a timm model name: `load_state_dict`."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Literal

import torch

from vit.models.weight_files import (
    MAX_BYTES_VARIABLE,
    MAX_CONFIG_BYTES,
    PretrainedError,
    error_summary,
    max_bytes,
    open_regular_file,
    read_file,
    read_json,
)
from vit.offline import cache_only_if_unreachable

# The file-level names other modules take from here, as `vit.models.weights` is where pretrained weights come from.
__all__ = [
    "MAX_BYTES_VARIABLE",
    "MAX_CONFIG_BYTES",
    "PretrainedError",
    "load_state_dict",
    "max_bytes",
    "open_regular_file",
    "read_json",
    "source_kind",
    "weight_shapes",
]

_HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's source prefix, in both spellings timm reads

_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt", ".ckpt", ".tar", ".npz")

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")  # org/name[@revision]

UNKNOWN_NAME = "pretrained={!r} is neither a file nor a timm model name (see timm.list_models(pretrained=True))"


def load_state_dict(source: str | os.PathLike, name: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict named by `source` (`source_kind`; timm downloads names and hub ids), checked to be finite;
    `name`: how messages name a local file (default `pretrained='<source>'`)."""
    kind = source_kind(source)
    state = _local(source, read_file, name) if kind == "file" else _download(str(source), kind)
    for key, tensor in state.items():
        # A NaN or infinity in the weights would only show up later as a NaN loss, blamed on the learning rate.
        if not tensor.is_floating_point():
            continue
        if tensor.element_size() == 1:  # float8: torch.isfinite has no kernel for it, every value is exact in float32
            tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise PretrainedError(
                f"{name or f'pretrained={str(source)!r}'} is unusable: {key} holds NaN or "
                f"infinite values ({bad} of {tensor.numel()})"
            )
    return state


def weight_shapes(source: str | os.PathLike, name: str | None = None) -> dict[str, torch.Tensor]:
    """The weights at `source` as tensors on the meta device (names, shapes, dtypes), read from a .safetensors file's
    header without its data; other sources are loaded (`load_state_dict`)."""
    if source_kind(source) == "file":
        return _local(source, lambda path, shown: read_file(path, shown, header_only=True), name)
    return load_state_dict(source, name)


def _local(source: str | os.PathLike, read, name: str | None = None) -> dict[str, torch.Tensor]:
    """`read(path, name)` of the local file `source` (a model folder: its `model.safetensors`, the weights of another
    run's model), its errors told that an `org/name` could be a Hub id."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file():
        path = path / "model.safetensors"
    try:
        return read(path, name or f"pretrained={str(source)!r}")
    except PretrainedError as err:
        if isinstance(source, str) and _REPO_ID.fullmatch(source) and not source.lower().endswith(_WEIGHT_SUFFIXES):
            # `org/name` is a Hub id unless a file or folder of that name exists; here one did.
            raise PretrainedError(
                f"{err}; it was read as a local path because {source} exists here: a Hugging "
                f"Face Hub id is written hf-hub:{source}"
            ) from None
        raise


def source_kind(source: str | os.PathLike) -> Literal["file", "hub", "name"]:
    """How `source` is read: `"file"` (a path that exists, or looks like one), `"hub"` (`hf-hub:org/name` or
    `org/name`), or `"name"` (a timm model name with an optional tag, `vit_small_patch16_224.augreg_in21k`)."""
    text = str(source)
    if not isinstance(source, str) or _exists(text):
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


def _exists(text: str) -> bool:
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):  # a name over 255 bytes (ENAMETOOLONG) or with a NUL byte names no file
        return False


def _download(source: str, kind: Literal["hub", "name"]) -> dict[str, torch.Tensor]:
    """The weights of a timm model name or hub id, as `timm.create_model(..., pretrained=True)` fetches them."""
    import timm

    # timm reads `hf-hub:org/name` (the repo's config.json names the architecture) and refuses a bare `org/name`.
    timm_name = "hf-hub:" + source.split(":", 1)[-1] if kind == "hub" else source
    try:
        with cache_only_if_unreachable():
            return timm.create_model(timm_name, pretrained=True).state_dict()
    except RuntimeError as err:
        if kind == "name" and str(err).startswith("Unknown model"):
            raise PretrainedError(UNKNOWN_NAME.format(source)) from None
        if kind == "name" and str(err).startswith("Invalid pretrained tag"):
            model = source.split(".", 1)[0]
            tags = [t.split(".", 1)[1] for t in timm.list_pretrained(f"{model}.*")]
            raise PretrainedError(
                f"pretrained={source!r}: timm has no pretrained tag {source.split('.', 1)[1]!r} "
                f"for {model}; it has {tags}"
            ) from None
        raise _download_error(source, kind, err) from None
    except Exception as err:  # noqa: BLE001  (huggingface_hub and urllib raise many kinds when offline)
        raise _download_error(source, kind, err) from None


def _download_error(source: str, kind: Literal["hub", "name"], err: Exception) -> PretrainedError:
    repo = "<org>/<name>"
    if kind == "hub":
        repo = source.split(":", 1)[-1].split("@", 1)[0]
    else:
        with contextlib.suppress(Exception):  # the hint is a courtesy; the error below is what matters
            import timm

            repo = timm.models.get_pretrained_cfg(source).hf_hub_id or repo
    taken = " (taken for a Hugging Face Hub id: there is no file of that name)" if _REPO_ID.fullmatch(source) else ""
    return PretrainedError(
        f"the weights of {source!r}{taken} could not be downloaded ({error_summary(err)}). Without "
        f"network, download its files on a machine that has it (`hf download {repo} "
        "model.safetensors config.json --local-dir weights`) and pass the file instead: "
        "pretrained=weights/model.safetensors (its sizes are read from the file and the config.json beside it)"
    )
