"""Pretrained weights as a state dict, from a local file, a Hugging Face Hub id or a timm model name: `load_state_dict`.
A `.safetensors` file, or a `torch.save` file read with `weights_only=True`, checked whole: complete, finite tensors."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import Literal

import torch

_HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's source prefix, in both spellings timm reads
_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt", ".ckpt", ".tar", ".npz")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")  # org/name[@revision]
_FORMATS = ".safetensors, or a torch.save file (.pth, .pt, .bin, .ckpt, .tar)"
UNKNOWN_NAME = "pretrained={!r} is neither a file nor a timm model name (see timm.list_models(pretrained=True))"


class PretrainedError(ValueError):
    """Pretrained weights that cannot be had or do not fit the config."""


def load_state_dict(source: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict named by `source` (`source_kind`; timm downloads names and hub ids), checked to be finite."""
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
    """How `source` is read: `"file"` (a path that exists, or looks like one), `"hub"` (`hf-hub:org/name` or
    `org/name`), or `"name"` (a timm model name with an optional tag, `vit_small_patch16_224.augreg_in21k`)."""
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
    return PretrainedError(f"{name} is a NumPy .npz archive (JAX / big_vision weights), a format not supported here: "
                           f"expected {_FORMATS}. timm reads a big_vision ViT's .npz (timm.models.load_checkpoint("
                           "model, path)); save that model's state_dict() with safetensors.torch.save_file and pass "
                           "the .safetensors file")


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
    # torch.save writes a zip archive (its table of contents at the end), or a bare pickle in its legacy format.
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
            raise PretrainedError(f"{name} holds Python objects, not only tensors (it asks for {found[1]}); loading it "
                                  "could run arbitrary code, so it is refused. Pass a state dict saved with "
                                  "torch.save(model.state_dict(), path), or a .safetensors file") from None
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
            raise PretrainedError(UNKNOWN_NAME.format(source)) from None
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
        with contextlib.suppress(Exception):  # the hint is a courtesy; the error below is what matters
            import timm

            repo = timm.models.get_pretrained_cfg(source).hf_hub_id or repo
    taken = " (taken for a Hugging Face Hub id: there is no file of that name)" if _REPO_ID.fullmatch(source) else ""
    return PretrainedError(f"the weights of {source!r}{taken} could not be downloaded ({_first_line(err)}). Without "
                           f"network, download the file on a machine that has it (`hf download {repo} "
                           "model.safetensors --local-dir weights`) and pass the file instead: "
                           "pretrained=weights/model.safetensors")
