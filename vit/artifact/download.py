"""A model folder at an http(s) URL, downloaded: `<url>/config.json` and `<url>/model.safetensors`, each under one
byte limit and one deadline, into `<torch hub dir>/readable-vit/<hash of the URL>/`. Redirects go to http(s) only
(urllib would follow one to ftp). A Hub id goes through `huggingface_hub` instead (`vit.artifact.locate`)."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from vit.checks import CheckpointError
from vit.messages import first_line
from vit.models.weight_files import MAX_BYTES_VARIABLE, whole_number

TIMEOUT_VARIABLE = "READABLE_VIT_DOWNLOAD_TIMEOUT"
DEFAULT_TIMEOUT = 600  # seconds for one file, headers and body: a ViT-B's 350 MB at 1 MB/s fit


class DownloadError(CheckpointError):
    """A URL that could not be downloaded; one line naming it, its query string left out."""


def redact(url: str) -> str:
    """`url` as messages show it: without the query string (often a token), a password, or a fragment."""
    parts = urlsplit(url)
    query = "..." if parts.query else ""
    return parts._replace(netloc=parts.netloc.rpartition("@")[2], query=query, fragment="").geturl()


def download_folder(url: str, files: dict[str, int]) -> Path:
    """The local copy of the folder at `url`: its `files`, each of at most its number of bytes (module doc)."""
    import torch

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise DownloadError(f"{redact(url)}: only http(s) URLs are downloaded; download it another way, give its path")
    base = parts._replace(query="", fragment="").geturl().rstrip("/")
    folder = Path(torch.hub.get_dir(), "readable-vit", hashlib.sha256(base.encode()).hexdigest()[:16])
    folder.mkdir(parents=True, exist_ok=True)
    query = f"?{parts.query}" if parts.query else ""
    for name, most in files.items():
        download(f"{base}/{name}{query}", folder / name, most)
    return folder


class _HttpOnly(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urlsplit(newurl).scheme not in ("http", "https"):
            raise DownloadError(f"{redact(req.full_url)} redirects to {redact(newurl)}: only http(s) is followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def download(url: str, target: Path, max_bytes: int) -> None:
    """GET `url` into `target`, replaced only by a whole file of at most `max_bytes`. The copy runs in a thread
    joined with the deadline: a socket timeout bounds each wait, and a server could trickle forever."""
    timeout = whole_number(TIMEOUT_VARIABLE, DEFAULT_TIMEOUT)
    tmp = target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"
    failure: list[Exception] = []

    def copy(out) -> None:
        try:
            with urllib.request.build_opener(_HttpOnly).open(url, timeout=timeout) as response:
                while chunk := response.read1(2**20):
                    if out.tell() + len(chunk) > max_bytes:
                        raise DownloadError(
                            f"{redact(url)} is larger than {max_bytes} bytes (set {MAX_BYTES_VARIABLE})"
                        )
                    out.write(chunk)
        except DownloadError as err:
            failure.append(err)
        except Exception as err:  # noqa: BLE001  (handed to the caller, which raises it as one line)
            failure.append(
                DownloadError(f"{redact(url)} could not be downloaded: {type(err).__name__}: {first_line(err)}")
            )

    with open(tmp, "wb") as out:  # a thread past the deadline writes on into a file no one sees, then stops
        worker = threading.Thread(target=copy, args=(out,), daemon=True)
        worker.start()
        worker.join(timeout)
        try:
            if worker.is_alive():
                raise DownloadError(f"{redact(url)} timed out: not downloaded in {timeout} s (set {TIMEOUT_VARIABLE})")
            if failure:
                raise failure[0]
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
