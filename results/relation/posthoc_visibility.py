# python results/relation/posthoc_visibility.py > results/relation/posthoc_visibility.txt  (from the repository root)
# Post-hoc (after the study's runs): the visible share per span bin under stricter criteria
# (k adjacent ink pixels of each stroke in one unit), against the measured accuracy per bin.
import glob, numpy as np, torch
from pathlib import Path
from vit.experiments import grid, visibility as V
torch.set_num_threads(1)
cfg = grid.load_config("configs/study/relation.yaml")
binsl = [(11,13),(14,16),(17,19),(20,22),(23,25),(26,28),(29,32)]
for model in ["cnn-rf21", "cnn-rf29", "cnn-rf13"]:
    net = V.conv_model(cfg["models"][model]); win = V.unit_windows(net)
    files = sorted(Path("results/relation/predictions").glob(f"relation-same_different-{model}-n64000-s*.npz"))
    pos, ids, corr, span = [], [], [], []
    for f in files:
        z = np.load(f)
        pos.append(torch.from_numpy(z["test_positions"])); ids.append(torch.from_numpy(z["test_shape_ids"]))
        corr.append(z["test_pred"] == z["test_label"]); span.append(z["test_distance"])
    pos, ids, corr, span = torch.cat(pos), torch.cat(ids), np.concatenate(corr), np.concatenate(span)
    print(model, "measured acc per bin:", " ".join(f"{100*corr[(span>=a)&(span<=b)].mean():.1f}" for a,b in binsl))
    for k in (2, 3, 4, 5):
        seen = V.visible(win, pos, ids, adjacent=k).numpy()
        a = corr[seen].mean()
        pred = [100*(a*seen[(span>=lo)&(span<=hi)].mean() + 0.5*(1-seen[(span>=lo)&(span<=hi)].mean())) for lo,hi in binsl]
        print(f"  k={k}: visible {100*seen.mean():.1f}%, acc on visible {100*a:.1f}; visible per bin",
              " ".join(f"{100*seen[(span>=lo)&(span<=hi)].mean():.1f}" for lo,hi in binsl), "| predicted", " ".join(f"{p:.1f}" for p in pred))
