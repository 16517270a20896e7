"""The study's reports, from its `runs.csv` (and `shortcuts.csv`) alone: tables and figures.

* ``summary.md`` / ``summary.csv``: per cell (experiment, task, model, training-set size) every run's
  test accuracy, the median, and the success count ``k/n`` with its 95% Clopper-Pearson interval,
  where success means beating the task's best shortcut (``shortcuts.csv``) by 5 points; with the
  learning rate, parameters, FLOPs per image and the median wall time of a run.
* ``calibration.md``: the learning-rate grid of each model family and the rate chosen.
* ``comparisons.md``: every pair of models within an experiment, seed-paired (exact permutation and
  sign tests on the accuracy differences) and by success counts (Fisher's exact test), each with
  Holm's correction over the pairs of its table (the family of tests a reader scans at once).
* ``<experiment>_runs.png``: a dot per run and the median per model.
* ``translation.md`` and ``<experiment>_<task>_shift.png`` (experiments with a ``shift_region``):
  each run's accuracy in its own region and on the moved test set, and the seed-paired tests.
* ``by_distance.md``: the same per distance bin, and for each CNN within and beyond its receptive field.
* ``<experiment>_<task>_by_distance.png``: test accuracy against the distance between the two parts, one
  curve per model (all seeds' test images pooled), each CNN's receptive field marked: the study's
  headline figure.
* ``visibility.md`` and ``<experiment>_<task>_visibility.png`` (``same_different``, from the per-image
  predictions in ``predictions/``): each CNN's accuracy on the pairs one of its units sees and on
  the others, and its curve against span beside the partial-view model's
  (``vit.experiments.visibility``).

Every file it writes is named here; ``predictions.md`` (the predictions written before the runs)
is not one of them, and nothing in ``out_dir`` is deleted.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from vit.experiments.grid import CALIBRATE, calibration_scores, experiments
from vit.experiments.stats import clopper_pearson, fisher_p, holm, paired_permutation_p, sign_test_p
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


def write_reports(rows: list[dict], out_dir: Path, cfg: dict) -> None:
    """Every table and figure of the study from the rows of ``runs.csv`` (see the module doc)."""
    shortcuts = read_shortcuts(out_dir)
    cells = per_cell(rows)
    _summary(cells, shortcuts, out_dir, cfg)
    _calibration(rows, out_dir, cfg)
    _comparisons(cells, shortcuts, out_dir, cfg)
    _translation(cells, shortcuts, out_dir, cfg)
    _by_distance(cells, out_dir, cfg)
    _figures(cells, shortcuts, out_dir, cfg)
    _visibility(cells, out_dir, cfg)


def _summary(cells: dict, shortcuts: dict, out_dir: Path, cfg: dict) -> None:
    header = ["experiment", "task", "model", "num_train", "train_region", "test_region", "receptive_field", "n_seeds",
              "test_acc_median", "test_acc_min", "test_acc_max", "test_acc_runs", "success_threshold", "successes",
              "success_ci_low", "success_ci_high", "shift_region", "shift_acc_median", "shift_acc_runs", "lr",
              "params", "flops_per_image", "train_time_median_s", "revisions"]
    table = []
    for (exp, task, model, n), runs in cells.items():
        accs = [float(r["test_acc"]) for r in runs]
        thr = success_threshold(shortcuts, task)
        succ = successes(accs, thr)
        shifted = [float(r["shift_acc"]) for r in runs if r.get("shift_acc")]
        table.append({
            "experiment": exp, "task": task, "model": model, "num_train": n,
            "train_region": runs[0]["train_region"], "test_region": runs[0]["test_region"],
            "receptive_field": model_rf(cfg, model) if model in cfg["models"] else None, "n_seeds": len(accs),
            "test_acc_median": f"{np.median(accs):.4f}", "test_acc_min": f"{min(accs):.4f}",
            "test_acc_max": f"{max(accs):.4f}", "test_acc_runs": " ".join(f"{a:.4f}" for a in accs),
            "success_threshold": "" if thr is None else f"{thr:.4f}",
            "successes": "" if succ is None else succ[0],
            "success_ci_low": "" if succ is None else f"{succ[1]:.3f}",
            "success_ci_high": "" if succ is None else f"{succ[2]:.3f}",
            "shift_region": runs[0].get("shift_region", ""),
            "shift_acc_median": f"{np.median(shifted):.4f}" if shifted else "",
            "shift_acc_runs": " ".join(f"{a:.4f}" for a in shifted),
            "lr": runs[0].get("lr", ""), "params": runs[0].get("params", ""),
            "flops_per_image": runs[0].get("flops_per_image", ""),
            "train_time_median_s": f"{np.median([float(r['train_time_s']) for r in runs]):.1f}",
            "revisions": " ".join(sorted({r.get("revision", "") for r in runs})),
        })
    with (out_dir / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, lineterminator="\n")
        w.writeheader()
        w.writerows(table)
    revisions = sorted({r["revisions"] for r in table})
    lines = ["# Study summary: test accuracy (%) of every run", "",
             "Generated by `python -m vit.experiments.study` from `runs.csv`. Runs are listed by seed. Success: "
             f"above the task's best shortcut (`shortcuts.md`) + {MARGIN * PERCENT:.0f} points, with a 95% "
             "Clopper-Pearson interval; `–` where the shortcuts already reach 100%.",
             f"Code revision of the rows: {', '.join(revisions) if revisions else 'none yet'}.", ""]
    for exp in experiments(cfg):
        for task in exp["tasks"]:
            sel = sorted((t for t in table if t["experiment"] == exp["name"] and t["task"] == task),
                         key=lambda t: exp["models"].index(t["model"]) if t["model"] in exp["models"] else len(exp["models"]))
            if not sel:
                continue
            thr = success_threshold(shortcuts, task)
            moved = exp.get("shift_region")
            lines += [f"## {exp['name']}: task `{task}`, train region `{exp['train_region']}`, test region "
                      f"`{exp['test_region']}`" + (f" (success > {thr * PERCENT:.1f}%)" if thr and thr < 1 else ""), "",
                      "| model | RF (px) | n | median | runs | success k/n [95% CI] | "
                      + (f"median moved to `{moved}` | " if moved else "") + "lr | params | MFLOPs/image | s/run |",
                      "|---" * (10 + bool(moved)) + "|"]
            for t in sel:
                runs = " ".join(f"{float(a) * PERCENT:.1f}" for a in t["test_acc_runs"].split())
                succ = "–" if t["successes"] == "" else \
                    f"{t['successes']}/{t['n_seeds']} [{float(t['success_ci_low']):.2f}, {float(t['success_ci_high']):.2f}]"
                flops = f"{int(t['flops_per_image']) / 1e6:.1f}" if t["flops_per_image"] else ""
                shift = (f"{float(t['shift_acc_median']) * PERCENT:.1f} | " if t["shift_acc_median"] else "– | ") \
                    if moved else ""
                lines.append(f"| {t['model']} | {t['receptive_field'] or '–'} | {t['n_seeds']} | "
                             f"{float(t['test_acc_median']) * PERCENT:.1f} | {runs} | {succ} | {shift}{t['lr']} | "
                             f"{t['params']} | {flops} | {t['train_time_median_s']} |")
            lines.append("")
    (out_dir / "summary.md").write_text("\n".join(lines))


def _calibration(rows: list[dict], out_dir: Path, cfg: dict) -> None:
    if "calibration" not in cfg:
        return
    cal = cfg["calibration"]
    seeds = cal.get("seeds", [cal.get("seed")])
    lines = ["# Learning-rate calibration: validation accuracy (%)", "",
             f"Task `{cal['task']}`, {cal['num_train']} training images, data seeds {', '.join(map(str, seeds))} (not "
             "study seeds), the study's schedule. Each cell: the mean over the seeds, then every seed. The rate with "
             "the best mean of each family (ties: the smaller) is used for all its models.", "",
             "| family (model) | " + " | ".join(f"lr {lr:g}" for lr in cal["lrs"]) + " | chosen |",
             "|---" * (len(cal["lrs"]) + 2) + "|"]
    for family, model in cal["models"].items():
        scores = {lr: calibration_scores({"calibration": {**cal, "seeds": seeds}}, rows, model, lr) for lr in cal["lrs"]}
        done = {lr: float(np.mean(s)) for lr, s in scores.items() if None not in s}
        chosen = f"{max(sorted(done), key=lambda lr: done[lr]):g}" if len(done) == len(scores) else "(unfinished)"
        cells = [(f"{done[lr] * PERCENT:.1f} (" if lr in done else "– (")
                 + " ".join("–" if a is None else f"{a * PERCENT:.1f}" for a in s) + ")" for lr, s in scores.items()]
        lines.append(f"| {family} ({model}) | " + " | ".join(cells) + f" | {chosen} |")
    (out_dir / "calibration.md").write_text("\n".join(lines) + "\n")


def _comparisons(cells: dict, shortcuts: dict, out_dir: Path, cfg: dict) -> None:
    lines = ["# Seed-paired comparisons", "",
             "Pairs of models of an experiment on the seeds both have. `diff`: median over seeds of the "
             "accuracy difference (first minus second, points). `perm p`: exact two-sided paired permutation test; "
             "`sign p`: exact sign test; both cannot go below 0.0625 with 5 seeds. `Fisher p`: success counts "
             "(5/5 against 0/5: 0.008). `(Holm)`: the same p-value after Holm's correction over the pairs of its "
             "table, which is the family of tests: first each family of comparisons the config names before the "
             "runs (`comparisons`), one question each, then every pair of the experiment (one family of all pairs: "
             "with many models nothing survives it at 5 seeds).", ""]
    for exp in experiments(cfg):
        for task in exp["tasks"]:
            models = [m for m in exp["models"] if (exp["name"], task, m, exp["num_train"][-1]) in cells]
            if len(models) < 2:
                continue
            lines += [f"## {exp['name']}: task `{task}`", ""]
            for family, pairs in cfg.get("comparisons", {}).get(exp["name"], {}).items():
                done = [(a, b) for a, b in pairs if a in models and b in models]
                lines += [f"### {family} ({len(done)} of its {len(pairs)} pairs run; Holm over those)", ""]
                lines += _pair_table(cells, exp, task, done, success_threshold(shortcuts, task))
            every = [(a, b) for i, a in enumerate(models) for b in models[i + 1:]]
            lines += [f"### every pair ({len(every)}; Holm over all of them)", ""]
            lines += _pair_table(cells, exp, task, every, success_threshold(shortcuts, task))
    (out_dir / "comparisons.md").write_text("\n".join(lines))


def _pair_table(cells: dict, exp: dict, task: str, pairs: list[tuple[str, str]], thr: float | None) -> list[str]:
    """The rows of ``pairs`` (seed-paired and success-count tests), Holm-corrected over these pairs."""
    table = []
    for a, b in pairs:
        ra = {r["seed"]: float(r["test_acc"]) for r in cells[(exp["name"], task, a, exp["num_train"][-1])]}
        rb = {r["seed"]: float(r["test_acc"]) for r in cells[(exp["name"], task, b, exp["num_train"][-1])]}
        seeds = sorted(set(ra) & set(rb), key=int)
        if not seeds:
            continue
        xa, xb = [ra[s] for s in seeds], [rb[s] for s in seeds]
        sa, sb = successes(xa, thr), successes(xb, thr)
        table.append({"a": a, "b": b, "n": len(seeds), "diff": np.median(np.subtract(xa, xb)) * PERCENT,
                      "perm": paired_permutation_p(xa, xb), "sign": sign_test_p(xa, xb),
                      "succ": None if sa is None else f"{sa[0]}/{len(seeds)} vs {sb[0]}/{len(seeds)}",
                      "fisher": None if sa is None else fisher_p(sa[0], len(seeds), sb[0], len(seeds))})
    perm_holm = holm([t["perm"] for t in table]) if table else []
    fisher = [t["fisher"] for t in table if t["fisher"] is not None]
    fisher_holm = iter(holm(fisher) if fisher else [])
    lines = ["| first | second | seeds | diff | perm p | perm p (Holm) | sign p | successes | Fisher p | "
             "Fisher p (Holm) |", "|---" * 10 + "|"]
    for t, ph in zip(table, perm_holm):
        fh = "–" if t["fisher"] is None else f"{next(fisher_holm):.3f}"
        fp = "–" if t["fisher"] is None else f"{t['fisher']:.3f}"
        lines.append(f"| {t['a']} | {t['b']} | {t['n']} | {t['diff']:+.1f} | {t['perm']:.3f} | {ph:.3f} | "
                     f"{t['sign']:.3f} | {t['succ'] or '–'} | {fp} | {fh} |")
    return lines + [""]


def _translation(cells: dict, shortcuts: dict, out_dir: Path, cfg: dict) -> None:
    exps = [e for e in experiments(cfg) if e.get("shift_region")]
    if not exps:
        return
    lines = ["# Translation: the same weights on the test set moved to another region", "",
             "Each run is tested in its training region, then on a test set drawn in the shift region "
             "(for same_different: the same draws, moved right by 3/8 of the width: 12 px at 32 px). Accuracy (%) per seed; `drop`: median over "
             "seeds of in-region minus moved (points); `perm p` / `sign p`: exact seed-paired tests of no drop "
             "(they cannot go below 0.0625 with 5 seeds); successes in both placements.", ""]
    for exp in exps:
        for task in exp["tasks"]:
            thr = success_threshold(shortcuts, task)
            lines += [f"## {exp['name']}: task `{task}`, trained in `{exp['train_region']}`, moved to "
                      f"`{exp['shift_region']}`", "",
                      "| model | in region | moved | drop | perm p | sign p | successes in region / moved |",
                      "|---|---|---|---|---|---|---|"]
            for m in exp["models"]:
                runs = [r for k, v in cells.items() if k[:3] == (exp["name"], task, m) for r in v if r.get("shift_acc")]
                if not runs:
                    continue
                a = [float(r["test_acc"]) for r in runs]
                b = [float(r["shift_acc"]) for r in runs]
                sa, sb = successes(a, thr), successes(b, thr)
                succ = "–" if sa is None else f"{sa[0]}/{len(a)} / {sb[0]}/{len(b)}"
                lines.append(f"| {m} | {' '.join(f'{x * PERCENT:.1f}' for x in a)} | "
                             f"{' '.join(f'{x * PERCENT:.1f}' for x in b)} | "
                             f"{np.median(np.subtract(a, b)) * PERCENT:+.1f} | {paired_permutation_p(a, b):.3f} | "
                             f"{sign_test_p(a, b):.3f} | {succ} |")
            lines.append("")
    (out_dir / "translation.md").write_text("\n".join(lines))


def within_and_beyond(runs: list[dict], rf: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """``((accuracy, images) with distance <= rf, (accuracy, images) beyond rf)``, all runs' test images pooled."""
    acc, count = pooled_by_distance(runs, np.array([0, rf + 1, 10**9]))
    return (float(acc[0]), int(count[0])), (float(acc[1]), int(count[1]))


def _by_distance(cells: dict, out_dir: Path, cfg: dict) -> None:
    lines = ["# Test accuracy (%) against the distance between the parts", "",
             "All seeds' test images pooled per bin of the distance (`span` for same_different: the side of the "
             "smallest square holding both shapes; the rounded centre distance for the circle tasks). For each CNN, "
             "`<= RF` pools the images whose distance its receptive field covers, `> RF` the others.", ""]
    for exp in experiments(cfg):
        for task in exp["tasks"]:
            runs = {m: [r for k, v in cells.items() if k[:3] == (exp["name"], task, m) for r in v
                        if r.get("test_by_distance")] for m in exp["models"]}
            runs = {m: v for m, v in runs.items() if v}
            if not runs:
                continue
            dists = [int(d) for v in runs.values() for r in v for d in json.loads(r["test_by_distance"])]
            edges = distance_edges(dists)
            heads = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
            lines += [f"## {exp['name']}: task `{task}`", "",
                      "| model | RF | <= RF | > RF | " + " | ".join(heads) + " |", "|---" * (len(heads) + 4) + "|"]
            for m, v in runs.items():
                acc, count = pooled_by_distance(v, edges)
                rf = model_rf(cfg, m) if m in cfg["models"] else None
                near = far = "–"
                if rf is not None:
                    (a_in, n_in), (a_out, n_out) = within_and_beyond(v, rf)
                    near = f"{a_in * PERCENT:.1f} ({n_in})" if n_in else "–"
                    far = f"{a_out * PERCENT:.1f} ({n_out})" if n_out else "–"
                bins = [f"{a * PERCENT:.1f}" if c else "–" for a, c in zip(acc, count)]
                lines.append(f"| {m} | {rf or '–'} | {near} | {far} | " + " | ".join(bins) + " |")
            lines.append("")
            lines += _split_at_receptive_fields(runs, cfg, min(dists), max(dists))
    (out_dir / "by_distance.md").write_text("\n".join(lines))


def _split_at_receptive_fields(runs: dict[str, list[dict]], cfg: dict, lo: int, hi: int) -> list[str]:
    """Every model's accuracy within and beyond each CNN's receptive field that falls inside the
    distances, seed by seed: the claim predicts a drop beyond the RF for that CNN and none for a ViT."""
    rfs = sorted({rf for m in runs if m in cfg["models"] and (rf := model_rf(cfg, m)) is not None and lo <= rf < hi})
    lines = []
    for rf in rfs:
        owners = ", ".join(m for m in runs if m in cfg["models"] and model_rf(cfg, m) == rf)
        lines += [f"### Split at {rf} px (the receptive field of {owners})", "",
                  "Per seed: accuracy (%) at distance <= RF / beyond it. `drop`: median over seeds of the difference "
                  "(points); `perm p`: exact seed-paired permutation test of no drop.", "",
                  "| model | per seed (<= RF / > RF) | drop | perm p |", "|---|---|---|---|"]
        for m, v in runs.items():
            pairs = [within_and_beyond([r], rf) for r in v]
            near, far = [a for (a, _), _ in pairs], [b for _, (b, _) in pairs]
            seeds = " ".join(f"{a * PERCENT:.1f}/{b * PERCENT:.1f}" for a, b in zip(near, far))
            lines.append(f"| {m} | {seeds} | {np.median(np.subtract(near, far)) * PERCENT:+.1f} | "
                         f"{paired_permutation_p(near, far):.3f} |")
        lines.append("")
    return lines


def distance_edges(dists: list[int], width: int = 3) -> np.ndarray:
    """Bin edges of ``width`` px from the smallest to the largest distance; a last bin narrower than 2 px joins the one before."""
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


def _figures(cells: dict, shortcuts: dict, out_dir: Path, cfg: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for exp in experiments(cfg):
        for task in exp["tasks"]:
            models = [m for m in exp["models"] if any(k[:3] == (exp["name"], task, m) for k in cells)]
            if not models:
                continue
            runs = {m: [r for k, v in cells.items() if k[:3] == (exp["name"], task, m) for r in v] for m in models}
            colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(models)}
            where = f"train {exp['train_region']}, test {exp['test_region']}"
            ceiling = max(shortcuts[task].values()) if task in shortcuts else None
            # Dots: every run, and the median.
            fig, ax = plt.subplots(figsize=(1.1 * len(models) + 2.5, 4))
            for i, m in enumerate(models):
                accs = [float(r["test_acc"]) * PERCENT for r in runs[m]]
                ax.plot(np.full(len(accs), i) + np.linspace(-0.12, 0.12, len(accs)), accs, "o", color=colors[m], ms=5)
                ax.plot([i - 0.3, i + 0.3], [np.median(accs)] * 2, "k-", lw=2)
            _per_model_axes(ax, models, ceiling, "test accuracy (%): dot = one seed, bar = median",
                            f"{exp['name']}: {task} ({where})")
            fig.tight_layout()
            fig.savefig(out_dir / f"{exp['name']}_{task}_runs.png", dpi=110)
            plt.close(fig)
            if exp.get("shift_region"):
                _shift_figure(runs, models, colors, ceiling, exp, task, out_dir)
            # Accuracy against the distance between the parts.
            dists = [int(d) for m in models for r in runs[m] if r.get("test_by_distance")
                     for d in json.loads(r["test_by_distance"])]
            if not dists:
                continue
            hi = max(dists)
            edges = distance_edges(dists)
            centres = (edges[:-1] + edges[1:] - 1) / 2
            fig, ax = plt.subplots(figsize=(7.5, 4.5))
            for m in models:
                acc, count = pooled_by_distance(runs[m], edges)
                rf = model_rf(cfg, m) if m in cfg["models"] else None
                ls = "-" if rf is not None else "--"
                ax.plot(centres, acc * PERCENT, ls, marker="o", ms=4, color=colors[m],
                        label=f"{m} (RF {rf})" if rf else m)
                for r in runs[m]:  # each seed, thin: a cell whose seeds split shows it
                    seed_acc, _ = pooled_by_distance([r], edges)
                    ax.plot(centres, seed_acc * PERCENT, ls, color=colors[m], lw=0.6, alpha=0.35)
                if rf is not None:
                    x = min(rf, hi + 1.5)
                    ax.axvline(x, color=colors[m], ls=":", lw=1.2)
                    ax.annotate(f"RF {rf}" + ("→" if rf > hi + 1.5 else ""), (x, 41), rotation=90, fontsize=7,
                                color=colors[m], ha="right", va="bottom")
            if task in shortcuts:
                local = shortcuts[task].get("bag_of_shapes")
                best = max(v for k, v in shortcuts[task].items() if k != "bag_of_shapes")
                ax.axhline(best * PERCENT, color="crimson", ls=":", lw=1, label=f"best shortcut ({best * PERCENT:.0f}%)")
                if local is not None:
                    ax.axhline(local * PERCENT, color="black", ls="-.", lw=1,
                               label=f"local-view ceiling ({local * PERCENT:.1f}%)")
            ax.axhline(50, color="grey", lw=0.8, ls="--")
            xlabel = ("span of the pair (px): side of the smallest square holding both shapes"
                      if task == "same_different" else "distance between the circle centres (px)")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test accuracy (%): thick = seeds pooled, thin = one seed")
            ax.set_ylim(40, 101)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
            ax.set_title(f"{exp['name']}: {task} ({where}); dotted line: a CNN's receptive field", fontsize=9)
            fig.tight_layout()
            fig.savefig(out_dir / f"{exp['name']}_{task}_by_distance.png", dpi=110)
            plt.close(fig)


def _shift_figure(runs: dict, models: list[str], colors: dict, ceiling: float | None, exp: dict, task: str,
                  out_dir: Path) -> None:
    """Each run's accuracy in its region and moved, joined by a line: the translation test at a glance."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.3 * len(models) + 2.5, 4))
    for i, m in enumerate(models):
        for r in runs[m]:
            if r.get("shift_acc"):
                ax.plot([i - 0.18, i + 0.18], [float(r["test_acc"]) * PERCENT, float(r["shift_acc"]) * PERCENT],
                        "-o", color=colors[m], ms=4, lw=1, alpha=0.8)
    _per_model_axes(ax, models, ceiling, "test accuracy (%): left dot in region, right dot moved",
                    f"{exp['name']}: {task}, trained and tested in {exp['train_region']}, then moved to "
                    f"{exp['shift_region']}")
    fig.tight_layout()
    fig.savefig(out_dir / f"{exp['name']}_{task}_shift.png", dpi=110)
    plt.close(fig)


def _per_model_axes(ax, models: list[str], ceiling: float | None, ylabel: str, title: str) -> None:
    """One column per model on a 40-100% axis, with chance and the best shortcut (or local-view ceiling) drawn."""
    if ceiling is not None:
        ax.axhline(ceiling * PERCENT, color="crimson", ls=":", lw=1, label="best shortcut or local-view ceiling")
        ax.legend(fontsize=8, loc="lower right")
    ax.axhline(50, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_ylim(40, 101)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title, fontsize=9)


def _visibility(cells: dict, out_dir: Path, cfg: dict) -> None:
    """Each CNN's test predictions re-binned by the partial-view model, beside the curve it predicts."""
    from vit.experiments import visibility

    pred_dir = out_dir / "predictions"
    if not pred_dir.is_dir():  # a study from before per-image predictions
        return
    sections, curves = [], {}
    for exp in experiments(cfg):
        if "same_different" not in exp["tasks"]:
            continue
        for m in exp["models"]:
            net = visibility.conv_model(cfg["models"][m]) if m in cfg["models"] else None
            runs = [r for k, v in cells.items() if k[:3] == (exp["name"], "same_different", m) for r in v]
            files = [f for r in runs if (f := pred_dir / f"{r.get('key')}.npz").exists()]
            if net is None or not files:
                continue
            got = visibility.rebin(visibility.unit_windows(net), files)
            (cv, nv), (ch, nh) = got["visible"], got["hidden"]
            acc_visible = cv / nv if nv else float("nan")
            spans = sorted(got["span"])
            measured = np.array([got["span"][d][0] / got["span"][d][1] for d in spans])
            share = np.array([got["span"][d][2] / got["span"][d][1] for d in spans])
            curves[(exp["name"], m)] = (spans, measured, visibility.predicted_accuracy(share, acc_visible),
                                        [got["span"][d][1] for d in spans])
            sections.append(f"| {exp['name']} | {m} | {net.receptive_field} | "
                            f"{'yes' if visibility.is_additive(cfg['models'][m]) else 'no'} | {len(files)} | "
                            f"{nv / (nv + nh) * PERCENT:.1f} | "
                            + (f"{acc_visible * PERCENT:.1f} ({nv})" if nv else "–") + " | "
                            + (f"{ch / nh * PERCENT:.1f} ({nh})" if nh else "–") + " |")
    if not sections:
        return
    lines = ["# Test accuracy re-binned by the partial-view (visibility) model", "",
             "A test pair is *visible* to a CNN when one unit of its last layer holds at least "
             f"{visibility.ADJACENT} adjacent ink pixels of each stroke (`vit/experiments/visibility.py`, from the "
             "units' exact windows). The model predicts 50% on the pairs that are not visible for average pooling "
             "and a linear head (`additive`); it says nothing for max pooling or an MLP head. All seeds' test pairs "
             "pooled (`runs`: the runs with per-image predictions). The predictions written before the runs are in "
             "`predictions.md`.", "",
             "| experiment | model | RF | additive | runs | visible (%) | acc. on visible pairs (n) | "
             "acc. on the others (n) |", "|---" * 8 + "|", *sections, "",
             "## Measured / predicted accuracy (%) per span bin", "",
             "Predicted: the accuracy on visible pairs (the row above, the one number taken from the runs) where "
             "a pair is visible, 50% elsewhere, pooled over the bin.", ""]
    all_spans = sorted({d for spans, *_ in curves.values() for d in spans})
    edges = distance_edges(all_spans)
    heads = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    lines += ["| model | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    binned = {}  # (experiment, model) -> (measured, predicted) per bin, the bin's pairs pooled
    for key, (spans, measured, predicted, counts) in curves.items():
        per_bin = []
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = [(a, p, n) for d, a, p, n in zip(spans, measured, predicted, counts) if lo <= d < hi]
            total = sum(n for *_, n in sel)
            per_bin.append((sum(a * n for a, _, n in sel) / total, sum(p * n for _, p, n in sel) / total)
                           if total else (np.nan, np.nan))
        binned[key] = np.array(per_bin)
        lines.append(f"| {key[1]} | " + " | ".join("–" if np.isnan(a) else f"{a * PERCENT:.1f} / {p * PERCENT:.1f}"
                                                    for a, p in per_bin) + " |")
    (out_dir / "visibility.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name in sorted({e for e, _ in curves}):
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        centres = (edges[:-1] + edges[1:] - 1) / 2
        for i, ((e, m), values) in enumerate(c for c in binned.items() if c[0][0] == name):
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
