"""The study's figures: per experiment and task a dot per run, the moved test set, and the headline
curve of accuracy against the distance between the two parts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from studies.runner.cells import PERCENT, distance_edges, model_rf, pooled_by_distance
from studies.runner.grid import experiments


def draw(cells: dict, shortcuts: dict, out_dir: Path, cfg: dict) -> None:
    """``<experiment>_<task>_runs.png``, ``_shift.png`` (with a ``shift_region``) and ``_by_distance.png``."""
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
            _runs_figure(runs, models, colors, ceiling, exp, task, where, out_dir)
            if exp.get("shift_region"):
                shift_figure(runs, models, colors, ceiling, exp, task, out_dir)
            _by_distance_figure(runs, models, shortcuts, exp, task, where, out_dir, cfg)


def _runs_figure(
    runs: dict, models: list[str], colors: dict, ceiling: float | None, exp: dict, task: str, where: str, out_dir: Path
) -> None:
    """``<experiment>_<task>_runs.png``: a dot per run and a bar at the median, one column per model."""
    import matplotlib.pyplot as plt

    # Dots: every run, and the median.
    fig, ax = plt.subplots(figsize=(1.1 * len(models) + 2.5, 4))
    for i, m in enumerate(models):
        accs = [float(r["test_acc"]) * PERCENT for r in runs[m]]
        ax.plot(np.full(len(accs), i) + np.linspace(-0.12, 0.12, len(accs)), accs, "o", color=colors[m], ms=5)
        ax.plot([i - 0.3, i + 0.3], [np.median(accs)] * 2, "k-", lw=2)
    per_model_axes(
        ax,
        models,
        ceiling,
        "test accuracy (%): dot = one seed, bar = median",
        f"{exp['name']}: {task} ({where})",
    )
    fig.tight_layout()
    fig.savefig(out_dir / f"{exp['name']}_{task}_runs.png", dpi=110)
    plt.close(fig)


def _by_distance_figure(
    runs: dict, models: list[str], shortcuts: dict, exp: dict, task: str, where: str, out_dir: Path, cfg: dict
) -> None:
    """``<experiment>_<task>_by_distance.png``: one panel per model family (none without distances in the rows)."""
    import matplotlib.pyplot as plt

    # Accuracy against the distance between the parts.
    dists = [
        int(d) for m in models for r in runs[m] if r.get("test_by_distance") for d in json.loads(r["test_by_distance"])
    ]
    if not dists:
        return
    edges = distance_edges(dists)
    # One panel per family, each with its own colours: no two curves share a style.
    panels = {name: [m for m in models if family(cfg, m) == name] for name in FAMILIES}
    panels = {name: members for name, members in panels.items() if members}
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.2 * len(panels), 7.5), 5.4), sharey=True, squeeze=False)
    for ax, (name, members) in zip(axes[0], panels.items()):
        _distance_panel(ax, members, runs, edges, max(dists), cfg)
        if task in shortcuts:
            _shortcut_lines(ax, name, shortcuts[task])
        ax.axhline(50, color="grey", lw=0.8, ls="--")
        ax.set_title(name, fontsize=9)
        ax.set_ylim(40, 101)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    xlabel = (
        "span of the pair (px): side of the smallest square holding both shapes"
        if task in ("same_different", "arrangement")
        else "distance between the circle centres (px)"
    )
    for ax in axes[0]:
        ax.set_xlabel(xlabel, fontsize=8)
    axes[0][0].set_ylabel("test accuracy (%): thick = seeds pooled, thin = one seed")
    fig.suptitle(f"{exp['name']}: {task} ({where}); dotted line: a CNN's receptive field", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / f"{exp['name']}_{task}_by_distance.png", dpi=110)
    plt.close(fig)


def _distance_panel(ax, members: list[str], runs: dict, edges, hi: int, cfg: dict) -> None:
    """The curves of one family's panel: each model's seeds pooled and each seed, and each CNN's receptive field."""
    import matplotlib.pyplot as plt

    centres = (edges[:-1] + edges[1:] - 1) / 2
    for i, m in enumerate(members):
        color = plt.cm.tab10(i % 10)
        acc, _ = pooled_by_distance(runs[m], edges)
        rf = model_rf(cfg, m) if m in cfg["models"] else None
        ax.plot(centres, acc * PERCENT, "-", marker="o", ms=4, color=color, label=f"{m} (RF {rf})" if rf else m)
        for r in runs[m]:  # each seed, thin: a cell whose seeds split shows it
            seed_acc, _ = pooled_by_distance([r], edges)
            ax.plot(centres, seed_acc * PERCENT, "-", color=color, lw=0.6, alpha=0.35)
        if rf is not None:
            x = min(rf, hi + 1.5)
            ax.axvline(x, color=color, ls=":", lw=1.2)
            ax.annotate(
                f"RF {rf}" + ("→" if rf > hi + 1.5 else ""),
                (x, 41),
                rotation=90,
                fontsize=7,
                color=color,
                ha="right",
                va="bottom",
            )


def _shortcut_lines(ax, name: str, task_shortcuts: dict) -> None:
    """The task's best shortcut on a panel, and on the average-pool linear-head panel its local-view ceiling."""
    local = task_shortcuts.get("bag_of_shapes")
    best = max(v for k, v in task_shortcuts.items() if k != "bag_of_shapes")
    ax.axhline(best * PERCENT, color="crimson", ls=":", lw=1, label=f"{best * PERCENT:.1f}%: best shortcut")
    if local is not None and name == AVERAGE_LINEAR:  # the bound holds for this readout only
        ax.axhline(
            local * PERCENT,
            color="black",
            ls="-.",
            lw=1,
            label=f"{local * PERCENT:.1f}%: local-view ceiling, avg pool + linear head",
        )


AVERAGE_LINEAR = "CNN, average pool + linear head, by receptive field"
FAMILIES = (AVERAGE_LINEAR, "CNN, other readouts (max pool or MLP head)", "ViT")


def family(cfg: dict, model: str) -> str:
    """The panel of ``model`` in the by-distance figure: CNNs with the additive readout, CNNs with
    another readout (max pooling or an MLP head), and the rest (the ViTs)."""
    spec = cfg["models"].get(model, {})
    if not spec.get("class_path", "").endswith("ConvNet"):
        return FAMILIES[2]
    args = spec.get("init_args", {})
    if args.get("pool", "avg") != "avg" or args.get("head", "linear") != "linear":
        return FAMILIES[1]
    return AVERAGE_LINEAR


def shift_figure(
    runs: dict, models: list[str], colors: dict, ceiling: float | None, exp: dict, task: str, out_dir: Path
) -> None:
    """Each run's accuracy in its region and moved, joined by a line: the translation test at a glance."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.3 * len(models) + 2.5, 4))
    for i, m in enumerate(models):
        for r in runs[m]:
            if r.get("shift_acc"):
                ax.plot(
                    [i - 0.18, i + 0.18],
                    [float(r["test_acc"]) * PERCENT, float(r["shift_acc"]) * PERCENT],
                    "-o",
                    color=colors[m],
                    ms=4,
                    lw=1,
                    alpha=0.8,
                )
    per_model_axes(
        ax,
        models,
        ceiling,
        "test accuracy (%): left dot in region, right dot moved",
        f"{exp['name']}: {task}, trained and tested in {exp['train_region']}, then moved to {exp['shift_region']}",
    )
    fig.tight_layout()
    fig.savefig(out_dir / f"{exp['name']}_{task}_shift.png", dpi=110)
    plt.close(fig)


def per_model_axes(ax, models: list[str], ceiling: float | None, ylabel: str, title: str) -> None:
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
