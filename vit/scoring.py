"""A labelled folder scored: its images and their labels from class folders matched to a model's classes by name
(`labelled_files`), and the scores of probabilities against labels (`metrics`): what `vit.evaluate` and
`Predictor.evaluate` report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class EvaluateError(ValueError):
    """A labelled folder or an argument that `vit.evaluate` cannot work with."""


def class_folders(root: Path, class_names: list[str]) -> tuple[list[str], list[str]]:
    """`root`'s class folders, each named as one of the model's classes, and the classes no folder is named after;
    `EvaluateError` naming what does not fit (no image is listed: a check before any work)."""
    from vit.data.files import visible_folders

    if not root.is_dir():
        raise EvaluateError(f"--input_dir {root} is not a folder" + ("" if root.exists() else " (it does not exist)"))
    folders = visible_folders(root)
    if not folders:
        raise EvaluateError(
            f"--input_dir {root} has no class folders: give a folder of one sub-folder per class, named as the "
            f"model's classes ({listed(class_names)})"
        )
    extra = [name for name in folders if name not in class_names]
    if extra:
        raise EvaluateError(
            f"--input_dir {root} has folder(s) {listed(extra)} that name no class of the model; its classes are "
            f"{listed(class_names)} (the folders are matched to them by name)"
        )
    return folders, [name for name in class_names if name not in folders]


def labelled_files(root: Path, class_names: list[str]) -> tuple[list[Path], list[int], list[str]]:
    """The images in `root`'s class folders (`class_folders`; sorted, not searched further down), each folder's label
    as the model's index of the class named as it is, and the model's classes no folder is named after."""
    from vit.data.images import image_files

    folders, missing = class_folders(root, class_names)
    index = {name: i for i, name in enumerate(class_names)}
    paths, labels = [], []
    for name in folders:
        found = image_files(root / name)
        paths += found
        labels += [index[name]] * len(found)
    return paths, labels, missing


def listed(names: list[str], most: int = 10) -> str:
    shown = ", ".join(repr(name) for name in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def metrics(probs: torch.Tensor, labels: torch.Tensor, class_names: list[str]) -> dict:
    """The scores of `probs` `(N, K)` against `labels` `(N,)`: count, top-1, top-5 (K >= 5), per-class count and
    accuracy (None for a class with no image), and the confusion matrix `[true][predicted]`."""
    import torch

    K = len(class_names)
    predicted = probs.argmax(dim=-1)
    confusion = torch.bincount(labels * K + predicted, minlength=K * K).view(K, K)  # (true, predicted)
    counts = confusion.sum(dim=1)
    result = {"images": int(labels.numel()), "top1": float((predicted == labels).float().mean())}
    if K >= 5:
        top5 = probs.topk(5, dim=-1).indices  # (N, 5)
        result["top5"] = float((top5 == labels[:, None]).any(dim=-1).float().mean())
    result["per_class"] = {
        name: {"images": int(counts[k]), "accuracy": float(confusion[k, k] / counts[k]) if counts[k] else None}
        for k, name in enumerate(class_names)
    }
    result["class_names"] = list(class_names)
    result["confusion_matrix"] = confusion.tolist()
    return result
