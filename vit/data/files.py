"""Which files under a folder are images to read: each regular file once, links followed but never in circles.

Class folders are walked with their links followed, as torchvision's `ImageFolder` walks them, in
the same order (folders sorted by path, files by name), with three differences, so that no image is
counted twice (landing in both train and val) and no read blocks forever:

- a folder already visited is not entered again: a link back up (`ln -s . current`) or a second link
  to one folder is listed once, as skipped;
- a file whose resolved path (`os.path.realpath`) was listed already, through a link or under another
  class, is kept at its first path and skipped at the others;
- only regular files are samples, after following a file link: a named pipe (FIFO) would block the
  first `open()` forever and a device (a link to `/dev/zero`) never ends, so both are skipped.

Hidden entries (a name starting with '.') are ignored, not reported. A name that is not valid UTF-8
(a byte such as 0xFF, written by another system's encoding) is read from its real path; `text_name`
is the text to show or store for it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from vit.checks import file_kind

SHOWN_SKIPPED = 20  # a folder of 20,000 unreadable files is summed up in one line, not listed


def text_name(name: str) -> str:
    """`name` as valid text: bytes that are not UTF-8 become backslash escapes (`caf\\xff.png`), the rest is kept.

    Python holds such bytes in a `str` as lone surrogates (PEP 383), which no UTF-8 writer (CSV,
    JSON, TensorBoard) accepts. The escape is readable, and the same name always gives the same text.
    """
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def visible_folders(folder: Path) -> list[str]:
    """Sorted names of the sub-folders of `folder`, without hidden ones (`.ipynb_checkpoints`, `.git`)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def not_a_file(path: str | os.PathLike) -> str | None:
    """Why `path` is not a regular file to read (after following links), or None when it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing (dangling)" if os.path.islink(path) else "removed while being read"
    except OSError as err:
        return "a symbolic link loop" if err.errno == errno.ELOOP else (err.strerror or str(err))
    return None if stat.S_ISREG(mode) else f"{file_kind(mode)}, not a regular file"


def list_files(folders: list[str]) -> tuple[list[list[str]], dict[str, str]]:
    """The regular files under each of `folders` (see the module doc), and `{path: why}` of what was left out.

    Folders and files are shared across `folders`: a link from one class folder into another lists nothing twice.
    """
    skipped: dict[str, str] = {}
    seen_folders: set[str] = set()
    seen_files: dict[str, str] = {}  # resolved path -> the path it is listed at
    listed = []
    for folder in folders:
        files = []
        for top, names in _walk(folder, seen_folders, skipped):
            for name in names:
                path = os.path.join(top, name)
                if (why := not_a_file(path)) is not None:
                    skipped[path] = why
                elif (real := os.path.realpath(path)) in seen_files:
                    first = seen_files[real]
                    first = os.path.relpath(first, os.path.commonpath([first, path]))  # from where the two part
                    skipped[path] = f"the same file as {text_name(first)}, listed once"
                else:
                    seen_files[real] = path
                    files.append(path)
        listed.append(files)
    return listed, skipped


def _walk(folder: str, seen_folders: set[str], skipped: dict[str, str]) -> list[tuple[str, list[str]]]:
    """`(folder, sorted visible file names)` of each folder under `folder` not visited before, sorted by path."""
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
        found.append((top, sorted(f for f in files if not f.startswith("."))))
    return sorted(found)  # torchvision's order: folders by path


def first_skipped(skipped: dict[str, str], template: str, limit: int = SHOWN_SKIPPED) -> list[str]:
    """`template` (`{name}`, `{why}`) filled in for the first `limit` of `skipped` (`{name: why}`), then one
    `... and N more skipped file(s)` for the rest."""
    shown = [template.format(name=name, why=why) for name, why in list(skipped.items())[:limit]]
    rest = len(skipped) - len(shown)
    return shown + ([f"... and {rest} more skipped file(s)"] if rest > 0 else [])
