"""The spatial-relation study: a resumable grid of train.py runs, and its tables and plots.

    python -m vit.experiments.study --config configs/study/two_circles.yaml

The study config (YAML) names a base train.py config, the models (backbone blocks as in any
train.py config), the seeds, the training budget, and a list of experiments; each experiment is a
grid ``task x model x num_train x seed`` with one train/test placement region. Every grid point
is one ``vit.training.cli.main(["fit", "--config", base, "--config", overrides])`` call, the same Lightning
code as ``python train.py fit``: the best checkpoint (by ``val/acc``) is tested after fit. Logs
(TensorBoard and CSV) and checkpoints go to ``<log_dir>/<run key>/``.

Outputs in ``out_dir``: ``runs.csv`` (one row per finished run), ``summary.md`` and
``summary.csv`` (test accuracy mean +- std over seeds), and PNG plots.

Resuming. A run is keyed by its grid coordinates (experiment, task, model, num_train, seed). Its
row is appended to ``runs.csv`` in one write, only after it has finished, so the CSV never holds a
partial run. On start, every key already in the CSV is skipped. A run that was killed midway has no
row: it is redone from scratch, and its unfinished log directory is moved aside first (to
``<run key>.unfinished-N``), never deleted or overwritten. A row records a fingerprint of the
run's settings; if the config changed since (other epochs, other model widths), the study stops
with an error instead of mixing the two in one table.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from vit.checks import check_choice
from vit.data.two_circles import Region, Task

COLUMNS = (
    "key", "experiment", "task", "model", "num_train", "seed", "train_region", "test_region",
    "params", "epochs", "steps", "batch_size", "train_time_s", "train_acc", "val_acc", "test_acc",
    "fingerprint", "finished_at",
)
PERCENT = 100.0


@dataclass(frozen=True)
class Run:
    """One grid point and the settings that make it (what the fingerprint hashes)."""

    experiment: str
    task: str
    model: str
    num_train: int
    seed: int
    train_region: str
    test_region: str
    epochs: int
    overrides: dict
    base_digest: str  # of the base config's text: editing it changes every run

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.task}-{self.model}-n{self.num_train}-s{self.seed}"

    @property
    def fingerprint(self) -> str:
        text = json.dumps([self.overrides, self.base_digest], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- config


def _require(cfg: dict, name: str, kind: type, where: str):
    if name not in cfg:
        raise ValueError(f"{where}: missing required key {name!r}")
    value = cfg[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{where}: {name}={value!r} is not allowed: expected {names}")
    return value


def schedule(num_train: int, *, train_samples: int, num_val_checks: int, batch_size: int) -> tuple[int, int, int]:
    """``(epochs, val_every, val_batches)``: about ``train_samples`` samples seen, at least one epoch.

    Every run gets the same compute (about ``train_samples / batch_size`` optimisation steps), so a
    small training set is seen for many epochs and a large one for few; a set larger than
    ``train_samples`` is seen once (one epoch, more steps). Validation runs about
    ``num_val_checks`` times and always after the last step: every ``val_every`` epochs or, with
    fewer epochs than checks, every ``val_batches`` batches within an epoch (0: at the end of the
    epoch only). The checks per epoch are the divisor of the number of batches nearest to the
    wanted number, so that the epoch's last batch is always a check.
    """
    epochs = max(1, round(train_samples / num_train))
    val_every = max(1, epochs // num_val_checks)
    num_batches = math.ceil(num_train / batch_size)
    wanted = max(1, round(num_val_checks / epochs))
    divisors = [d for d in range(1, num_batches + 1) if num_batches % d == 0]
    checks_per_epoch = min(divisors, key=lambda d: (abs(d - wanted), -d))
    val_batches = num_batches // checks_per_epoch if checks_per_epoch > 1 else 0
    return math.ceil(epochs / val_every) * val_every, val_every, val_batches


def load_config(path: str | Path) -> dict:
    """Read and check a study config; errors name the key, the value and what is allowed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"study config {str(path)!r} does not exist")
    cfg = yaml.safe_load(path.read_text())
    where = str(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a mapping at the top level")
    allowed = {"base_config", "out_dir", "log_dir", "seeds", "batch_size", "train_samples", "num_val_checks",
               "num_val", "num_test", "threads", "warmup_fraction", "models", "experiments"}
    unknown = set(cfg) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    base = Path(_require(cfg, "base_config", str, where))
    if not base.is_file():
        raise FileNotFoundError(f"{where}: base_config {str(base)!r} does not exist")
    _require(cfg, "out_dir", str, where)
    _require(cfg, "log_dir", str, where)
    seeds = _require(cfg, "seeds", list, where)
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds):
        raise ValueError(f"{where}: seeds={seeds!r} is not allowed: expected a non-empty list of ints >= 0")
    for name in ("batch_size", "train_samples", "num_val_checks", "num_val", "num_test", "threads"):
        if _require(cfg, name, int, where) < 1:
            raise ValueError(f"{where}: {name}={cfg[name]!r} is not allowed: expected an int >= 1")
    warmup = _require(cfg, "warmup_fraction", (int, float), where)
    if not 0 <= warmup <= 1:
        raise ValueError(f"{where}: warmup_fraction={warmup!r} is not allowed: expected a float in [0, 1]")
    models = _require(cfg, "models", dict, where)
    for name, model in models.items():
        if not isinstance(model, dict) or "class_path" not in model:
            raise ValueError(f"{where}: models.{name} must be a backbone mapping with a class_path "
                             f"(and init_args), as under model.backbone in a train.py config")
    experiments = _require(cfg, "experiments", list, where)
    seen: dict[str, tuple[str, str]] = {}
    for i, exp in enumerate(experiments):
        w = f"{where}: experiments[{i}]"
        if not isinstance(exp, dict):
            raise ValueError(f"{w}: expected a mapping")
        extra = set(exp) - {"name", "tasks", "models", "num_train", "train_region", "test_region"}
        if extra:
            raise ValueError(f"{w}: unknown keys {sorted(extra)}")
        name = _require(exp, "name", str, w)
        if not name or "-" in name:
            raise ValueError(f"{w}: name={name!r} is not allowed: expected a non-empty name without '-'")
        for task in _require(exp, "tasks", list, w):
            check_choice(f"{w}.tasks", task, Task)
        for model in _require(exp, "models", list, w):
            check_choice(f"{w}.models", model, tuple(models))
        sizes = _require(exp, "num_train", list, w)
        if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"{w}: num_train={sizes!r} is not allowed: expected a list of ints >= 1")
        for region in ("train_region", "test_region"):
            check_choice(f"{w}.{region}", exp.setdefault(region, "all"), Region)
        # Entries may share a name (e.g. all models at one size, a few models at more sizes): they
        # fill one table, so they must agree on the regions.
        regions = (exp["train_region"], exp["test_region"])
        if seen.setdefault(name, regions) != regions:
            raise ValueError(f"{w}: experiment {name!r} is listed with regions {seen[name]} and {regions}; "
                             f"entries that share a name must share train_region and test_region")
    return cfg


def experiments(cfg: dict) -> list[dict]:
    """The experiments by name, entries that share a name merged (tasks, models, sizes in first-seen order)."""
    merged: dict[str, dict] = {}
    for exp in cfg["experiments"]:
        m = merged.setdefault(exp["name"], {"name": exp["name"], "tasks": [], "models": [], "num_train": [],
                                            "train_region": exp["train_region"], "test_region": exp["test_region"]})
        for key in ("tasks", "models", "num_train"):
            m[key] += [v for v in exp[key] if v not in m[key]]
    for m in merged.values():
        m["num_train"].sort()
    return list(merged.values())


def plan(cfg: dict) -> list[Run]:
    """Every run of the study, in the order they are run: entry by entry as listed, and within an
    entry seed by seed (every cell of the entry with the first seed, then with the next).

    So a study stopped early holds the entries listed first, each cell with the same number of
    seeds (give or take one): list the most important entries first.
    """
    base_digest = hashlib.sha256(Path(cfg["base_config"]).read_bytes()).hexdigest()[:12]
    runs, keys = [], set()
    for exp in cfg["experiments"]:
        for seed in cfg["seeds"]:
            for task in exp["tasks"]:
                for num_train in exp["num_train"]:
                    for model in exp["models"]:
                        epochs, val_every, val_batches = schedule(
                            num_train, train_samples=cfg["train_samples"], num_val_checks=cfg["num_val_checks"],
                            batch_size=cfg["batch_size"])
                        trainer = {"max_epochs": epochs, "check_val_every_n_epoch": val_every}
                        if val_batches:  # only then: the other runs keep their settings fingerprint
                            trainer["val_check_interval"] = val_batches
                        overrides = {
                            "seed_everything": seed,
                            "trainer": trainer,
                            "model": {"backbone": cfg["models"][model],
                                      "warmup_epochs": round(cfg["warmup_fraction"] * epochs, 4)},
                            "data": {"init_args": {
                                "task": task, "num_train": num_train, "num_val": cfg["num_val"],
                                "num_test": cfg["num_test"], "batch_size": cfg["batch_size"], "seed": seed,
                                "train_region": exp["train_region"], "test_region": exp["test_region"]}},
                        }
                        run = Run(exp["name"], task, model, num_train, seed, exp["train_region"],
                                  exp["test_region"], epochs, overrides, base_digest)
                        if run.key not in keys:
                            keys.add(run.key)
                            runs.append(run)
    return runs


# ----------------------------------------------------------------------------- running


def read_rows(csv_path: Path) -> list[dict]:
    """The finished runs in ``runs.csv`` (empty if there is none yet)."""
    if not csv_path.exists():
        return []
    with csv_path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row in a single ``write`` on an O_APPEND descriptor, then fsync: all of it or none."""
    header = not csv_path.exists() or csv_path.stat().st_size == 0
    lines = []
    for values in ([dict(zip(COLUMNS, COLUMNS))] if header else []) + [row]:
        buf = io.StringIO()
        csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n").writerow(values)
        lines.append(buf.getvalue())
    fd = os.open(csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, "".join(lines).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_aside(path: Path) -> None:
    """Rename an unfinished run directory to ``<name>.unfinished-N`` (the first free N)."""
    n = 1
    while (target := path.with_name(f"{path.name}.unfinished-{n}")).exists():
        n += 1
    path.rename(target)


def _last_train_acc(log_dir: Path) -> float:
    """The last epoch's ``train/acc`` from the CSVLogger's metrics.csv (NaN if it is not there)."""
    metrics = log_dir / "metrics.csv"
    if not metrics.exists():
        return float("nan")
    with metrics.open(newline="") as f:
        values = [r["train/acc"] for r in csv.DictReader(f) if r.get("train/acc")]
    return float(values[-1]) if values else float("nan")


def run_one(run: Run, *, base_config: str, log_dir: Path) -> dict:
    """Train and test one grid point through ``vit.training.cli.main``; return its CSV row."""
    from vit.training.cli import main  # imported here so that `--help` and planning stay fast

    run_dir = log_dir / run.key
    if run_dir.exists():  # no row in the CSV, so this is what a killed run left behind
        _move_aside(run_dir)
    logger_args = {"save_dir": str(log_dir), "name": run.key, "version": ""}
    overrides = json.loads(json.dumps(run.overrides))
    overrides["trainer"].update({
        "logger": [
            {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
             "init_args": {**logger_args, "default_hp_metric": False}},
            {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": logger_args},
        ],
        "enable_progress_bar": False,
        "enable_model_summary": False,
    })
    run_dir.mkdir(parents=True)
    overrides_path = run_dir / "study_overrides.yaml"
    overrides_path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    start = time.perf_counter()
    with warnings.catch_warnings():
        # main(args=...) is the documented way to call LightningCLI from Python; its warning is
        # about `python -m vit.experiments.study`'s own sys.argv. TensorBoard and CSV share the run directory.
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        warnings.filterwarnings("ignore", message=".*exists and is not empty")
        cli = main(args=["fit", "--config", base_config, "--config", str(overrides_path)])
    seconds = time.perf_counter() - start
    trainer = cli.trainer
    if trainer.interrupted or "test/acc" not in trainer.callback_metrics:
        raise RuntimeError(f"run {run.key} did not finish (interrupted={trainer.interrupted}); "
                           f"its logs are in {run_dir}")
    best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    return {
        "key": run.key, "experiment": run.experiment, "task": run.task, "model": run.model,
        "num_train": run.num_train, "seed": run.seed, "train_region": run.train_region,
        "test_region": run.test_region,
        "params": sum(p.numel() for p in cli.model.backbone.parameters()),
        "epochs": trainer.current_epoch, "steps": trainer.global_step,
        "batch_size": run.overrides["data"]["init_args"]["batch_size"],
        "train_time_s": f"{seconds:.1f}", "train_acc": f"{_last_train_acc(run_dir):.4f}",
        "val_acc": f"{float(best) if best is not None else float('nan'):.4f}",
        "test_acc": f"{float(trainer.callback_metrics['test/acc']):.4f}",
        "fingerprint": run.fingerprint, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def run_study(config: str | Path, *, max_runs: int | None = None, progress: bool = True) -> list[dict]:
    """Run every unfinished grid point of the study (at most ``max_runs`` of them), then write the reports."""
    import torch
    from tqdm.auto import tqdm

    cfg = load_config(config)
    out_dir, log_dir = Path(cfg["out_dir"]), Path(cfg["log_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "runs.csv"
    runs = plan(cfg)
    done = {row["key"]: row for row in read_rows(csv_path)}
    for run in runs:
        row = done.get(run.key)
        if row is not None and row["fingerprint"] != run.fingerprint:
            raise ValueError(f"{csv_path} holds run {run.key} made with other settings (fingerprint "
                             f"{row['fingerprint']}, the config now gives {run.fingerprint}); use a new "
                             f"out_dir/log_dir for the new settings, or move the old results away")
    todo = [run for run in runs if run.key not in done]
    if max_runs is not None:
        todo = todo[:max_runs]
    torch.set_num_threads(cfg["threads"])
    # One line per run from the study; Lightning's per-run banners would bury the progress bar.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    bar = tqdm(todo, desc="study runs", unit="run", disable=not progress,
               initial=len(runs) - len(todo) if max_runs is None else 0,
               total=len(runs) if max_runs is None else len(todo))
    for run in bar:
        bar.set_postfix_str(run.key)
        row = run_one(run, base_config=cfg["base_config"], log_dir=log_dir)
        append_row(csv_path, row)
        bar.write(f"{run.key}: test/acc {row['test_acc']}  val/acc {row['val_acc']}  ({row['train_time_s']} s)")
    bar.close()
    rows = read_rows(csv_path)
    write_reports(rows, out_dir, cfg)
    return rows


# ----------------------------------------------------------------------------- reports


def per_cell(rows: list[dict], metric: str = "test_acc") -> dict[tuple, list[float]]:
    """``{(experiment, task, model, num_train): [metric of each seed's run]}``."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["experiment"], r["task"], r["model"], int(r["num_train"])), []).append(float(r[metric]))
    return groups


def aggregate(rows: list[dict], metric: str = "test_acc") -> dict[tuple, tuple[float, float, int]]:
    """``{(experiment, task, model, num_train): (mean, std, n)}`` of ``metric`` over seeds (std with ddof=1, 0 if n=1)."""
    return {k: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, len(v))
            for k, v in per_cell(rows, metric).items()}


def format_cell(mean: float, std: float, n: int) -> str:
    """Accuracy in percent as ``mean ± std (n)``."""
    return f"{mean * PERCENT:.1f} ± {std * PERCENT:.1f} ({n})"


def write_reports(rows: list[dict], out_dir: Path, cfg: dict) -> None:
    """``summary.md``, ``summary.csv`` and the plots from the rows of ``runs.csv``."""
    test, val = aggregate(rows, "test_acc"), aggregate(rows, "val_acc")
    with (out_dir / "summary.csv").open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["experiment", "task", "model", "num_train", "n_seeds", "test_acc_mean", "test_acc_std",
                    "val_acc_mean", "val_acc_std"])
        for k, (m, s, n) in test.items():
            w.writerow([*k, n, f"{m:.4f}", f"{s:.4f}", f"{val[k][0]:.4f}", f"{val[k][1]:.4f}"])
    lines = ["# Two-circles study: test accuracy (%), mean ± std over seeds (number of seeds)", "",
             "Generated by `python -m vit.experiments.study`; one row per model, one column per training-set size. "
             "`runs.csv` holds every run.", ""]
    for exp in experiments(cfg):
        name = exp["name"]
        for task in exp["tasks"]:
            sizes = [n for n in exp["num_train"] if any(k[:2] == (name, task) and k[3] == n for k in test)]
            if not sizes:
                continue
            lines += [f"## {name}: task `{task}`, train region `{exp['train_region']}`, "
                      f"test region `{exp['test_region']}`", ""]
            shift = exp["train_region"] != exp["test_region"]
            head = [f"n={n}" for n in sizes]
            if shift:
                head = [f"n={n} test ({exp['test_region']})" for n in sizes] + \
                       [f"n={n} val ({exp['train_region']})" for n in sizes]
            lines += ["| model | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
            for model in exp["models"]:
                cells = [format_cell(*test[(name, task, model, n)]) if (name, task, model, n) in test else "–"
                         for n in sizes]
                if shift:
                    cells += [format_cell(*val[(name, task, model, n)]) if (name, task, model, n) in val else "–"
                              for n in sizes]
                lines.append(f"| {model} | " + " | ".join(cells) + " |")
            lines.append("")
    (out_dir / "summary.md").write_text("\n".join(lines))
    _plots(test, val, per_cell(rows, "test_acc"), per_cell(rows, "val_acc"), out_dir, cfg)


def _bars(ax, models: list[str], series: list[tuple[str | None, dict, dict]], key) -> None:
    """Grouped bars: one group per model, one bar per (label, cells, runs) series, error bars = std,
    and a dot per run (seed): a cell whose seeds split between chance and success shows it."""
    x = np.arange(len(models))
    width = 0.8 / len(series)
    for i, (label, cells, runs) in enumerate(series):
        v = [cells.get(key(m), (np.nan, 0.0, 0)) for m in models]
        pos = x + (i - (len(series) - 1) / 2) * width
        ax.bar(pos, [c[0] * PERCENT for c in v], width, yerr=[c[1] * PERCENT for c in v], capsize=3, label=label)
        for p, m in zip(pos, models):
            seeds = runs.get(key(m), [])
            ax.plot([p] * len(seeds), [a * PERCENT for a in seeds], "k.", ms=4, zorder=3)
    ax.set_xticks(x, models, rotation=30, ha="right")


def _plots(test: dict, val: dict, test_runs: dict, val_runs: dict, out_dir: Path, cfg: dict) -> None:
    """Per experiment: accuracy vs training-set size (lines), and all models at one size (bars).

    Means with std error bars, and a dot per run. For an experiment whose test region differs from
    its train region (a placement shift), the bars show the shifted test accuracy beside the
    in-distribution validation accuracy.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    def finish(fig, axes, title: str, path: Path) -> None:
        for ax in axes:
            ax.axhline(50, color="grey", lw=0.8, ls="--")
            ax.set_ylim(40, 102)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("accuracy (%): mean ± std over seeds, dot = one run")
        labelled = [ax for ax in axes if ax.get_legend_handles_labels()[0]]
        if labelled:  # a partial study may have no curve yet
            labelled[-1].legend(fontsize=8, loc="best")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    for exp in experiments(cfg):
        name, tasks = exp["name"], exp["tasks"]
        cells = {k: v for k, v in test.items() if k[0] == name}
        if not cells:
            continue
        shift = exp["train_region"] != exp["test_region"]
        where = f"train {exp['train_region']} → test {exp['test_region']}"
        sizes = sorted({k[3] for k in cells})
        # Lines: the models measured at two sizes or more.
        curves = {t: [m for m in exp["models"] if len({k[3] for k in cells if k[1:3] == (t, m)}) > 1] for t in tasks}
        if any(curves.values()):
            fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4), squeeze=False, sharey=True)
            for ax, task in zip(axes[0], tasks):
                for model in curves[task]:
                    pts = [(n, *cells[(name, task, model, n)][:2]) for n in sizes if (name, task, model, n) in cells]
                    n_, m_, s_ = (np.array(c) for c in zip(*pts))
                    line = ax.errorbar(n_, m_ * PERCENT, yerr=s_ * PERCENT, marker="o", capsize=3, label=model)
                    for n in n_:
                        seeds = test_runs[(name, task, model, n)]
                        ax.plot([n] * len(seeds), [a * PERCENT for a in seeds], ".", ms=4, alpha=0.6,
                                color=line[0].get_color())
                ax.set_xscale("log")
                ax.set_xticks(sizes, [f"{n:,}" for n in sizes])  # the measured sizes, written out
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xlabel("training-set size (log scale)")
                ax.set_title(task)
            finish(fig, list(axes[0]), f"{name}: test accuracy vs training-set size ({where})",
                   out_dir / f"{name}_vs_size.png")
        # Bars: every model at the size where the most models were run (the largest such size).
        fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4), squeeze=False, sharey=True)
        for ax, task in zip(axes[0], tasks):
            count = {n: sum((name, task, m, n) in cells for m in exp["models"]) for n in sizes}
            n = max(sizes, key=lambda s: (count[s], s))
            models = [m for m in exp["models"] if (name, task, m, n) in cells]
            series = [(f"test ({exp['test_region']})", cells, test_runs)]
            if shift:
                series.append((f"val ({exp['train_region']}, in distribution)", val, val_runs))
            _bars(ax, models, series, lambda m: (name, task, m, n))
            ax.set_title(f"{task}, n={n}")
        finish(fig, list(axes[0]), f"{name}: test accuracy per model ({where})", out_dir / f"{name}_models.png")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vit.experiments.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="study config YAML, e.g. configs/study/two_circles.yaml")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary and plots from runs.csv, run nothing")
    parser.add_argument("--list", action="store_true", help="print the planned runs and whether each is done")
    args = parser.parse_args(argv)
    if args.max_runs is not None and args.max_runs < 0:
        parser.error(f"--max-runs={args.max_runs} is not allowed: expected an int >= 0")
    if args.list or args.report_only:
        cfg = load_config(args.config)
        rows = read_rows(Path(cfg["out_dir"]) / "runs.csv")
        if args.list:
            keys = {r["key"] for r in rows}
            runs = plan(cfg)
            for run in runs:
                print(f"{'done' if run.key in keys else 'todo'}  {run.key}  epochs={run.epochs}")
            print(f"{sum(r.key in keys for r in runs)}/{len(runs)} runs done")
        if args.report_only:
            write_reports(rows, Path(cfg["out_dir"]), cfg)
        return
    run_study(args.config, max_runs=args.max_runs)


if __name__ == "__main__":
    main()
