"""Every way a checkpoint enters (a path, `file://`, `http://`, `last`) loads with weights_only=True and passes the same checks.

The URL cases use a real HTTP server on 127.0.0.1 serving files the tests write.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from robust_helpers import cli, error_line, main_in_process, run_dirs, shared_run, tiny_config

from vit import predict
from vit.training.checkpointing import AtomicCheckpointIO, CheckpointError, fetch_checkpoint


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
    thread = threading.Thread(target=server.serve_forever, daemon=True)
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


def test_the_checkpoint_io_loads_with_weights_only_whatever_it_is_asked(trained, tmp_path):
    marker = tmp_path / "code_ran"
    evil = malicious_copy(trained, tmp_path / "x.ckpt", marker)
    with pytest.raises(Exception, match="Weights only load failed"):
        AtomicCheckpointIO().load_checkpoint(evil, weights_only=False)
    assert not marker.exists()


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


def test_a_good_checkpoint_from_a_url_validates(trained, served, tmp_path, monkeypatch, capsys):
    folder, url = served
    (folder / "last.ckpt").write_bytes(trained.read_bytes())
    main_in_process(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", f"{url}/last.ckpt"],
                    monkeypatch)
    assert "val/acc" in capsys.readouterr().out


def test_two_urls_ending_in_the_same_name_are_two_files(served):
    folder, url = served
    for name, content in (("a", b"first"), ("b", b"second")):
        (folder / name).mkdir()
        (folder / name / "last.ckpt").write_bytes(content)
    first, second = fetch_checkpoint(f"{url}/a/last.ckpt"), fetch_checkpoint(f"{url}/b/last.ckpt")
    assert first != second
    assert (Path(first).read_bytes(), Path(second).read_bytes()) == (b"first", b"second")
    (folder / "a" / "last.ckpt").write_bytes(b"changed")  # a resumed run's last.ckpt is read afresh
    assert Path(fetch_checkpoint(f"{url}/a/last.ckpt")).read_bytes() == b"changed"


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


def test_explain_refuses_a_url_checkpoint_that_would_run_code(trained, served, tmp_path, capsys):
    from vit.explain.__main__ import main as explain_main

    folder, url = served
    marker = tmp_path / "code_ran"
    malicious_copy(trained, folder / "x.ckpt", marker)
    code = explain_main(["--ckpt_path", f"{url}/x.ckpt", "--out", str(tmp_path / "maps.png")])
    assert code == 2
    assert "holds Python objects that are not plain data" in error_line(capsys.readouterr().err)
    assert not marker.exists()
