"""The grid runner that the studies share: a resumable grid of train.py runs fanned out by submitit, and its reports.

    python -m studies.runner --config studies/relation/configs/relation.yaml

Run from the repository root (the configs' paths are relative to it). A study config (YAML)
names a base train.py config, the models (backbone blocks as in any train.py config), the seeds,
the training budget, and a list of experiments; each experiment is a grid
``task x model x num_train x seed`` with one train/test placement region. One invocation
(``study.run_study``):

1. the shortcut audit (``studies.runner.shortcuts``) into ``out_dir``, if the config asks for it;
2. the learning-rate calibration runs, if the config has ``families`` and ``calibration``; the
   best rate of each family on the validation split is then fixed for its models (``grid.choose_lr``);
3. every run of the grid;
4. the reports (``studies.runner.report``).

Every run (``run.run_one``) is one ``vit.training.cli.main(["fit", "--config", base, "--config",
overrides])`` call, the same Lightning code as ``python train.py fit``: the best checkpoint (by
``val/acc``) is tested after fit, then scored again per distance between the two parts, and its
per-image predictions go to ``<out_dir>/predictions/<run key>.npz`` (what the report re-bins by
visibility, ``studies.runner.visibility``). Logs (TensorBoard and CSV) and checkpoints go to
``<log_dir>/<run key>/``.

Executors (``--executor``): ``forked`` (the default, ``studies.runner.forked``) runs each run in a
process of its own forked from a copy of this one, ``--parallel`` (2) at a time with ``threads`` torch
threads each, without importing torch and Lightning again per run; submitit's ``local`` does the same
in a fresh interpreter per run (4-5 s more a run here); ``debug`` runs them one by one in this process (the
tests); ``slurm`` submits one job array (``--partition``, ``--gpus``, ``--cpus``, ``--timeout_min``;
at most ``--parallel`` tasks at a time), in which Lightning's own SLURM auto-requeue is off and
submitit requeues a preempted run (``run.StudyJob`` is checkpointable). Only this process writes
``runs.csv``, as the runs finish.

Resuming. A run is keyed by its grid coordinates (experiment, task, model, num_train, seed; the
learning rate too for calibration runs). Its row is appended to ``runs.csv`` in one write, only
after it has finished, so the CSV never holds a partial run (``runs_csv``). On start, every key
already in the CSV is skipped. A run that was killed midway has no row: it is redone from scratch,
and its unfinished log directory is moved aside first (to ``<run key>.unfinished-N``), never
deleted or overwritten. A row records a fingerprint of the run's settings and the code revision;
if the config changed since, the study stops with an error instead of mixing the two in one table.
A row that is damaged (cut short, edited by hand) stops the study too, naming its line.

One invocation at a time per ``out_dir`` (``lock``): it holds ``<out_dir>/study.lock``
(``fcntl.flock``, released by the kernel when the process ends, ``kill -9`` included) and a second
one is refused. After a ``kill -9``, the local jobs it had started run on: the lock names them
(``processes``), and the next invocation refuses to start while one still runs. On SIGTERM or
Ctrl-C the study cancels its runs under way (local and forked runs would outlive it) and exits with
128 + the signal; its finished rows are kept, and the same command goes on.

A study with steps of its own around the grid (``studies.arrangement``) builds its command from
``parse_args``, ``read_config``, ``exit_codes`` and ``run``, as ``main`` does.
"""

from __future__ import annotations

import argparse
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from vit.commands import EitherSpelling

# The rest (the grid's data modules: torch and Lightning, 4-5 s here) is imported once the options are read: `--help`
# and a refused option answer at once.

PROG = "python -m studies.runner"
EXECUTORS = ("forked", "local", "debug", "slurm")


def parse_args(
    argv: list[str] | None = None, *, prog: str = PROG, description: str | None = None, config: str | None = None
) -> argparse.Namespace:
    """The runner's options, checked; ``config`` is the default of ``--config`` (without one, it is required)."""
    parser = EitherSpelling(prog=prog, description=description or __doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        required=config is None,
        default=config,
        help=f"study config YAML (default {config})"
        if config
        else "study config YAML, e.g. studies/relation/configs/relation.yaml",
    )
    parser.add_argument("--max_runs", type=int, default=None, help="stop after this many new runs (resume later)")
    parser.add_argument(
        "--report_only", action="store_true", help="rewrite summary and plots from runs.csv, run nothing"
    )
    parser.add_argument("--list", action="store_true", help="print the planned runs and whether each is done")
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="forked",
        help="forked: processes forked from one that imported torch once (default); submitit's local (a fresh "
        "interpreter per run), debug (in this process), slurm (a job array)",
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2: one per core here)")
    parser.add_argument("--timeout_min", type=int, default=120, help="wall-time limit of one run, in minutes")
    slurm = parser.add_argument_group("slurm", "with --executor slurm")
    slurm.add_argument("--partition", default=None, help="SLURM partition")
    slurm.add_argument("--gpus", type=int, default=1, help="GPUs per run")
    slurm.add_argument("--cpus", type=int, default=8, help="CPU cores per run")
    args = parser.parse_args(argv)
    for name in ("parallel", "timeout_min", "cpus"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} is not allowed: expected an int >= 1")
    if args.gpus < 0:
        parser.error(f"--gpus={args.gpus} is not allowed: expected an int >= 0")
    if args.max_runs is not None and args.max_runs < 0:
        parser.error(f"--max_runs={args.max_runs} is not allowed: expected an int >= 0")
    return args


def read_config(path: str) -> dict:
    """The checked study config; one `error:` line and exit status 2 when it cannot be used."""
    from studies.runner.grid import load_config

    try:
        return load_config(path)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


@contextmanager
def exit_codes(csv_path: Path):
    """A ``StudyError`` as one `error:` line and exit status 2, failed runs (``study.RunsFailed``, each named) as one
    and 1; SIGTERM and Ctrl-C as one line and 128 + the signal, naming the finished runs kept in ``csv_path``; any
    other error keeps its traceback."""
    from studies.runner import study
    from studies.runner.lock import Stopped
    from studies.runner.runs_csv import StudyError, read_rows
    from vit.training.run_lock import printable

    try:
        yield
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except study.RunsFailed as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        print(
            f"stopped by {signal.Signals(signum).name}: the {len(read_rows(csv_path))} finished runs are kept in "
            f"{printable(csv_path)} and the runs under way were stopped; rerun the same command to go on (those are "
            "redone)",
            file=sys.stderr,
        )
        raise SystemExit(128 + signum) from None


def run(args: argparse.Namespace, cfg: dict, *, prog: str = PROG) -> None:
    """What the options ask: ``--list`` and ``--report_only`` read runs.csv and run nothing; otherwise the study."""
    from studies.runner import study

    csv_path = Path(cfg["out_dir"]) / "runs.csv"
    if args.list or args.report_only:
        _list_and_report(args, cfg, csv_path, prog)
        return
    slurm_params = study.slurm_parameters(
        partition=args.partition, time_min=args.timeout_min, gpus=args.gpus, cpus=args.cpus, parallel=args.parallel
    )
    study.run_study(
        args.config,
        max_runs=args.max_runs,
        executor=args.executor,
        parallel=args.parallel,
        slurm=slurm_params,
        timeout_min=args.timeout_min,
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m studies.runner`. A config it cannot use, a damaged runs.csv, an out_dir it cannot
    create or in use (also by the runs of a killed invocation) or nothing to report is one `error:` line
    and exit status 2, before anything runs; SIGTERM and Ctrl-C are one line and 128 + the signal; an
    error during the runs keeps its traceback."""
    args = parse_args(argv)
    cfg = read_config(args.config)
    with exit_codes(Path(cfg["out_dir"]) / "runs.csv"):
        run(args, cfg)


def _list_and_report(args, cfg: dict, csv_path: Path, prog: str) -> None:
    """``--list`` and ``--report_only``: read runs.csv, run nothing."""
    from studies.runner.grid import calibration_plan, choose_lr, plan
    from studies.runner.report import write_reports
    from studies.runner.runs_csv import StudyError, read_rows
    from vit.training.run_lock import printable

    rows = read_rows(csv_path)
    if args.list:
        keys = {r["key"] for r in rows}
        runs = calibration_plan(cfg)
        try:
            runs += plan(cfg, choose_lr(cfg, rows) if "calibration" in cfg else None)
        except ValueError:
            print("(the study's runs are planned once the calibration has finished)")
        for planned in runs:
            print(f"{'done' if planned.key in keys else 'todo'}  {planned.key}  epochs={planned.epochs}")
        print(f"{sum(r.key in keys for r in runs)}/{len(runs)} runs done")
    if args.report_only:
        if not rows:
            raise StudyError(
                f"no finished runs in {printable(csv_path.parent)} yet (no rows in "
                f"{printable(csv_path.name)}), so there is nothing to report: start the study with "
                f"{prog} --config {printable(args.config)}"
            )
        write_reports(rows, csv_path.parent, cfg)


if __name__ == "__main__":
    main()
