"""The arrangement task's shortcut audit: how far the tilt of a pair can be read without relating its two discs, on
every subset of images that the study's tables score.

    python -m studies.arrangement.shortcuts --out studies/arrangement/results/audit_v2

Measured before any model, on the study's own images (``--config``: the study's config). A setting is one split as
the study draws it: for each experiment of the task ``arrangement``, the test split of every seed, made by the data
module of its runs (``studies.runner.grid.plan``) and pooled over the seeds; and the validation split of an
experiment that bounds the trained spans (``span_ood/val``: the ``val`` column of ``arrangement.md``); and the test
split placed in an experiment's ``shift_region`` (``translation/shift``: the translation test). Each baseline
is scored on the subsets of a setting's images that the tables score (``settings.span_subsets``):

* every image (``summary.md``, ``comparisons.md``);
* the 3-px span bins of ``by_distance.md`` (``studies.runner.cells.distance_edges``);
* within and beyond each CNN's receptive field in the span range (``by_distance.md``'s ``<= RF`` / ``> RF`` and its
  split tables);
* the span bins of ``arrangement.md``'s ``span_ood`` table (``settings.SPAN_OOD_BINS``);
* spans >= 25, the longest, where the discs hug the borders and corners.

On each subset a baseline is fit on the images of the same spans in a fresh draw of the same law (the same data
module with seed ``FIT_SEED``, ``--num_fit`` images), then scored on the study's images of those spans. Each row is
a test accuracy with its exact 95% Clopper-Pearson interval. Bayes rows are the majority label per key learned on
the fit draw (``studies.runner.shortcuts.bayes_accuracy``): an upper estimate of what that statistic gives.

Shortcuts, label-free by construction or by measurement (each must stay at most 55%):

* ``disc_a``, ``disc_b``, ``disc_random``: Bayes on one disc's centre pixel alone (the first, the second, or one
  chosen by a seeded coin per image);
* ``midpoint``: Bayes on the pair's midpoint (half-pixel grid);
* ``span``, ``distance``: Bayes on the span and on the rounded centre distance;
* ``ink``, ``parts``: logistic regression on the total ink; Bayes on the number of connected
  blobs above half the ink level (from the pixels);
* ``quadrants``: Bayes on which quadrants the two discs occupy (unordered);
* ``pixels_logreg``: logistic regression on the raw pixels (an additive score of the two discs:
  what global average pooling and a linear head over position-aware local features can reach);
* ``centres_logreg``: logistic regression on the two-hot map of the discs' centres (the same, on
  the positions alone).

Not shortcuts, at chance by no design (they read the relation, at some resolution), scored on every image of each
setting only:

* ``grid4``: Bayes on which cells of a 4x4 grid the two discs occupy (unordered): the relation
  read at an 8-px resolution;
* ``positions_sorted``: gradient-boosted trees on both centres without order (sorted): the
  positions of identical parts, unordered, *are* the relation;
* ``pixels_mlp``: a 2-layer MLP (256 hidden units) on the raw pixels: a model, not a shortcut.
"""

from __future__ import annotations

import csv
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from studies.arrangement.settings import (  # what the audit scores
    Images,
    Setting,
    study_settings,
)
from studies.runner.grid import load_config
from studies.runner.shortcuts import bayes_accuracy, logreg_accuracy
from studies.runner.stats import clopper_pearson
from vit.commands import EitherSpelling

CONFIG = "studies/arrangement/configs/arrangement.yaml"  # the study's (studies/arrangement/__main__.py)
LIMIT = 0.55  # the highest accuracy a shortcut may reach
NOT_SHORTCUTS = ("grid4", "positions_sorted", "pixels_mlp")


def _cells(c: np.ndarray, cell: int, side: int) -> np.ndarray:
    """One key per sample: the unordered pair of grid cells (``cell`` px) that hold the two centres."""
    per_row = side // cell
    k = np.sort((c[..., 0] // cell) * per_row + c[..., 1] // cell, axis=1)  # (N, 2)
    return k[:, 0] * per_row**2 + k[:, 1]


def _mlp_accuracy(xtr, ytr, xte, yte) -> float:
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(256,), max_iter=100, early_stopping=True, random_state=0)
    return float(clf.fit(xtr, ytr).score(xte, yte))


def _trees_accuracy(xtr, ytr, xte, yte) -> float:
    from sklearn.ensemble import HistGradientBoostingClassifier

    return float(HistGradientBoostingClassifier(max_iter=300, random_state=0).fit(xtr, ytr).score(xte, yte))


def subset_label(setting: str, lo: int, hi: int) -> str:
    """The name of a subset in the results: ``relation 11-13``, ``relation 11`` for one span."""
    return f"{setting} {lo}" if lo == hi else f"{setting} {lo}-{hi}"


def _row(label: str, name: str, acc: float, n: int, what: str) -> dict:
    """One result row: ``name``'s accuracy on the ``n`` images of subset ``label``, with its exact 95% interval."""
    low, high = clopper_pearson(round(acc * n), n)
    return {
        "region": label,
        "n": n,
        "baseline": name,
        "accuracy": round(acc, 4),
        "low": round(low, 4),
        "high": round(high, 4),
        "shortcut": name not in NOT_SHORTCUTS,
        "what": what,
    }


def _pixel(c: np.ndarray, img_size: int) -> np.ndarray:
    """The flat pixel of each (row, col) centre."""
    return c[..., 0] * img_size + c[..., 1]  # (N, ...) flat pixel of (N, ..., 2) (row, col)


def _two_hot(c: np.ndarray, img_size: int) -> np.ndarray:
    """The two-hot map (N, img_size**2) of each sample's two centres."""
    out = np.zeros((len(c), img_size * img_size), dtype=np.float32)
    np.add.at(out, (np.arange(len(c))[:, None], c[..., 0] * img_size + c[..., 1]), 1.0)
    return out


def _sorted_centres(c: np.ndarray, img_size: int) -> np.ndarray:
    """Both centres of each sample without order (sorted by flat pixel), as (N, 4)."""
    order = np.argsort(_pixel(c, img_size), axis=1)  # (N, 2)
    return np.take_along_axis(c, order[..., None], axis=1).reshape(len(c), 4)


def _bayes(fit: Images, test: Images, name: str, key, what: str) -> tuple[str, float, str]:
    """``(name, accuracy, what)`` of the majority label per ``key(images)`` learned on ``fit``, scored on ``test``."""
    return name, bayes_accuracy(key(fit), fit.labels, key(test), test.labels), what


def _geometry_scores(fit: Images, test: Images, img_size: int) -> list[tuple[str, float, str]]:
    """``(name, accuracy, what)`` of the Bayes shortcuts on the centres: one disc, the midpoint, span and distance."""
    return [
        *(
            _bayes(
                fit,
                test,
                name,
                lambda im, k=k: _pixel(im.centres[:, k], img_size),
                f"Bayes on the centre pixel of disc {name[-1]} alone",
            )
            for k, name in enumerate(("disc_a", "disc_b"))
        ),
        _bayes(
            fit,
            test,
            "disc_random",
            lambda im: _pixel(im.centres[np.arange(len(im.pick)), im.pick], img_size),
            "Bayes on the centre pixel of one disc chosen at random",
        ),
        _bayes(
            fit,
            test,
            "midpoint",
            lambda im: im.centres[..., 0].sum(1) * 2 * img_size + im.centres[..., 1].sum(1),
            "Bayes on the midpoint (half pixels)",
        ),
        _bayes(fit, test, "span", lambda im: im.span, "Bayes on the span"),
        _bayes(
            fit,
            test,
            "distance",
            lambda im: np.rint(np.hypot(*(im.centres[:, 1] - im.centres[:, 0]).T)).astype(np.int64),
            "Bayes on the rounded centre distance",
        ),
    ]


def _layout_scores(fit: Images, test: Images, img_size: int) -> list[tuple[str, float, str]]:
    """``(name, accuracy, what)`` of the shortcuts on the ink, the blobs, the quadrants, the pixels and the centres."""
    ytr, yte = fit.labels, test.labels
    return [
        (
            "ink",
            logreg_accuracy(fit.pixels.sum(1, keepdims=True), ytr, test.pixels.sum(1, keepdims=True), yte),
            "logistic regression on the total ink",
        ),
        _bayes(fit, test, "parts", lambda im: im.blobs, "Bayes on the number of blobs in the pixels"),
        _bayes(
            fit,
            test,
            "quadrants",
            lambda im: _cells(im.centres, img_size // 2, img_size),
            "Bayes on the quadrants of both discs (unordered)",
        ),
        ("pixels_logreg", logreg_accuracy(fit.pixels, ytr, test.pixels, yte), "logistic regression on the raw pixels"),
        (
            "centres_logreg",
            logreg_accuracy(_two_hot(fit.centres, img_size), ytr, _two_hot(test.centres, img_size), yte),
            "logistic regression on the two-hot map of the centres",
        ),
    ]


def _relation_scores(fit: Images, test: Images, img_size: int, mlp: bool) -> list[tuple[str, float, str]]:
    """``(name, accuracy, what)`` of the baselines that read the relation (the MLP with ``mlp`` only)."""
    ytr, yte = fit.labels, test.labels
    scores = [
        _bayes(
            fit,
            test,
            "grid4",
            lambda im: _cells(im.centres, img_size // 4, img_size),
            "Bayes on the cells of a 4x4 grid of both discs (unordered): the relation at 8 px",
        ),
        (
            "positions_sorted",
            _trees_accuracy(_sorted_centres(fit.centres, img_size), ytr, _sorted_centres(test.centres, img_size), yte),
            "gradient-boosted trees on both centres, sorted: the relation itself",
        ),
    ]
    if mlp:
        scores.append(
            (
                "pixels_mlp",
                _mlp_accuracy(fit.pixels, ytr, test.pixels, yte),
                "2-layer MLP (256 hidden) on the raw pixels: a model",
            )
        )
    return scores


def audit_subset(
    fit: Images, test: Images, label: str, *, img_size: int = 32, relation: bool = False, mlp: bool = True
) -> list[dict]:
    """Rows ``{region, n, baseline, accuracy, low, high, shortcut, what}`` of every shortcut fit on ``fit`` and scored
    on ``test`` (``region``: the subset's ``label``); with ``relation``, the baselines that read the relation too."""
    scores = _geometry_scores(fit, test, img_size) + _layout_scores(fit, test, img_size)
    if relation:
        scores += _relation_scores(fit, test, img_size, mlp)
    return [_row(label, name, acc, len(test.labels), what) for name, acc, what in scores]


def audit(setting: Setting, *, img_size: int = 32, mlp: bool = True) -> list[dict]:
    """Rows of every baseline on every subset of ``setting`` (the relation's baselines on every image only)."""
    lo, hi = int(setting.scored.span.min()), int(setting.scored.span.max())
    rows = []
    for (a, b), _ in setting.subsets.items():
        rows += audit_subset(
            setting.fit.within(a, b),
            setting.scored.within(a, b),
            subset_label(setting.name, a, b),
            img_size=img_size,
            relation=(a, b) == (lo, hi),
            mlp=mlp,
        )
    return rows


def _interval(r: dict) -> str:
    """A row's accuracy with its interval, in percent: ``51.2 [49.8, 52.6]``."""
    return f"{100 * r['accuracy']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"


def _write_csv(rows: list[dict], path: Path) -> None:
    """Every row into the CSV at ``path``."""
    fields = ["region", "n", "baseline", "accuracy", "low", "high", "shortcut", "what"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def _intro(seconds: float, command: str) -> list[str]:
    """The lines of ``shortcuts.md``'s title and its paragraph on how the audit was made."""
    return [
        "# Arrangement: shortcut audit per span subset, test accuracy (%) with exact 95% intervals",
        "",
        (
            f"Generated by `{command}` in {seconds:.0f} s (one process, "
            f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}`); balanced classes (chance 50%). "
            "Scored on the study's own images (each setting: one split of every seed, as the study's runs draw "
            "it, pooled), on every subset of spans that a table scores; each baseline fit on the same spans of a "
            f"fresh draw of the same law. A shortcut passes at most {100 * LIMIT:.0f}%. Cells: accuracy; the "
            "last column the subset's highest shortcut with its interval (every interval: `shortcuts.csv`)."
        ),
        "",
    ]


def _setting_table(s: Setting, shortcuts: list[str], table: dict) -> list[str]:
    """The lines of one setting's table: a row per subset, a column per shortcut, and the subset's highest."""
    lines = [
        f"## `{s.name}`: {len(s.scored.labels):,} images scored, fit on {len(s.fit.labels):,}",
        "",
        "| spans | n | scored by | " + " | ".join(shortcuts) + " | highest |",
        "|---" * (len(shortcuts) + 4) + "|",
    ]
    for (a, b), why in s.subsets.items():
        label = subset_label(s.name, a, b)
        cells = [table[(label, name)] for name in shortcuts]
        top = max(cells, key=lambda r: r["accuracy"])
        lines.append(
            f"| {label.split(' ')[-1]} | {cells[0]['n']} | {why} | "
            + " | ".join(f"{100 * r['accuracy']:.1f}" for r in cells)
            + f" | {top['baseline']} {_interval(top)} |"
        )
    lines.append("")
    return lines


def _relation_table(rows: list[dict], table: dict) -> list[str]:
    """The lines of the table of the baselines that read the relation, a row per setting."""
    relation = [r for r in rows if not r["shortcut"]]
    models = list(dict.fromkeys(r["baseline"] for r in relation))
    lines = [
        "## Not shortcuts: the relation read, on every image of each setting",
        "",
        "| setting | " + " | ".join(models) + " |",
        "|---" * (len(models) + 1) + "|",
    ]
    for region in dict.fromkeys(r["region"] for r in relation):
        lines.append(
            f"| {region} | "
            + " | ".join(_interval(table[(region, m)]) if (region, m) in table else "–" for m in models)
            + " |"
        )
    return lines


def _verdict(rows: list[dict]) -> list[str]:
    """The closing lines: the shortcuts above ``LIMIT``, the highest one, and what each baseline is."""
    failed = [
        f"{r['baseline']} ({r['region']}: {100 * r['accuracy']:.1f}%)"
        for r in rows
        if r["shortcut"] and r["accuracy"] > LIMIT
    ]
    worst = max((r for r in rows if r["shortcut"]), key=lambda r: r["accuracy"])
    what = {r["baseline"]: r["what"] for r in rows}
    return [
        "",
        f"Shortcuts above {100 * LIMIT:.0f}%: "
        + (", ".join(failed) if failed else "none")
        + f". Highest: {worst['baseline']} on `{worst['region']}`, {_interval(worst)}.",
        "",
        *[f"- `{b}`: {what[b]}" for b in what],
        "",
    ]


def write(rows: list[dict], settings: list[Setting], out_dir: Path, seconds: float, command: str) -> None:
    """``shortcuts.csv`` (every row) and ``shortcuts.md`` (a table per setting) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_csv(rows, out_dir / "shortcuts.csv")
    shortcuts = list(dict.fromkeys(r["baseline"] for r in rows if r["shortcut"]))
    table = {(r["region"], r["baseline"]): r for r in rows}
    lines = _intro(seconds, command)
    for s in settings:
        lines += _setting_table(s, shortcuts, table)
    lines += _relation_table(rows, table)
    lines += _verdict(rows)
    (out_dir / "shortcuts.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.arrangement.shortcuts`: the audit, into ``--out``."""
    parser = EitherSpelling(prog="python -m studies.arrangement.shortcuts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for shortcuts.csv and shortcuts.md")
    parser.add_argument("--config", default=CONFIG, help="the study's config, whose images are scored")
    parser.add_argument("--num_fit", type=int, default=40_000, help="images of each fresh draw the baselines fit on")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    settings = study_settings(load_config(args.config), args.num_fit)
    rows = [r for s in settings for r in audit(s)]
    command = shlex.join(["python", "-m", "studies.arrangement.shortcuts", *(sys.argv[1:] if argv is None else argv)])
    write(rows, settings, Path(args.out), time.perf_counter() - start, command)
    print((Path(args.out) / "shortcuts.md").read_text())


if __name__ == "__main__":
    main()
