"""A checkpoint path or URL made a local file (`fetch`), then read as data (`load_archive`), for `read`. Downloads are
cached in `<torch hub dir>/checkpoints/readable-vit/<hash of the URL without query and user>/<name>`; after each
download, the cache's other files older than 7 days are deleted."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import pickle
import re
import secrets
import socket
import threading
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.error import URLError
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from vit.checks import first_line
from vit.training.checkpoint.values import CheckpointError

TIMEOUT_VARIABLE = "READABLE_VIT_DOWNLOAD_TIMEOUT"
MAX_BYTES_VARIABLE = "READABLE_VIT_DOWNLOAD_MAX_BYTES"
_DEFAULT_TIMEOUT = 60  # seconds in which at least _MIN_PROGRESS bytes must arrive
_DEFAULT_MAX_BYTES = 4 * 2**30  # a ViT-H checkpoint with its optimizer state is ~7.5 GB: raise it for those
_CHUNK = _MIN_PROGRESS = 2**20
_KEEP_SECONDS = 7 * 24 * 3600  # cached downloads older than this are deleted after each download
_NO_HEADERS = "the server's status line and headers did not all arrive within"
MAX_PICKLE_BYTES = 256 * 2**20  # the values beside the tensors: counters, settings, optimizer bookkeeping


def fetch(ckpt_path: str | os.PathLike) -> str:
    """A local file for `ckpt_path`: a path as it is (`~` expanded), `file://` as its path, any other URL (http(s),
    fsspec) downloaded afresh into a temporary file that replaces the cached one only when it is a complete zip
    archive; else `CheckpointError` names the URL redacted. Limits: docs/robust-runs.md."""
    text = str(ckpt_path)
    if "://" not in text:
        return os.path.expanduser(text)
    shown = redact_url(text)
    try:
        parts = urlsplit(text)
        name = PurePosixPath(parts.path).name or "checkpoint.ckpt"  # no query string in a file name
    except ValueError as err:  # e.g. an unclosed IPv6 bracket
        raise CheckpointError(f"checkpoint {shown} is not a valid URL ({err})") from err
    fs = path = None
    if not text.startswith(("http://", "https://")):
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as err:  # an unknown scheme, or one whose package is not installed
            raise CheckpointError(f"checkpoint {shown} cannot be read: {_scrubbed(err, text, shown)}") from err
        except Exception as err:  # some filesystems connect here: FTP, SFTP
            raise _not_downloaded(err, text, shown, timeout=None) from err
        if isinstance(fs, LocalFileSystem):
            return path
    timeout = _limit(TIMEOUT_VARIABLE, _DEFAULT_TIMEOUT, float, "a number of seconds")
    largest = max_bytes()
    key = urlunsplit((parts.scheme, _host(parts), parts.path, "", ""))  # a new token replaces the old copy
    cache = Path(torch.hub.get_dir()) / "checkpoints" / "readable-vit"
    folder = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
    target, tmp = folder / name, folder / f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            if fs is None:  # http(s)
                content_type = _download_http(parts, out, shown, timeout, largest)
            else:
                content_type = ""
                with fs.open(path, "rb") as source:
                    _check_size(getattr(source, "size", None), shown, largest)
                    _copy(source.read, out, shown, timeout, largest)
        _check_downloaded(tmp, shown, content_type)
        os.replace(tmp, target)
    except Exception as err:  # network, permissions, a missing object: all one line
        if isinstance(err, CheckpointError):
            raise
        raise _not_downloaded(err, text, shown, timeout) from err
    finally:
        tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: a refused download leaves nothing behind
    _prune(cache, keep=target)
    return str(target)


def _host(parts: SplitResult) -> str:
    return parts.netloc.rpartition("@")[2]  # without the `user:password@`


def _prune(cache: Path, keep: Path) -> None:
    """Delete the files in `cache`'s folders but `keep` written more than `_KEEP_SECONDS` ago, and emptied folders."""
    cutoff = time.time() - _KEEP_SECONDS
    for entry in list(cache.glob("*/*")):  # also the temporary file a killed download left
        with contextlib.suppress(OSError):  # deleted meanwhile, or not ours to delete: a download never fails here
            if entry != keep and entry.is_file() and entry.stat().st_mtime < cutoff:
                entry.unlink()
                entry.parent.rmdir()  # only when that was its last file


def _not_downloaded(err: Exception, url: str, shown: str, timeout: float | None) -> CheckpointError:
    """One line for a failed connection or transfer: the exception's type and first line, the URL redacted."""
    if timeout is not None and any(isinstance(e, TimeoutError) for e in (err, getattr(err, "reason", None))):
        return _timed_out(shown, timeout)  # one read waited `timeout` seconds
    reason = err.reason if isinstance(err, URLError) and isinstance(err.reason, Exception) else err
    return CheckpointError(f"checkpoint {shown} could not be downloaded: {type(reason).__name__}: "
                           f"{_scrubbed(reason, url, shown)}")


def redact_url(url: str) -> str:
    """`url` without what often holds an access token: the query string becomes `?...`, a user/password part `***@`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/]*@", "//***@", url.split("?", 1)[0].split("#", 1)[0])
    netloc = f"***@{_host(parts)}" if "@" in parts.netloc else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))


def _scrubbed(err: BaseException, url: str, shown: str) -> str:
    """The first line of `err`'s message, with the URL (and its secret parts) as `shown` says it."""
    text = first_line(err).replace(url, shown)
    parts = urlsplit(url)
    for secret in filter(None, (parts.query, parts.password)):
        text = text.replace(secret, "...")
    return text


def _limit(name: str, default: int, kind: type, unit: str) -> float | int:
    """The positive number in the environment variable `name`, or `default` when it is unset."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    number = 0
    with contextlib.suppress(ValueError):
        number = kind(value)
    if not math.isfinite(number) or number <= 0:
        raise CheckpointError(f"{name}={value!r} is not allowed: expected {unit} > 0 (default {default})")
    return number


def _download_http(parts: SplitResult, out, shown: str, timeout: float, max_bytes: int) -> str:
    """Write the body at the URL `parts` into `out`; return its content type."""
    with _open_http(parts, shown, timeout) as response:
        length = response.headers.get("Content-Length", "")
        expected = int(length) if length.isdigit() else None
        _check_size(expected, shown, max_bytes)
        # read1: whatever has arrived (read would wait for a whole chunk, however slowly it comes)
        received = _copy(response.read1, out, shown, timeout, max_bytes)
        if expected is not None and received < expected:
            raise CheckpointError(f"checkpoint {shown} could not be downloaded: the connection closed after "
                                  f"{received} of {expected} bytes")
        return response.headers.get_content_type()


def _open_http(parts: SplitResult, shown: str, timeout: float):
    """The response at `parts`, its status line and headers in within `timeout` s; `user:password@` as Basic auth."""
    url = urlunsplit(parts._replace(netloc=_host(parts)))
    request = urllib.request.Request(url, headers={"User-Agent": "readable-vit"})
    if parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        # unredirected: the password goes to the host the user named, not to whichever host it redirects to
        request.add_unredirected_header("Authorization", f"Basic {base64.b64encode(credentials).decode()}")
    deadline = _HeaderDeadline(timeout)
    try:
        response = urllib.request.build_opener(deadline).open(request, timeout=timeout)
    except Exception as err:
        if deadline.stop() and not isinstance(getattr(err, "reason", err), TimeoutError):
            raise
        raise _timed_out(shown, timeout, _NO_HEADERS) from err
    if not deadline.stop():  # in by a hair, but the deadline had already shut its socket
        response.close()
        raise _timed_out(shown, timeout, _NO_HEADERS)
    return response


class _HeaderDeadline(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """An http(s) handler that shuts its connections down `timeout` seconds after it is made, unless `stop` came
    first: urllib's `timeout` bounds each wait on the socket, so a server could trickle its headers forever."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.connections, self.expired, self._stopped, self._lock = [], False, threading.Event(), threading.Lock()
        threading.Thread(target=self._expire, args=(timeout,), daemon=True).start()

    def do_open(self, http_class, req, **kwargs):
        def connection(host, **options):  # kept, to be shut down (a redirect opens another)
            self.connections.append(http_class(host, **options))
            return self.connections[-1]
        return super().do_open(connection, req, **kwargs)

    def _expire(self, timeout: float) -> None:
        wait = timeout
        while not self._stopped.wait(wait):
            with self._lock:
                if not self._stopped.is_set():
                    self.expired = True
                    for connection in self.connections:
                        with contextlib.suppress(AttributeError, OSError):  # no socket, or a closed one
                            connection.sock.shutdown(socket.SHUT_RDWR)  # ends the read that waits on it
            wait = 0.05  # and again: a connection still connecting or in its TLS handshake has no socket yet

    def stop(self) -> bool:
        """Stop the deadline; True when it had not passed yet."""
        with self._lock:
            self._stopped.set()
            return not self.expired


def _copy(read, out, shown: str, timeout: float, max_bytes: int) -> int:
    """Copy `read(n)`'s chunks into `out`; return the bytes copied; refuse > `max_bytes`, or < 1 MiB per `timeout` s."""
    received, received_before, window_start = 0, 0, time.monotonic()
    while True:
        chunk = read(_CHUNK)
        if not chunk:
            return received
        received += len(chunk)
        _check_size(received, shown, max_bytes, f"more than {max_bytes} bytes")
        out.write(chunk)
        now = time.monotonic()
        if now - window_start >= timeout:
            if received - received_before < _MIN_PROGRESS:
                raise _timed_out(shown, timeout)
            window_start, received_before = now, received


def _check_size(size: int | None, shown: str, max_bytes: int, what: str = "") -> None:
    """Refuse `size` bytes (announced, or `what` received so far) above `max_bytes`."""
    if size is not None and size > max_bytes:
        raise CheckpointError(f"checkpoint {shown} is too large: {what or f'{size} bytes'}, above the limit of "
                              f"{max_bytes} bytes (set {MAX_BYTES_VARIABLE} to allow more)")


def _timed_out(shown: str, timeout: float, what: str = "less than 1 MiB arrived in") -> CheckpointError:
    return CheckpointError(f"checkpoint {shown} timed out: {what} {timeout:g} s (set {TIMEOUT_VARIABLE} to wait "
                           "longer)")


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


def max_bytes() -> int:
    """The largest checkpoint read, in bytes (downloaded, and unpacked: `READABLE_VIT_DOWNLOAD_MAX_BYTES`)."""
    return _limit(MAX_BYTES_VARIABLE, _DEFAULT_MAX_BYTES, int, "a whole number of bytes")


def load_archive(path: str | os.PathLike, source: str | None = None) -> dict[str, Any]:
    """The dict in a regular file holding a whole zip archive of uncompressed entries (at most `max_bytes()`), loaded
    with `weights_only=True` on the CPU; else `CheckpointError` naming `source` (the URL it came from) or the path."""
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
        return torch.load(p, map_location="cpu", weights_only=True, mmap=True)
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


def _check_entries(entries: list[zipfile.ZipInfo], source: str) -> None:
    """Refuse compressed entries, and more than `max_bytes()` unpacked (a zip bomb is small on disk)."""
    compressed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if compressed is not None:
        raise CheckpointError(f"checkpoint {source} has a compressed entry ({compressed.filename}); torch.save "
                              "stores its entries uncompressed, so another program wrote this file; refused")
    limit, total = max_bytes(), sum(e.file_size for e in entries)
    if total > limit:
        raise CheckpointError(f"checkpoint {source} holds {total} bytes, above the limit of {limit} bytes (set "
                              f"{MAX_BYTES_VARIABLE} to allow more)")
    pickled = sum(e.file_size for e in entries if e.filename.endswith(".pkl"))
    if pickled > MAX_PICKLE_BYTES:
        raise CheckpointError(f"checkpoint {source} has {pickled} bytes of pickled values beside its tensors (a "
                              f"checkpoint of this project has a few MB at most; limit {MAX_PICKLE_BYTES}); refused")
