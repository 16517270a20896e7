"""What the commands that open a checkpoint share: `python -m vit.predict`, `vit.explain` and `vit.export`.

Each checks its arguments and opens the checkpoint before doing any work (`prepare`), then works
(`work`). Whatever `prepare` refuses, a bad argument or a checkpoint `vit.training.rebuild` will not
open (`CheckpointError`, a `ValueError`), is one `error: ...` line on stderr and exit status 2,
with nothing read or written yet.

This module and each command's `main` import neither torch nor Lightning before the arguments are
parsed, so `--help` and a mistyped option answer at once (`parser`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

USAGE = 2  # the exit status of a command line that cannot work, as argparse's own errors
T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (unless it has none to show), and the example kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, False, argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action)


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of the command `python -m module`: named as it was run (`vit-predict` when run by that name),
    described by the first paragraph of its `doc`, with the second (the example) under its options."""
    name = Path(sys.argv[0]).name
    prog = name if name.startswith("vit-") else f"python -m {module}"
    description, example = doc.split("\n\n")[:2]
    return argparse.ArgumentParser(prog=prog, description=description, epilog=f"example:\n{example}",
                                   formatter_class=HelpFormatter)


def run(args: argparse.Namespace, prepare: Callable[[argparse.Namespace], T],
        work: Callable[[argparse.Namespace, T], int]) -> int:
    """`work(args, prepare(args))`, the command's exit status; a `ValueError` raised by `prepare` is `fail(err)`."""
    try:
        prepared = prepare(args)
    except ValueError as err:  # CheckpointError and each command's own refusals are ValueErrors
        return fail(err)
    return work(args, prepared)


def fail(message: object, status: int = USAGE) -> int:
    """Print `error: message` on stderr; return `status`, the command's exit status."""
    print(f"error: {message}", file=sys.stderr)
    return status


def note_unnamed(ckpt_path: str | os.PathLike, checkpoint: dict, instead: str) -> None:
    """A note on stderr when the checkpoint records no class names; `instead` says what is shown for them."""
    if "class_names" not in checkpoint:
        print(f"note: checkpoint {ckpt_path} records no class names (it was written before they were stored): "
              f"{instead}", file=sys.stderr)
