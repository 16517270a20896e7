"""Predictions on new images: a checkpoint's input transform, the model run over them in batches, and the CSV.

The CSV has one row per image: `file`, `class_name`, `class_index`, `probability`; with `topk=K` the next classes
follow as `class_name_2`, `class_index_2`, `probability_2`, ... Its cells are safe in a spreadsheet (`csv_text`).
"""

from __future__ import annotations

import csv
import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import Dataset, Subset

from vit.checks import check_int, check_topk
from vit.data.files import text_name
from vit.training.classifier import index_names


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
    """Write a CSV, its rows as they come, to a temporary file in the same folder, then rename it: no half-written file
    is ever left. Returns the number of rows; with `keep_empty=False` and none, nothing is written."""
    fd, tmp = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            writer, count = csv.writer(f), 0
            writer.writerow(header)
            for row in rows:
                writer.writerow(row)
                count += 1
        if count or keep_empty:
            os.chmod(tmp, 0o644)
            os.replace(tmp, output)
        return count
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone once renamed; removed on an error or with no rows to keep


def free_path(path: Path) -> Path:
    """`path`, or `stem-1.suffix`, `stem-2.suffix`, ... : the first name not taken, so nothing is overwritten."""
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.stem}-{n}{path.suffix}"), n + 1
    return candidate


def sample_name(dataset: Dataset, index: int) -> str:
    """How sample `index` of `dataset` is named in the CSV: its file under an image folder's root, else its index."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    samples = getattr(dataset, "samples", None)  # torchvision's ImageFolder: [(path, label), ...]
    if samples is not None and getattr(dataset, "root", None) is not None:
        return os.path.relpath(samples[index][0], dataset.root)
    return str(index)


class PredictionWriter(BasePredictionWriter):
    """`train.py predict`: the predictions CSV of the predict split, `filename` (or `stem-1.csv`, ... when that is
    taken) in the run folder; with several processes each writes its share to `stem-rank<r>.csv`."""

    def __init__(self, *, filename: str = "predictions.csv", topk: int = 1) -> None:
        super().__init__(write_interval="epoch")
        check_int("topk", topk, 1)
        if Path(filename).name != filename or not filename.endswith(".csv"):
            raise ValueError(
                f"filename={filename!r} is not allowed: expected a file name ending in .csv, without a folder"
            )
        self.filename, self.topk = filename, topk

    def write_on_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, predictions, batch_indices) -> None:
        loaders = trainer.predict_dataloaders
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        if not predictions:
            warnings.warn(
                "PredictionWriter: no predictions were kept (return_predictions=False?); nothing was written",
                stacklevel=2,
            )
            return
        if isinstance(predictions[0], torch.Tensor):  # one dataloader: Lightning gives its batches unnested
            predictions = [predictions]
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        names = getattr(pl_module, "class_names", None) or index_names(predictions[0][0].shape[-1])
        for i, (loader, batches, indices) in enumerate(zip(loaders, predictions, batch_indices)):
            if not batches:
                continue
            stem = Path(self.filename).stem + (f"-dataloader{i}" if len(loaders) > 1 else "")
            stem += f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
            files = [sample_name(loader.dataset, j) for batch in indices for j in batch]
            if len(files) != (n := sum(len(b) for b in batches)):  # known only with Lightning's own sampler wrapper
                warnings.warn(
                    "the predict loader's sample indices are unknown; `file` holds the row number", stacklevel=2
                )
                files = [str(j) for j in range(n)]
            probs, output = torch.cat([b.float().cpu() for b in batches]), free_path(folder / f"{stem}.csv")
            write_csv(output, *prediction_table(files, probs, names, self.topk))
            print(f"wrote {len(files)} predictions to {output}")
