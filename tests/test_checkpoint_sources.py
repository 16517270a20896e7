"""Every way a checkpoint enters (a path, `file://`, `http://`, `last`) loads with weights_only=True and passes the
same checks.

The URL cases use a real HTTP server on 127.0.0.1 serving files the tests write. The download's own limits
(deadlines, sizes, the cache) are tested in `tests/test_checkpoint_fetch.py`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from robust_helpers import cli, error_line, main_in_process, run_dirs, shared_run, tiny_config

from vit import predict
from vit.training.checkpoint import CheckpointError
from vit.training.checkpoint.fetch import fetch as fetch_checkpoint
from vit.training.checkpoint.io import AtomicCheckpointIO


class RunsCode:
    """Pickles to a call of os.system: loading it with weights_only=False creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def trained(tmp_path_factory, monkeypatch) -> Path:
    root = shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)
    [run_dir] = run_dirs(root)
    return run_dir / "checkpoints" / "last.ckpt"


@pytest.fixture
def served(tmp_path, monkeypatch):
    """`(folder, url)`: files written into `folder` are served at `url` by an HTTP server on 127.0.0.1."""
    folder = tmp_path / "served"
    folder.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # downloads land in the test's folder
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # serve_forever polls for shutdown every 0.5 s by default: each test's teardown waited that long.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def malicious_copy(trained: Path, path: Path, marker: Path) -> Path:
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["callbacks"] = {"payload": RunsCode(marker)}
    torch.save(checkpoint, path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("subcommand", ["validate", "fit"])
@pytest.mark.parametrize("scheme", ["http", "file", "path"])
def test_a_checkpoint_that_would_run_code_is_refused_from_every_source(
        scheme, subcommand, trained, served, tmp_path, monkeypatch, capsys):
    folder, url = served
    marker = tmp_path / "code_ran"
    evil = malicious_copy(trained, folder / "x.ckpt", marker)
    source = {"http": f"{url}/x.ckpt", "file": evil.as_uri(), "path": str(evil)}[scheme]
    code, stderr = cli([subcommand, "--config", str(tiny_config(tmp_path)), "--ckpt_path", source],
                       monkeypatch, capsys)
    assert code == 2
    assert "holds Python objects that are not plain data" in error_line(stderr)
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()  # refused before any run folder


@pytest.mark.slow
def test_the_checkpoint_io_reads_through_the_owner_whatever_it_is_asked(trained, tmp_path):
    marker = tmp_path / "code_ran"
    evil = malicious_copy(trained, tmp_path / "x.ckpt", marker)
    with pytest.raises(CheckpointError, match="holds Python objects that are not plain data"):
        AtomicCheckpointIO().load_checkpoint(evil, weights_only=False)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["file", "path"])
def test_a_checkpoint_with_a_nan_weight_is_refused_whatever_the_scheme(scheme, trained, tmp_path, monkeypatch, capsys):
    checkpoint = torch.load(trained, weights_only=True)
    checkpoint["state_dict"]["backbone.head.bias"][0] = float("nan")
    path = tmp_path / "nan.ckpt"
    torch.save(checkpoint, path)
    source = path.as_uri() if scheme == "file" else str(path)
    code, stderr = cli(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", source],
                       monkeypatch, capsys)
    assert code == 2
    assert "backbone.head.bias holds NaN or infinite values" in error_line(stderr)


@pytest.mark.slow
def test_a_good_checkpoint_from_a_url_validates(trained, served, tmp_path, monkeypatch, capsys):
    folder, url = served
    (folder / "last.ckpt").write_bytes(trained.read_bytes())
    main_in_process(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", f"{url}/last.ckpt"],
                    monkeypatch)
    assert "val/acc" in capsys.readouterr().out


@pytest.mark.slow
def test_a_url_that_cannot_be_reached_is_one_line(tmp_path, monkeypatch, capsys):
    with contextlib.closing(socket.socket()) as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    with pytest.raises(CheckpointError, match=rf"checkpoint http://127.0.0.1:{port}/x.ckpt could not be downloaded"):
        fetch_checkpoint(f"http://127.0.0.1:{port}/x.ckpt")
    code, stderr = cli(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path",
                        f"http://127.0.0.1:{port}/x.ckpt"], monkeypatch, capsys)
    assert code == 2 and "could not be downloaded" in error_line(stderr)


@pytest.mark.slow
def test_predict_refuses_a_url_checkpoint_that_would_run_code(trained, served, tmp_path, capsys):
    folder, url = served
    marker = tmp_path / "code_ran"
    malicious_copy(trained, folder / "x.ckpt", marker)
    images = tmp_path / "images"
    images.mkdir()
    code = predict.main(["--ckpt_path", f"{url}/x.ckpt", "--input_dir", str(images),
                         "--output", str(tmp_path / "p.csv")])
    assert code == 2
    assert "holds Python objects that are not plain data" in error_line(capsys.readouterr().err)
    assert not marker.exists()


@pytest.mark.slow
def test_explain_refuses_a_url_checkpoint_that_would_run_code(trained, served, tmp_path, capsys):
    from vit.explain.__main__ import main as explain_main

    folder, url = served
    marker = tmp_path / "code_ran"
    malicious_copy(trained, folder / "x.ckpt", marker)
    code = explain_main(["--ckpt_path", f"{url}/x.ckpt", "--out", str(tmp_path / "maps.png")])
    assert code == 2
    assert "holds Python objects that are not plain data" in error_line(capsys.readouterr().err)
    assert not marker.exists()


# --- A refused download through a door, and what the cache keeps (the limits themselves: test_checkpoint_fetch) ---


def cached_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "torch_home").rglob("*") if p.is_file()]


@pytest.mark.slow
@pytest.mark.parametrize(("content", "expected"), [
    (b"<!DOCTYPE html>\n<html><body>Sign in to download</body></html>",
     "returned a web page, not a checkpoint (a login, error or download page? give the file's direct download link)"),
    (b"\n  <html><head><title>404</title></head></html>",
     "returned a web page, not a checkpoint (a login, error or download page? give the file's direct download link)"),
    (b"not a checkpoint",
     "returned something that is not a checkpoint: its 16 bytes are not the zip archive torch.save writes"),
    ("truncated", "returned a truncated file: it starts like a checkpoint but its end is missing (2000 bytes)"),
])
def test_what_is_not_a_checkpoint_is_refused_naming_the_url_and_not_kept(
        content, expected, trained, served, tmp_path, monkeypatch, capsys):
    folder, url = served
    (folder / "x.ckpt").write_bytes(trained.read_bytes()[:2000] if content == "truncated" else content)
    with pytest.raises(CheckpointError) as err:
        fetch_checkpoint(f"{url}/x.ckpt")
    assert str(err.value) == f"checkpoint {url}/x.ckpt {expected}"
    assert cached_files(tmp_path) == []
    if content == "truncated":  # the command line says the same, in one line
        code, stderr = cli(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", f"{url}/x.ckpt"],
                           monkeypatch, capsys)
        assert code == 2 and error_line(stderr) == f"error: checkpoint {url}/x.ckpt {expected}"


def test_an_ftp_url_is_refused_before_any_connection(tmp_path, monkeypatch, capsys):
    # urllib and fsspec would speak ftp without a deadline; the scheme is refused before a socket is opened.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    message = "checkpoint ftp://127.0.0.1:1/x.ckpt cannot be read: the scheme 'ftp' is not allowed: "
    with pytest.raises(CheckpointError, match=re.escape(message)):
        fetch_checkpoint("ftp://127.0.0.1:1/x.ckpt")
    code, stderr = cli(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", "ftp://127.0.0.1:1/x.ckpt"],
                       monkeypatch, capsys)
    assert code == 2 and error_line(stderr).startswith(f"error: {message}")
    assert not (tmp_path / "torch_home").exists()


@pytest.mark.slow
def test_a_query_string_stays_out_of_the_cache_name_and_the_messages(trained, served):
    folder, url = served
    (folder / "last.ckpt").write_bytes(trained.read_bytes())
    path = Path(fetch_checkpoint(f"{url}/last.ckpt?token=s3cret&expires=1"))
    assert path.name == "last.ckpt" and "s3cret" not in str(path)
    assert path.read_bytes() == trained.read_bytes()
    with pytest.raises(CheckpointError) as err:
        fetch_checkpoint(f"{url}/missing.ckpt?token=s3cret")
    assert str(err.value) == (f"checkpoint {url}/missing.ckpt?... could not be downloaded: HTTPError: "
                              "HTTP Error 404: File not found")
    with pytest.raises(CheckpointError) as err:
        fetch_checkpoint("ftp://user:s3cret@127.0.0.1:1/x.ckpt?token=s3cret")
    assert "s3cret" not in str(err.value)
    assert str(err.value).startswith("checkpoint ftp://***@127.0.0.1:1/x.ckpt?... cannot be read: the scheme 'ftp' is "
                                     "not allowed")


@pytest.mark.slow
def test_a_path_starting_with_a_tilde_is_expanded(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "last.ckpt").write_bytes(trained.read_bytes())
    assert fetch_checkpoint("~/last.ckpt") == str(tmp_path / "home" / "last.ckpt")
    main_in_process(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", "~/last.ckpt"], monkeypatch)
    assert "val/acc" in capsys.readouterr().out
