"""A study run's wall time, whole (`python -m studies.runner`, process start to reports), against its bare steps.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/study_overhead.py --repeats 5
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/study_overhead.py --study studies/relation/configs/tiny.yaml

The study is the tiny one (`studies/relation/configs/tiny.yaml`, or `--config`: its model, batch size, validation
and test sizes), cut to one run of `--model` on same_different with a fixed learning rate (no calibration, no shortcut
audit), at two sizes: its smallest (32 pairs, 2 steps), whose wall time is the fixed cost F of an invocation with one
run, and a short one (`--num_train` pairs for 2 epochs). The bare steps B are forward, cross-entropy, backward and
AdamW on the same data and model, in this process (`benchmarks.step_overhead.bare_seconds_per_step`), one torch thread
as the study's. Each executor (`--executors`) runs both sizes back to back, each in a fresh process, in an order that
alternates with the bare steps from one repeat to the next; printed are the medians and ranges of the walls, of B, and
of the short run's excess over its steps, (W_short - F) / B, paired within a repeat (1.0: no cost beyond the steps).

With `--study CONFIG`, the whole study of CONFIG is timed instead, once per executor and repeat, alternating.

Measured on 2 shared cores (Linux, Python 3.11, one torch thread; the load is the 1-minute load average), 4 December
2026, with one `self.log` a training step (`ImageClassifier.training_step`). The machine ran the same bare steps 1.7 to
2.3 times slower than the day before, and its speed moved by up to 50% from one minute to the next:
    --repeats 5 --num_train 8000 --executors forked (the tiny ViT, 500 steps; load 1.0-1.1):
        bare steps B 2.28 s [2.08-3.60]; F 13.21 s [10.95-14.72], short run 15.72 s [14.08-21.96],
        (W - F) / B = 1.63 [1.16-2.14] (paired); the medians' W <= 1.2 B + F holds (15.72 <= 15.94 s)
    --config studies/relation/configs/relation.yaml --num_train 2000 --repeats 3 --executors forked (the relation
    study's ViT, 64 steps of 64; load 1.0): B 10.35 s [8.98-11.81], F 20.69 s [20.56-21.23] (its 1000 validation and
    2000 + 2000 test images), short run 32.36 s [30.99-33.53], (W - F) / B = 1.13 [1.04-1.16]
3 December, with three `self.log` calls a step (a faster machine): the tiny ViT 1.94 [1.62-2.69] forked, 2.29
[1.37-2.35] local (submitit, a fresh interpreter per run: F 13.11 s against forked 7.23 s); the relation ViT 1.22
[1.20-1.49]; the 10-run tiny study (`--study studies/relation/configs/tiny.yaml --repeats 3`) 14.54 s [11.70-29.36]
forked, 50.12 s [49.74-104.95] local.
F is the study process's one import of torch and Lightning (4.7 s of `python -X importtime` on 3 December), a run's
LightningCLI (jsonargparse builds, checks and dumps its config: about 60% of a tiny run's 0.6-0.9 s in one process,
cProfile), its 2 steps, validation and tests, and the reports (0.3-0.9 s). What a step costs beyond the bare one is
measured apart, in one process (`benchmarks/step_overhead.py --study ... --per_step`, docs/benchmarks.md): for the
tiny ViT, Lightning's own loop with nothing logged is 1.16x the bare step and `train.py` 1.56x, so 1.2 is out of
reach for a step of 3-5 ms through Lightning; a model of realistic size hides it (1.13 for the relation ViT).
"""

from __future__ import annotations

import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks import spread
from benchmarks.step_overhead import bare_config_of, bare_seconds_per_step, relation_experiment
from vit.commands import EitherSpelling

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "studies/relation/configs/tiny.yaml"


def one_run_config(folder: Path, model: str, num_train: int, study: Path = TINY) -> Path:
    """A study config in `folder`: `study`'s `model`, one seed, `num_train` pairs for 2 epochs, a fixed rate."""
    tiny = yaml.safe_load(Path(study).read_text())
    family = next(name for name, members in tiny["families"].items() if model in members)
    cfg = {
        **{
            k: v
            for k, v in tiny.items()
            if k not in ("calibration", "shortcuts", "experiments", "families", "comparisons")
        },
        "base_config": str(ROOT / tiny["base_config"]),
        "out_dir": str(folder / "results"),
        "log_dir": str(folder / "runs"),
        "seeds": [0],
        "models": {model: tiny["models"][model]},
        "families": {family: [model]},
        "lrs": {family: 1e-3},
        "experiments": [relation_experiment(model, num_train)],
    }
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def invocation(config: Path, executor: str) -> float:
    """Seconds of wall time of `python -m studies.runner --config config --executor executor`, in a fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "studies.runner", "--config", str(config), "--executor", executor],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the study failed (exit status {done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def planned(study: Path, model: str, num_train: int):
    """`(run, steps)`: the one run of `model` with `num_train` pairs, and its optimiser steps."""
    from studies.runner.grid import load_config, plan

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(one_run_config(Path(tmp), model, num_train, study))
    (run,) = plan(cfg)
    return run, run.epochs * -(-num_train // cfg["batch_size"])


def whole_run(study: Path, model: str, num_train: int, executor: str) -> float:
    """Wall seconds of one run of `model` with `num_train` pairs, its study in a fresh folder; its steps checked."""
    with tempfile.TemporaryDirectory() as tmp:
        config = one_run_config(Path(tmp), model, num_train, study)
        seconds = invocation(config, executor)
        with open(Path(tmp) / "results" / "runs.csv", newline="") as f:
            (row,) = csv.DictReader(f)
    assert int(row["steps"]) == planned(study, model, num_train)[1], row["steps"]
    return seconds


def bare_seconds(study: Path, model: str, num_train: int) -> float:
    """Seconds of the run's steps, bare, on its backbone and training data (`bare_seconds_per_step`)."""
    run, steps = planned(study, model, num_train)
    return steps * bare_seconds_per_step(bare_config_of(run), steps, skip=0)


def main_runs(args) -> None:
    """Both sizes through each executor against the bare steps, alternating; the medians and ranges printed."""
    walls: dict[tuple[str, str], list[float]] = {}
    bares, steps = [], planned(args.config, args.model, args.num_train)[1]
    for repeat in range(args.repeats):
        for which in ["bare", *args.executors] if repeat % 2 == 0 else [*args.executors[::-1], "bare"]:
            if which == "bare":
                bares.append(bare_seconds(args.config, args.model, args.num_train))
            for size, num_train in (("short", args.num_train), ("smallest", 32)) if which != "bare" else ():
                walls.setdefault((which, size), []).append(whole_run(args.config, args.model, num_train, which))
        shown = [f"{k[0]} {k[1]} {v[-1]:.2f} s" for k, v in walls.items()]
        print(f"repeat {repeat}: bare {bares[-1]:.2f} s, " + ", ".join(shown), flush=True)
    print(f"bare steps ({steps} steps of {args.model} of {args.config}): {spread(bares, unit=' s')}")
    for executor in args.executors:
        short, fixed = walls[(executor, "short")], walls[(executor, "smallest")]
        # paired: the two sizes of one repeat ran back to back, under the same load
        excess = [(w - f) / b for w, f, b in zip(short, fixed, bares)]
        bound = 1.2 * statistics.median(bares) + statistics.median(fixed)
        print(
            f"{executor}: short run {spread(short, unit=' s')}, smallest run (F) {spread(fixed, unit=' s')}; "
            f"(W_short - F) / B = {spread(excess)}; W_short <= 1.2 B + F = "
            f"{bound:.2f} s: {statistics.median(short) <= bound}"
        )


def main_study(args) -> None:
    """The whole study of `--study` through each executor, alternating; medians and ranges printed."""
    walls: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for executor in args.executors if repeat % 2 == 0 else args.executors[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = yaml.safe_load(Path(args.study).read_text())
                cfg.update(out_dir=f"{tmp}/results", log_dir=f"{tmp}/runs", base_config=str(ROOT / cfg["base_config"]))
                config = Path(tmp) / "study.yaml"
                config.write_text(yaml.safe_dump(cfg, sort_keys=False))
                walls.setdefault(executor, []).append(invocation(config, executor))
        print(f"repeat {repeat}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in walls.items()), flush=True)
    for executor, values in walls.items():
        print(f"{args.study} through {executor}: {spread(values, unit=' s')} over {args.repeats} repeats")


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=TINY, help="the study config whose run is cut to one")
    parser.add_argument("--model", default="vit-learned", help="a model of --config")
    parser.add_argument("--num_train", type=int, default=4000, help="pairs of the short run (2 epochs)")
    parser.add_argument("--executors", default="forked,local", help="comma-separated, of the runner's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--study", help="time this whole study config instead (its own out_dir is not touched)")
    args = parser.parse_args(argv)
    args.executors = [e for e in args.executors.split(",") if e]
    torch.set_num_threads(1)  # the study's `threads`
    (main_study if args.study else main_runs)(args)


if __name__ == "__main__":
    main()
