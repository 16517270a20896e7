"""The relation study's predictions, written before its runs: per CNN, the share of its own test pairs that the
partial-view (visibility) model calls visible, and the accuracy it predicts from that share.

    python -m studies.relation.visibility --config studies/relation/configs/relation.yaml \
        --out studies/relation/results/relation/predictions.md --acc-visible 0.922

The model (which pairs a CNN's units can read, ``unit_windows`` and ``visible``) is the runner's
``studies.runner.visibility``, whose ``report`` re-bins the finished runs by it; here, with no model
trained and nothing fitted, it is applied to the exact test sets the study's runs will draw
(``study_test_sets``), and ``a``, the accuracy on the pairs a CNN sees, is assumed (``--acc_visible``;
100% at best). ``main`` refuses to overwrite a page: predictions are written once, before the runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from studies.runner.cells import distance_edges
from studies.runner.grid import experiments, load_config
from studies.runner.visibility import ADJACENT, conv_model, is_additive, predicted_accuracy, unit_windows, visible
from vit.commands import EitherSpelling
from vit.data.same_different import SHAPE_SIZE, SameDifferentDataModule


def crossings(spans: np.ndarray, share: np.ndarray) -> dict[str, tuple[int, int] | None]:
    """Where the predicted curve falls, as ``(last span before, first span after)`` (None: it does not).

    ``"half"``: the visible share falls through 1/2, so the curve is halfway between the accuracy on
    visible pairs and 50%, whatever that accuracy is. ``"chance"``: the share reaches 0 and stays
    there, so the predicted accuracy reaches 50% (the "50% crossing").
    """
    half = next(
        ((int(lo), int(hi)) for lo, hi, a, b in zip(spans[:-1], spans[1:], share[:-1], share[1:]) if a >= 0.5 > b), None
    )
    seen = np.nonzero(share > 0)[0]
    chance = None
    if len(seen) and seen[-1] + 1 < len(spans):
        chance = (int(spans[seen[-1]]), int(spans[seen[-1] + 1]))
    return {"half": half, "chance": chance}


def by_span(span: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(spans, mean of values per span, count per span)`` over the distinct spans, ascending."""
    spans, inverse, counts = np.unique(span, return_inverse=True, return_counts=True)
    return spans, np.bincount(inverse, weights=values.astype(float)) / counts, counts


def study_test_sets(cfg: dict, split: str = "test") -> list[tuple[str, dict, list]]:
    """``[(experiment name, its entry, [(seed, dataset), ...])]``: the exact test sets (or, with ``split="shift"``,
    the moved test sets) of the study's ``same_different`` experiments, as its runs draw them."""
    out = []
    for exp in experiments(cfg):
        if "same_different" not in exp["tasks"] or (split == "shift" and not exp.get("shift_region")):
            continue
        sets = []
        for seed in cfg["seeds"]:
            data = SameDifferentDataModule(
                num_train=exp["num_train"][0],
                num_val=cfg["num_val"],
                num_test=cfg["num_test"],
                train_region=exp["train_region"],
                test_region=exp["test_region"],
                seed=seed,
                batch_size=cfg["batch_size"],
            )
            region = exp["shift_region"] if split == "shift" else exp["test_region"]
            sets.append((seed, data.make_split("test", cfg["num_test"], region)))
        out.append((exp["name"], exp, sets))
    return out


def predict(cfg: dict, acc_visible: float, split: str = "test") -> list[dict]:
    """For every ConvNet of the study's ``same_different`` experiments: the visible share per span, the predicted
    curve and crossing, on the study's own test sets (all seeds pooled)."""
    rows = []
    for name, exp, sets in study_test_sets(cfg, split):
        span = torch.cat([ds.span for _, ds in sets]).numpy()
        for model in exp["models"]:
            net = conv_model(cfg["models"][model])
            if net is None:
                continue
            windows = unit_windows(net)
            seen = torch.cat([visible(windows, ds.positions, ds.shape_ids) for _, ds in sets]).numpy()
            whole = torch.cat(
                [visible(windows, ds.positions, ds.shape_ids, adjacent=SHAPE_SIZE) for _, ds in sets]
            ).numpy()
            spans, share, counts = by_span(span, seen)
            rows.append(
                {
                    "experiment": name,
                    "model": model,
                    "receptive_field": net.receptive_field,
                    "grid": f"{int(windows.shape[0] ** 0.5)}x{int(windows.shape[0] ** 0.5)}",
                    "additive": is_additive(cfg["models"][model]),
                    "images": len(span),
                    "visible": float(seen.mean()),
                    "whole": float(whole.mean()),
                    "accuracy": float(predicted_accuracy(seen.mean(), acc_visible)),
                    "spans": spans.tolist(),
                    "share": share.tolist(),
                    "counts": counts.tolist(),
                    **crossings(spans, share),
                }
            )
    return rows


def bins(spans: list[int], width: int = 3) -> list[tuple[int, int]]:
    """The report's span bins (``cells.distance_edges``) as inclusive ``(lo, hi)`` pairs."""
    edges = distance_edges(spans, width)
    return [(int(lo), int(hi) - 1) for lo, hi in zip(edges[:-1], edges[1:])]


def binned(row: dict, lo: int, hi: int) -> float:
    """The visible share of ``row`` pooled over spans ``lo..hi`` (NaN if no pair has such a span)."""
    sel = [(s, n) for d, s, n in zip(row["spans"], row["share"], row["counts"]) if lo <= d <= hi]
    total = sum(n for _, n in sel)
    return sum(s * n for s, n in sel) / total if total else float("nan")


def _summary(rows: list[dict], out: Path, acc_visible: float, config: str) -> list[str]:
    """The page's title, how it was computed, and its table of one row per CNN with its crossings."""
    lines = [
        "# Predictions of the partial-view (visibility) model, written before the runs",
        "",
        f"`python -m studies.relation.visibility --config {config} --out {out} --acc-visible {acc_visible:g}`: "
        "computed from the exact windows of each CNN's last-layer units on the study's own test sets "
        f"({rows[0]['images']} pairs: every seed's test set pooled), with no model trained and nothing fitted "
        "(`studies/relation/visibility.py`). A pair is *visible* to a CNN when one unit holds at least "
        f"{ADJACENT} adjacent ink pixels of each stroke. Predicted accuracy = a x visible + 50% x (1 - visible), "
        f"with a = {acc_visible * 100:.1f}% assumed for the pairs it sees. Halfway is where the visible share "
        "falls through 1/2 (the curve halfway between a and 50%, whatever a is); the 50% crossing is where it "
        "reaches 0 and stays there (the predicted accuracy is 50% from that span on). Spans as `x-y`: between the "
        "two integer spans.",
        "",
        "| model | RF (px) | units | visible (2 adjacent px) | whole strokes in one unit | predicted acc. | "
        "halfway (span, px) | 50% crossing (span, px) | model applies |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        half = "–" if r["half"] is None else f"{r['half'][0]}-{r['half'][1]}"
        chance = "none (visible at every span)" if r["chance"] is None else f"{r['chance'][0]}-{r['chance'][1]}"
        lines.append(
            f"| {r['model']} | {r['receptive_field']} | {r['grid']} | {r['visible'] * 100:.1f}% | "
            f"{r['whole'] * 100:.1f}% | {r['accuracy'] * 100:.1f}% | {half} | {chance} | "
            f"{'yes' if r['additive'] else 'no: max pooling or MLP head'} |"
        )
    return lines


def _per_bin(rows: list[dict], acc_visible: float) -> list[str]:
    """The two tables per span bin, one row per CNN: the visible share, then the predicted accuracy."""
    spans = sorted({d for r in rows for d in r["spans"]})
    edges = bins(spans)
    heads = [f"{lo}-{hi}" for lo, hi in edges]
    lines = [
        "",
        "## Visible share (%) per span bin",
        "",
        "| model | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | " + " | ".join(f"{binned(r, lo, hi) * 100:.1f}" for lo, hi in edges) + " |")
    lines += [
        "",
        f"## Predicted test accuracy (%) per span bin, a = {acc_visible * 100:.1f}%",
        "",
        "| model | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | "
            + " | ".join(f"{predicted_accuracy(binned(r, lo, hi), acc_visible) * 100:.1f}" for lo, hi in edges)
            + " |"
        )
    return lines


def write_predictions(rows: list[dict], out: Path, *, acc_visible: float, config: str) -> None:
    """The predictions page: per CNN the visible share and the predicted accuracy per span bin, and the crossing."""
    if not rows:
        raise ValueError(f"{config} has no ConvNet in a same_different experiment: nothing to predict")
    lines = _summary(rows, out, acc_visible, config) + _per_bin(rows, acc_visible)
    lines += [
        "",
        "## Visible share per span (px), exact",
        "",
        "```",
        json.dumps({r["model"]: dict(zip(r["spans"], [round(s, 4) for s in r["share"]])) for r in rows}, indent=None),
        "```",
        "",
    ]
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.relation.visibility`: the predictions page; refuses to overwrite an existing one."""
    parser = EitherSpelling(prog="python -m studies.relation.visibility", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="study config YAML, e.g. studies/relation/configs/relation.yaml"
    )
    parser.add_argument("--out", required=True, help="the markdown file to write (must not exist)")
    parser.add_argument(
        "--acc_visible",
        type=float,
        default=1.0,
        help="accuracy assumed on the pairs a CNN sees (default 1.0: the model's upper bound)",
    )
    args = parser.parse_args(argv)
    if not 0.5 <= args.acc_visible <= 1:
        parser.error(f"--acc_visible={args.acc_visible} is not allowed: expected a float in [0.5, 1]")
    out = Path(args.out)
    if out.exists():  # predictions are written once, before the runs: never replaced silently
        print(
            f"error: {out} exists; predictions are written once, before the runs: move it away or choose another --out",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        cfg = load_config(args.config)
        rows = predict(cfg, args.acc_visible)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_predictions(rows, out, acc_visible=args.acc_visible, config=args.config)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
