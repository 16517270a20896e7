"""The checkpoint, owned in one place: every door calls `read(path_or_url)`, which `fetch`es a local file, loads it
as data and validates it whole (`schema`), or raises one `CheckpointError` line naming the key. `build` makes the
model from the checked values; `resume` checks the trainer state against a `fit` run."""

from __future__ import annotations

import os

from vit.training.checkpoint.fetch import fetch, load_archive, redact_url
from vit.training.checkpoint.schema import Checkpoint, validate
from vit.training.checkpoint.values import SCHEMA_VERSION, CheckpointError

__all__ = ["SCHEMA_VERSION", "Checkpoint", "CheckpointError", "read"]


def read(path_or_url: str | os.PathLike, training: bool = True) -> Checkpoint:
    """The validated `Checkpoint` at a path or URL, or `CheckpointError` naming what is wrong (`validate`)."""
    source = redact_url(os.fspath(path_or_url))
    return validate(load_archive(fetch(path_or_url), source), source, training)
