"""The study's ``runs.csv``: one row per finished run, every line checked when read, a row appended whole."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path

from studies.runner.grid import CALIBRATE, Run
from studies.runner.rows import append_rows
from vit.training.run_lock import printable

COLUMNS = (
    "key",
    "experiment",
    "task",
    "model",
    "num_train",
    "seed",
    "train_region",
    "test_region",
    "lr",
    "params",
    "flops_per_image",
    "epochs",
    "steps",
    "batch_size",
    "train_time_s",
    "train_acc",
    "val_acc",
    "test_acc",
    "test_by_distance",
    "shift_region",
    "shift_acc",
    "shift_by_distance",
    "fingerprint",
    "revision",
    "finished_at",
)
INT_COLUMNS = ("num_train", "seed", "params", "flops_per_image", "epochs", "steps", "batch_size")
FLOAT_COLUMNS = ("lr", "train_time_s", "train_acc", "val_acc", "test_acc")
SHOWN = 60  # the characters of a damaged field an error shows: a line of junk is named, not echoed


class StudyError(ValueError):
    """The study cannot go on as asked (runs.csv damaged or made with other settings, out_dir unusable or in use):
    ``main`` prints it as one ``error:`` line, before any run starts."""


def shown(value: str) -> str:
    """A field of runs.csv as an error shows it: escaped (``printable``) and cut to ``SHOWN`` characters."""
    text = printable(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(value)} characters)"


def _is_by_distance(text: str) -> bool:
    """Whether ``text`` is what run_one writes for the accuracy by distance: ``{"distance": [correct, total]}``."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: brackets nested thousands deep
        return False
    return isinstance(value, dict) and all(
        re.fullmatch(r"[0-9]+", d)
        and isinstance(p, list)
        and len(p) == 2
        and all(type(n) is int for n in p)
        and 0 <= p[0] <= p[1]
        for d, p in value.items()
    )


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
            return f"{name}='{shown(row[name])}' is not a number"
    for name in ("test_by_distance",) + (("shift_by_distance",) if row["shift_region"] else ()):
        if not _is_by_distance(row[name]):
            return f"{name} is not the JSON mapping of distances to [correct, total] run_one writes (cut short?)"
    if not re.fullmatch(r"[0-9a-f]{12}", row["fingerprint"]):
        return f"fingerprint='{shown(row['fingerprint'])}' is not 12 hex digits"
    try:
        time.strptime(row["finished_at"], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return f"finished_at='{shown(row['finished_at'])}' is not a time (cut short?)"
    lr = float(row["lr"]) if row["experiment"] == CALIBRATE else None
    key = Run(
        row["experiment"], row["task"], row["model"], int(row["num_train"]), int(row["seed"]), "", "", 0, {}, "", lr
    ).key
    if row["key"] != key:
        return f"its key '{shown(row['key'])}' does not match its columns (they make '{shown(key)}')"
    return None


def read_rows(csv_path: Path) -> list[dict]:
    """The finished runs in ``runs.csv`` (empty if there is none yet), every line checked.

    A damaged line (cut short, edited by hand) raises ``StudyError`` naming the file and the line:
    deleting it makes the study redo that run. run_one's fields never hold a newline, so every
    line is one row.
    """
    if not csv_path.exists():
        return []
    # Lines end at "\n" only (str.splitlines also ends them at \f, \x1c, ...): the numbers an editor shows.
    lines = csv_path.read_text(errors="replace").replace("\r\n", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        return []
    where = printable(csv_path)
    header = _fields(lines[0]) or []
    if tuple(header) != COLUMNS:
        raise StudyError(
            f"{where} line 1 is not the header this study writes ({len(header)} columns, expected "
            f"{len(COLUMNS)}: {','.join(COLUMNS)}): restore it, or use a new out_dir if another "
            f"version of the study wrote this file"
        )
    rows, seen = [], {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = _fields(line)
        problem = "it is not a line of CSV" if fields is None else _row_problem(fields)
        if problem is not None:
            key = fields[0] if fields else ""
            raise StudyError(
                f"{where} line {number} is damaged: {problem}. Delete that line to redo its run "
                f"({shown(key) if key else 'no key'}), then rerun the same command"
            )
        if fields[0] in seen:
            raise StudyError(
                f"{where} line {number} repeats run {shown(fields[0])} of line {seen[fields[0]]}: "
                f"delete one of the two lines"
            )
        seen[fields[0]] = number
        rows.append(dict(zip(COLUMNS, fields)))
    return rows


def _fields(line: str) -> list[str] | None:
    """The fields of one line, or None if it is not CSV (e.g. a field over the csv module's size limit)."""
    try:
        return next(csv.reader([line]), [])
    except csv.Error:
        return None


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row whole (`studies.runner.rows.append_rows`): a killed invocation leaves no half line."""
    append_rows(csv_path, COLUMNS, [row])
