"""The report's building blocks: the runs grouped by cell, what counts as a success, each CNN's
receptive field, and the bins of the distance between the two parts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from studies.runner.grid import CALIBRATE
from studies.runner.stats import clopper_pearson
from vit.models.cnn import receptive_field

PERCENT = 100.0
MARGIN = 0.05  # success: the best shortcut's accuracy plus this


def per_cell(rows: list[dict]) -> dict[tuple, list[dict]]:
    """``{(experiment, task, model, num_train): [rows, by seed]}`` of the study's runs (calibration left out)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["experiment"] != CALIBRATE:
            groups.setdefault((r["experiment"], r["task"], r["model"], int(r["num_train"])), []).append(r)
    return {k: sorted(v, key=lambda r: int(r["seed"])) for k, v in groups.items()}


def read_shortcuts(out_dir: Path) -> dict[str, dict[str, float]]:
    """``{task: {baseline: accuracy}}`` from ``shortcuts.csv`` (empty if there is none)."""
    path = out_dir / "shortcuts.csv"
    table: dict[str, dict[str, float]] = {}
    if path.exists():
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                table.setdefault(r["task"], {})[r["baseline"]] = float(r["accuracy"])
    return table


def success_threshold(shortcuts: dict[str, dict[str, float]], task: str) -> float | None:
    """Accuracy a run must exceed to count as a success: the task's best shortcut + 5 points (None: no audit)."""
    return max(shortcuts[task].values()) + MARGIN if task in shortcuts else None


def model_rf(cfg: dict, model: str) -> int | None:
    """The exact receptive field of a ``ConvNet`` model of the config (None for other models)."""
    spec = cfg["models"][model]
    if not spec["class_path"].endswith("ConvNet"):
        return None
    args = spec.get("init_args", {})
    widths = args.get("widths", (32, 32, 32))
    strides = args.get("strides") or (1,) * len(widths)
    return receptive_field((args.get("kernel_size", 3),) * len(widths), tuple(strides))


def successes(accs: list[float], threshold: float | None) -> tuple[int, float, float] | None:
    """``(k, ci_low, ci_high)``: runs above ``threshold`` and the 95% Clopper-Pearson interval."""
    if threshold is None or threshold >= 1:
        return None
    k = sum(a > threshold for a in accs)
    return (k, *clopper_pearson(k, len(accs)))


def distance_edges(dists: list[int], width: int = 3) -> np.ndarray:
    """Bin edges of ``width`` px from the smallest to the largest distance; a last bin narrower than 2 px joins the
    one before."""
    lo, hi = min(dists), max(dists)
    edges = list(range(lo, hi + 2, width))
    if edges[-1] != hi + 1:
        if hi + 1 - edges[-1] < 2 and len(edges) > 1:
            edges[-1] = hi + 1
        else:
            edges.append(hi + 1)
    return np.array(edges)


def pooled_by_distance(runs: list[dict], edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(accuracy, count)`` per distance bin ``[edges[i], edges[i+1])``, the test images of all runs pooled."""
    correct, total = np.zeros(len(edges) - 1), np.zeros(len(edges) - 1)
    for r in runs:
        for d, (c, t) in json.loads(r["test_by_distance"]).items():
            i = np.searchsorted(edges, int(d), side="right") - 1
            if 0 <= i < len(total):
                correct[i] += c
                total[i] += t
    with np.errstate(invalid="ignore", divide="ignore"):
        return correct / total, total


def within_and_beyond(runs: list[dict], rf: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """``((accuracy, images) with distance <= rf, (accuracy, images) beyond rf)``, all runs' test images pooled."""
    acc, count = pooled_by_distance(runs, np.array([0, rf + 1, 10**9]))
    return (float(acc[0]), int(count[0])), (float(acc[1]), int(count[1]))
