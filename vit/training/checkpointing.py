"""Checkpoint I/O: writes that are never half-done, safe reads, fetching a checkpoint from a URL, finding `last.ckpt`.

What a checkpoint is checked against before a run (the config, the model) is in `vit.training.preflight`.

Why `AtomicCheckpointIO`: Lightning 2.6 saves through an fsspec transaction. For a local path
fsspec writes the bytes to a temporary file made by `tempfile.mkstemp()` in the *system* temp
folder, then `shutil.move`s it into place. When the temp folder and the run folder are on
different filesystems (a tmpfs `/tmp`, a network home) the move is a copy into the destination
followed by a delete, so a kill during the copy leaves a truncated `last.ckpt`; there is no fsync
either, so a power cut can leave a renamed but empty file. `AtomicCheckpointIO` writes the
checkpoint into a temporary file *in the destination folder*, fsyncs it, and `os.replace`s it over
the old one: a reader sees the old checkpoint or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import pickle
import re
import secrets
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vit.checks import first_line

LAST_CHECKPOINT = re.compile(r"last(-v\d+)?\.ckpt")  # ModelCheckpoint's "last" names
PARTIAL_WRITE = re.compile(r"\..+\.ckpt\.[0-9a-f]{16}\.tmp")  # AtomicCheckpointIO's temporary files


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: missing, unreadable, or made for another model."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic: temp file in the same folder, fsync, `os.replace`.

    Remote paths (`s3://...`) keep Lightning's behaviour. A temporary file left by a killed process
    is named `.<name>.<random>.tmp`: it never matches `*.ckpt`, so `--ckpt_path last` ignores it.
    Every load is `weights_only=True`, whatever the caller asks: Lightning's own default for a URL is
    weights_only off, which runs any code pickled into the file.
    """

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # os.open with mode 0o666 lets the umask decide the permissions, as for any new file
        # (tempfile.mkstemp would make it 0600); O_EXCL never reuses someone else's file.
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)  # make the rename itself durable


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `AtomicCheckpointIO` leaves when a process is killed mid-write; return them.

    Called when a run resumes in its own folder: no process of that run can be writing then.
    """
    partial = [p for p in Path(folder).glob(".*.ckpt.*.tmp") if PARTIAL_WRITE.fullmatch(p.name)]
    for path in partial:
        path.unlink(missing_ok=True)
    return partial


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fetch_checkpoint(ckpt_path: str | os.PathLike) -> str:
    """A local file for `ckpt_path`: a plain path as it is, `file://` as its path, any other URL downloaded.

    Every checkpoint then goes through the same checks (`read_checkpoint`: `weights_only=True`,
    layout; the CLI's config, world-size and finite-weights checks) before Lightning loads it.
    A URL (`http(s)://`, or any fsspec scheme such as `s3://`) is downloaded afresh on every call
    into `<torch hub dir>/checkpoints/readable-vit/<hash of the whole URL>/<file name>`: keyed by the
    whole URL, two URLs that end in the same file name never share a file (torch hub's cache keys by
    the name alone), and a `last.ckpt` that changed since the last resume is not read stale.
    """
    text = str(ckpt_path)
    try:
        fs, path = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as err:  # an unknown scheme, or one whose package is not installed
        raise CheckpointError(f"checkpoint {text} cannot be read: {first_line(err)}") from err
    if isinstance(fs, LocalFileSystem):
        return path if "://" in text else text
    folder = Path(torch.hub.get_dir()) / "checkpoints" / "readable-vit" / hashlib.sha256(text.encode()).hexdigest()[:16]
    target = folder / (PurePosixPath(path).name or "checkpoint.ckpt")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{target.name}.{secrets.token_hex(8)}.tmp"
    try:
        if text.startswith(("http://", "https://")):
            torch.hub.download_url_to_file(text, str(tmp), progress=False)
        else:
            fs.get_file(path, str(tmp))
        os.replace(tmp, target)
    except Exception as err:  # noqa: BLE001  (network, permissions, a missing object: all one line)
        raise CheckpointError(f"checkpoint {text} could not be downloaded: {type(err).__name__}: {first_line(err)}") from err
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a Lightning checkpoint on the CPU, or raise `CheckpointError` saying what is wrong with the file.

    Loads with `weights_only=True` (no arbitrary code runs) and `mmap=True` (tensors are read only
    when touched, so checking a large file is cheap).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if p.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder, not a checkpoint file")
    if p.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes): its writing was interrupted")
    try:
        with open(p, "rb") as f:
            head = f.read(4)
        archive_complete = zipfile.is_zipfile(p)
    except PermissionError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror}") from err
    # torch.save writes a zip archive, whose table of contents is at the end of the file.
    if head != b"PK\x03\x04":
        raise CheckpointError(f"checkpoint {path} is not a PyTorch checkpoint (not the zip archive torch.save writes)")
    if not archive_complete:
        raise CheckpointError(
            f"checkpoint {path} is truncated: it starts like a checkpoint but its end is missing "
            f"({p.stat().st_size} bytes; was its writing interrupted?)"
        )
    try:
        checkpoint = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" in str(err).lower():
            raise CheckpointError(
                f"checkpoint {path} holds Python objects that are not plain data; it was not written by "
                "this project, and loading it could run arbitrary code, so it is refused"
            ) from err
        raise CheckpointError(f"checkpoint {path} is not a PyTorch checkpoint, or it is corrupted ({first_line(err)})") from err
    except Exception as err:  # torch raises RuntimeError, OSError or EOFError for damaged archives
        raise CheckpointError(f"checkpoint {path} cannot be loaded: it is corrupted ({first_line(err)})") from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        kind = "" if isinstance(checkpoint, dict) else f": it holds a {type(checkpoint).__name__}, not a dict"
        raise CheckpointError(f"checkpoint {path} is not a Lightning checkpoint (it has no 'state_dict'){kind}")
    layout = _layout_problem(checkpoint)
    if layout:
        raise CheckpointError(
            f"checkpoint {path} is not a checkpoint of this project: {layout}. A plain state dict of the backbone "
            "can be loaded in Python with `model.backbone.load_state_dict(...)`"
        )
    return checkpoint


def _layout_problem(checkpoint: dict) -> str:
    """What makes a dict with a 'state_dict' something other than a Lightning checkpoint, or ''."""
    state = checkpoint["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        return "its 'state_dict' is not a mapping of names to tensors"
    hparams = checkpoint.get("hyper_parameters", {})
    if not isinstance(hparams, dict):
        return f"its 'hyper_parameters' is a {type(hparams).__name__}, not a mapping"
    if "pytorch-lightning_version" not in checkpoint and "optimizer_states" in checkpoint:
        return "it has optimizer states but no 'pytorch-lightning_version' (another trainer wrote it)"
    return ""


def find_last_checkpoint(folder: str | os.PathLike, runs: str = "*") -> Path | None:
    """The most recently written `last.ckpt` (or `last-vN.ckpt`) in `folder/<runs>/checkpoints/`, or None.

    `folder` is a logger's `save_dir/name`, whose subfolders are the runs (`version_0`, ...);
    `runs` is a glob pattern, or one run's folder name.
    """
    pattern = f"{runs if runs == '*' else glob.escape(runs)}/checkpoints/last*.ckpt"
    candidates = [p for p in Path(folder).glob(pattern) if LAST_CHECKPOINT.fullmatch(p.name)]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)

