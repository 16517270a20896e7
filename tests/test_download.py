"""A model folder at an http(s) URL: `vit.load(url)` downloads `<url>/config.json` and `<url>/model.safetensors`
under one byte limit and one deadline each, follows redirects to http(s) only, and names the URL without its query
string in every message. A real HTTP server on 127.0.0.1 serves what the tests write."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest
import torch

import vit
import vit.artifact as artifact
from vit.artifact.download import DownloadError
from vit.models import VisionTransformer
from vit.models.timm_compat import timm_state_dict
from vit.models.weights import PretrainedError

HANDLERS: dict[str, object] = {}  # path -> bytes to serve, or a callable(handler) that answers itself
REQUESTS: list[str] = []


class Serve(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802  (http.server's name)
        REQUESTS.append(self.path)
        answer = HANDLERS.get(self.path.split("?", 1)[0])
        if callable(answer):
            return answer(self)
        if answer is None:
            return self.send_error(404)
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path, monkeypatch):
    HANDLERS.clear()
    REQUESTS.clear()
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def folder(tmp_path) -> Path:
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2
    ).eval()
    backbone = {
        "class_path": "vit.models.VisionTransformer",
        "init_args": dict(img_size=16, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2),
    }
    inputs = {"img_size": [16, 16], "in_chans": 1, "mean": None, "std": None, "interpolation": "bilinear"}
    config = artifact.describe(model, backbone, inputs, ["no", "yes"])
    return artifact.write(tmp_path / "model", config, timm_state_dict(model))


def serve_folder(folder: Path, prefix: str = "/models/tiny") -> None:
    for name in ("config.json", "model.safetensors"):
        HANDLERS[f"{prefix}/{name}"] = (folder / name).read_bytes()


def test_a_model_folder_at_a_url_opens_as_the_folder_does(server, folder):
    serve_folder(folder)
    x = torch.rand(2, 1, 16, 16)
    with torch.no_grad():
        by_url, by_folder = vit.load(f"{server}/models/tiny?token=secret").model(x), vit.load(folder).model(x)
    torch.testing.assert_close(by_url, by_folder, rtol=0, atol=0)
    assert REQUESTS == ["/models/tiny/config.json?token=secret", "/models/tiny/model.safetensors?token=secret"]


def test_a_missing_file_is_one_line_naming_the_url_without_its_token(server):
    with pytest.raises(DownloadError) as refused:
        vit.load(f"{server}/nothing?token=secret")
    message = str(refused.value)
    assert message == f"{server}/nothing/config.json?... could not be downloaded: HTTPError: HTTP Error 404: Not Found"
    assert "secret" not in message


def test_more_than_the_byte_limit_is_refused(server, folder, monkeypatch):
    serve_folder(folder)
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_MAX_BYTES", "1000")
    with pytest.raises(
        DownloadError,
        match=r"model.safetensors is larger than 1000 bytes \(set "
        r"READABLE_VIT_DOWNLOAD_MAX_BYTES\)",
    ):
        vit.load(f"{server}/models/tiny")


def trickle(handler):
    """Headers one byte a tenth of a second: each read is quick, the whole never ends in time."""
    try:
        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Slow: " + b"x" * 1000:
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(0.1)
    except OSError:  # the client gave up
        pass


def test_a_server_that_trickles_is_stopped_at_the_deadline(server, monkeypatch):
    HANDLERS["/slow/config.json"] = trickle
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(
        DownloadError,
        match=r"/slow/config.json timed out: not downloaded in 1 s \(set "
        r"READABLE_VIT_DOWNLOAD_TIMEOUT\)",
    ):
        vit.load(f"{server}/slow")
    assert time.monotonic() - start < 5


def redirect_to(location: str):
    def answer(handler):
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return answer


def test_redirects_are_followed_to_http_only(server, folder):
    serve_folder(folder, "/moved")
    HANDLERS["/old/config.json"] = redirect_to("/moved/config.json")
    HANDLERS["/old/model.safetensors"] = redirect_to("/moved/model.safetensors")
    assert vit.load(f"{server}/old").class_names == ["no", "yes"]
    HANDLERS["/ftp/config.json"] = redirect_to("ftp://127.0.0.1/config.json")
    with pytest.raises(
        DownloadError,
        match=r"redirects to ftp://127.0.0.1/config.json: only http\(s\) is "
        "followed",
    ):
        vit.load(f"{server}/ftp")


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/model", "file:///etc/model", "s3://bucket/model"])
def test_other_schemes_are_refused_without_a_request(url, server):
    with pytest.raises(DownloadError, match="only http"):
        vit.load(url)
    assert REQUESTS == []


def test_a_bad_limit_is_named(server, monkeypatch):
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_TIMEOUT", "soon")
    with pytest.raises(
        PretrainedError,  # a setting refused as the byte limit's is (`weight_files.whole_number`)
        match=r"READABLE_VIT_DOWNLOAD_TIMEOUT='soon' is not allowed: expected "
        r"a whole number > 0 \(default 600\)",
    ):
        vit.load(f"{server}/models/tiny")
