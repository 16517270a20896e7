"""Which files under a folder are images to read: each regular file once, links followed but never in circles.

Class folders are walked as torchvision's `ImageFolder` walks them, but a folder or file already visited is skipped, and
only regular files are samples (a named pipe or a device would block a read forever). Hidden entries are ignored."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from vit.messages import file_kind

SHOWN_SKIPPED = 20  # a folder of 20,000 unreadable files is summed up in one line, not listed

# Characters a terminal or a text view acts on instead of showing: C0 and C1 controls (ESC starts the sequences that
# clear the screen or move the cursor over a line already printed), line and paragraph separators, and the
# bidirectional overrides and isolates that show the text after them in another order.
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def text_name(name: str) -> str:
    """`name` as valid text to show: bytes that are not UTF-8 (lone surrogates, PEP 383) and `CONTROL_CHARACTERS`
    become escapes (`caf\\xff.png`, `\\x1b[2J.png`). Applied twice, it gives the same text."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return CONTROL_CHARACTERS.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


def visible_folders(folder: Path) -> list[str]:
    """Sorted names of the sub-folders of `folder`, without hidden ones (`.ipynb_checkpoints`, `.git`)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why `path` is not a regular file to read (after following links), or None when it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing (dangling)" if os.path.islink(path) else "not found (no such file)"
    except OSError as err:
        return "a symbolic link loop" if err.errno == errno.ELOOP else (err.strerror or str(err))
    return None if stat.S_ISREG(mode) else f"{file_kind(mode)}, not a regular file"


def list_files(folders: list[str]) -> tuple[list[list[str]], dict[str, str]]:
    """The regular files under each of `folders` (see the module doc), and `{path: why}` of what was left out."""
    skipped, seen_folders, listed = {}, set(), []
    seen_files: dict[str, str] = {}  # resolved path -> the path it is listed at
    for folder in folders:
        files = []
        for top, real_top, names in _walk(folder, seen_folders, skipped):
            for name in names:
                path = os.path.join(top, name)
                why, real = _entry(path, real_top)
                if why is not None:
                    skipped[path] = why
                elif real in seen_files:
                    first = seen_files[real]
                    first = os.path.relpath(first, os.path.commonpath([first, path]))  # from where the two part
                    skipped[path] = f"the same file as {text_name(first)}, listed once"
                else:
                    seen_files[real] = path
                    files.append(path)
        listed.append(files)
    return listed, skipped


def _entry(path: str, real_top: str) -> tuple[str | None, str]:
    """`(not_a_file(path), os.path.realpath(path))` for an entry of the folder whose real path is `real_top`, from one
    `lstat` when it is no link: a regular file's real path is its name in that folder (realpath would look up every
    part of the path again, ten times the cost on a folder of a million files)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # gone since it was listed
        mode = stat.S_IFLNK  # not_a_file names why
    if stat.S_ISLNK(mode):
        return not_a_file(path), os.path.realpath(path)
    why = None if stat.S_ISREG(mode) else f"{file_kind(mode)}, not a regular file"
    return why, os.path.join(real_top, os.path.basename(path))


def _walk(folder: str, seen_folders: set[str], skipped: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """`(folder, its real path, sorted visible file names)` of each folder under `folder` not visited before, sorted
    by path."""
    found = []

    def unreadable(err: OSError) -> None:
        skipped[err.filename] = f"a folder that cannot be listed ({err.strerror or err})"

    for top, dirs, files in os.walk(folder, onerror=unreadable, followlinks=True):
        real = os.path.realpath(top)
        if real in seen_folders:
            skipped[top] = "a link to a folder listed already (not entered again)"
            dirs[:] = []
            continue
        seen_folders.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # os.walk enters only these, in this order
        found.append((top, real, sorted(f for f in files if not f.startswith("."))))
    return sorted(found)  # torchvision's order: folders by path


def first_skipped(skipped: dict[str, str], template: str, limit: int = SHOWN_SKIPPED) -> list[str]:
    """`template` (`{name}`, `{why}`) for the first `limit` of `skipped`, then `... and N more skipped file(s)`; names
    and reasons as text to show (`text_name`), as they may hold control characters."""
    shown = [template.format(name=text_name(name), why=text_name(why)) for name, why in list(skipped.items())[:limit]]
    rest = len(skipped) - len(shown)
    return shown + ([f"... and {rest} more skipped file(s)"] if rest > 0 else [])
