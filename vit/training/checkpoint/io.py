"""Writing checkpoints (atomically) and finding them on disk.

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
import os
import re
import secrets
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vit.training.checkpoint import read

LAST_CHECKPOINT = re.compile(r"last(-v\d+)?\.ckpt")  # ModelCheckpoint's "last" names
PARTIAL_WRITE = re.compile(r"\..+\.ckpt\.[0-9a-f]{16}\.tmp")  # AtomicCheckpointIO's temporary files


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that reads through this project's checkpoint owner and writes atomically.

    Loading: a checkpoint that `train.py` validated before the run (`expect`) is handed over as
    validated, without reading the file again; any other (the best checkpoint tested after `fit`) is
    read and validated by `vit.training.checkpoint.read`. Lightning never unpickles a file itself.

    Saving: a temp file in the same folder, fsync, `os.replace`. Remote paths (`s3://...`) keep
    Lightning's behaviour. A temporary file left by a killed process is named `.<name>.<random>.tmp`:
    it never matches `*.ckpt`, so `--ckpt_path last` ignores it.

    Removing (ModelCheckpoint's top-k): a regular file or a link only, never a folder.
    """

    def __init__(self) -> None:
        super().__init__()
        self._validated: dict[Path, dict] = {}

    def expect(self, path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
        """Hand `checkpoint` (validated, and for `fit` checked by `resume.check_resume`) to Lightning for `path`."""
        self._validated[_key(path)] = checkpoint

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        validated = self._validated.get(_key(path))
        return validated if validated is not None else read(path).raw

    def remove_checkpoint(self, path) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().remove_checkpoint(path)
        path = Path(path)
        if path.is_symlink() or path.is_file():
            path.unlink()

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


def _key(path: str | os.PathLike) -> str | Path:
    """A URL as given; a file by where it is, links and `..` resolved."""
    return str(path) if "://" in str(path) else Path(path).expanduser().resolve()


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


def find_last_checkpoint(folder: str | os.PathLike, runs: str = "*") -> Path | None:
    """The most recently written `last.ckpt` (or `last-vN.ckpt`) in `folder/<runs>/checkpoints/`, or None.

    `folder` is a logger's `save_dir/name`, whose subfolders are the runs (`version_0`, ...);
    `runs` is a glob pattern, or one run's folder name.
    """
    pattern = f"{runs if runs == '*' else glob.escape(runs)}/checkpoints/last*.ckpt"
    candidates = [p for p in Path(folder).glob(pattern) if LAST_CHECKPOINT.fullmatch(p.name)]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)

