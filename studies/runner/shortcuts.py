"""The shortcut audit of the two-circles and same-different tasks: how far each can be solved without relating its
two parts; and the estimators it uses (``bayes_accuracy``, ``logreg_accuracy``), which other audits share.

    python -m studies.runner.shortcuts --out studies/relation/results/relation

Measured before any model is trained, on fresh draws of each generator (train split to fit, test
split to score, both from fixed seeds):

* ``pixels_logreg``: logistic regression on the raw pixels (scikit-learn, L2, ``C=1``).
* ``ink``: logistic regression on the total ink of the image (one number).
* ``position_<part>``: the empirical Bayes classifier on one part's position alone (its pixel), from
  the generator's metadata: for every position the majority label of the training samples there.
  An upper estimate of what any model can get from where that part is.
* ``quadrants``: the same on the pair of quadrants that hold the two parts (16 cells).
* ``span``: the same on the distance between the parts (``span``, or the rounded centre distance).
* ``bag_of_shapes`` (same-different only): the exact ceiling of any rule that scores each shape on
  its own and adds the scores (``vit.data.same_different.bag_of_shapes_ceiling``): what a CNN whose
  receptive field holds one shape, with global average pooling and a linear head, can reach. It is
  the local view's ceiling, reported beside the shortcuts, not one of them.

A task whose shortcuts reach the accuracy a model gets says nothing about relations. A grid config's
``shortcuts`` runs this audit first, into its ``out_dir`` (``study.run_study``).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from vit.commands import EitherSpelling
from vit.data.same_different import SameDifferentDataset, bag_of_shapes_ceiling
from vit.data.two_circles import TwoCirclesDataset

TASKS = ("diagonal", "relative", "same_different")
TRAIN_SEED, TEST_SEED = 1001, 1002


def bayes_accuracy(train_keys: np.ndarray, train_y: np.ndarray, test_keys: np.ndarray, test_y: np.ndarray) -> float:
    """Accuracy on the test split of the majority label per key, learned on the train split.

    Keys never seen in training (and ties) predict the training split's majority label.
    """
    keys, inverse = np.unique(np.concatenate([train_keys, test_keys]), return_inverse=True)
    tr, te = inverse[: len(train_keys)], inverse[len(train_keys) :]
    ones = np.bincount(tr, weights=train_y, minlength=len(keys))
    total = np.bincount(tr, minlength=len(keys))
    default = int(train_y.mean() > 0.5)
    pred = np.where(2 * ones > total, 1, np.where(2 * ones < total, 0, default))
    return float((pred[te] == test_y).mean())


def logreg_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> float:
    """Test accuracy of an L2 logistic regression (``C=1``) fit on standardised features."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    clf.fit(x_train, y_train)
    return float(clf.score(x_test, y_test))


def _make(task: str, n: int, seed: int, img_size: int):
    if task == "same_different":
        return SameDifferentDataset(num_samples=n, img_size=img_size, seed=seed)
    return TwoCirclesDataset(num_samples=n, img_size=img_size, task=task, seed=seed)


def _parts(ds) -> tuple[np.ndarray, list[str]]:
    """Integer pixel of each part ``(N, 2, 2)`` and the parts' names."""
    if isinstance(ds, SameDifferentDataset):
        return ds.positions.numpy() + ds.shapes.shape[-1] // 2, ["shape_a", "shape_b"]
    names = ["circle_a", "circle_b"] if ds.task == "relative" else ["circle_first", "circle_second"]
    return np.floor(ds.centers.numpy()).astype(np.int64), names


def audit(task: str, *, num_train: int = 20_000, num_test: int = 10_000, img_size: int = 32) -> list[dict]:
    """Rows ``{task, baseline, accuracy, what}`` of every baseline for ``task`` (see the module doc)."""
    train, test = _make(task, num_train, TRAIN_SEED, img_size), _make(task, num_test, TEST_SEED, img_size)
    ytr, yte = train.labels.numpy(), test.labels.numpy()
    rows = []

    def add(name: str, acc: float, what: str) -> None:
        rows.append({"task": task, "baseline": name, "accuracy": round(acc, 4), "what": what})

    xtr = train.images[:, 0].reshape(num_train, -1).numpy()
    xte = test.images[:, 0].reshape(num_test, -1).numpy()
    add("pixels_logreg", logreg_accuracy(xtr, ytr, xte, yte), "logistic regression on the raw pixels")
    add(
        "ink",
        logreg_accuracy(xtr.sum(1, keepdims=True), ytr, xte.sum(1, keepdims=True), yte),
        "logistic regression on the total ink",
    )
    ptr, names = _parts(train)
    pte, _ = _parts(test)
    for k, name in enumerate(names):
        add(
            f"position_{name}",
            bayes_accuracy(ptr[:, k, 0] * img_size + ptr[:, k, 1], ytr, pte[:, k, 0] * img_size + pte[:, k, 1], yte),
            f"Bayes on the pixel of {name.replace('_', ' ')} alone",
        )

    def quadrant_pair(p):
        q = (p[..., 0] >= img_size // 2) * 2 + (p[..., 1] >= img_size // 2)  # (N, 2)
        return q[:, 0] * 4 + q[:, 1]

    add(
        "quadrants",
        bayes_accuracy(quadrant_pair(ptr), ytr, quadrant_pair(pte), yte),
        "Bayes on the quadrants of both parts",
    )
    if isinstance(train, SameDifferentDataset):
        add("span", bayes_accuracy(train.span.numpy(), ytr, test.span.numpy(), yte), "Bayes on the span of the pair")
        add(
            "bag_of_shapes",
            bag_of_shapes_ceiling(),
            "local-view ceiling: best additive score of the two shapes (exact)",
        )
    else:

        def dist(ds):
            c = ds.centers.numpy()
            return np.rint(np.hypot(*(c[:, 1] - c[:, 0]).T)).astype(np.int64)

        add("span", bayes_accuracy(dist(train), ytr, dist(test), yte), "Bayes on the rounded centre distance")
    return rows


def write(rows: list[dict], out_dir: Path) -> None:
    """``shortcuts.csv`` and ``shortcuts.md`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "shortcuts.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task", "baseline", "accuracy", "what"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    baselines = list(dict.fromkeys(r["baseline"] for r in rows))
    table = {(r["task"], r["baseline"]): r["accuracy"] for r in rows}
    lines = [
        "# Shortcut audit: test accuracy (%) of baselines that do not relate the two parts",
        "",
        "Generated by `python -m studies.runner.shortcuts`; every task balanced (chance 50%). "
        "`position_*` and `quadrants` are Bayes classifiers on the generator's metadata; "
        "`bag_of_shapes` is the local view's exact ceiling, not a shortcut.",
        "",
        "| baseline | " + " | ".join(tasks) + " |",
        "|---" * (len(tasks) + 1) + "|",
    ]
    for b in baselines:
        cells = [f"{100 * table[(t, b)]:.1f}" if (t, b) in table else "–" for t in tasks]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    what = {r["baseline"]: r["what"] for r in rows}
    lines += ["", *[f"- `{b}`: {what[b]}" for b in baselines], ""]
    (out_dir / "shortcuts.md").write_text("\n".join(lines))


def ceiling(rows: list[dict], task: str) -> float:
    """The highest shortcut accuracy for ``task`` (the local-view ceiling included)."""
    return max(r["accuracy"] for r in rows if r["task"] == task)


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.runner.shortcuts`: the audit alone, into ``--out``."""
    parser = EitherSpelling(prog="python -m studies.runner.shortcuts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for shortcuts.csv and shortcuts.md")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--num_train", type=int, default=20_000)
    parser.add_argument("--num_test", type=int, default=10_000)
    args = parser.parse_args(argv)
    rows = [r for task in args.tasks for r in audit(task, num_train=args.num_train, num_test=args.num_test)]
    write(rows, Path(args.out))
    print((Path(args.out) / "shortcuts.md").read_text())


if __name__ == "__main__":
    main()
