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
import math
import os
import pickle
import re
import secrets
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.error import URLError
from urllib.parse import urlsplit, urlunsplit

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


TIMEOUT_VARIABLE = "READABLE_VIT_DOWNLOAD_TIMEOUT"
MAX_BYTES_VARIABLE = "READABLE_VIT_DOWNLOAD_MAX_BYTES"
_DEFAULT_TIMEOUT = 60  # seconds in which at least _MIN_PROGRESS bytes must arrive
_DEFAULT_MAX_BYTES = 4 * 2**30  # a ViT-H checkpoint with its optimizer state is ~7.5 GB: raise it for those
_MIN_PROGRESS = 2**20
_CHUNK = 2**20


def fetch_checkpoint(ckpt_path: str | os.PathLike) -> str:
    """A local file for `ckpt_path`: a path as it is (`~` expanded), `file://` as its path, any other URL downloaded.

    Every checkpoint then goes through the same checks (`read_checkpoint`: `weights_only=True`,
    layout; the CLI's config, world-size and finite-weights checks) before Lightning loads it.
    A URL (`http(s)://`, or any fsspec scheme such as `s3://`) is downloaded afresh on every call
    into `<torch hub dir>/checkpoints/readable-vit/<hash of the whole URL>/<file name>`: keyed by the
    whole URL, two URLs that end in the same file name never share a file (torch hub's cache keys by
    the name alone), and a `last.ckpt` that changed since the last resume is not read stale.

    The download goes to a temporary file beside the cached one and replaces it only when it is
    complete and is the zip archive `torch.save` writes; anything else (an HTML login page, a file
    over the size limit, a download that timed out) is deleted and raises `CheckpointError`, one
    line naming the URL. Messages show the URL without its query string and user/password part
    (`https://host/x.ckpt?...`), which often hold an access token; the file name in the cache has
    no query string either. Two environment variables set the limits:

    - `READABLE_VIT_DOWNLOAD_TIMEOUT` (seconds, default 60): the download is abandoned when less
      than 1 MiB arrives in that time: a server that stops answering, or one that trickles.
    - `READABLE_VIT_DOWNLOAD_MAX_BYTES` (bytes, default 4 GiB): a larger file is refused, before
      the download when the server announces its size, else as soon as it is passed.

    For other schemes than http(s) the byte counts are the same, and the backend's own timeouts
    bound a call that blocks (fsspec's FTP connects when the URL is opened, with a 30 s timeout).
    """
    text = str(ckpt_path)
    if "://" not in text:
        return os.path.expanduser(text)
    shown = redact_url(text)
    try:
        name = PurePosixPath(urlsplit(text).path).name or "checkpoint.ckpt"  # no query string in a file name
    except ValueError as err:  # e.g. an unclosed IPv6 bracket
        raise CheckpointError(f"checkpoint {shown} is not a valid URL ({err})") from err
    fs = path = None
    if not text.startswith(("http://", "https://")):
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as err:  # an unknown scheme, or one whose package is not installed
            raise CheckpointError(f"checkpoint {shown} cannot be read: {_scrubbed(err, text, shown)}") from err
        except Exception as err:  # noqa: BLE001  (some filesystems connect here: FTP, SFTP)
            raise _not_downloaded(err, text, shown, timeout=None) from err
        if isinstance(fs, LocalFileSystem):
            return path
    timeout, max_bytes = _download_limits()
    folder = Path(torch.hub.get_dir()) / "checkpoints" / "readable-vit" / hashlib.sha256(text.encode()).hexdigest()[:16]
    target, tmp = folder / name, folder / f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            if fs is None:  # http(s)
                content_type = _download_http(text, out, shown, timeout, max_bytes)
            else:
                content_type = ""
                with fs.open(path, "rb") as source:
                    _check_size(getattr(source, "size", None), shown, max_bytes)
                    _copy(source.read, out, shown, timeout, max_bytes)
        _check_downloaded(tmp, shown, content_type)
        os.replace(tmp, target)
    except Exception as err:  # noqa: BLE001  (network, permissions, a missing object: all one line)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: a refused download leaves nothing behind
        if isinstance(err, CheckpointError):
            raise
        raise _not_downloaded(err, text, shown, timeout) from err
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


def _not_downloaded(err: Exception, url: str, shown: str, timeout: float | None) -> CheckpointError:
    """One line for a failed connection or transfer: the exception's type and first line, the URL redacted."""
    timed_out = isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)
    if timed_out and timeout is not None:
        return _timed_out(shown, timeout)  # the connection, or one read, waited `timeout` seconds
    reason = err.reason if isinstance(err, URLError) and isinstance(err.reason, Exception) else err
    return CheckpointError(f"checkpoint {shown} could not be downloaded: {type(reason).__name__}: "
                           f"{_scrubbed(reason, url, shown)}")


def redact_url(url: str) -> str:
    """`url` without what often holds an access token: the query string becomes `?...`, a user/password part `***@`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/]*@", "//***@", url.split("?", 1)[0].split("#", 1)[0])
    netloc = f"***@{parts.netloc.rpartition('@')[2]}" if "@" in parts.netloc else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))


def _scrubbed(err: BaseException, url: str, shown: str) -> str:
    """The first line of `err`'s message, with the URL (and its secret parts) as `shown` says it."""
    text = first_line(err).replace(url, shown)
    parts = urlsplit(url)
    for secret in (parts.query, parts.password):
        if secret:
            text = text.replace(secret, "...")
    return text


def _download_limits() -> tuple[float, int]:
    """`(timeout in seconds, largest size in bytes)`: the environment's values, or the defaults."""
    return (_limit(TIMEOUT_VARIABLE, _DEFAULT_TIMEOUT, float, "a number of seconds"),
            _limit(MAX_BYTES_VARIABLE, _DEFAULT_MAX_BYTES, int, "a whole number of bytes"))


def _limit(name: str, default: int, kind: type, unit: str) -> float | int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        number = 0
    if not math.isfinite(number) or number <= 0:
        raise CheckpointError(f"{name}={value!r} is not allowed: expected {unit} > 0 (default {default})")
    return number


def _download_http(url: str, out, shown: str, timeout: float, max_bytes: int) -> str:
    """Write the body at `url` into `out`; return its content type. `timeout` also bounds each wait on the socket."""
    request = urllib.request.Request(url, headers={"User-Agent": "readable-vit"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        length = response.headers.get("Content-Length", "")
        expected = int(length) if length.isdigit() else None
        _check_size(expected, shown, max_bytes)
        # read1: whatever has arrived (read would wait for a whole chunk, however slowly it comes)
        received = _copy(response.read1, out, shown, timeout, max_bytes)
        if expected is not None and received < expected:
            raise CheckpointError(f"checkpoint {shown} could not be downloaded: the connection closed after "
                                  f"{received} of {expected} bytes")
        return response.headers.get_content_type()


def _copy(read, out, shown: str, timeout: float, max_bytes: int) -> int:
    """Copy `read(n)`'s chunks into `out` until it returns b""; refuse more than `max_bytes`, or less than 1 MiB in
    any `timeout` seconds. Returns the number of bytes."""
    received = 0
    window_start, received_before = time.monotonic(), 0
    while True:
        chunk = read(_CHUNK)
        if not chunk:
            return received
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(shown, f"more than {max_bytes} bytes", max_bytes)
        out.write(chunk)
        now = time.monotonic()
        if now - window_start >= timeout:
            if received - received_before < _MIN_PROGRESS:
                raise _timed_out(shown, timeout)
            window_start, received_before = now, received


def _check_size(size: int | None, shown: str, max_bytes: int) -> None:
    """Refuse a size the server announced, before anything is downloaded."""
    if size is not None and size > max_bytes:
        raise _too_large(shown, f"{size} bytes", max_bytes)


def _too_large(shown: str, size: str, max_bytes: int) -> CheckpointError:
    return CheckpointError(f"checkpoint {shown} is too large: {size}, above the limit of {max_bytes} bytes (set "
                           f"{MAX_BYTES_VARIABLE} to allow more)")


def _timed_out(shown: str, timeout: float) -> CheckpointError:
    return CheckpointError(f"checkpoint {shown} timed out: less than 1 MiB arrived in {timeout:g} s (set "
                           f"{TIMEOUT_VARIABLE} to wait longer)")


def _check_downloaded(path: Path, shown: str, content_type: str) -> None:
    """Raise `CheckpointError` unless the file at `path` is a complete zip archive, the format torch.save writes."""
    with open(path, "rb") as f:
        head = f.read(256)
    if head.startswith(b"PK\x03\x04") and zipfile.is_zipfile(path):
        return
    html = head.lstrip().lower().startswith((b"<!doctype", b"<html"))
    if html or content_type in ("text/html", "application/xhtml+xml"):
        raise CheckpointError(f"checkpoint {shown} returned a web page, not a checkpoint (a login, error or download "
                              "page? give the file's direct download link)")
    size = path.stat().st_size
    if head.startswith(b"PK\x03\x04"):
        raise CheckpointError(f"checkpoint {shown} returned a truncated file: it starts like a checkpoint but its end "
                              f"is missing ({size} bytes)")
    raise CheckpointError(f"checkpoint {shown} returned something that is not a checkpoint: its {size} bytes are not "
                          "the zip archive torch.save writes")


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

