"""How an error names what went wrong in one line: an exception's first line (`first_line`) and what a file is
(`file_kind`), so that every message says it the same way."""

from __future__ import annotations

import stat


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for one-line errors."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def file_kind(mode: int) -> str:
    """What a file is, from its `st_mode` (`os.lstat` to see a link itself): "a file", "a symbolic link", ..."""
    kinds = (
        (stat.S_ISREG, "a file"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")
