"""What the arrangement study adds to the shared runner's reports: the held-out stroke per class, the
unseen spans against the seen ones, and attention blocking on the study's own ViT checkpoints.

Written by the study's command (``python -m studies.arrangement``, ``__main__``) into its ``out_dir``,
``studies/arrangement/results/arrangement``: ``shortcuts.csv`` before the grid (``runner_shortcuts``: the
audit in the runner's format, from which its report counts a run as a success above the best shortcut + 5
points); after the grid, ``blocking.csv`` (``run_blocking``: one row per checkpoint, as each finishes, a
rerun skipping those already there; the checkpoints the runs left under ``<log_dir>/<run key>/checkpoints``
are not committed) and ``arrangement.md`` (``write``: every number a median over the seeds with the
range, per model), from ``runs.csv`` and the per-image predictions.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

import numpy as np

from studies.runner.rows import append_rows

# The relation experiment's global-attention ViTs (of the first grid, then of the matched grid) that attention
# blocking tests.
BLOCKED_MODELS = ("vit-sincos2d", "vit-sincos2d-cls", "vit-sincos", "vit-learned-0.7")
# The first grid's audit (configs/arrangement.yaml: made before its placement was balanced per span); every other
# grid's audit is made for its own config, into ``<out_dir>/audit`` (``audit_path``).
FIRST_GRID = Path("studies/arrangement/results/arrangement")
FIRST_AUDIT = Path("studies/arrangement/results/shortcuts.csv")
RELATION_SHORTCUTS = Path("studies/relation/results/relation/shortcuts.csv")
BLOCKING_IMAGES = 1000  # the first test images of each checkpoint's own test split


def audit_path(results: Path) -> Path:
    """The ``shortcuts.csv`` of the audit made for the grid whose ``out_dir`` is ``results``."""
    return FIRST_AUDIT if Path(results) == FIRST_GRID else Path(results) / "audit" / "shortcuts.csv"


def runner_shortcuts(results: Path, audit: Path | None = None, relation: Path = RELATION_SHORTCUTS) -> None:
    """``<results>/shortcuts.csv`` in the shared runner's format (task, baseline, accuracy, what), which its
    report reads for the success threshold (the task's best shortcut + 5 points): the arrangement audit's
    shortcut rows on every image of each setting (``<baseline>@<setting>``; the subsets of a span bin, a few
    hundred images, are for the tables that score them, not for counting a run over every image a success),
    and the relation study's ``same_different`` rows."""
    audited = [r for r in _rows(audit or audit_path(results)) if r["shortcut"] == "True"]
    largest: dict[str, int] = {}  # setting -> its number of images (the subset of every image)
    for r in audited:
        setting = r["region"].split(" ")[0]
        largest[setting] = max(largest.get(setting, 0), int(r.get("n") or 0))  # the first audit: no n
    rows = [
        {
            "task": "arrangement",
            "baseline": f"{r['baseline']}@{r['region']}",
            "accuracy": r["accuracy"],
            "what": r["what"],
        }
        for r in audited
        if int(r.get("n") or 0) == largest[r["region"].split(" ")[0]]
    ]
    rows += [r for r in _rows(relation) if r["task"] == "same_different"]
    with (results / "shortcuts.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["task", "baseline", "accuracy", "what"], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _spread(values: list[float]) -> str:
    """``median [min-max]`` in percent, or ``–`` for no values."""
    if not values:
        return "–"
    v = [100 * x for x in values]
    return f"{statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]"


def _by_model(rows: list[dict], experiment: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["experiment"] == experiment:
            out.setdefault(r["model"], []).append(r)
    return out


def held_out_table(rows: list[dict], results: Path) -> list[str]:
    """Per model: the accuracy on the "same" pairs (the unseen stroke twice), on the "different" ones (the unseen
    stroke beside a trained one), overall, and the in-distribution validation accuracy (the three trained strokes)."""
    lines = [
        "## held_out: `same_different` with the anti-diagonal stroke never trained on",
        "",
        "Every test pair holds the unseen stroke. Validation (3 trained strokes) is in distribution.",
        "",
        '| model | n | val (trained strokes) | test overall | test "same" (unseen twice) | test "different" |',
        "|---|---|---|---|---|---|",
    ]
    for model, runs in _by_model(rows, "held_out").items():
        same, diff = [], []
        for r in runs:
            z = np.load(results / "predictions" / f"{r['key']}.npz")
            correct = z["test_pred"] == z["test_label"]
            same.append(float(correct[z["test_label"] == 1].mean()))
            diff.append(float(correct[z["test_label"] == 0].mean()))
        lines.append(
            f"| {model} | {len(runs)} | {_spread([float(r['val_acc']) for r in runs])} | "
            f"{_spread([float(r['test_acc']) for r in runs])} | {_spread(same)} | {_spread(diff)} |"
        )
    return lines + [""]


def span_ood_table(rows: list[dict], results: Path) -> list[str]:
    """Per model: the validation accuracy on the trained spans (<= 20) against the test on unseen spans (21-32)."""
    lines = [
        "## span_ood: trained on spans <= 20 px, tested on spans 21-32",
        "",
        "Each span bin: the median [min-max] of the runs' accuracies on its images, then (after the slash) all "
        "runs' images of the bin pooled.",
        "",
        "| model | n | val (spans <= 20) | test (21-32) | test 21-24 | test 25-28 | test 29-32 | runs (val / test) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, runs in _by_model(rows, "span_ood").items():
        bins = {b: [] for b in ((21, 24), (25, 28), (29, 32))}
        pooled = {b: [0, 0] for b in bins}  # (right, images) over every run
        for r in runs:
            z = np.load(results / "predictions" / f"{r['key']}.npz")
            correct, span = z["test_pred"] == z["test_label"], z["test_distance"]
            for lo, hi in bins:
                inside = (span >= lo) & (span <= hi)
                bins[(lo, hi)].append(float(correct[inside].mean()))
                pooled[(lo, hi)][0] += int(correct[inside].sum())
                pooled[(lo, hi)][1] += int(inside.sum())
        each = " ".join(f"{100 * float(r['val_acc']):.1f}/{100 * float(r['test_acc']):.1f}" for r in runs)
        lines.append(
            f"| {model} | {len(runs)} | {_spread([float(r['val_acc']) for r in runs])} | "
            f"{_spread([float(r['test_acc']) for r in runs])} | "
            + " | ".join(f"{_spread(v)} / {100 * pooled[b][0] / pooled[b][1]:.1f}" for b, v in bins.items())
            + f" | {each} |"
        )
    return lines + [""]


def run_blocking(rows: list[dict], results: Path, runs_dir: Path) -> None:
    """Attention blocking (``studies.runner.attention_blocking``, CLS conditions included) on the best checkpoint of
    every finished run of ``BLOCKED_MODELS`` in the relation experiment; rows appended to ``blocking.csv``."""
    from studies.runner.attention_blocking import CLS_CONDITIONS, CONDITIONS, blocking_accuracies

    conditions = CONDITIONS + CLS_CONDITIONS
    out = results / "blocking.csv"
    done = {r["key"] for r in _rows(out)} if out.exists() else set()
    columns = ["key", "model", "seed", "images", "left_out", *conditions]
    for r in rows:
        if r["experiment"] != "relation" or r["model"] not in BLOCKED_MODELS or r["key"] in done:
            continue
        ckpts = sorted((runs_dir / r["key"] / "checkpoints").glob("*.ckpt"))
        if not ckpts:
            print(f"no checkpoint for {r['key']} under {runs_dir}: rerun the study to make it", file=sys.stderr)
            continue
        result = blocking_accuracies(ckpts[-1], conditions=conditions, max_images=BLOCKING_IMAGES)
        append_rows(
            out,
            columns,
            [
                {
                    "key": r["key"],
                    "model": r["model"],
                    "seed": r["seed"],
                    **{k: result[k] for k in ("images", "left_out", *conditions)},
                }
            ],
        )
        print(f"blocking: {r['key']} done", flush=True)


def blocking_table(results: Path) -> list[str]:
    from studies.runner.attention_blocking import CLS_CONDITIONS, CONDITIONS

    path = results / "blocking.csv"
    if not path.exists():
        return []
    rows = _rows(path)
    blocked = [m for m in BLOCKED_MODELS if any(r["model"] == m for r in rows)]
    lines = [
        "## Attention blocking (experiment `relation`, at test time, every layer)",
        "",
        f"The first {BLOCKING_IMAGES} test images of each run, less those where one token's window holds "
        "ink of both discs (`images` kept). `studies/runner/attention_blocking.py` defines the conditions.",
        "",
        "| condition | " + " | ".join(f"{m} (n={sum(r['model'] == m for r in rows)})" for m in blocked) + " |",
        "|---" * (len(blocked) + 1) + "|",
    ]
    for condition in ("images", *CONDITIONS, *CLS_CONDITIONS):
        cells = []
        for m in blocked:
            values = [r[condition] for r in rows if r["model"] == m and r[condition] != ""]
            if condition == "images":
                cells.append(f"{statistics.median(int(v) for v in values):.0f}" if values else "–")
            else:
                cells.append(_spread([float(v) for v in values]))
        lines.append(f"| {condition} | " + " | ".join(cells) + " |")
    return lines + [""]


def write(rows: list[dict], results: Path) -> None:
    """``arrangement.md``: the held-out, span and blocking tables (printed too)."""
    names, tables = [], []
    for name, experiment, table in (
        ("the held-out stroke", "held_out", held_out_table),
        ("the unseen spans", "span_ood", span_ood_table),
    ):
        if _by_model(rows, experiment):
            names.append(name)
            tables += table(rows, results)
    if (results / "blocking.csv").exists():
        names.append("attention blocking")
        tables += blocking_table(results)
    lines = [
        f"# Arrangement study: {', '.join(names)}",
        "",
        "Generated by `python -m studies.arrangement` from `runs.csv`, the per-image predictions and "
        "`blocking.csv`. Test accuracy (%), median [min-max] over the seeds.",
        "",
        *tables,
    ]
    (results / "arrangement.md").write_text("\n".join(lines))
    print("\n".join(lines))
