"""Whether the Hugging Face Hub can be reached from here, and huggingface_hub's cache-only switch while it cannot:
without network huggingface_hub retries each file for about a minute before it looks in its cache."""

from __future__ import annotations

import contextlib
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterator

PROBE_TIMEOUT = 3.0  # seconds for the Hub's host to accept a connection


def hub_reachable(timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether the Hub's host (huggingface_hub's endpoint, `HF_ENDPOINT`) accepts a TCP connection within
    `timeout` s; True behind a proxy, which only the proxy can answer for."""
    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)
    if url.hostname is None or urllib.request.getproxies():
        return True
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:  # no route, no name resolution, refused, timed out
        return False
    return True


@contextlib.contextmanager
def cache_only_if_unreachable() -> Iterator[None]:
    """Downloads inside read only huggingface_hub's cache when the Hub cannot be reached: without network it retries
    each file for about a minute (5 retries, backing off to 8 s) before it looks in the cache. Its offline switch is
    the one `HF_HUB_OFFLINE=1` sets, which it reads at every request."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or hub_reachable():
        yield
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = False
