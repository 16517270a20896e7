"""Write the model folder of a checkpoint that has none (one written before model folders): beside it, as a run
writes it now (`last.ckpt` -> `last/`), or into --out.

    python -m vit.upgrade --ckpt_path runs/two_circles/vit/version_0/checkpoints/last.ckpt

The checkpoint is loaded as data only (`weights_only=True`), its model rebuilt from this project's registered
classes with checked arguments, and the folder read back as every door reads it before it is kept."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from vit.checks import CheckpointError
from vit.commands import parser, run, write_failed


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.upgrade", __doc__)
    options.add_argument("--ckpt_path", type=Path, required=True, help="checkpoint written by train.py")
    options.add_argument("--out", type=Path, default=None, help="the folder to write (default: beside the checkpoint)")
    options.add_argument("--overwrite", action="store_true", help="replace a model folder this project wrote")
    return run(options.parse_args(argv), prepare, write)


def prepare(args: argparse.Namespace) -> tuple[Path, dict, dict]:
    """The checkpoint read and its folder's contents made; `ValueError` for an --out that exists (without
    --overwrite, or not a model folder) or a checkpoint whose backbone is not recorded by name."""
    import vit.artifact as artifact
    from vit.artifact.io import read_trainer_state

    out = args.out or artifact.folder_of(args.ckpt_path.expanduser().resolve())
    if out.exists() and not (args.overwrite and artifact.is_artifact(out)):
        why = (
            "pass --overwrite to replace it"
            if artifact.is_artifact(out)
            else "it is not a model folder this project wrote, so it is left alone"
        )
        raise ValueError(f"--out {out} exists; {why}")
    try:
        made = artifact.from_checkpoint(read_trainer_state(args.ckpt_path.expanduser()))
    except artifact.ArtifactError:
        raise
    except CheckpointError as err:  # what the record holds that no door would open: named with the file
        raise CheckpointError(f"checkpoint {args.ckpt_path}: {err}") from None
    if made is None:
        raise ValueError(f"checkpoint {args.ckpt_path} records no backbone by name (it was built in Python)")
    return out, *made


def write(args: argparse.Namespace, prepared: tuple[Path, dict, dict]) -> int:
    import vit.artifact as artifact

    out, config, tensors = prepared
    try:
        artifact.write(out, config, tensors)
    except OSError as err:
        return write_failed("--out", out, err)
    try:
        artifact.read(out)
    except artifact.ArtifactError:
        shutil.rmtree(out)
        raise
    print(f"wrote {out / artifact.WEIGHTS} and {artifact.CONFIG}; open it with vit.load('{out}') or timm (local-dir:)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
