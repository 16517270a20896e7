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
import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import yaml

from vit.experiments.grid import Run, load_config, plan
from vit.experiments.report import write_reports

COLUMNS = (
    "key", "experiment", "task", "model", "num_train", "seed", "train_region", "test_region",
    "params", "epochs", "steps", "batch_size", "train_time_s", "train_acc", "val_acc", "test_acc",
    "fingerprint", "finished_at",
)


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


def main(argv: list[str] | None = None) -> None:
    """`python -m vit.experiments.study`. A config it cannot use is one `error:` line and exit status 2,
    before anything runs; an error during the runs keeps its traceback."""
    parser = argparse.ArgumentParser(prog="python -m vit.experiments.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="study config YAML, e.g. configs/study/two_circles.yaml")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary and plots from runs.csv, run nothing")
    parser.add_argument("--list", action="store_true", help="print the planned runs and whether each is done")
    args = parser.parse_args(argv)
    if args.max_runs is not None and args.max_runs < 0:
        parser.error(f"--max-runs={args.max_runs} is not allowed: expected an int >= 0")
    try:
        cfg = load_config(args.config)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.list or args.report_only:
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
