"""What the studies share: a results CSV that grows by whole rows, so a killed run leaves no half line."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def append_rows(csv_path: Path, columns: Sequence[str], rows: Sequence[Mapping]) -> None:
    """Append `rows` (with the header when the file is new or empty) in one `write` on an O_APPEND descriptor,
    then fsync: all of them or none. A last line left without its newline (an editor's) is ended first."""
    header = not csv_path.exists() or csv_path.stat().st_size == 0
    lines = []
    if not header:
        with csv_path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                lines.append("\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    lines.append(buf.getvalue())
    fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(lines).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
