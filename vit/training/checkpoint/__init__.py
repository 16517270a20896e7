"""The checkpoint, owned in one place: read once, validated whole, then used.

Every door that opens a checkpoint goes through `read(path_or_url)`: `vit.load`, `python -m
vit.predict`, `vit.explain`, `vit.export`, `train.py validate|test|predict|fit --ckpt_path` (and
the test after `fit`), the notebooks and the studies. `read`

1. makes the path or URL a local file (`fetch`: one deadline, a byte limit, nothing refused kept);
2. loads it as data (`archive.load_archive`: a whole zip archive of stored entries under the byte
   limit, `torch's loader with `weights_only=True``);
3. validates it whole against the schema (`schema.validate`): every key known, every value plain,
   typed and bounded, the classes allowlisted, the architecture's shapes compared on the meta
   device with the weights, `inputs` consistent with the backbone.

Then `build.build_classifier` makes the model from the checked values, and for `train.py fit`
`resume.check_resume` checks the trainer state against the run before any run folder exists;
Lightning restores the run from the same validated dict (`io.AtomicCheckpointIO.load_checkpoint`),
never from a second reading of the file. A value the schema does not accept stops the door with one
`CheckpointError` line naming the key.
"""

from __future__ import annotations

import os

from vit.training.checkpoint.archive import load_archive
from vit.training.checkpoint.errors import CheckpointError
from vit.training.checkpoint.fetch import fetch, redact_url
from vit.training.checkpoint.schema import SCHEMA_VERSION, Checkpoint, validate

__all__ = ["SCHEMA_VERSION", "Checkpoint", "CheckpointError", "read"]


def read(path_or_url: str | os.PathLike) -> Checkpoint:
    """The validated `Checkpoint` at a path or URL (module doc), or `CheckpointError` naming what is wrong."""
    source = redact_url(os.fspath(path_or_url))
    local = fetch(path_or_url)
    return validate(load_archive(local, source), source)
