"""`train.py predict`'s predictions CSV (`PredictionWriter`; its layout: `vit.prediction_csv`), each sample named by
its file under an image folder's root (`sample_name`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import Dataset, Subset
from torchvision.datasets import DatasetFolder

from vit.checks import check_int
from vit.data.readable_split import ReadableSplit
from vit.prediction_csv import free_path, prediction_table, write_csv
from vit.training.classifier import index_names
from vit.training.contract import class_names_of


def sample_name(dataset: Dataset, index: int) -> str:
    """How sample `index` of `dataset` is named in the CSV: its file under an image folder's root, else its index."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, dataset.indices[index]
    if isinstance(dataset, DatasetFolder):  # torchvision's ImageFolder: samples [(path, label), ...] under root
        return os.path.relpath(dataset.samples[index][0], dataset.root)
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
        names = class_names_of(pl_module) or index_names(predictions[0][0].shape[-1])
        for i, (loader, batches, indices) in enumerate(zip(loaders, predictions, batch_indices)):
            if not batches:
                continue
            stem = Path(self.filename).stem + (f"-dataloader{i}" if len(loaders) > 1 else "")
            stem += f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
            # An image folder's evaluation split leaves a file that fails to decode out of its batch: not a row.
            split = loader.dataset if isinstance(loader.dataset, ReadableSplit) else None
            files = [
                sample_name(loader.dataset, j) for batch in indices for j in batch if not (split and split.left_out(j))
            ]
            if len(files) != (n := sum(len(b) for b in batches)):  # known only with Lightning's own sampler wrapper
                warnings.warn(
                    "the predict loader's sample indices are unknown; `file` holds the row number", stacklevel=2
                )
                files = [str(j) for j in range(n)]
            probs, output = torch.cat([b.float().cpu() for b in batches]), free_path(folder / f"{stem}.csv")
            write_csv(output, *prediction_table(files, probs, names, self.topk))
            print(f"wrote {len(files)} predictions to {output}")
