"""Post-hoc, after the relation study's runs: the visible share per span bin under stricter criteria.

    python -m studies.relation.posthoc_visibility > studies/relation/results/relation/posthoc_visibility.txt

The partial-view model (``visibility``) calls a pair visible to a CNN when one unit holds 2 adjacent
ink pixels of each stroke. Here, for the CNNs of the headline figure, the same with ``k`` = 2 to 5
adjacent pixels, against each CNN's measured accuracy per span bin (every seed's test pairs pooled,
from the runs' per-image predictions); the predicted accuracy takes the accuracy on visible pairs
from the runs. Written after the runs: a reading of them, not a prediction.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from studies.runner import grid, visibility
from vit.commands import EitherSpelling

SPAN_BINS = [(11, 13), (14, 16), (17, 19), (20, 22), (23, 25), (26, 28), (29, 32)]  # inclusive, px
MODELS = ("cnn-rf21", "cnn-rf29", "cnn-rf13")


def main(argv: list[str] | None = None) -> None:
    """Print, per CNN, the measured accuracy per span bin, then for each ``k`` the visible share and the prediction."""
    parser = EitherSpelling(prog="python -m studies.relation.posthoc_visibility", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="studies/relation/configs/relation.yaml", help="the study config")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = grid.load_config(args.config)
    for model in MODELS:
        windows = visibility.unit_windows(visibility.conv_model(cfg["models"][model]))
        files = sorted((Path(cfg["out_dir"]) / "predictions").glob(f"relation-same_different-{model}-n64000-s*.npz"))
        pos, ids, correct, span = [], [], [], []
        for path in files:
            with np.load(path) as f:
                pos.append(torch.from_numpy(f["test_positions"]))
                ids.append(torch.from_numpy(f["test_shape_ids"]))
                correct.append(f["test_pred"] == f["test_label"])
                span.append(f["test_distance"])
        pos, ids, correct, span = torch.cat(pos), torch.cat(ids), np.concatenate(correct), np.concatenate(span)
        in_bin = [(span >= lo) & (span <= hi) for lo, hi in SPAN_BINS]
        print(model, "measured acc per bin:", " ".join(f"{100 * correct[b].mean():.1f}" for b in in_bin))
        for k in (2, 3, 4, 5):
            seen = visibility.visible(windows, pos, ids, adjacent=k).numpy()
            acc_visible = correct[seen].mean()
            share = [seen[b].mean() for b in in_bin]
            predicted = [100 * (acc_visible * s + 0.5 * (1 - s)) for s in share]
            print(
                f"  k={k}: visible {100 * seen.mean():.1f}%, acc on visible {100 * acc_visible:.1f}; visible per bin",
                " ".join(f"{100 * s:.1f}" for s in share),
                "| predicted",
                " ".join(f"{p:.1f}" for p in predicted),
            )


if __name__ == "__main__":
    main()
