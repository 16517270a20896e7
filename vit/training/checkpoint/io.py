"""The one way Lightning reads and writes checkpoints. Reading: whatever path Lightning takes to a checkpoint
(`--ckpt_path` of any form, `hpc`, SLURM's requeue, `best`, `last` of an on-exception checkpoint, the test after
`fit`), the bytes reach it through `AtomicCheckpointIO.load_checkpoint`, which validates the file whole and confines
the trainer state to the run before Lightning sees a value. Writing: Lightning moves a checkpoint from the temp folder
into place, across filesystems a copy without fsync (a kill leaves a truncated `last.ckpt`); here a reader sees the
old checkpoint or the new one."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

import vit.artifact as artifact
from vit.training.checkpoint import Checkpoint, read
from vit.training.checkpoint.trainer_state import without_checkpoint_paths

LAST_CHECKPOINT = re.compile(r"last(-v\d+)?\.ckpt")  # ModelCheckpoint's "last" names
PARTIAL_WRITE = re.compile(r"\..+\.ckpt\.[0-9a-f]{16}\.tmp")  # AtomicCheckpointIO's temporary files
PARTIAL_ARTIFACT = re.compile(r"\..+\.[0-9a-f]{16}\.(tmp|old)")  # vit.artifact.write's temporary folders


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that reads through `vit.training.checkpoint.read` (Lightning never unpickles a file
    itself), writes `.<name>.<random>.tmp` (never matched by `*.ckpt`), fsyncs it and `os.replace`s; removing deletes
    a file or a link, never a folder.

    What a read hands Lightning: the dict validated before the run for that path (`expect`), else `admit(checkpoint)`
    (the run's own check, set by the CLI once the trainer exists), else the validated dict without `ModelCheckpoint`'s
    paths, which Lightning would otherwise delete as they rotate (a run that is not known cannot vouch for any)."""

    def __init__(self, admit: Callable[[Checkpoint], dict] | None = None) -> None:
        super().__init__()
        self.admit = admit
        self._validated: dict[Path, dict] = {}

    def expect(self, path: str | os.PathLike, checkpoint: dict[str, Any]) -> None:
        """Hand `checkpoint` (validated, and for `fit` checked by `resume.check_resume`) to Lightning for `path`."""
        self._validated[_key(path)] = checkpoint

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict[str, Any]:
        validated = self._validated.get(_key(path))
        if validated is not None:
            return validated
        checkpoint = read(path)
        return self.admit(checkpoint) if self.admit is not None else without_checkpoint_paths(checkpoint.raw)

    def remove_checkpoint(self, path) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            return super().remove_checkpoint(path)
        path = Path(path)
        if path.is_symlink() or path.is_file():
            path.unlink()
        artifact.remove(artifact.folder_of(path))  # its model folder goes with it (only a folder vit.artifact wrote)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # mode 0o666: the umask decides, as for any new file (mkstemp makes 0600); O_EXCL: never someone else's file
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
        with contextlib.suppress(OSError):  # the rename made durable; not every filesystem lets a folder be fsynced
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        model = artifact.from_checkpoint(checkpoint)
        if model is not None:  # the trained model as a file of its own, beside its checkpoint (`vit.artifact`)
            artifact.write(artifact.folder_of(path), *model)


def _key(path: str | os.PathLike) -> str | Path:
    """A URL as given; a file by where it is, links and `..` resolved."""
    return str(path) if "://" in str(path) else Path(path).expanduser().resolve()


def remove_partial_writes(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of writes a killed process left (called as its run resumes); return them."""
    partial = [p for p in Path(folder).glob(".*.ckpt.*.tmp") if PARTIAL_WRITE.fullmatch(p.name) and not p.is_dir()]
    for path in partial:
        path.unlink(missing_ok=True)
    folders = [p for p in Path(folder).glob(".*.*") if PARTIAL_ARTIFACT.fullmatch(p.name) and p.is_dir()
               and not p.is_symlink()]
    for path in folders:
        shutil.rmtree(path, ignore_errors=True)
    return partial + folders


def find_last_checkpoint(folder: str | os.PathLike, runs: str = "*") -> Path | None:
    """The newest `last.ckpt` / `last-vN.ckpt` in `folder/<runs>/checkpoints/` (`runs`: a glob or a run), or None."""
    pattern = f"{runs if runs == '*' else glob.escape(runs)}/checkpoints/last*.ckpt"
    candidates = [p for p in Path(folder).glob(pattern) if LAST_CHECKPOINT.fullmatch(p.name)]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)

