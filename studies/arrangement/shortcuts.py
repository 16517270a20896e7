"""The arrangement task's shortcut audit: how far the tilt of a pair can be read without relating its two discs.

    python -m studies.arrangement.shortcuts --out studies/arrangement/results

(the study's command, ``python -m studies.arrangement``, runs it first when ``shortcuts.csv`` is not there).
Measured before any model, on fresh draws of ``studies.runner.arrangement.ArrangementDataset`` (the train
split to fit, the test split to score, fixed seeds), per setting: the regions ``all`` and ``left``
(5/8 of the columns), and the two span ranges of the study's out-of-distribution experiment in the
whole image, ``short`` (spans up to 20 px, what it trains on) and ``long`` (21 px and more, what it
is tested on). Each row is a test accuracy with its exact 95%
Clopper-Pearson interval. Bayes rows are the majority label per key learned on the train split
(``studies.runner.shortcuts.bayes_accuracy``): an upper estimate of what that statistic gives.

Shortcuts, label-free by construction or by measurement (each must stay at most 55%):

* ``disc_a``, ``disc_b``: Bayes on one disc's centre pixel alone;
* ``midpoint``: Bayes on the pair's midpoint (half-pixel grid);
* ``span``, ``distance``: Bayes on the span and on the rounded centre distance;
* ``ink``, ``parts``: logistic regression on the total ink; Bayes on the number of connected
  blobs above half the ink level (from the pixels);
* ``quadrants``: Bayes on which quadrants the two discs occupy (unordered);
* ``pixels_logreg``: logistic regression on the raw pixels (an additive score of the two discs:
  what global average pooling and a linear head over position-aware local features can reach);
* ``centres_logreg``: logistic regression on the two-hot map of the discs' centres (the same, on
  the positions alone).

Not shortcuts, at chance by no design (they read the relation, at some resolution):

* ``grid4``: Bayes on which cells of a 4x4 grid the two discs occupy (unordered): the relation
  read at an 8-px resolution;
* ``positions_sorted``: gradient-boosted trees on both centres without order (sorted): the
  positions of identical parts, unordered, *are* the relation;
* ``pixels_mlp``: a 2-layer MLP (256 hidden units) on the raw pixels: a model, not a shortcut.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

import numpy as np
from scipy import ndimage

from studies.runner.arrangement import DISC_SIZE, ArrangementDataset
from studies.runner.shortcuts import bayes_accuracy, logreg_accuracy
from studies.runner.stats import clopper_pearson

# Each setting: (region, min_span, max_span) of the train and test draws.
SETTINGS = {"all": ("all", None, None), "left": ("left", None, None), "short": ("all", None, 20),
            "long": ("all", 21, None)}
TRAIN_SEED, TEST_SEED = 2001, 2002
LIMIT = 0.55  # the highest accuracy a shortcut may reach
NOT_SHORTCUTS = ("grid4", "positions_sorted", "pixels_mlp")


def _centres(ds: ArrangementDataset) -> np.ndarray:
    """Centre pixel ``(N, 2, 2)`` (sample, disc, (row, col)) of each disc."""
    return ds.positions.numpy() + DISC_SIZE // 2


def _cells(c: np.ndarray, cell: int, side: int) -> np.ndarray:
    """One key per sample: the unordered pair of grid cells (``cell`` px) that hold the two centres."""
    per_row = side // cell
    k = np.sort((c[..., 0] // cell) * per_row + c[..., 1] // cell, axis=1)  # (N, 2)
    return k[:, 0] * per_row**2 + k[:, 1]


def _blobs(images: np.ndarray) -> np.ndarray:
    """Number of 4-connected blobs above 0.5 in each image ``(N, H, W)``."""
    return np.array([ndimage.label(im > 0.5)[1] for im in images])


def _mlp_accuracy(xtr, ytr, xte, yte) -> float:
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(256,), max_iter=100, early_stopping=True, random_state=0)
    return float(clf.fit(xtr, ytr).score(xte, yte))


def _trees_accuracy(xtr, ytr, xte, yte) -> float:
    from sklearn.ensemble import HistGradientBoostingClassifier

    return float(HistGradientBoostingClassifier(max_iter=300, random_state=0).fit(xtr, ytr).score(xte, yte))


def audit(region: str, *, num_train: int = 20_000, num_test: int = 10_000, img_size: int = 32,
          mlp: bool = True) -> list[dict]:
    """Rows ``{region, baseline, accuracy, low, high, shortcut, what}`` of every baseline (see the module doc)."""
    place, min_span, max_span = SETTINGS[region]
    train = ArrangementDataset(num_samples=num_train, img_size=img_size, region=place, min_span=min_span,
                               max_span=max_span, seed=TRAIN_SEED)
    test = ArrangementDataset(num_samples=num_test, img_size=img_size, region=place, min_span=min_span,
                              max_span=max_span, seed=TEST_SEED)
    ytr, yte = train.labels.numpy(), test.labels.numpy()
    ctr, cte = _centres(train), _centres(test)
    xtr, xte = train.images[:, 0].reshape(num_train, -1).numpy(), test.images[:, 0].reshape(num_test, -1).numpy()
    rows = []

    def add(name: str, acc: float, what: str) -> None:
        low, high = clopper_pearson(round(acc * num_test), num_test)
        rows.append({"region": region, "baseline": name, "accuracy": round(acc, 4), "low": round(low, 4),
                     "high": round(high, 4), "shortcut": name not in NOT_SHORTCUTS, "what": what})

    def bayes(name: str, key, what: str) -> None:
        add(name, bayes_accuracy(key(train, ctr), ytr, key(test, cte), yte), what)

    for k, name in enumerate(("disc_a", "disc_b")):
        bayes(name, lambda ds, c, k=k: c[:, k, 0] * img_size + c[:, k, 1],
              f"Bayes on the centre pixel of disc {name[-1]} alone")
    bayes("midpoint", lambda ds, c: c[..., 0].sum(1) * 2 * img_size + c[..., 1].sum(1),
          "Bayes on the midpoint (half pixels)")
    bayes("span", lambda ds, c: ds.span.numpy(), "Bayes on the span")
    bayes("distance", lambda ds, c: np.rint(np.hypot(*(c[:, 1] - c[:, 0]).T)).astype(np.int64),
          "Bayes on the rounded centre distance")
    add("ink", logreg_accuracy(xtr.sum(1, keepdims=True), ytr, xte.sum(1, keepdims=True), yte),
        "logistic regression on the total ink")
    add("parts", bayes_accuracy(_blobs(train.images[:, 0].numpy()), ytr, _blobs(test.images[:, 0].numpy()), yte),
        "Bayes on the number of blobs in the pixels")
    bayes("quadrants", lambda ds, c: _cells(c, img_size // 2, img_size),
          "Bayes on the quadrants of both discs (unordered)")
    add("pixels_logreg", logreg_accuracy(xtr, ytr, xte, yte), "logistic regression on the raw pixels")

    def two_hot(c):
        out = np.zeros((len(c), img_size * img_size), dtype=np.float32)
        np.add.at(out, (np.arange(len(c))[:, None], c[..., 0] * img_size + c[..., 1]), 1.0)
        return out

    add("centres_logreg", logreg_accuracy(two_hot(ctr), ytr, two_hot(cte), yte),
        "logistic regression on the two-hot map of the centres")
    bayes("grid4", lambda ds, c: _cells(c, img_size // 4, img_size),
          "Bayes on the cells of a 4x4 grid of both discs (unordered): the relation at 8 px")

    def sorted_centres(c):
        flat = c[..., 0] * img_size + c[..., 1]
        order = np.argsort(flat, axis=1)
        return np.take_along_axis(c, order[..., None], axis=1).reshape(len(c), 4)

    add("positions_sorted", _trees_accuracy(sorted_centres(ctr), ytr, sorted_centres(cte), yte),
        "gradient-boosted trees on both centres, sorted: the relation itself")
    if mlp:
        add("pixels_mlp", _mlp_accuracy(xtr, ytr, xte, yte), "2-layer MLP (256 hidden) on the raw pixels: a model")
    return rows


def write(rows: list[dict], out_dir: Path, seconds: float, command: str, sizes: tuple[int, int]) -> None:
    """``shortcuts.csv`` and ``shortcuts.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = ["region", "baseline", "accuracy", "low", "high", "shortcut", "what"]
    with (out_dir / "shortcuts.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    regions = list(dict.fromkeys(r["region"] for r in rows))
    baselines = list(dict.fromkeys(r["baseline"] for r in rows))
    table = {(r["region"], r["baseline"]): r for r in rows}
    lines = ["# Arrangement: shortcut audit, test accuracy (%) with exact 95% intervals", "",
             (f"Generated by `{command}` in {seconds:.0f} s (one process, "
              f"`OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}`); balanced classes (chance 50%), "
              f"fresh draws of {sizes[0]:,} train and {sizes[1]:,} test images per setting (`all`, `left`: the region; "
              "`short`, `long`: the whole image, spans <= 20 and >= 21 px). A shortcut passes at most "
              f"{100 * LIMIT:.0f}%; the rows below the line read the relation and are not shortcuts."), "",
             "| baseline | " + " | ".join(f"`{g}`" for g in regions) + " |", "|---" * (len(regions) + 1) + "|"]

    def cell(r):
        return f"{100 * r['accuracy']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}]"

    first_model = next((b for b in baselines if b in NOT_SHORTCUTS), None)
    for b in baselines:
        if b == first_model:
            lines.append("| *not shortcuts* |" + " |" * len(regions))
        lines.append(f"| {b} | " + " | ".join(cell(table[(g, b)]) if (g, b) in table else "–" for g in regions) + " |")
    failed = [f"{r['baseline']} ({r['region']})" for r in rows if r["shortcut"] and r["accuracy"] > LIMIT]
    what = {r["baseline"]: r["what"] for r in rows}
    lines += ["", f"Shortcuts above {100 * LIMIT:.0f}%: " + (", ".join(failed) if failed else "none") + ".", "",
              *[f"- `{b}`: {what[b]}" for b in baselines], ""]
    (out_dir / "shortcuts.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.arrangement.shortcuts`: the audit, into ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m studies.arrangement.shortcuts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for shortcuts.csv and shortcuts.md")
    parser.add_argument("--regions", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                        help="settings: the regions all and left, and the spans of the study's out-of-distribution "
                             "experiment (short: <= 20 px, long: >= 21 px)")
    parser.add_argument("--num-train", type=int, default=20_000)
    parser.add_argument("--num-test", type=int, default=10_000)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = [r for g in args.regions for r in audit(g, num_train=args.num_train, num_test=args.num_test)]
    command = "python -m studies.arrangement.shortcuts --out " + args.out
    write(rows, Path(args.out), time.perf_counter() - start, command, (args.num_train, args.num_test))
    print((Path(args.out) / "shortcuts.md").read_text())


if __name__ == "__main__":
    main()
