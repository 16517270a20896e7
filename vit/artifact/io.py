"""The one way Lightning reads and writes a run's checkpoints (`AtomicCheckpointIO`).

Reading: whatever path Lightning takes to a checkpoint (`--ckpt_path`, `hpc`, SLURM's requeue, `best`, `last`),
the file is loaded with `weights_only=True` (plain data and tensors: no code runs) and the paths in
`ModelCheckpoint`'s state, which Lightning deletes as it rotates its top-k, are confined to the run's checkpoint
folder. Everything else goes to Lightning as it is: what does not fit the run fails there, in one caught line.
Writing: a temporary file fsynced and renamed into place (Lightning's own move is a copy without fsync across file
systems), then the model folder beside it (`last.ckpt` -> `last/`)."""

from __future__ import annotations

import os
import re
import secrets
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vit.artifact import folder_of, from_checkpoint, remove, write
from vit.checks import CheckpointError
from vit.messages import first_line
from vit.models.weight_files import PretrainedError, check_zip_entries, checked_size, open_regular_file
from vit.registry import shown

PARTIAL_WRITE = re.compile(r"\..+\.[0-9a-f]{16}\.(tmp|old)")  # this module's and `files.write`'s temporary names
PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")  # the files a ModelCheckpoint state names
SCORES = ("best_model_score", "kth_value", "current_score")


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` as the module doc says. `folders()`: `{state key: checkpoint folder}` of the run's
    `ModelCheckpoint`s, set by `train.py` once the trainer exists; a state of another key or folder keeps no path."""

    def __init__(self) -> None:
        super().__init__()
        self.folders: Callable[[], Mapping[str, Path]] = dict

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = read_trainer_state(path)
        folders = self.folders()
        callbacks = checkpoint.get("callbacks", {})
        if not isinstance(callbacks, dict):
            raise CheckpointError(f"checkpoint {path}: its callbacks are a {type(callbacks).__name__}, not a mapping")
        for key, state in callbacks.items():
            if key in folders or (isinstance(key, str) and key.startswith("ModelCheckpoint")):
                callbacks[key] = confine(state, folders.get(key), f"checkpoint {path}: callbacks.{key}")
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            # O_EXCL: never someone else's file; mode 0o666: the umask decides, as for any new file
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        model = from_checkpoint(checkpoint)
        if model is not None:  # None: a backbone built in Python, which nothing records how to build again
            write(folder_of(path), *model)

    def remove_checkpoint(self, path) -> None:
        if "://" in str(path):
            return super().remove_checkpoint(path)
        path = Path(path)
        if path.is_symlink() or path.is_file():  # never a folder
            path.unlink()
        remove(folder_of(path))  # its model folder goes with it (only a folder this project wrote)


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """The dict in a checkpoint file, read as every weights file is (`vit.models.weight_files`: a regular file, a zip
    archive of uncompressed entries of at most `READABLE_VIT_DOWNLOAD_MAX_BYTES`) and loaded with `weights_only=True`;
    else one line naming it."""
    if "://" in str(path):
        raise CheckpointError(f"checkpoint {path} is a URL: a run's state is read from its own folder only")
    name = f"checkpoint {path}"
    try:  # the rules of every weights file: a regular file, its size and zip directory bounded before unpacking
        with open_regular_file(Path(path), name) as f:
            checked_size(f, name)
            check_zip_entries(zipfile.ZipFile(f).infolist(), name)
            f.seek(0)
            checkpoint = torch.load(f, map_location="cpu", weights_only=True)
    except PretrainedError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001  (zip, unpickling, recursion and storage errors: all one line)
        raise CheckpointError(f"{name} cannot be loaded as data: {first_line(err)}") from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise CheckpointError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict)")
    return checkpoint


def confine(state: Any, folder: Path | None, key: str) -> dict:
    """A `ModelCheckpoint` state whose paths are files inside `folder` (links and `..` resolved) and whose scores are
    numbers; a state of another folder (or none known) forgets its paths, as a run continued elsewhere tracks its own
    checkpoints from there."""
    if not isinstance(state, dict) or not isinstance(state.get("best_k_models", {}), dict):
        raise CheckpointError(f"{key} is not a ModelCheckpoint state")
    # Lightning compares every score with the run's as a float tensor: one of another kind fails at the next save.
    scores = {name: _score(state[name], f"{key}.{name}") for name in SCORES if state.get(name) is not None}
    best_k = {path: _score(value, f"{key}.best_k_models") for path, value in state.get("best_k_models", {}).items()}
    state = {**state, **scores, "best_k_models": best_k}
    if folder is None or _resolved(state.get("dirpath")) != folder:
        return {**state, **{name: "" for name in PATHS if name in state}, "best_k_models": {}}
    for path in [*(state.get(name) for name in PATHS), *best_k]:
        if path is None or (isinstance(path, str) and not path):  # no file named
            continue
        resolved = _resolved(path)
        if resolved is None or folder not in resolved.parents or not resolved.is_file():
            raise CheckpointError(
                f"{key} names {shown(path, 300)}, which is not a checkpoint file of this run's {folder}"
            )
    return state


def _score(value: Any, key: str) -> torch.Tensor:
    try:
        return torch.tensor(float(value))
    except (TypeError, ValueError, RuntimeError):
        raise CheckpointError(f"{key}: {shown(value)} is not a score (one number)") from None


def _resolved(path: Any) -> Path | None:
    """`path` with links and `..` resolved; None for what names no file (not a string, a NUL byte, a loop)."""
    try:
        return Path(path).resolve() if isinstance(path, str) and path else None
    except (OSError, ValueError, RuntimeError):
        return None
