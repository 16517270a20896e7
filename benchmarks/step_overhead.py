"""Seconds per training step through `train.py` against the bare step of the same model, in one process.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --config configs/same_different/vit.yaml

The bare step is forward, cross-entropy, backward, AdamW step on batches sliced from the training
tensors, nothing else. The `train.py` step is `vit.training.cli.main(["fit", ...])` on the same
config (its loggers, callbacks, data loader and LightningModule), timed by a callback from the
start of step `--skip` to the end of the last step, so that building the trainer and the first
steps do not count. Validation is off (it is not a training step). Between the two, Lightning's floor: the bare
step and batches run by a bare `Trainer` (`BareStep`: the loss returned, nothing logged; no logger, checkpoint or
callback but the timer), what any LightningModule pays; and the floor with one `self.log` a step, whose difference
from the floor is what one such call costs. The four are timed alternately, each first in turn, `--repeats` times;
each repeat gives the ratios to bare, whose medians and ranges are printed. Any `train.py` option can be appended
after `--` (e.g. `-- --trainer.enable_progress_bar false`) to see what it costs. With `--study CONFIG --model NAME
--per_step`, the same for a run of the study (its `train.py` configs as `studies.runner.run.run_one` passes them, its
loggers and callbacks; figures in docs/benchmarks.md):

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --study studies/relation/configs/tiny.yaml \
        --model vit-learned --per_step --num_train 8000 --steps 500 --skip 20 --repeats 8

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

from benchmarks import spread
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


def bare_parts(config: dict):
    """`(model, x, y, optimizer, batch)`: the config's backbone, its training tensors, AdamW over timm's weight-decay
    groups, the batch size."""
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
    return model, x, y, optimizer, config["data"]["init_args"]["batch_size"]


def bare_seconds_per_step(config: dict, steps: int, skip: int) -> float:
    """The same backbone and data, in a plain loop."""
    model, x, y, optimizer, batch = bare_parts(config)
    for step in range(steps):
        if step == skip:
            start = time.perf_counter()
        idx = torch.randint(len(y), (batch,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (time.perf_counter() - start) / (steps - skip)


class SlicedBatches:
    """`steps` random batches sliced from `x` and `y`, drawn as the bare loop draws them (no DataLoader)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int, steps: int) -> None:
        self.x, self.y, self.batch, self.steps = x, y, batch, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            idx = torch.randint(len(self.y), (self.batch,))
            yield self.x[idx], self.y[idx]


class BareStep(L.LightningModule):
    """The bare step inside Lightning's loop, with the bare loop's optimizer: the loss returned, and logged with
    `self.log` (as `train/loss`, on step and epoch) when `logged`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, logged: bool = False) -> None:
        super().__init__()
        self.model, self.optimizer, self.logged = model, optimizer, logged

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if self.logged:
            self.log("train/loss", loss.detach(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer


def floor_seconds_per_step(config: dict, steps: int, skip: int, logged: bool = False) -> float:
    """Lightning's floor: the bare step and batches run by a bare `Trainer` (no logger, checkpoint, progress bar or
    callback but the timer); what any LightningModule pays on top of its own work. `logged`: and one `self.log`."""
    model, x, y, optimizer, batch = bare_parts(config)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StepTimer(skip)],
    )
    trainer.fit(BareStep(model, optimizer, logged), SlicedBatches(x, y, batch, steps))
    return StepTimer.last


def cli_seconds_per_step(configs: list[str], extra: list[str], steps: int, skip: int) -> float:
    """A step of `train.py fit --config C...` (validation and the test off), from step `skip` to the last."""
    args = [arg for config in configs for arg in ("--config", config)]
    train_main(
        [
            "fit",
            *args,
            "--trainer.max_steps",
            str(steps),
            "--trainer.limit_val_batches",
            "0",
            "--test_after_fit",
            "false",
            "--trainer.callbacks+=benchmarks.step_overhead.StepTimer",
            f"--trainer.callbacks.skip={skip}",
            *extra,
        ]
    )
    return import_module("benchmarks.step_overhead").StepTimer.last  # the class as train.py imports it (__main__)


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


def bare_config_of(run) -> dict:
    """What `bare_seconds_per_step` takes of a study run: its data, its backbone and its learning rate."""
    return {"data": run.overrides["data"], "model": {"backbone": run.overrides["model"]["backbone"], "lr": run.lr}}


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
    bare_config = bare_config_of(run)
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


def main_steps(args, bare_config: dict, cli_args) -> None:
    """Seconds per step, alternately (each first in turn): the bare step, Lightning's floor (without and with one
    `self.log`) and train.py, where
    `cli_args(folder)` gives train.py's configs and options for a run in a fresh `folder`."""
    times: dict[str, list[float]] = {"bare": [], "floor": [], "floor + 1 log": [], "train.py": []}
    for repeat in range(args.repeats):
        kinds = list(times)[repeat % 4 :] + list(times)[: repeat % 4]
        for which in kinds:
            if which == "bare":
                times[which].append(bare_seconds_per_step(bare_config, args.steps, args.skip))
            elif which.startswith("floor"):
                logged = which != "floor"
                times[which].append(floor_seconds_per_step(bare_config, args.steps, args.skip, logged))
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    times[which].append(cli_seconds_per_step(*cli_args(Path(tmp)), args.steps, args.skip))
        shown = ", ".join(f"{k} {1000 * v[-1]:.2f}" for k, v in times.items())
        print(f"repeat {repeat} ({kinds[0]} first): {shown} ms/step", flush=True)
    for which in list(times)[1:]:
        ratios = [t / b for t, b in zip(times[which], times["bare"])]
        print(f"{which} / bare = {spread(ratios)} over {args.repeats} repeats")
    one_log = [1000 * (a - b) for a, b in zip(times["floor + 1 log"], times["floor"])]
    print(f"one self.log a step costs {spread(one_log)} ms (floor + 1 log - floor, paired)")
    medians = ", ".join(f"{k} {1000 * statistics.median(v):.2f}" for k, v in times.items())
    print(f"medians: {medians} ms/step; torch threads {torch.get_num_threads()}")


def study_steps(args, extra: list[str]) -> None:
    """`main_steps` for the study's run of `--model` (`study_run`): its train.py configs as `run_one` passes them."""
    from studies.runner.grid import load_config
    from studies.runner.run import run_overrides

    cfg = load_config(args.study)
    run = study_run(cfg, args.model, args.num_train)
    bare_config = bare_config_of(run)

    def cli_args(folder: Path) -> tuple[list[str], list[str]]:
        overrides = folder / "study_overrides.yaml"
        overrides.write_text(yaml.safe_dump(run_overrides(run, folder), sort_keys=False))
        return [cfg["base_config"], str(overrides)], extra

    main_steps(args, bare_config, cli_args)


def main(argv: list[str] | None = None) -> None:
    parser = EitherSpelling(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a train.py config: time its steps through train.py")
    parser.add_argument("--study", help="a study config: time whole study runs of --model instead")
    parser.add_argument("--model", help="with --study: the study model to run")
    parser.add_argument("--num_train", type=int, default=16000, help="with --study: training pairs (2 epochs)")
    parser.add_argument("--per_step", action="store_true", help="with --study: the run's steps, as with --config")
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
        return study_steps(args, extra) if args.per_step else main_study(args)
    config = yaml.safe_load(open(args.config))
    main_steps(
        args, config, lambda folder: ([args.config], [*extra, "--trainer.logger.init_args.save_dir", str(folder)])
    )


if __name__ == "__main__":
    main()
