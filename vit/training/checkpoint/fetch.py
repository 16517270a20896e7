"""A checkpoint path or URL made a local file: `fetch`.

Only `vit.training.checkpoint.read` calls this; every door opens a checkpoint through `read`.

Downloads are cached in `<torch hub dir>/checkpoints/readable-vit/<hash>/<file name>`, hashing the URL without its
query string and user/password part: a presigned URL whose token changes on every call replaces its previous copy.
After each successful download, every other file in the cache written more than 7 days ago is deleted (a download is
read right after it is written, so such a file is no longer in use), and so is its folder once empty.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import math
import os
import re
import secrets
import socket
import threading
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from urllib.error import URLError
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from vit.checks import first_line
from vit.training.checkpoint.errors import CheckpointError

TIMEOUT_VARIABLE = "READABLE_VIT_DOWNLOAD_TIMEOUT"
MAX_BYTES_VARIABLE = "READABLE_VIT_DOWNLOAD_MAX_BYTES"
_DEFAULT_TIMEOUT = 60  # seconds in which at least _MIN_PROGRESS bytes must arrive
_DEFAULT_MAX_BYTES = 4 * 2**30  # a ViT-H checkpoint with its optimizer state is ~7.5 GB: raise it for those
_MIN_PROGRESS = 2**20
_CHUNK = 2**20
_KEEP_SECONDS = 7 * 24 * 3600  # cached downloads older than this are deleted after each download
_NO_HEADERS = "the server's status line and headers did not all arrive within"


def fetch(ckpt_path: str | os.PathLike) -> str:
    """A local file for `ckpt_path`: a path as it is (`~` expanded), `file://` as its path, any other URL downloaded.

    Every checkpoint then goes through the same reading and schema (`vit.training.checkpoint.read`). A URL
    (`http(s)://`, or any fsspec scheme such as `s3://`) is downloaded afresh on every call into the cache (see
    the module): a `last.ckpt` that changed since the last resume is not read stale, and two URLs ending in the
    same file name but with different paths never share a file (torch hub's cache keys by the name alone). An
    http(s) URL's `user:password@` is sent as HTTP Basic authorization, to that host only (not to a host it
    redirects to).

    The download goes to a temporary file that replaces the cached one only when it is complete and is the zip
    archive `torch.save` writes; anything else (an HTML login page, a file over the size limit, a download that timed
    out) is deleted and raises `CheckpointError`, one line naming the URL without its query string and user/password
    part (`https://***@host/x.ckpt?...`), which often hold an access token; nor are they in a cached file's name.

    - `READABLE_VIT_DOWNLOAD_TIMEOUT` (seconds, default 60): an http(s) server's status line and headers (redirects
      included) must all arrive within that time, however they trickle; then the download is abandoned when less
      than 1 MiB of the body arrives in that time.
    - `READABLE_VIT_DOWNLOAD_MAX_BYTES` (bytes, default 4 GiB): a larger file is refused, before the download when
      the server announces its size, else as soon as it is passed.

    For other schemes than http(s) the byte counts are the same, and the backend's own timeouts bound a call that
    blocks (fsspec's FTP connects when the URL is opened, with a 30 s timeout).
    """
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
    timed_out = isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)
    if timed_out and timeout is not None:
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
    for secret in (parts.query, parts.password):
        if secret:
            text = text.replace(secret, "...")
    return text


def _limit(name: str, default: int, kind: type, unit: str) -> float | int:
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
