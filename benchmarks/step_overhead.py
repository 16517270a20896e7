"""Seconds per training step through `train.py` against the bare step of the same model, in one process.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --config configs/same_different/vit.yaml

The bare step is forward, cross-entropy, backward, AdamW step on batches sliced from the training
tensors, nothing else. The `train.py` step is `vit.training.cli.main(["fit", ...])` on the same
config (its loggers, callbacks, data loader and LightningModule), timed by a callback from the
start of step `--skip` to the end of the last step, so that building the trainer and the first
steps do not count. Validation is off (it is not a training step). The two are timed alternately,
`--repeats` times, and each repeat gives one ratio train.py / bare; the median and the range of
the ratios are printed. Any `train.py` option can be appended after `--` (e.g.
`-- --trainer.enable_progress_bar false`) to see what it costs.

With `--study CONFIG --model NAME`, what is timed is a whole run of the relation study instead:
`studies.runner.run.run_one` of that model on `same_different` (building the data, fit with
the study's validations, loggers and checkpoints, test, the scoring by distance and the
translation test), against `steps` bare steps, where `steps` is the run's own number of steps. The
run is shortened to `--num_train` pairs for 2 epochs (the study: 64,000); its fixed costs then
weigh more than in a full run, so the ratio is an upper bound for the study's 2000-step runs:

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --study studies/relation/configs/relation.yaml \
        --model vit-learned
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from importlib import import_module
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import yaml
from timm.optim import param_groups_weight_decay

from vit.commands import EitherSpelling
from vit.training.cli import main as train_main


class StepTimer(L.Callback):
    """Seconds per step from the start of step `skip` to the end of the last step (kept in `StepTimer.last`)."""

    last: float | None = None

    def __init__(self, skip: int = 5) -> None:
        self.skip, self.start = skip, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.skip and self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        StepTimer.last = (time.perf_counter() - self.start) / (trainer.global_step - self.skip)


def build(spec: dict, **extra):
    """An object from a `class_path` + `init_args` block of a config."""
    module, name = spec["class_path"].rsplit(".", 1)
    return getattr(import_module(module), name)(**spec.get("init_args", {}), **extra)


def bare_seconds_per_step(config: dict, steps: int, skip: int) -> float:
    """The same backbone and data, in a plain loop."""
    data = build(config["data"])
    model = build(
        config["model"]["backbone"], img_size=data.img_size, in_chans=data.in_chans, num_classes=data.num_classes
    )
    data.setup("fit")
    x, y = data.train_set.images.contiguous(), data.train_set.labels
    hp = config["model"]
    groups = param_groups_weight_decay(
        model, hp.get("weight_decay", 0.05), no_weight_decay_list=getattr(model, "no_weight_decay", set)()
    )
    optimizer = torch.optim.AdamW(groups, lr=hp.get("lr", 1e-3))
    batch = config["data"]["init_args"]["batch_size"]
    for step in range(steps):
        if step == skip:
            start = time.perf_counter()
        idx = torch.randint(len(y), (batch,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / (steps - skip)


def relation_experiment(model: str, num_train: int) -> dict:
    """A study grid's experiment of one run: ``model`` on ``same_different`` with ``num_train`` pairs for 2 epochs."""
    return {
        "name": "relation",
        "tasks": ["same_different"],
        "models": [model],
        "num_train": [num_train],
        "train_region": "left",
        "test_region": "left",
        "shift_region": "right",
        "train_samples": 2 * num_train,
    }


def study_run(cfg: dict, model: str, num_train: int):
    """The study's run of ``model`` on ``same_different`` with ``num_train`` pairs for 2 epochs, from ``cfg``."""
    from studies.runner.grid import plan

    cfg = {k: v for k, v in cfg.items() if k != "calibration"}
    experiment = relation_experiment(model, num_train)
    (run,) = plan({**cfg, "seeds": [0], "experiments": [experiment]}, lrs={"vit": 1e-3, "cnn": 2e-3})
    return run


def main_study(args) -> None:
    from studies.runner.grid import load_config
    from studies.runner.run import run_one

    cfg = load_config(args.study)
    run = study_run(cfg, args.model, args.num_train)
    steps = run.epochs * -(-args.num_train // cfg["batch_size"])
    bare_config = {
        "data": run.overrides["data"],
        "model": {"backbone": run.overrides["model"]["backbone"], "lr": run.lr},
    }
    ratios, runs, bares = [], [], []
    for repeat in range(args.repeats):
        times = {}
        for which in ("bare", "study") if repeat % 2 == 0 else ("study", "bare"):
            if which == "bare":
                times["bare"] = bare_seconds_per_step(bare_config, steps, args.skip)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                row = run_one(run, base_config=cfg["base_config"], log_dir=Path(tmp))
                times["study"] = (time.perf_counter() - start) / steps
            assert int(row["steps"]) == steps, (row["steps"], steps)
        runs.append(times["study"])
        bares.append(times["bare"])
        ratios.append(times["study"] / times["bare"])
        print(
            f"repeat {repeat}: bare {1000 * times['bare']:.1f} ms/step, whole study run {1000 * times['study']:.1f} "
            f"ms/step ({steps} steps), ratio {ratios[-1]:.2f}",
            flush=True,
        )
    print(
        f"study run / bare = {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] over "
        f"{args.repeats} repeats; bare {1000 * statistics.median(bares):.1f} ms/step, whole study run "
        f"{1000 * statistics.median(runs):.1f} ms/step (medians); torch threads {torch.get_num_threads()}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a train.py config: time its steps through train.py")
    parser.add_argument("--study", help="a study config: time whole study runs of --model instead")
    parser.add_argument("--model", help="with --study: the study model to run")
    parser.add_argument("--num_train", type=int, default=16000, help="with --study: training pairs (2 epochs)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if (args.config is None) == (args.study is None) or (args.study is not None and args.model is None):
        parser.error("give either --config, or --study with --model")
    sys.argv = sys.argv[:1]  # LightningCLI below reads its arguments from the list it is given, not from here
    if args.study:
        return main_study(args)
    config = yaml.safe_load(open(args.config))
    ratios, bare_all, cli_all = [], [], []
    for repeat in range(args.repeats):
        times = {}
        for which in ("bare", "cli") if repeat % 2 == 0 else ("cli", "bare"):
            if which == "bare":
                times["bare"] = bare_seconds_per_step(config, args.steps, args.skip)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    train_main(
                        [
                            "fit",
                            "--config",
                            args.config,
                            "--trainer.max_steps",
                            str(args.steps),
                            "--trainer.limit_val_batches",
                            "0",
                            "--test_after_fit",
                            "false",
                            "--trainer.logger.init_args.save_dir",
                            tmp,
                            "--trainer.callbacks+=benchmarks.step_overhead.StepTimer",
                            f"--trainer.callbacks.skip={args.skip}",
                            *extra,
                        ]
                    )
                # the callback's class as train.py imports it (this file runs as __main__)
                times["cli"] = import_module("benchmarks.step_overhead").StepTimer.last
        bare_all.append(times["bare"])
        cli_all.append(times["cli"])
        ratios.append(times["cli"] / times["bare"])
        print(
            f"repeat {repeat}: bare {1000 * times['bare']:.1f} ms/step, train.py {1000 * times['cli']:.1f} ms/step, "
            f"ratio {ratios[-1]:.2f}",
            flush=True,
        )
    print(
        f"train.py / bare = {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] over "
        f"{args.repeats} repeats; bare {1000 * statistics.median(bare_all):.1f} ms/step, "
        f"train.py {1000 * statistics.median(cli_all):.1f} ms/step (medians); "
        f"torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
