"""The study's ``runs.csv``: one row per finished run, every line checked when read, a row appended whole."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

from studies.runner.grid import CALIBRATE, Run
from studies.runner.rows import append_rows

COLUMNS = (
    "key", "experiment", "task", "model", "num_train", "seed", "train_region", "test_region", "lr",
    "params", "flops_per_image", "epochs", "steps", "batch_size", "train_time_s", "train_acc", "val_acc", "test_acc",
    "test_by_distance", "shift_region", "shift_acc", "shift_by_distance", "fingerprint", "revision", "finished_at",
)
INT_COLUMNS = ("num_train", "seed", "params", "flops_per_image", "epochs", "steps", "batch_size")
FLOAT_COLUMNS = ("lr", "train_time_s", "train_acc", "val_acc", "test_acc")


class StudyError(ValueError):
    """The study cannot go on as asked (runs.csv damaged or made with other settings, out_dir unusable or in use):
    ``main`` prints it as one ``error:`` line, before any run starts."""



def _row_problem(fields: list[str]) -> str | None:
    """What makes one line of runs.csv unusable (None: nothing), checked field by field as run_one writes them."""
    if len(fields) != len(COLUMNS):
        short = " (cut short?)" if len(fields) < len(COLUMNS) else ""
        return f"it has {len(fields)} of the {len(COLUMNS)} fields{short}"
    row = dict(zip(COLUMNS, fields))
    for name in INT_COLUMNS + FLOAT_COLUMNS:
        try:
            (int if name in INT_COLUMNS else float)(row[name])
        except ValueError:
            return f"{name}={row[name]!r} is not a number"
    for name in ("test_by_distance",) + (("shift_by_distance",) if row["shift_region"] else ()):
        try:
            if not isinstance(json.loads(row[name]), dict):
                raise ValueError
        except ValueError:
            return f"{name} is not the JSON mapping run_one writes (cut short?)"
    if not re.fullmatch(r"[0-9a-f]{12}", row["fingerprint"]):
        return f"fingerprint={row['fingerprint']!r} is not 12 hex digits"
    try:
        time.strptime(row["finished_at"], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return f"finished_at={row['finished_at']!r} is not a time (cut short?)"
    lr = float(row["lr"]) if row["experiment"] == CALIBRATE else None
    key = Run(row["experiment"], row["task"], row["model"], int(row["num_train"]), int(row["seed"]), "", "", 0, {}, "",
              lr).key
    if row["key"] != key:
        return f"its key {row['key']!r} does not match its columns (they make {key!r})"
    return None


def read_rows(csv_path: Path) -> list[dict]:
    """The finished runs in ``runs.csv`` (empty if there is none yet), every line checked.

    A damaged line (cut short, edited by hand) raises ``StudyError`` naming the file and the line:
    deleting it makes the study redo that run. run_one's fields never hold a newline, so every
    line is one row.
    """
    if not csv_path.exists():
        return []
    lines = csv_path.read_text(errors="replace").splitlines()
    if not lines:
        return []
    header = next(csv.reader([lines[0]]), [])
    if tuple(header) != COLUMNS:
        raise StudyError(f"{csv_path} line 1 is not the header this study writes ({len(header)} columns, expected "
                         f"{len(COLUMNS)}: {','.join(COLUMNS)}): restore it, or use a new out_dir if another "
                         f"version of the study wrote this file")
    rows, seen = [], {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = next(csv.reader([line]))
        problem = _row_problem(fields)
        if problem is not None:
            raise StudyError(f"{csv_path} line {number} is damaged: {problem}. Delete that line to redo its run "
                             f"({fields[0] or 'no key'}), then rerun the same command")
        if fields[0] in seen:
            raise StudyError(f"{csv_path} line {number} repeats run {fields[0]} of line {seen[fields[0]]}: "
                             f"delete one of the two lines")
        seen[fields[0]] = number
        rows.append(dict(zip(COLUMNS, fields)))
    return rows


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row whole (`studies.runner.rows.append_rows`): a killed invocation leaves no half line."""
    append_rows(csv_path, COLUMNS, [row])

