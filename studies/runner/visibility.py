"""The partial-view (visibility) model: which same/different pairs a CNN's units can read, and a finished grid's
test predictions re-binned by it (``report``: ``visibility.md`` and a figure, part of the runner's report).

The hypothesis (the relation study's, ``studies/relation/README.md``): a CNN with global average pooling
and a linear head can tell "same" from "different" only where one unit of its last layer holds at
least **2 adjacent ink pixels of each stroke** (two neighbouring pixels of a straight stroke give
its orientation); on the other pairs its score is additive over the strokes, and under
cross-entropy the best additive score is the constant (loss ln 2): 50%. So, with nothing fitted,

    predicted accuracy(span) = a * visible(span) + 0.5 * (1 - visible(span))

where ``visible(span)`` is the share of the test pairs of that span that some unit sees in this
way, and ``a`` is the network's accuracy on the pairs it sees. What decides ``visible`` is the
exact window of every unit on the units' grid (``unit_windows``: kernels, strides, padding), not
only the receptive field's size: a stroke 27 px from another may or may not share a 21 px window
with it depending on where the grid falls.

``unit_windows`` pushes every one-pixel image through the network's convolutions with all-ones
kernels (positive weights: a pixel reaches a unit iff the unit's window holds it, whatever the
padding, circular included); ``tests/test_study_runner_visibility.py`` checks it against the
gradient support of the real network and the visibility against a brute-force count of adjacent ink
pixels. ``report`` re-bins the per-image predictions of every ``same_different`` CNN of a grid;
the page of predictions written before the runs is the relation study's
(``python -m studies.relation.visibility``).

The model is about the average-pooled, linear-head CNNs: with global max pooling or an MLP head a
bag of one-stroke detectors can read the relation with no unit that sees both strokes
(``vit.models.cnn``), and the model predicts nothing for them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from studies.runner.cells import PERCENT, distance_edges
from studies.runner.grid import experiments
from vit.data.same_different import make_shapes
from vit.models.cnn import ConvNet

ADJACENT = 2  # ink pixels in a row of one stroke that a unit must hold to read its orientation


@torch.no_grad()
def unit_windows(model: ConvNet) -> torch.Tensor:
    """`(U, H, W)` bool: the input pixels each unit of the last layer sees; units row-major on their `(H', W')` grid."""
    height, width = model.img_size
    x = torch.eye(height * width, dtype=torch.float64).view(-1, 1, height, width)  # one image per pixel
    for layer in model.features:
        if not isinstance(layer, nn.Conv2d):
            continue  # BatchNorm and ReLU change values, not which pixels reach a unit
        ones = torch.ones(1, 1, *layer.kernel_size, dtype=torch.float64)
        pad_h, pad_w = layer.padding
        if layer.padding_mode == "circular":
            x = F.pad(x, (pad_w, pad_w, pad_h, pad_h), mode="circular")
            pad_h = pad_w = 0
        x = F.conv2d(x, ones, stride=layer.stride, padding=(pad_h, pad_w))  # (H*W, 1, H', W')
    return (x[:, 0] > 0).flatten(1).T.reshape(-1, height, width)


def stroke_offsets() -> torch.Tensor:
    """`(NUM_SHAPES, SHAPE_PIXELS, 2)`: each stroke's ink pixels (row, col) in its box, in order along the stroke."""
    out = []
    for shape in make_shapes():
        rows, cols = np.nonzero(shape)  # row-major: for these straight strokes, the order along the stroke
        assert np.all(np.maximum(np.abs(np.diff(rows)), np.abs(np.diff(cols))) == 1), "not a connected stroke"
        out.append(np.stack([rows, cols], axis=1))
    return torch.from_numpy(np.stack(out))


def sees_stroke(windows: torch.Tensor, pixels: torch.Tensor, adjacent: int = ADJACENT) -> torch.Tensor:
    """`(N, U)` bool: unit u holds ``adjacent`` consecutive ink pixels of the stroke whose pixels are `(N, P, 2)`."""
    width = windows.shape[-1]
    flat = windows.flatten(1)  # (U, H*W)
    inside = flat[:, pixels[..., 0] * width + pixels[..., 1]].permute(1, 0, 2)  # (N, U, P)
    runs = inside.unfold(2, adjacent, 1).all(-1)  # (N, U, P - adjacent + 1): each run of `adjacent` pixels
    return runs.any(-1)


def visible(
    windows: torch.Tensor, positions: torch.Tensor, shape_ids: torch.Tensor, adjacent: int = ADJACENT, chunk: int = 500
) -> torch.Tensor:
    """`(N,)` bool: some unit holds ``adjacent`` adjacent ink pixels of each of the two strokes.

    ``positions`` `(N, 2, 2)` are the strokes' box corners (row, col), ``shape_ids`` `(N, 2)` their patterns,
    as ``SameDifferentDataset`` stores them.
    """
    offsets = stroke_offsets()
    out = []
    for i in range(0, len(positions), chunk):
        pos, ids = positions[i : i + chunk].long(), shape_ids[i : i + chunk].long()
        both = [sees_stroke(windows, pos[:, k, None, :] + offsets[ids[:, k]], adjacent) for k in range(2)]
        out.append((both[0] & both[1]).any(1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def conv_model(spec: dict, img_size: int = 32) -> ConvNet | None:
    """The ``ConvNet`` of a study config's model entry (None for other models): its geometry is all that is used."""
    if not spec["class_path"].endswith("ConvNet"):
        return None
    return ConvNet(img_size=img_size, in_chans=1, num_classes=2, **spec.get("init_args", {}))


def is_additive(spec: dict) -> bool:
    """Whether the visibility model applies: average pooling and a linear head (the ConvNet defaults)."""
    args = spec.get("init_args", {})
    return args.get("pool", "avg") == "avg" and args.get("head", "linear") == "linear"


def predicted_accuracy(visible_share: np.ndarray, acc_visible: float) -> np.ndarray:
    """The model's accuracy: ``acc_visible`` on the pairs some unit sees, 50% on the others."""
    return acc_visible * visible_share + 0.5 * (1 - visible_share)


def rebin(windows: torch.Tensor, files: list[Path], split: str = "test") -> dict:
    """Per-image predictions of a study's runs (``<out_dir>/predictions/<key>.npz``) re-binned by visibility.

    Returns ``{"visible": [correct, total], "hidden": [correct, total], "span": {span: [correct, total,
    visible]}}`` over all files pooled: what the report compares with ``predicted_accuracy``.
    """
    out = {"visible": [0, 0], "hidden": [0, 0], "span": {}}
    for path in files:
        with np.load(path) as f:
            pos, ids = torch.from_numpy(f[f"{split}_positions"]), torch.from_numpy(f[f"{split}_shape_ids"])
            correct = f[f"{split}_pred"] == f[f"{split}_label"]
            span = f[f"{split}_distance"]
        seen = visible(windows, pos, ids).numpy()
        for key, sel in (("visible", seen), ("hidden", ~seen)):
            out[key][0] += int(correct[sel].sum())
            out[key][1] += int(sel.sum())
        for d in np.unique(span):
            sel = span == d
            c, n, v = out["span"].get(int(d), [0, 0, 0])
            out["span"][int(d)] = [c + int(correct[sel].sum()), n + int(sel.sum()), v + int(seen[sel].sum())]
    return out


def report(cells: dict, out_dir: Path, cfg: dict) -> None:
    """``visibility.md`` and ``<experiment>_same_different_visibility.png`` of the study's report: each CNN's
    test predictions re-binned by the partial-view model, beside the curve it predicts."""
    pred_dir = out_dir / "predictions"
    if not pred_dir.is_dir():  # a study from before per-image predictions
        return
    sections, curves = [], {}
    for exp in experiments(cfg):
        if "same_different" not in exp["tasks"]:
            continue
        for m in exp["models"]:
            net = conv_model(cfg["models"][m]) if m in cfg["models"] else None
            runs = [r for k, v in cells.items() if k[:3] == (exp["name"], "same_different", m) for r in v]
            files = [f for r in runs if (f := pred_dir / f"{r.get('key')}.npz").exists()]
            if net is None or not files:
                continue
            curves[(exp["name"], m)], row = _rebinned_model(exp["name"], m, net, files, cfg)
            sections.append(row)
    if not sections:
        return
    all_spans = sorted({d for spans, *_ in curves.values() for d in spans})
    edges = distance_edges(all_spans)
    lines = _page_head(sections, edges)
    binned = {}  # (experiment, model) -> (measured, predicted) per bin, the bin's pairs pooled
    for key, curve in curves.items():
        per_bin = _per_bin(curve, edges)
        binned[key] = np.array(per_bin)
        lines.append(
            f"| {key[1]} | "
            + " | ".join("–" if np.isnan(a) else f"{a * PERCENT:.1f} / {p * PERCENT:.1f}" for a, p in per_bin)
            + " |"
        )
    (out_dir / "visibility.md").write_text("\n".join(lines) + "\n")
    _figures(binned, edges, out_dir)


def _rebinned_model(name: str, m: str, net: ConvNet, files: list[Path], cfg: dict) -> tuple[tuple, str]:
    """One CNN's runs re-binned: its curve ``(spans, measured, predicted, counts)`` and its row of the first table."""
    got = rebin(unit_windows(net), files)
    (cv, nv), (ch, nh) = got["visible"], got["hidden"]
    acc_visible = cv / nv if nv else float("nan")
    spans = sorted(got["span"])
    measured = np.array([got["span"][d][0] / got["span"][d][1] for d in spans])
    share = np.array([got["span"][d][2] / got["span"][d][1] for d in spans])
    curve = (
        spans,
        measured,
        predicted_accuracy(share, acc_visible),
        [got["span"][d][1] for d in spans],
    )
    row = (
        f"| {name} | {m} | {net.receptive_field} | "
        f"{'yes' if is_additive(cfg['models'][m]) else 'no'} | {len(files)} | "
        f"{nv / (nv + nh) * PERCENT:.1f} | "
        + (f"{acc_visible * PERCENT:.1f} ({nv})" if nv else "–")
        + " | "
        + (f"{ch / nh * PERCENT:.1f} ({nh})" if nh else "–")
        + " |"
    )
    return curve, row


def _page_head(sections: list[str], edges: np.ndarray) -> list[str]:
    """``visibility.md`` up to the rows of its span table: the text, the table of the models, the span table's head."""
    heads = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    return [
        "# Test accuracy re-binned by the partial-view (visibility) model",
        "",
        "A test pair is *visible* to a CNN when one unit of its last layer holds at least "
        f"{ADJACENT} adjacent ink pixels of each stroke (`studies/runner/visibility.py`, from the "
        "units' exact windows). The model predicts 50% on the pairs that are not visible for average pooling "
        "and a linear head (`additive`); it says nothing for max pooling or an MLP head. All seeds' test pairs "
        "pooled (`runs`: the runs with per-image predictions). The predictions written before the runs are in "
        "`predictions.md`.",
        "",
        "| experiment | model | RF | additive | runs | visible (%) | acc. on visible pairs (n) | "
        "acc. on the others (n) |",
        "|---" * 8 + "|",
        *sections,
        "",
        "## Measured / predicted accuracy (%) per span bin",
        "",
        "Predicted: the accuracy on visible pairs (the row above, the one number taken from the runs) where "
        "a pair is visible, 50% elsewhere, pooled over the bin.",
        "",
        "| model | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]


def _per_bin(curve: tuple, edges: np.ndarray) -> list[tuple[float, float]]:
    """``(measured, predicted)`` accuracy of each bin of ``edges``, its spans' pairs pooled (NaN: no pairs)."""
    spans, measured, predicted, counts = curve
    per_bin = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = [(a, p, n) for d, a, p, n in zip(spans, measured, predicted, counts) if lo <= d < hi]
        total = sum(n for *_, n in sel)
        per_bin.append(
            (sum(a * n for a, _, n in sel) / total, sum(p * n for _, p, n in sel) / total)
            if total
            else (np.nan, np.nan)
        )
    return per_bin


def _figures(binned: dict, edges: np.ndarray, out_dir: Path) -> None:
    """``<experiment>_same_different_visibility.png``: each CNN's measured and predicted curve, per experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in sorted({e for e, _ in binned}):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        centres = (edges[:-1] + edges[1:] - 1) / 2
        for i, ((_, m), values) in enumerate(c for c in binned.items() if c[0][0] == name):
            color = plt.cm.tab10(i % 10)
            ax.plot(centres, values[:, 0] * PERCENT, "-o", ms=3, color=color, label=f"{m} measured")
            ax.plot(centres, values[:, 1] * PERCENT, "--", color=color, lw=1.2, label=f"{m} predicted")
        ax.axhline(50, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("span of the pair (px), bins of 3 px")
        ax.set_ylabel("test accuracy (%), all seeds pooled")
        ax.set_ylim(40, 101)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        ax.set_title(f"{name}: measured (solid) and the partial-view model (dashed)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}_same_different_visibility.png", dpi=110)
        plt.close(fig)
