"""Where a model folder is (beside its checkpoint, or fetched for a Hub id), and writing, reading the config of and
removing one: whole, regular files only, nothing deleted that this project did not write."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vit.artifact.config import CONFIG, MAX_CONFIG_BYTES, WEIGHTS, ArtifactError

if TYPE_CHECKING:
    import torch

def folder_of(checkpoint: str | os.PathLike) -> Path:
    """The model folder beside a checkpoint file: its name without `.ckpt` (`last.ckpt` -> `last`)."""
    return Path(checkpoint).with_suffix("")


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


def locate(source: str | os.PathLike) -> Path | None:
    """The model folder a door was given: the folder itself, the folder beside a `.ckpt` (a link to a checkpoint
    counts as the checkpoint it names), an `hf-hub:org/name[@revision]` id's files fetched through
    `huggingface_hub` (its cache first; offline, only the cache), or a timm model name's pretrained weights (its
    Hub repo, the same way). None for a checkpoint without a model folder (one written before this format) and for
    URLs: those are read as checkpoints."""
    text = os.fspath(source)
    if text.lower().startswith(("hf-hub:", "hf_hub:")):
        return _hub_folder(text[len("hf-hub:"):])
    if "://" in text:
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if not os.path.lexists(path) and _TIMM_NAME.fullmatch(text):
        return _timm_folder(text)
    beside = folder_of(path.resolve()) if path.suffix == ".ckpt" else None
    return beside if beside is not None and (beside / CONFIG).is_file() else None


_TIMM_NAME = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)?")  # timm's model names, with a pretrained tag: no path


def _timm_folder(name: str) -> Path | None:
    """The Hub folder of a timm model name's pretrained weights (`vit_tiny_patch16_224`, or with its tag), through
    `_hub_folder` (timm keeps its weights in the same cache); None for a name timm has no Hub weights for."""
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # a tag timm does not have
        cfg = None
    if cfg is None or not cfg.hf_hub_id:
        return None
    return _hub_folder(cfg.hf_hub_id)


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
