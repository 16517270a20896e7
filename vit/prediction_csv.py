"""The predictions CSV, without Lightning (`vit.predict` and `train.py predict` write it): one row per image, `file`,
`class_name`, `class_index`, `probability`; with `topk=K` the next classes follow as `class_name_2`,
`class_index_2`, `probability_2`, ... Its cells are safe in a spreadsheet (`csv_text`); it is written whole
(`write_csv`), never over an existing file (`free_path`)."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

import torch

from vit.checks import check_topk
from vit.commands import write_whole
from vit.data.files import text_name


def prediction_table(
    files: list[str], probs: torch.Tensor, class_names: list[str], topk: int = 1
) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the predictions CSV for `probs` `(N, num_classes)` of `files` (see the module doc)."""
    check_topk(topk, probs.shape[-1])
    columns = ["class_name", "class_index", "probability"]
    header = ["file", *columns] + [f"{column}_{rank}" for rank in range(2, topk + 1) for column in columns]
    confidence, classes = probs.topk(topk, dim=-1)  # (N, K) each, best first
    rows = [
        [csv_text(file), *(cell for k, p in zip(ks, ps) for cell in (csv_text(class_names[k]), str(k), f"{p:.6f}"))]
        for file, ks, ps in zip(files, classes.tolist(), confidence.tolist())
    ]
    return header, rows


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # what spreadsheets read as the start of a formula


def csv_text(name: str) -> str:
    """A file or class name as a CSV cell: valid text (`text_name`: `caf\\xff.png`), after a `'` when it would start
    a formula (`'=cmd.png`, OWASP's advice against CSV injection)."""
    name = text_name(name)
    return "'" + name if name.startswith(FORMULA_STARTS) else name


def write_csv(output: Path, header: list[str], rows: Iterable[list[str]], keep_empty: bool = True) -> int:
    """Write a CSV, its rows as they come, whole (`vit.commands.write_whole`): no half-written file is ever left.
    Returns the number of rows; with `keep_empty=False` and none, nothing is written."""
    count = 0

    def fill(f) -> bool:
        nonlocal count
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            writer.writerow(row)
            count += 1
        return bool(count) or keep_empty

    write_whole(output, fill, newline="")
    return count


def free_path(path: Path) -> Path:
    """`path`, or `stem-1.suffix`, `stem-2.suffix`, ... : the first name not taken, so nothing is overwritten."""
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate
