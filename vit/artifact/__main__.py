"""Write the model folder of a checkpoint that has none (one written before model folders): beside it, as a run
writes it now (`last.ckpt` -> `last/`), or into --out.

    python -m vit.artifact --ckpt_path runs/two_circles/vit/version_0/checkpoints/last.ckpt

The checkpoint is read as every door reads one (validated whole, no code from it runs); only a backbone recorded by
its registry name (as `train.py` records it) has a folder: one built in Python records nothing to build it from."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vit.commands import parser, run, write_failed


def main(argv: list[str] | None = None) -> int:
    options = parser("vit.artifact", __doc__)
    options.add_argument("--ckpt_path", required=True, help="checkpoint written by train.py (a path or URL)")
    options.add_argument("--out", type=Path, default=None, help="the model folder to write (default: beside the "
                         "checkpoint, its name without .ckpt)")
    options.add_argument("--overwrite", action="store_true", help="replace a model folder this project wrote")
    return run(options.parse_args(argv), prepare, write)


def prepare(args: argparse.Namespace) -> tuple[Path, dict, dict]:
    """The checkpoint read and its folder's contents made; `ValueError` for an --out that exists (without
    --overwrite, or not a model folder) or a checkpoint whose backbone is not recorded by name."""
    import vit.artifact as artifact
    from vit.training.checkpoint import read

    if args.out is None and "://" in str(args.ckpt_path):
        raise ValueError("--ckpt_path is a URL: give --out, the folder to write the model into")
    out = args.out or artifact.folder_of(Path(os.path.expanduser(args.ckpt_path)).resolve())
    if os.path.lexists(out) and not (args.overwrite and artifact.is_artifact(out)):
        why = ("pass --overwrite to replace it" if artifact.is_artifact(out) else
               "it is not a model folder this project wrote, so it is left alone")
        raise ValueError(f"--out {out} exists; {why}")
    checkpoint = read(args.ckpt_path, training=False)
    made = artifact.from_checkpoint(checkpoint.raw)
    if made is None:
        raise ValueError(f"checkpoint {checkpoint.source} records no backbone by name (it was built in Python): "
                         "there is nothing to build its model folder from")
    return out, *made


def write(args: argparse.Namespace, prepared: tuple[Path, dict, dict]) -> int:
    import vit.artifact as artifact

    out, config, tensors = prepared
    try:
        artifact.write(out, config, tensors)
    except OSError as err:
        return write_failed("--out", out, err)
    print(f"wrote {out / artifact.WEIGHTS} and {artifact.CONFIG} ({len(config['label_names'])} classes); open it "
          f"with vit.load('{out}') or timm.create_model('local-dir:{out}', pretrained=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
