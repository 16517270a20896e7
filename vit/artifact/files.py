"""Where a model folder is (`locate`), and writing (`write`: whole) and removing one (only one this project wrote)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vit.artifact.config import CONFIG, MAX_CONFIG_BYTES, WEIGHTS, ArtifactError
from vit.hub import hub_folder, timm_repo

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


def locate(source: str | os.PathLike) -> Path:
    """The model folder a door was given: the folder itself; the folder beside a `.ckpt` (a link to a checkpoint
    counts as the checkpoint it names); an `hf-hub:org/name[@revision]` id or a timm model name with pretrained
    weights, through `huggingface_hub` (its cache first; offline, only the cache); an http(s) URL of a model folder,
    downloaded (`vit.artifact.download`). Anything else is refused in one line saying what to give."""
    text = os.fspath(source)
    if text.lower().startswith(("hf-hub:", "hf_hub:")):
        return hub_folder(text[len("hf-hub:") :], (CONFIG, WEIGHTS))
    if "://" in text:
        from vit.artifact.download import download_folder

        return download_folder(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    repo = timm_repo(text) if not os.path.lexists(path) else None
    if repo is not None:
        return hub_folder(repo, (CONFIG, WEIGHTS))
    if path.suffix == ".ckpt" and path.is_file():
        beside = folder_of(path.resolve())
        if (beside / CONFIG).is_file():
            return beside
        raise ArtifactError(
            f"checkpoint {text} has no model folder beside it ({beside.name}/): it was written before model folders; "
            f"write one with `python -m vit.artifact --ckpt_path {text}`"
        )
    exists = os.path.lexists(path)
    named = f"checkpoint {text}" if path.suffix == ".ckpt" else text
    raise ArtifactError(
        f"{named} {'is not a model folder or a .ckpt' if exists else 'does not exist'}: give a model folder "
        "(config.json + model.safetensors), a run's .ckpt, an hf-hub:org/name id, a timm model name with pretrained "
        "weights, or an http(s) URL of a model folder"
    )
