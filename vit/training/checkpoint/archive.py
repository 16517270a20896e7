"""A checkpoint file read as data: `load_archive` (the zip archive `torch.save` writes, `weights_only=True`).

Only `vit.training.checkpoint.read` calls this; every door opens a checkpoint through `read`.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from vit.checks import first_line
from vit.training.checkpoint.errors import CheckpointError
from vit.training.checkpoint.fetch import MAX_BYTES_VARIABLE, max_bytes

MAX_PICKLE_BYTES = 256 * 2**20  # the values beside the tensors: counters, settings, optimizer bookkeeping


def load_archive(path: str | os.PathLike, source: str | None = None) -> dict[str, Any]:
    """The dict a checkpoint file holds, loaded on the CPU with `weights_only=True`, or `CheckpointError`.

    Before `torch.load` sees the file: it must be a regular file holding the zip archive `torch.save`
    writes, whole (its table of contents is at the end), with every entry stored uncompressed (as
    `torch.save` stores them: a compressed entry could unpack to far more than the file's size) and
    at most `max_bytes` bytes in all. Tensors are memory-mapped (`mmap=True`): checking a large file
    reads only what is checked. `source` names the file in messages (a URL it was downloaded from).
    """
    p, source = Path(path), source or str(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {source} does not exist")
    if p.is_dir():
        raise CheckpointError(f"checkpoint {source} is a folder, not a checkpoint file")
    if not p.is_file():
        raise CheckpointError(f"checkpoint {source} is not a regular file (a pipe or a device?)")
    size = p.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {source} is empty (0 bytes): its writing was interrupted")
    try:
        with open(p, "rb") as f:
            head = f.read(4)
        entries = zipfile.ZipFile(p).infolist() if head == b"PK\x03\x04" and zipfile.is_zipfile(p) else None
    except PermissionError as err:
        raise CheckpointError(f"checkpoint {source} cannot be read: {err.strerror}") from err
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"checkpoint {source} cannot be read: it is corrupted ({first_line(err)})") from err
    if head != b"PK\x03\x04":
        raise CheckpointError(f"checkpoint {source} is not a PyTorch checkpoint (not the zip archive torch.save "
                              "writes)")
    if entries is None:
        raise CheckpointError(f"checkpoint {source} is truncated: it starts like a checkpoint but its end is missing "
                              f"({size} bytes; was its writing interrupted?)")
    _check_entries(entries, source)
    try:
        checkpoint = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" in str(err).lower():
            raise CheckpointError(f"checkpoint {source} holds Python objects that are not plain data; it was not "
                                  "written by this project, and loading it could run arbitrary code, so it is refused"
                                  ) from err
        raise CheckpointError(f"checkpoint {source} is not a PyTorch checkpoint, or it is corrupted "
                              f"({first_line(err)})") from err
    except RecursionError:
        raise CheckpointError(f"checkpoint {source} is nested too deeply to be a checkpoint; refused") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, OSError or EOFError for damaged archives)
        raise CheckpointError(f"checkpoint {source} cannot be loaded: it is corrupted ({first_line(err)})") from err
    return checkpoint


def _check_entries(entries: list[zipfile.ZipInfo], source: str) -> None:
    """Refuse compressed entries, and more than `max_bytes()` unpacked (a zip bomb is small on disk)."""
    compressed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if compressed is not None:
        raise CheckpointError(f"checkpoint {source} has a compressed entry ({compressed.filename}); torch.save "
                              "stores its entries uncompressed, so another program wrote this file; refused")
    limit = max_bytes()
    total = sum(e.file_size for e in entries)
    if total > limit:
        raise CheckpointError(f"checkpoint {source} holds {total} bytes, above the limit of {limit} bytes (set "
                              f"{MAX_BYTES_VARIABLE} to allow more)")
    pickled = sum(e.file_size for e in entries if e.filename.endswith(".pkl"))
    if pickled > MAX_PICKLE_BYTES:
        raise CheckpointError(f"checkpoint {source} has {pickled} bytes of pickled values beside its tensors (a "
                              f"checkpoint of this project has a few MB at most; limit {MAX_PICKLE_BYTES}); refused")
