"""`vit.training.checkpoint.fetch`: a checkpoint path or URL made a local file.

Every server here listens on 127.0.0.1; downloads land in the test's own torch hub folder.
"""

from __future__ import annotations

import base64
import bz2
import contextlib
import gzip
import lzma
import os
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fsspec
import pytest
import torch
from robust_helpers import cli, error_line, tiny_config

from vit.training.checkpoint import CheckpointError, read
from vit.training.checkpoint.fetch import fetch, load_archive, max_bytes, redact_url

HEADERS_LATE = "timed out: the server's status line and headers did not all arrive within 1 s (set " \
               "READABLE_VIT_DOWNLOAD_TIMEOUT to wait longer)"
DAY = 24 * 3600


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """The folder downloads are cached in, under this test's own torch hub folder."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return tmp_path / "torch_home" / "hub" / "checkpoints" / "readable-vit"


def cached_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


def checkpoint_bytes(tmp_path: Path, content: str) -> bytes:
    """A small file in torch.save's format (a zip archive), different for each `content`."""
    torch.save({"content": content}, tmp_path / "small.pt")
    return (tmp_path / "small.pt").read_bytes()


@contextlib.contextmanager
def http_server(respond):
    """`url` of a server whose GET calls `respond(handler, stop)`; `stop` is set when the block ends, so a handler
    that waits or trickles ends with it."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            with contextlib.suppress(OSError):  # the client hung up: what a refused download does
                respond(self, stop)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # serve_forever polls for shutdown every 0.5 s by default: each test's teardown would wait that long.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def serving(files: dict[str, bytes]):
    """A `respond` that serves `files` by path (any query string ignored), and 404 for any other path."""
    def respond(handler, stop):
        body = files.get(handler.path.split("?", 1)[0])
        handler.send_response(200 if body is not None else 404)
        handler.send_header("Content-Length", str(len(body or b"")))
        handler.end_headers()
        handler.wfile.write(body or b"")
    return respond


# --- paths and schemes


def test_a_path_is_itself_a_tilde_expanded_and_file_url_its_path(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch("runs/last.ckpt") == "runs/last.ckpt"
    assert fetch(Path("runs/last.ckpt")) == "runs/last.ckpt"
    assert fetch("~/last.ckpt") == str(tmp_path / "home" / "last.ckpt")
    assert fetch(f"file://{tmp_path}/x.ckpt") == f"{tmp_path}/x.ckpt"
    assert not cache.exists()  # nothing downloaded


def test_an_fsspec_url_is_downloaded_and_checked_like_http(tmp_path, cache):
    body = checkpoint_bytes(tmp_path, "memory")
    root = f"memory://vit-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe(f"{root}/run/last.ckpt", body)
        fs.pipe(f"{root}/run/page.ckpt", b"<!DOCTYPE html><html>sign in</html>")
        path = Path(fetch(f"{root}/run/last.ckpt"))
        assert path.read_bytes() == body and path.name == "last.ckpt" and path.is_relative_to(cache)
        with pytest.raises(CheckpointError) as err:
            fetch(f"{root}/run/page.ckpt")
    finally:
        fs.rm(root, recursive=True)
    assert str(err.value) == (f"checkpoint {root}/run/page.ckpt returned a web page, not a checkpoint (a login, error "
                              "or download page? give the file's direct download link)")
    assert cached_files(cache) == [path]


def test_an_unknown_scheme_is_one_line(cache):
    with pytest.raises(CheckpointError, match=r"^checkpoint nosuchscheme://h/x\.ckpt\?\.\.\. cannot be read: "):
        fetch("nosuchscheme://h/x.ckpt?token=s3cret")


# --- the cache


def test_two_urls_ending_in_the_same_name_are_two_files_read_afresh(tmp_path, cache):
    first, second, changed = (checkpoint_bytes(tmp_path, c) for c in ("first", "second", "changed"))
    files = {"/a/last.ckpt": first, "/b/last.ckpt": second}
    with http_server(serving(files)) as url:
        a, b = Path(fetch(f"{url}/a/last.ckpt")), Path(fetch(f"{url}/b/last.ckpt"))
        assert a != b and a.name == b.name == "last.ckpt"
        assert (a.read_bytes(), b.read_bytes()) == (first, second)
        files["/a/last.ckpt"] = changed  # a resumed run's last.ckpt is downloaded again, not read stale
        assert Path(fetch(f"{url}/a/last.ckpt")) == a and a.read_bytes() == changed
    assert cached_files(cache) == sorted([a, b])


def test_a_new_query_string_replaces_the_previous_copy(tmp_path, cache):
    first, second = checkpoint_bytes(tmp_path, "first"), checkpoint_bytes(tmp_path, "second")
    files = {"/x.ckpt": first}
    with http_server(serving(files)) as url:
        one = fetch(f"{url}/x.ckpt?X-Amz-Signature=s3cret1&X-Amz-Expires=60")
        files["/x.ckpt"] = second
        two = fetch(f"{url}/x.ckpt?X-Amz-Signature=s3cret2&X-Amz-Expires=60")
    assert one == two and Path(two).name == "x.ckpt" and "s3cret" not in two
    assert cached_files(cache) == [Path(two)]
    assert Path(two).read_bytes() == second


def test_a_download_deletes_cached_files_older_than_a_week(tmp_path, cache):
    def cached(folder: str, name: str, age_days: float) -> Path:
        path = cache / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"old download")
        then = time.time() - age_days * DAY
        os.utime(path, (then, then))
        return path

    old, recent = cached("0123456789abcdef", "old.ckpt", 8), cached("fedcba9876543210", "recent.ckpt", 6)
    stale_tmp = cached("fedcba9876543210", ".recent.ckpt.0011223344556677.tmp", 30)  # from a killed download
    body = checkpoint_bytes(tmp_path, "new")
    with http_server(serving({"/new.ckpt": body})) as url:
        new = Path(fetch(f"{url}/new.ckpt"))
    assert not old.exists() and not old.parent.exists() and not stale_tmp.exists()
    assert cached_files(cache) == sorted([new, recent])
    assert recent.read_bytes() == b"old download" and new.read_bytes() == body


def test_a_refused_download_deletes_nothing_from_the_cache(cache):
    old = cache / "0123456789abcdef" / "old.ckpt"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"old download")
    os.utime(old, (time.time() - 8 * DAY,) * 2)
    with http_server(serving({})) as url, pytest.raises(CheckpointError):
        fetch(f"{url}/missing.ckpt")
    assert cached_files(cache) == [old]  # pruning comes only after a download that succeeded


# --- time and size limits


def trickle_headers(hung_up: threading.Event):
    """A `respond` that sends its status line and headers one byte per 0.2 s, and sets `hung_up` once the client
    has closed the connection."""
    def respond(handler, stop):
        try:
            for byte in b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 10\r\n\r\n":
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                if stop.wait(0.2):
                    return
        except OSError:
            hung_up.set()
            raise
    return respond


def silent(handler, stop):
    """A server that reads the request, then answers nothing."""
    stop.wait(30)


def test_headers_that_trickle_time_out_at_the_deadline_and_leave_nothing(cache, monkeypatch):
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    hung_up = threading.Event()
    with http_server(trickle_headers(hung_up)) as url:
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            fetch(f"{url}/x.ckpt?token=s3cret")
        elapsed = time.monotonic() - started
        assert hung_up.wait(2)  # the connection was closed, not left trickling in the background
    assert str(err.value) == f"checkpoint {url}/x.ckpt?... {HEADERS_LATE}"
    assert 0.9 < elapsed < 3
    assert cached_files(cache) == []


def test_a_server_that_never_answers_times_out(cache, monkeypatch):
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    with http_server(silent) as url:
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            fetch(f"{url}/x.ckpt")
        assert time.monotonic() - started < 3
    assert str(err.value) == f"checkpoint {url}/x.ckpt {HEADERS_LATE}"
    assert cached_files(cache) == []


def test_a_body_that_trickles_times_out_and_leaves_nothing(cache, monkeypatch):
    def respond(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        while not stop.wait(0.2):
            handler.wfile.write(b"x")
            handler.wfile.flush()

    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    with http_server(respond) as url:
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            fetch(f"{url}/x.ckpt")
        assert time.monotonic() - started < 3
    assert str(err.value) == (f"checkpoint {url}/x.ckpt timed out: less than 1 MiB arrived in 1 s (set "
                              "READABLE_VIT_DOWNLOAD_TIMEOUT to wait longer)")
    assert cached_files(cache) == []


def test_a_redirect_within_the_deadline_is_followed(tmp_path, cache, monkeypatch):
    body = checkpoint_bytes(tmp_path, "moved")

    def respond(handler, stop):
        if handler.path == "/old.ckpt":
            time.sleep(0.4)  # two slow answers, each within the deadline
            handler.send_response(302)
            handler.send_header("Location", "/new.ckpt")
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        else:
            time.sleep(0.4)
            serving({"/new.ckpt": body})(handler, stop)

    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    with http_server(respond) as url:
        path = Path(fetch(f"{url}/old.ckpt"))
    assert path.name == "old.ckpt" and path.read_bytes() == body


@pytest.mark.parametrize("announced", [True, False])
def test_a_file_above_the_size_limit_is_refused_and_not_kept(announced, tmp_path, cache, monkeypatch):
    body = checkpoint_bytes(tmp_path, "x" * 5000)

    def respond(handler, stop):
        handler.send_response(200)
        if announced:
            handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()  # without a length, HTTP/1.0: the body ends when the connection closes
        handler.wfile.write(body)

    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_MAX_BYTES", "1000")
    with http_server(respond) as url, pytest.raises(CheckpointError) as err:
        fetch(f"{url}/big.ckpt")
    size = f"{len(body)} bytes" if announced else "more than 1000 bytes"
    assert str(err.value) == (f"checkpoint {url}/big.ckpt is too large: {size}, above the limit of 1000 bytes "
                              "(set READABLE_VIT_DOWNLOAD_MAX_BYTES to allow more)")
    assert cached_files(cache) == []
    monkeypatch.delenv("READABLE_VIT_DOWNLOAD_MAX_BYTES")
    with http_server(respond) as url:  # under the default limit, the same file is downloaded
        assert Path(fetch(f"{url}/big.ckpt")).read_bytes() == body


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("READABLE_VIT_DOWNLOAD_TIMEOUT", "soon", "expected a number of seconds > 0 (default 60)"),
    ("READABLE_VIT_DOWNLOAD_TIMEOUT", "nan", "expected a number of seconds > 0 (default 60)"),
    ("READABLE_VIT_DOWNLOAD_MAX_BYTES", "4G", "expected a whole number of bytes > 0 (default 4294967296)"),
    ("READABLE_VIT_DOWNLOAD_MAX_BYTES", "0", "expected a whole number of bytes > 0 (default 4294967296)"),
])
def test_a_bad_limit_in_the_environment_is_named(variable, value, expected, cache, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(CheckpointError, match=f"^{re.escape(f'{variable}={value!r} is not allowed: {expected}')}$"):
        fetch("http://127.0.0.1:1/x.ckpt")  # refused before any connection


def test_max_bytes_is_the_environment_s_limit(monkeypatch):
    assert max_bytes() == 4 * 2**30
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_MAX_BYTES", "1234")
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "soon")  # not its business
    assert max_bytes() == 1234


# --- what is not a checkpoint


@pytest.mark.parametrize(("content", "expected"), [
    (b"<!DOCTYPE html>\n<html><body>Sign in to download</body></html>",
     "returned a web page, not a checkpoint (a login, error or download page? give the file's direct download link)"),
    (b"\n  <html><head><title>404</title></head></html>",
     "returned a web page, not a checkpoint (a login, error or download page? give the file's direct download link)"),
    (b"not a checkpoint",
     "returned something that is not a checkpoint: its 16 bytes are not the zip archive torch.save writes"),
    ("truncated", "returned a truncated file: it starts like a checkpoint but its end is missing (300 bytes)"),
])
def test_what_is_not_a_checkpoint_is_refused_naming_the_url_and_not_kept(content, expected, tmp_path, cache):
    body = checkpoint_bytes(tmp_path, "whole")[:300] if content == "truncated" else content
    with http_server(serving({"/x.ckpt": body})) as url, pytest.raises(CheckpointError) as err:
        fetch(f"{url}/x.ckpt?token=s3cret")
    assert str(err.value) == f"checkpoint {url}/x.ckpt?... {expected}"
    assert list(cache.iterdir()) == []  # neither the file nor its folder


def test_a_connection_closed_early_is_named(tmp_path, cache):
    def respond(handler, stop):
        handler.send_response(200)
        handler.send_header("Content-Length", "5000")
        handler.end_headers()
        handler.wfile.write(b"PK\x03\x04" + b"x" * 100)

    with http_server(respond) as url, pytest.raises(CheckpointError) as err:
        fetch(f"{url}/x.ckpt")
    assert str(err.value) == (f"checkpoint {url}/x.ckpt could not be downloaded: the connection closed after 104 of "
                              "5000 bytes")
    assert cached_files(cache) == []


# --- credentials and redaction


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def guarded(body: bytes, authorization: str, seen: list, redirect: str | None = None):
    """A `respond` that records each request's Authorization header and answers 401 without `authorization`; with it,
    `body`, or a redirect to `redirect`."""
    def respond(handler, stop):
        seen.append(handler.headers.get("Authorization"))
        if handler.headers.get("Authorization") != authorization:
            handler.send_response(401)
            handler.send_header("WWW-Authenticate", 'Basic realm="checkpoints"')
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        elif redirect:
            handler.send_response(302)
            handler.send_header("Location", redirect)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
        else:
            serving({handler.path.split("?", 1)[0]: body})(handler, stop)
    return respond


def test_credentials_in_the_url_are_sent_as_basic_authorization_never_shown(tmp_path, cache):
    body, seen = checkpoint_bytes(tmp_path, "private"), []
    with http_server(guarded(body, basic("user", "p@ss word"), seen)) as url:
        host = url.removeprefix("http://")
        path = fetch(f"http://user:p%40ss%20word@{host}/x.ckpt")
        assert Path(path).read_bytes() == body and "user" not in path and "p%40ss" not in path
        with pytest.raises(CheckpointError) as without:
            fetch(f"{url}/x.ckpt")
        with pytest.raises(CheckpointError) as wrong:
            fetch(f"http://user:wr0ngpass@{host}/x.ckpt")
    assert seen == [basic("user", "p@ss word"), None, basic("user", "wr0ngpass")]
    assert str(without.value) == f"checkpoint {url}/x.ckpt could not be downloaded: HTTPError: HTTP Error 401: " \
                                 "Unauthorized"
    assert str(wrong.value) == f"checkpoint http://***@{host}/x.ckpt could not be downloaded: HTTPError: HTTP " \
                               "Error 401: Unauthorized"
    assert cached_files(cache) == [Path(path)]


def test_credentials_are_not_sent_to_where_the_url_redirects(tmp_path, cache):
    body, seen_there, seen_here = checkpoint_bytes(tmp_path, "elsewhere"), [], []

    def there(handler, stop):
        seen_there.append(handler.headers.get("Authorization"))
        serving({"/blob": body})(handler, stop)

    with http_server(there) as elsewhere, \
            http_server(guarded(body, basic("me", "s3cret"), seen_here, redirect=f"{elsewhere}/blob")) as url:
        path = fetch(f"http://me:s3cret@{url.removeprefix('http://')}/x.ckpt")
    assert Path(path).read_bytes() == body
    assert seen_here == [basic("me", "s3cret")] and seen_there == [None]


def test_an_unreachable_url_with_credentials_shows_neither_them_nor_the_query(cache):
    with pytest.raises(CheckpointError) as err:
        fetch("http://user:s3cret@127.0.0.1:1/x.ckpt?token=t0ken")  # port 1: the connection is refused
    assert str(err.value).startswith("checkpoint http://***@127.0.0.1:1/x.ckpt?... could not be downloaded: "
                                     "ConnectionRefusedError: ")
    assert "s3cret" not in str(err.value) and "t0ken" not in str(err.value)


@pytest.mark.parametrize(("url", "shown"), [
    ("https://host/x.ckpt", "https://host/x.ckpt"),
    ("https://host/x.ckpt?token=s3cret#part", "https://host/x.ckpt?..."),
    ("https://user:s3cret@host:8443/x.ckpt", "https://***@host:8443/x.ckpt"),
    ("ftp://token@host/x.ckpt?a=1", "ftp://***@host/x.ckpt?..."),
    ("https://user:s3cret@[::1/x.ckpt?t=1", "https://***@[::1/x.ckpt"),  # not a valid URL: still redacted
])
def test_redact_url_hides_the_query_string_and_the_credentials(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize(("url", "shown"), [
    ("HTTP://User:s3cret@Host/x.ckpt?t=1", "HTTP://***@Host/x.ckpt?..."),  # as written, not rebuilt lower-cased
    ("runs/x?y#z.ckpt", "runs/x?y#z.ckpt"),  # a path is not a URL: '?' and '#' are part of its name
    ("file:/tmp/x.ckpt", "file:/tmp/x.ckpt"),  # a file: URL holds no secret: shown as given
])
def test_redact_url_leaves_paths_and_what_it_does_not_hide_as_given(url, shown):
    assert redact_url(url) == shown


# --- schemes and redirects: http(s) only, within the deadline


def refused_scheme(shown: str, scheme: str) -> str:
    return (f"checkpoint {shown} cannot be read: the scheme {scheme!r} is not allowed: expected http://, https://, "
            "file:// or a path, or an object store (s3://, s3a://, gs://, gcs://, az://, abfs://, abfss://, hf://, "
            "memory://); download the file another way and pass its path")


@contextlib.contextmanager
def listening_silently():
    """A port on 127.0.0.1 that accepts connections and never sends a byte (an FTP server would greet first)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:{port}/x.ckpt", "FTP://u:s3cret@127.0.0.1:{port}/x.ckpt",
                                 "sftp://127.0.0.1:{port}/x.ckpt", "simplecache::ftp://127.0.0.1:{port}/x.ckpt"])
def test_a_url_of_a_scheme_without_a_deadline_is_refused_at_once(url, cache, monkeypatch):
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    with listening_silently() as port:
        url = url.format(port=port)
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            fetch(url)
        assert time.monotonic() - started < 0.5  # no connection tried
    scheme = url.split(":", 1)[0].lower()
    assert str(err.value) == refused_scheme(redact_url(url), scheme)
    assert "s3cret" not in str(err.value)
    assert not cache.exists()


def redirecting(location: str):
    def respond(handler, stop):
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return respond


@pytest.mark.parametrize(("location", "shown", "scheme"), [
    ("ftp://127.0.0.1:{port}/x.ckpt?token=s3cret", "ftp://127.0.0.1:{port}/x.ckpt?...", "ftp"),
    ("file:///etc/passwd", "file:///etc/passwd", "file"),
    ("gopher://127.0.0.1:{port}/x", "gopher://127.0.0.1:{port}/x", "gopher"),
])
def test_a_redirect_to_another_scheme_than_http_is_refused_naming_it(location, shown, scheme, cache, monkeypatch):
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    with listening_silently() as port, http_server(redirecting(location.format(port=port))) as url:
        started = time.monotonic()
        with pytest.raises(CheckpointError) as err:
            fetch(f"{url}/x.ckpt")
        assert time.monotonic() - started < 0.9  # refused, not timed out
    assert str(err.value) == (f"checkpoint {url}/x.ckpt could not be downloaded: it redirects to "
                              f"{shown.format(port=port)}, a {scheme} URL: only http and https are followed")
    assert cached_files(cache) == []


def test_ten_redirects_are_followed_and_an_eleventh_or_a_loop_is_refused(tmp_path, cache):
    body = checkpoint_bytes(tmp_path, "far")

    def respond(handler, stop):  # /hop/N redirects to /hop/N-1, /hop/0 is the file; /loop redirects to itself
        if handler.path == "/loop":
            redirecting("/loop")(handler, stop)
        elif hops := int(handler.path.rsplit("/", 1)[1]):
            redirecting(f"/hop/{hops - 1}")(handler, stop)
        else:
            serving({handler.path: body})(handler, stop)

    with http_server(respond) as url:
        far = Path(fetch(f"{url}/hop/10"))
        for path in ("hop/11", "loop"):
            with pytest.raises(CheckpointError) as err:
                fetch(f"{url}/{path}")
            assert str(err.value) == f"checkpoint {url}/{path} could not be downloaded: it redirects more than 10 times"
    assert far.read_bytes() == body and cached_files(cache) == [far]


def test_an_upper_case_scheme_is_the_same_scheme_and_shown_as_given(tmp_path, cache):
    body = checkpoint_bytes(tmp_path, "upper")
    with http_server(serving({"/x.ckpt": body})) as url:
        loud = url.replace("http://", "HTTP://")
        assert Path(fetch(f"{loud}/x.ckpt")).read_bytes() == body
        with pytest.raises(CheckpointError) as err:
            fetch(f"{loud}/missing.ckpt")
    assert str(err.value) == f"checkpoint {loud}/missing.ckpt could not be downloaded: HTTPError: HTTP Error 404: " \
                             "Not Found"


# --- the cached file's name


@pytest.mark.parametrize(("component", "name"), [
    ("a" * 300 + ".ckpt", r"checkpoint-[0-9a-f]{16}\.ckpt"),  # over the 255 characters a file name may have
    ("..", r"checkpoint-[0-9a-f]{16}\.ckpt"),  # would name the cache folder's parent
    (".x.ckpt", r"checkpoint-[0-9a-f]{16}\.ckpt"),  # a leading dot: the temporary files' prefix
    ("my%20model.pt", r"checkpoint-[0-9a-f]{16}\.pt"),
    ("x.ckpt;" + "b" * 40, r"checkpoint-[0-9a-f]{16}\.ckpt"),  # a suffix that is not a plain one
    ("last.ckpt", r"last\.ckpt"),
])
def test_the_cached_name_is_the_url_s_only_when_it_is_short_and_plain(component, name, tmp_path, cache):
    body = checkpoint_bytes(tmp_path, "named")
    with http_server(serving({f"/run/{component}": body})) as url:
        path = Path(fetch(f"{url}/run/{component}"))
        with pytest.raises(CheckpointError) as err:
            fetch(f"{url}/gone/{component}")
    assert re.fullmatch(name, path.name) and path.parent.parent == cache and path.read_bytes() == body
    assert str(err.value) == f"checkpoint {url}/gone/{component} could not be downloaded: HTTPError: HTTP Error 404: " \
                             "Not Found"
    assert cached_files(cache) == [path]


# --- what is read is what was checked


def saved(path: Path) -> Path:
    torch.save({"weight": torch.arange(4096, dtype=torch.float32)}, path)
    return path


def test_the_loaded_weights_are_read_once_not_mapped_from_the_file(tmp_path):
    path = saved(tmp_path / "x.ckpt")
    weight = load_archive(path)["weight"]
    assert weight.untyped_storage().filename is None  # in memory: a mapped tensor names its file
    data = path.read_bytes()
    start = data.index(torch.arange(4096, dtype=torch.float32).numpy().tobytes())
    with open(path, "r+b") as f:  # overwritten in place: a mapped tensor would now read NaN
        f.seek(start)
        f.write(torch.full((4096,), float("nan")).numpy().tobytes())
    assert torch.equal(weight, torch.arange(4096, dtype=torch.float32))
    os.truncate(path, 0)  # truncated: touching a mapped tensor's pages would kill the process (SIGBUS)
    assert weight.sum().item() == sum(range(4096))


def test_a_checkpoint_written_while_it_is_read_is_refused(tmp_path, monkeypatch):
    path = saved(tmp_path / "x.ckpt")
    real_load = torch.load

    def load_while_written(f, **kwargs):
        with open(path, "ab") as writer:
            writer.write(b"more")
        return real_load(f, **kwargs)

    monkeypatch.setattr(torch, "load", load_while_written)
    with pytest.raises(CheckpointError) as err:
        load_archive(path)
    assert str(err.value) == f"checkpoint {path} changed while it was read (is something writing it?); read it again " \
                             "once it is written"


# --- what is not a checkpoint, said for what it is


def archive_with_junk(tmp_path: Path) -> tuple[Path, int]:
    path = saved(tmp_path / "junk.ckpt")
    end = path.stat().st_size
    with open(path, "ab") as f:
        f.write(os.urandom(100_000))  # past the 64 KiB in which zipfile looks for the archive's end
    return path, end


def test_data_after_the_end_of_the_archive_is_named_not_called_truncated(tmp_path, cache):
    path, end = archive_with_junk(tmp_path)
    with pytest.raises(CheckpointError) as err:
        read(path)
    assert str(err.value) == (f"checkpoint {path} has 100000 bytes of data after the end of the archive (which ends "
                              f"at byte {end}): something was appended to what torch.save wrote; refused")
    with http_server(serving({"/x.ckpt": path.read_bytes()})) as url, pytest.raises(CheckpointError) as err:
        fetch(f"{url}/x.ckpt")
    assert str(err.value) == (f"checkpoint {url}/x.ckpt returned a file with 100000 bytes of data after the end of "
                              f"the archive (which ends at byte {end}): something was appended to it; refused")
    assert list(cache.iterdir()) == []


def test_a_truncated_archive_is_still_called_truncated(tmp_path):
    path = saved(tmp_path / "x.ckpt")
    os.truncate(path, path.stat().st_size - 30)  # the end record gone, the central directory still there
    with pytest.raises(CheckpointError) as err:
        read(path)
    assert str(err.value) == (f"checkpoint {path} is truncated: it starts like a checkpoint but its end is missing "
                              f"({path.stat().st_size} bytes; was its writing interrupted?)")


@pytest.mark.parametrize(("pack", "kind"), [(gzip.compress, "a gzip file"), (bz2.compress, "a bzip2 file"),
                                            (lzma.compress, "an xz file")])
def test_a_compressed_checkpoint_is_named_for_its_format(pack, kind, tmp_path, cache):
    packed = tmp_path / "x.ckpt.gz"
    packed.write_bytes(pack(saved(tmp_path / "x.ckpt").read_bytes()))
    with pytest.raises(CheckpointError) as err:
        read(packed)
    assert str(err.value) == f"checkpoint {packed} is {kind}, not a checkpoint; unpack it first"
    with http_server(serving({"/x.ckpt.gz": packed.read_bytes()})) as url, pytest.raises(CheckpointError) as err:
        fetch(f"{url}/x.ckpt.gz")
    assert str(err.value) == f"checkpoint {url}/x.ckpt.gz returned {kind}, not a checkpoint; unpack it first"
    assert list(cache.iterdir()) == []


KERNEL_FILE = "is a special file of the kernel (under /proc or /sys), not a file on disk: not a checkpoint"


@pytest.mark.parametrize(("given", "expected"), [
    ("", "checkpoint '' is an empty path: give a checkpoint file's path or URL"),
    ("/proc/self/environ", f"checkpoint /proc/self/environ {KERNEL_FILE}"),  # reports 0 bytes, holds many
    ("/proc/kmsg", f"checkpoint /proc/kmsg {KERNEL_FILE}"),  # reading it would block
    ("/sys/kernel/mm/transparent_hugepage/enabled",
     f"checkpoint /sys/kernel/mm/transparent_hugepage/enabled {KERNEL_FILE}"),
    ("{tmp}/zero.ckpt", "checkpoint {tmp}/zero.ckpt is a character device (through a symbolic link), not a checkpoint "
                        "file"),
    ("{tmp}/proc.ckpt", f"checkpoint {{tmp}}/proc.ckpt {KERNEL_FILE}"),  # a link into /proc
    ("file:{tmp}/nope.ckpt", "checkpoint file:{tmp}/nope.ckpt does not exist"),  # shown as given, not rewritten
    ("FILE://localhost{tmp}/nope%20here.ckpt", "checkpoint FILE://localhost{tmp}/nope%20here.ckpt does not exist"),
    ("file://server{tmp}/x.ckpt", "checkpoint file://server{tmp}/x.ckpt names the host 'server': a file: URL is read "
                                  "on this machine only (file:///path/to/x.ckpt); pass the path"),
    ("file://{tmp}/x.ckpt?v=1", "checkpoint file://{tmp}/x.ckpt?v=1 has a query string or fragment, which a file: URL "
                                "cannot use (a '?' or '#' in the file's name is written %3F or %23); pass the path"),
])
def test_what_is_not_a_checkpoint_file_is_named_for_what_it_is(given, expected, tmp_path):
    (tmp_path / "zero.ckpt").symlink_to("/dev/zero")
    (tmp_path / "proc.ckpt").symlink_to("/proc/self/environ")
    given, expected = given.replace("{tmp}", str(tmp_path)), expected.replace("{tmp}", str(tmp_path))
    if given.startswith(("/proc", "/sys")) and not os.path.exists(given):
        pytest.skip(f"{given} does not exist here")
    with pytest.raises(CheckpointError) as err:
        read(given)
    assert str(err.value) == expected


def test_a_file_url_is_decoded_and_read_on_this_machine(tmp_path):
    path = saved(tmp_path / "a b#1.ckpt")
    for url in (path.as_uri(), f"file://localhost{path.as_uri()[7:]}", f"FILE:{path.as_uri()[7:]}"):
        assert fetch(url) == str(path)


def test_the_command_line_says_each_refusal_in_one_line(tmp_path, cache, monkeypatch, capsys):
    packed = tmp_path / "x.ckpt.gz"
    packed.write_bytes(gzip.compress(saved(tmp_path / "x.ckpt").read_bytes()))
    long_name = "a" * 300 + ".ckpt"
    with http_server(redirecting("ftp://127.0.0.1:1/x.ckpt")) as url:
        for given, expected in [
            (f"{url}/x.ckpt", f"checkpoint {url}/x.ckpt could not be downloaded: it redirects to "
                              "ftp://127.0.0.1:1/x.ckpt, a ftp URL: only http and https are followed"),
            (f"{url}/{long_name}", f"checkpoint {url}/{long_name} could not be downloaded: it redirects to "
                                   "ftp://127.0.0.1:1/x.ckpt, a ftp URL: only http and https are followed"),
            (str(packed), f"checkpoint {packed} is a gzip file, not a checkpoint; unpack it first"),
        ]:
            code, stderr = cli(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", given],
                               monkeypatch, capsys)
            assert (code, error_line(stderr)) == (2, f"error: {expected}")
    assert cached_files(cache) == []
