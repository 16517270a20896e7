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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from importlib import import_module

import lightning as L
import torch
import torch.nn.functional as F
import yaml
from timm.optim import param_groups_weight_decay

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
    model = build(config["model"]["backbone"], img_size=data.img_size, in_chans=data.in_chans,
                  num_classes=data.num_classes)
    data.setup("fit")
    x, y = data.train_set.images.contiguous(), data.train_set.labels
    hp = config["model"]
    groups = param_groups_weight_decay(model, hp.get("weight_decay", 0.05), no_weight_decay_list=model.no_weight_decay())
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    sys.argv = sys.argv[:1]  # LightningCLI below reads its arguments from the list it is given, not from here
    config = yaml.safe_load(open(args.config))
    ratios, bare_all, cli_all = [], [], []
    for repeat in range(args.repeats):
        times = {}
        for which in (("bare", "cli") if repeat % 2 == 0 else ("cli", "bare")):
            if which == "bare":
                times["bare"] = bare_seconds_per_step(config, args.steps, args.skip)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    train_main(["fit", "--config", args.config, "--trainer.max_steps", str(args.steps),
                                "--trainer.limit_val_batches", "0", "--test_after_fit", "false",
                                "--trainer.logger.init_args.save_dir", tmp,
                                "--trainer.callbacks+=benchmarks.step_overhead.StepTimer",
                                f"--trainer.callbacks.skip={args.skip}", *extra])
                # the callback's class as train.py imports it (this file runs as __main__)
                times["cli"] = import_module("benchmarks.step_overhead").StepTimer.last
        bare_all.append(times["bare"])
        cli_all.append(times["cli"])
        ratios.append(times["cli"] / times["bare"])
        print(f"repeat {repeat}: bare {1000 * times['bare']:.1f} ms/step, train.py {1000 * times['cli']:.1f} ms/step, "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"train.py / bare = {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] over {args.repeats} "
          f"repeats; bare {1000 * statistics.median(bare_all):.1f} ms/step, train.py {1000 * statistics.median(cli_all):.1f}"
          f" ms/step (medians); torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
