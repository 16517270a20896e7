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
import stat
import struct
import threading
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.error import URLError
from urllib.parse import SplitResult, unquote, urljoin, urlsplit, urlunsplit

import fsspec
import torch

from vit.checks import file_kind, first_line
from vit.training.checkpoint.values import CheckpointError

TIMEOUT_VARIABLE = "READABLE_VIT_DOWNLOAD_TIMEOUT"
MAX_BYTES_VARIABLE = "READABLE_VIT_DOWNLOAD_MAX_BYTES"
_DEFAULT_TIMEOUT = 60  # seconds in which at least _MIN_PROGRESS bytes must arrive
_DEFAULT_MAX_BYTES = 4 * 2**30  # a ViT-H checkpoint with its optimizer state is ~7.5 GB: raise it for those
_CHUNK = _MIN_PROGRESS = 2**20
_KEEP_SECONDS = 7 * 24 * 3600  # cached downloads older than this are deleted after each download
_NO_HEADERS = "the server's status line and headers did not all arrive within"
MAX_PICKLE_BYTES = 256 * 2**20  # the values beside the tensors: counters, settings, optimizer bookkeeping
MAX_REDIRECTS = 10  # urllib's own limit, checked here to say so in one line
# Object stores read through fsspec, by their own clients (botocore, gcsfs, adlfs, huggingface_hub), which time out
# on their own; memory:// is in-process. Every other scheme is refused: urllib and fsspec would also speak ftp, sftp,
# smb, webdav... with no deadline (an FTP server that never answers hangs the read), or wrap another URL
# (`simplecache::`, `zip://`), none of which the deadlines here can bound.
FSSPEC_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "hf", "memory")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a cached file's name taken from its URL as it is


def fetch(ckpt_path: str | os.PathLike) -> str:
    """A local file for `ckpt_path`: a path as it is (`~` expanded), a `file:` URL as its path, an http(s) URL or one
    of `FSSPEC_SCHEMES` downloaded afresh into a temporary file that replaces the cached one only when it is a
    complete zip archive; else `CheckpointError` names the URL redacted. Limits: docs/robust-runs.md."""
    text = str(ckpt_path)
    if not _is_url(text):
        return os.path.expanduser(text)
    shown = redact_url(text)
    try:
        parts = urlsplit(text)  # the scheme comes lower-cased: schemes are case-insensitive
    except ValueError as err:  # e.g. an unclosed IPv6 bracket
        raise CheckpointError(f"checkpoint {shown} is not a valid URL ({err})") from err
    if parts.scheme == "file":
        return _file_url_path(text, parts)
    if parts.scheme not in ("http", "https", *FSSPEC_SCHEMES):
        allowed = ", ".join(f"{s}://" for s in FSSPEC_SCHEMES)
        raise CheckpointError(f"checkpoint {shown} cannot be read: the scheme {parts.scheme or '(none)'!r} is not "
                              f"allowed: expected http://, https://, file:// or a path, or an object store "
                              f"({allowed}); download the file another way and pass its path")
    fs = path = None
    if parts.scheme not in ("http", "https"):
        try:
            fs, path = fsspec.core.url_to_fs(text)
        except (ImportError, ValueError) as err:  # the scheme's package is not installed, or a malformed URL
            raise CheckpointError(f"checkpoint {shown} cannot be read: {_scrubbed(err, text, shown)}") from err
        except Exception as err:  # some filesystems connect here
            raise _not_downloaded(err, text, shown, timeout=None) from err
    timeout = _limit(TIMEOUT_VARIABLE, _DEFAULT_TIMEOUT, float, "a number of seconds")
    largest = max_bytes()
    key = urlunsplit((parts.scheme, _host(parts), parts.path, "", ""))  # a new token replaces the old copy
    cache = Path(torch.hub.get_dir()) / "checkpoints" / "readable-vit"
    folder = cache / hashlib.sha256(key.encode()).hexdigest()[:16]
    name = _local_name(PurePosixPath(parts.path).name)
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
        # A failed clean-up must not replace the error being raised; a temporary file it left is pruned later.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: a refused download leaves nothing behind
    _prune(cache, keep=target)
    return str(target)


def _is_url(text: str) -> bool:
    """Whether `text` is a URL: `scheme://...`, or `file:` with any number of slashes (`file:/x.ckpt` too)."""
    return "://" in text or text[:5].lower() == "file:"


def _file_url_path(url: str, parts: SplitResult) -> str:
    """The local path a `file:` URL names: percent-escapes decoded, on this machine only (`file:///x`,
    `file://localhost/x`, `file:/x`). Messages show `url` as given: it holds no secret to redact."""
    if parts.netloc not in ("", "localhost"):
        raise CheckpointError(f"checkpoint {url} names the host {parts.netloc!r}: a file: URL is read on this "
                              "machine only (file:///path/to/x.ckpt); pass the path")
    if "?" in url or "#" in url:
        raise CheckpointError(f"checkpoint {url} has a query string or fragment, which a file: URL cannot use "
                              "(a '?' or '#' in the file's name is written %3F or %23); pass the path")
    return urllib.request.url2pathname(parts.path)


def _local_name(name: str) -> str:
    """The cached file's name: the URL's file name when it is a plain short name, else a hash of it (keeping a
    plain suffix). A URL's last component can be anything: 300 characters (over the 255 a file system allows),
    `..`, percent-escapes, a leading dot (the temporary files' prefix)."""
    if not name:
        return "checkpoint.ckpt"
    if _PLAIN_NAME.fullmatch(name):
        return name
    suffix = PurePosixPath(name).suffix
    suffix = suffix if re.fullmatch(r"\.[A-Za-z0-9]{1,16}", suffix) else ".ckpt"
    return f"checkpoint-{hashlib.sha256(name.encode()).hexdigest()[:16]}{suffix}"


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
    """`url` without what often holds an access token: the query string becomes `?...`, a user/password part `***@`,
    the fragment is dropped; the rest as given (a path or a `file:` URL: all of it)."""
    if not _is_url(url) or url[:5].lower() == "file:":
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return re.sub(r"//[^/]*@", "//***@", url.split("?", 1)[0].split("#", 1)[0])
    shown = url.split("#", 1)[0]  # a query's '?' can only come before a fragment's '#'
    if parts.query:
        shown = f"{shown.split('?', 1)[0]}?..."
    if "@" in parts.netloc:  # edited in place, not rebuilt: `HTTP://Host` stays as the user wrote it
        shown = shown.replace(parts.netloc, f"***@{_host(parts)}", 1)
    return shown


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
        response = urllib.request.build_opener(deadline, _Redirects(shown)).open(request, timeout=timeout)
    except Exception as err:
        if deadline.stop() and not isinstance(getattr(err, "reason", err), TimeoutError):
            raise
        raise _timed_out(shown, timeout, _NO_HEADERS) from err
    if not deadline.stop():  # in by a hair, but the deadline had already shut its socket
        response.close()
        raise _timed_out(shown, timeout, _NO_HEADERS)
    return response


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, to http(s) only (urllib would follow one to ftp, which no deadline here bounds), at most
    `MAX_REDIRECTS`, each refusal one line naming the URL redacted."""

    max_repeats = max_redirections = MAX_REDIRECTS + 1  # the count below speaks first

    def __init__(self, shown: str) -> None:
        super().__init__()
        self.shown, self.followed = shown, 0

    def http_error_302(self, req, fp, code, msg, headers):
        location = headers.get("location") or headers.get("uri")  # the header urllib follows
        if location is not None:
            try:
                target = urljoin(req.full_url, location.strip())
                scheme = urlsplit(target).scheme
            except ValueError:
                target, scheme = location, ""
            if scheme not in ("http", "https"):
                fp.close()
                raise CheckpointError(f"checkpoint {self.shown} could not be downloaded: it redirects to "
                                      f"{redact_url(target)}, a {scheme or 'scheme-less'} URL: only http and https "
                                      "are followed")
            self.followed += 1
            if self.followed > MAX_REDIRECTS:
                fp.close()
                raise CheckpointError(f"checkpoint {self.shown} could not be downloaded: it redirects more than "
                                      f"{MAX_REDIRECTS} times")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


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
        if head.startswith(_ZIP) and zipfile.is_zipfile(f):
            return
        size = os.fstat(f.fileno()).st_size
        end = _archive_end(f, size) if head.startswith(_ZIP) else None
    html = head.lstrip().lower().startswith((b"<!doctype", b"<html"))
    if html or content_type in ("text/html", "application/xhtml+xml"):
        raise CheckpointError(f"checkpoint {shown} returned a web page, not a checkpoint (a login, error or download "
                              "page? give the file's direct download link)")
    if packed := _packed_format(head):
        raise CheckpointError(f"checkpoint {shown} returned {packed}, not a checkpoint; unpack it first")
    if end is not None:
        raise CheckpointError(f"checkpoint {shown} returned a file with {size - end} bytes of data after the end of "
                              f"the archive (which ends at byte {end}): something was appended to it; refused")
    if head.startswith(_ZIP):
        raise CheckpointError(f"checkpoint {shown} returned a truncated file: it starts like a checkpoint but its end "
                              f"is missing ({size} bytes)")
    raise CheckpointError(f"checkpoint {shown} returned something that is not a checkpoint: its {size} bytes are not "
                          "the zip archive torch.save writes")


_ZIP = b"PK\x03\x04"  # a zip archive's first local file header
_PACKED = ((b"\x1f\x8b", "a gzip file"), (b"\xfd7zXZ\x00", "an xz file"), (b"\x28\xb5\x2f\xfd", "a zstd file"),
           *((b"BZh" + bytes([level]), "a bzip2 file") for level in b"123456789"))


def _packed_format(head: bytes) -> str | None:
    """The compressed format a file starting with `head` is in ("a gzip file"), or None."""
    return next((name for magic, name in _PACKED if head.startswith(magic)), None)


def _archive_end(f, size: int) -> int | None:
    """Where the zip archive in `f` (of `size` bytes) ends, when its end record lies further back than the last 64 KiB
    that zipfile searches, so bytes were appended after it; None when there is no valid end record (truncated).
    Reads the file backwards, a chunk at a time: only a file already refused pays for it."""
    end_record = b"PK\x05\x06"
    pos, overlap = size, b""
    while pos > 0:
        start = max(0, pos - _CHUNK)
        f.seek(start)
        block = f.read(pos - start) + overlap  # a record cut by the chunk's edge is found whole
        at = block.rfind(end_record)
        while at >= 0:
            if (end := _end_of_archive(f, start + at, size)) is not None:
                return end
            at = block.rfind(end_record, 0, at)
        pos, overlap = start, block[:len(end_record) - 1]
    return None


def _end_of_archive(f, offset: int, size: int) -> int | None:
    """The archive's end when the bytes at `offset` are a zip end record pointing at a central directory (the same
    four bytes inside a tensor's data point at nothing); else None."""
    f.seek(offset)
    record = f.read(22)
    if len(record) < 22:
        return None
    *_, entries, directory_size, directory, comment = struct.unpack("<4sHHHHIIH", record)
    if directory == 0xFFFFFFFF:  # zip64: the real offset is in the zip64 end record the locator before it names
        f.seek(max(0, offset - 20))
        locator = f.read(20)
        if len(locator) < 20 or not locator.startswith(b"PK\x06\x07"):
            return None
        f.seek(struct.unpack("<4sIQI", locator)[2])
        zip64 = f.read(56)
        if len(zip64) < 56 or not zip64.startswith(b"PK\x06\x06"):
            return None
        directory = struct.unpack("<4sQHHIIQQQQ", zip64)[-1]
    end = offset + 22 + comment
    if end > size or directory >= size:
        return None
    f.seek(directory)
    return end if f.read(4) == b"PK\x01\x02" or (entries == 0 and directory_size == 0) else None


def max_bytes() -> int:
    """The largest checkpoint read, in bytes (downloaded, and unpacked: `READABLE_VIT_DOWNLOAD_MAX_BYTES`)."""
    return _limit(MAX_BYTES_VARIABLE, _DEFAULT_MAX_BYTES, int, "a whole number of bytes")


def load_archive(path: str | os.PathLike, source: str | None = None) -> dict[str, Any]:
    """The dict in a regular file holding a whole zip archive of uncompressed entries (at most `max_bytes()`), loaded
    with `weights_only=True` on the CPU; else `CheckpointError` naming `source` (the URL it came from) or the path."""
    p, source = Path(path), str(path) if source is None else source
    if not os.fspath(path):  # Path("") is ".", the current folder
        raise CheckpointError("checkpoint '' is an empty path: give a checkpoint file's path or URL")
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"checkpoint {source} does not exist") from None
    except OSError as err:  # a link loop, a name too long, a folder it may not enter
        raise CheckpointError(f"checkpoint {source} cannot be read: {err.strerror}") from err
    if stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"checkpoint {source} is a folder, not a checkpoint file")
    if not stat.S_ISREG(st.st_mode):
        link = " (through a symbolic link)" if p.is_symlink() else ""
        raise CheckpointError(f"checkpoint {source} is {file_kind(st.st_mode)}{link}, not a checkpoint file")
    if _kernel_file(p, st):
        raise CheckpointError(f"checkpoint {source} is a special file of the kernel (under /proc or /sys), not a file "
                              "on disk: not a checkpoint")
    if st.st_size == 0:
        raise CheckpointError(f"checkpoint {source} is empty (0 bytes): its writing was interrupted")
    try:
        # The checks and the load all read this one open file. Non-blocking: a pipe swapped in since the stat
        # above opens at once (and is refused below) instead of waiting for a writer.
        f = open(p, "rb", opener=lambda name, flags: os.open(name, flags | getattr(os, "O_NONBLOCK", 0)))
    except OSError as err:
        raise CheckpointError(f"checkpoint {source} cannot be read: {err.strerror}") from err
    with f:
        opened = os.fstat(f.fileno())
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise _changed(source)  # replaced between the checks above and the opening
        return _load_open(f, st, source)


def _load_open(f, st: os.stat_result, source: str) -> dict[str, Any]:
    """`load_archive` once the regular file `f` (`st` its status before it was opened) is open."""
    size = st.st_size
    try:
        head = f.read(8)
        entries = zipfile.ZipFile(f).infolist() if head.startswith(_ZIP) and zipfile.is_zipfile(f) else None
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"checkpoint {source} cannot be read: it is corrupted ({first_line(err)})") from err
    if packed := _packed_format(head):
        raise CheckpointError(f"checkpoint {source} is {packed}, not a checkpoint; unpack it first")
    if not head.startswith(_ZIP):
        raise CheckpointError(f"checkpoint {source} is not a PyTorch checkpoint (not the zip archive torch.save "
                              "writes)")
    if entries is None:
        if (end := _archive_end(f, size)) is not None:
            raise CheckpointError(f"checkpoint {source} has {size - end} bytes of data after the end of the archive "
                                  f"(which ends at byte {end}): something was appended to what torch.save wrote; "
                                  "refused")
        raise CheckpointError(f"checkpoint {source} is truncated: it starts like a checkpoint but its end is missing "
                              f"({size} bytes; was its writing interrupted?)")
    _check_entries(entries, source)
    f.seek(0)
    try:
        # Read into memory, not mapped (mmap=True): mapped pages are read from the file whenever a tensor is used,
        # so a file truncated after these checks kills the process (SIGBUS) and one overwritten in place changes
        # weights already validated. Read once, what `validate` checks is what is used; the file is checked not to
        # have changed while it was read. The memory is the checkpoint's size (a few hundred MB for this project's
        # models, bounded by max_bytes()), and validation reads every tensor anyway.
        checkpoint = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        _check_unchanged(f, st, source)
        if "weights only load failed" in str(err).lower():
            raise CheckpointError(f"checkpoint {source} holds Python objects that are not plain data; it was not "
                                  "written by this project, and loading it could run arbitrary code, so it is refused"
                                  ) from err
        raise CheckpointError(f"checkpoint {source} is not a PyTorch checkpoint, or it is corrupted "
                              f"({first_line(err)})") from err
    except RecursionError:
        raise CheckpointError(f"checkpoint {source} is nested too deeply to be a checkpoint; refused") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, OSError or EOFError for damaged archives)
        _check_unchanged(f, st, source)
        raise CheckpointError(f"checkpoint {source} cannot be loaded: it is corrupted ({first_line(err)})") from err
    _check_unchanged(f, st, source)
    return checkpoint


def _check_unchanged(f, before: os.stat_result, source: str) -> None:
    """Refuse what was read from `f` when its size or modification time is no longer `before`'s."""
    after = os.fstat(f.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise _changed(source)


def _changed(source: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {source} changed while it was read (is something writing it?); read it "
                           "again once it is written")


def _kernel_file(path: Path, st: os.stat_result) -> bool:
    """Whether `path` (`st` its status) is one of the kernel's files under /proc or /sys. They pass as regular files
    but are not files on disk: most report 0 bytes whatever they hold, some block when read (/proc/kmsg), none is a
    checkpoint. Judged without reading them (a read could block): by file system, the st_dev of /proc and /sys (which
    also catches one bound elsewhere), and by resolved path (the file systems mounted below them, such as
    /sys/fs/cgroup or /proc/sys/fs/binfmt_misc, have st_devs of their own)."""
    kernel = ("/proc", "/sys")
    devices = set()
    for root in kernel:
        with contextlib.suppress(OSError):  # not Linux
            devices.add(os.stat(root).st_dev)
    real = os.path.realpath(path)
    return st.st_dev in devices or any(real == root or real.startswith(f"{root}/") for root in kernel)


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
