"""What the commands that open a checkpoint share: `python -m vit.predict`, `vit.explain` and `vit.export`.

Each checks everything before any work (`prepare`: a refusal is one `error: ...` line, exit status 2), then works
(`work`: a write that fails is one line, exit status 1). Nothing here imports torch, so `--help` answers at once."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO, TypeVar

from vit.messages import file_kind, first_line

USAGE = 2  # the exit status of a command line that cannot work, as argparse's own errors
T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help (unless it has none to show), and the example kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, False, argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action)


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of `python -m module`: `doc`'s first paragraph above the options, the second (the example) under."""
    name = Path(sys.argv[0]).name
    prog = name if name.startswith("vit-") else f"python -m {module}"
    description, example = doc.split("\n\n")[:2]
    # allow_abbrev=False: a prefix (`--ckpt`) is an unknown option, never another option taken silently
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=f"example:\n{example}",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )


def run(
    args: argparse.Namespace, prepare: Callable[[argparse.Namespace], T], work: Callable[[argparse.Namespace, T], int]
) -> int:
    """`work(args, prepare(args))`, the command's exit status; a `ValueError` raised by either is `fail(err)`: one
    line, the usage status (a refusal found while working, e.g. an image's record, is no less the input's)."""
    try:
        return work(args, prepare(args))
    except ValueError as err:  # CheckpointError and each command's own refusals are ValueErrors
        return fail(err)


def fail(message: object, status: int = USAGE) -> int:
    """Print `error: message` on stderr; return `status`, the command's exit status."""
    print(f"error: {message}", file=sys.stderr)
    return status


def check_output(option: str, path: Path, overwrite: bool) -> None:
    """Raise `ValueError` unless `path` can be written: new in an existing folder, or a regular file and `overwrite`."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None  # nothing there yet; its folder is checked below
    except OSError as err:
        raise ValueError(f"{option} {path} cannot be checked ({err.strerror or first_line(err)})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{option} {path} is {file_kind(mode)}; only a regular file is replaced: give another path")
    if mode is not None and not overwrite:
        raise ValueError(f"{option} {path} already exists; pass --overwrite to replace it")
    if not path.parent.is_dir():
        raise ValueError(f"{option} {path}: its folder {path.parent} does not exist")


def write_failed(option: str, path: str | os.PathLike, err: Exception) -> int:
    """`fail` (exit status 1) for an output that could not be written, with the system's reason (also safetensors')."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)
    quoted = re.search(r"(?:^|: )([^:]+?) \(os error \d+\)", reason)
    return fail(f"{option} {path} could not be written: {quoted[1] if quoted else reason}", status=1)


def print_skipped(skipped: dict[str, str]) -> None:
    """One line on stderr for each of the first skipped files (`{name: reason}`), then how many more there are."""
    from vit.data.files import first_skipped

    for line in first_skipped(skipped, "skipped {name}: not a readable image ({why})"):
        print(line, file=sys.stderr)


def write_whole(path: Path, fill: Callable[[TextIO], bool], newline: str | None = None) -> None:
    """Write the text file `path` whole: `fill(f)` writes a temporary file in the same folder, which then replaces
    `path` (mode 0644) if `fill` returns True; it is removed otherwise, and on an error: no half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline=newline) as f:
            keep = fill(f)
        if keep:
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone once renamed


class EitherSpelling(argparse.ArgumentParser):
    """A parser whose options, spelt with underscores (`--max_runs`, as `train.py` and `vit.predict` spell them), also
    answer to the same name with dashes (`--max-runs`), the other way round too; the help shows the spelling given.

    The studies' and benchmarks' commands took dashes before: a script written for either spelling keeps working."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault(
            "epilog", "Each option also answers to its name with dashes for underscores (or the reverse)."
        )
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)  # after `--`, every word is a value
        return super().parse_known_args([self._spelt(arg) for arg in args[:end]] + args[end:], namespace)

    def _spelt(self, arg: str) -> str:
        """`arg` (`--name` or `--name=value`) as this parser spells the option, if it names one spelt otherwise."""
        name, equals, value = arg.partition("=")
        if not name.startswith("--") or name in self._option_string_actions:
            return arg
        for other in ("--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")):
            if other in self._option_string_actions:
                return other + equals + value
        return arg


class Progress:
    """How far a long command is, on stderr: `label: done/total unit (note), rate unit/s, about N s left`, the line
    `python -m vit.predict` prints. On a terminal it is redrawn in place; in a log file or a pipe each report is a
    whole line ending in a newline (no carriage return), at most one per `every` seconds, and always the last one.

    `done` counts what an earlier invocation finished (a resumed study): the rate and the time left are this one's."""

    def __init__(
        self, label: str, total: int, unit: str, *, done: int = 0, every: float = 10.0, stream: TextIO | None = None
    ) -> None:
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.done, self.first = done, done
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.start, self.shown, self.line = time.monotonic(), float("-inf"), ""  # `line`: the one drawn in place

    def update(self, n: int = 1, note: str = "") -> None:
        """Count `n` more done (`note`: which, e.g. the item just finished) and report if it is time to."""
        self.done += n
        now = time.monotonic()
        if not (self.tty or now - self.shown >= self.every or self.done >= self.total):
            return
        self.shown, rate = now, (self.done - self.first) / max(now - self.start, 1e-9)
        left = f", about {(self.total - self.done) / rate:.0f} s left" if 0 < rate and self.done < self.total else ""
        line = f"{self.label}: {self.done}/{self.total} {self.unit}{f' ({note})' if note else ''}"
        shown = f"{rate:.3g}" if rate < 1000 else f"{rate:.0f}"  # three figures, never an exponent
        self._draw(f"{line}, {shown} {self.unit}/s{left}", keep=not self.tty or self.done >= self.total)

    def write(self, message: str, file: TextIO | None = None) -> None:
        """Print `message` as a line of its own on `file` (default: the progress's stream), above the line drawn in
        place, which is erased first and drawn again after (on a terminal both streams are the same screen)."""
        line = self.line
        if file is None or file is self.stream:
            self._draw(message, keep=True)
        else:
            if line:
                self._draw("", keep=False)
            print(message, file=file, flush=True)
        if line:
            self._draw(line, keep=False)

    def close(self) -> None:
        """End the line drawn in place, so that what is printed next starts a line of its own."""
        if self.line:
            self.stream.write("\n")
            self.stream.flush()
            self.line = ""

    def _draw(self, text: str, *, keep: bool) -> None:
        """Write `text` over the line drawn in place (ANSI: erase to the line's end), ended by a newline if `keep`."""
        self.stream.write(("\r" + text + "\x1b[K" if self.tty else text) + ("\n" if keep else ""))
        self.stream.flush()
        self.line = "" if keep else text
