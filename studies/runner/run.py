"""One run of the study: a ``train.py`` fit and test, re-scored per distance, its predictions and its row."""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import submitit
import yaml

from studies.runner.grid import Run
from vit.training.run_lock import printable

PREDICTIONS = "predictions"  # <out_dir>/predictions/<run key>.npz: each run's per-image test predictions


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


STUDY_WANDB = "READABLE_VIT_STUDY_WANDB"  # offline | online: each run also on W&B, grouped by its cell
WANDB_MODES = ("offline", "online")


class _ErrorLine:
    """stderr as it is, remembering the tail of what was written: the one `error:` line `train.py` prints before it
    exits, which its `SystemExit` does not carry."""

    def __init__(self, stream) -> None:
        self.stream, self.tail = stream, ""

    def write(self, text: str) -> int:
        self.tail = (self.tail + text)[-8192:]
        return self.stream.write(text)

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)

    def error(self) -> str | None:
        lines = [line for line in self.tail.splitlines() if line.startswith("error: ")]
        return printable(lines[-1].removeprefix("error: ")) if lines else None


def failed(run: Run) -> str:
    """How the error of a run that failed begins: the run named by its key, model and seed."""
    return f"run {run.key} (model {run.model}, seed {run.seed}) failed: "


def cell_key(run: Run) -> str:
    """The run's cell, the run key without its seed: the runs that differ only in their seed share it."""
    return run.key.removesuffix(f"-s{run.seed}")


def run_overrides(run: Run, log_dir: Path, environ: dict | None = None) -> dict:
    """The run's train.py overrides, with its loggers. Under a submitit SLURM job, Lightning's own
    SLURM auto-requeue is switched off, so that only submitit requeues a preempted run, and the
    accelerator is Lightning's choice (the GPU the job was given), not the base config's CPU.

    TensorBoard and CSV log every run to ``<log_dir>/<run key>``; the keys sort by cell, then seed.
    With ``READABLE_VIT_STUDY_WANDB=offline`` (or ``online``) in the environment, W&B logs the run
    too: project ``study-<log_dir's name>``, the cell as its group (``cell_key``), the run key as its
    name, the cell and the seed in its config, files under ``<log_dir>/wandb``."""
    environ = os.environ if environ is None else environ
    logger_args = {"save_dir": str(log_dir), "name": run.key, "version": ""}
    overrides = json.loads(json.dumps(run.overrides))
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {**logger_args, "default_hp_metric": False},
        },
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": logger_args},
    ]
    wandb_mode = environ.get(STUDY_WANDB, "")
    if wandb_mode:
        if wandb_mode not in WANDB_MODES:
            raise ValueError(
                f"{STUDY_WANDB}={wandb_mode!r} is not allowed: expected one of {list(WANDB_MODES)} "
                "(or unset, for no W&B)"
            )
        loggers.append(
            {
                "class_path": "vit.training.loggers.WandbLogger",
                "init_args": {
                    "project": f"study-{Path(log_dir).name}",
                    "name": run.key,
                    "group": cell_key(run),
                    "save_dir": str(log_dir),
                    "offline": wandb_mode == "offline",
                    "config": {"cell": cell_key(run), "seed": run.seed},
                },
            }
        )
    overrides["trainer"].update(
        {
            "logger": loggers,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        }
    )
    if environ.get("SUBMITIT_EXECUTOR") == "slurm":
        overrides["trainer"]["accelerator"] = "auto"
        overrides["trainer"]["plugins"] = [
            {
                "class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment",
                "init_args": {"auto_requeue": False},
            }
        ]
    return overrides


def finish_wandb_run() -> None:
    """Close the W&B run a study run opened, if any: in a process that runs several
    (``--executor debug``), the next run's WandbLogger would otherwise log into it."""
    wandb = sys.modules.get("wandb")  # not imported: no W&B run to close
    if wandb is not None and wandb.run is not None:
        wandb.finish()


def flops_per_image(backbone, in_chans: int, img_size: int) -> int:
    """Forward FLOPs of one image, counted by ``torch.utils.flop_counter.FlopCounterMode`` (a multiply-add is 2)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    was_training = backbone.training
    backbone.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        backbone(torch.zeros(1, in_chans, img_size, img_size))
    backbone.train(was_training)
    return int(counter.get_total_flops())


def part_distance(dataset):
    """The distance between the two parts of every sample, in whole pixels: ``span`` for
    same-different (the side of the square holding both shapes), the rounded centre distance otherwise."""
    import torch

    if hasattr(dataset, "span"):
        return dataset.span.long()
    d = dataset.centers[:, 1] - dataset.centers[:, 0]
    return torch.round(torch.hypot(d[:, 0], d[:, 1])).long()


def predict_images(backbone, dataset, batch_size: int = 500):
    """The predicted class `(N,)` of every image of ``dataset`` (the backbone in eval mode, no gradients)."""
    import torch

    backbone.eval()
    with torch.no_grad():
        return torch.cat(
            [backbone(dataset.images[i : i + batch_size]).argmax(1) for i in range(0, len(dataset), batch_size)]
        )


def accuracy_by_distance(dataset, preds) -> dict[str, list[int]]:
    """``{distance: [correct, total]}`` of the predictions ``preds`` (``predict_images``) on ``dataset``
    (see ``part_distance``)."""
    correct = preds == dataset.labels
    dist = part_distance(dataset)
    return {str(int(d)): [int(correct[dist == d].sum()), int((dist == d).sum())] for d in dist.unique()}


def save_predictions(path: Path, splits: dict) -> None:
    """Per-image predictions ``{split: (dataset, preds)}`` as one compressed ``.npz``, written atomically.

    Per split ``s``: ``s_index``, ``s_label``, ``s_pred``, ``s_distance`` (``part_distance``), and for
    same-different ``s_positions`` and ``s_shape_ids``: what ``studies.runner.visibility.rebin`` needs.
    Written to a temporary name, then renamed: a reader never sees half a file, and a run that is
    redone replaces the file of its killed attempt (which had no row in runs.csv).
    """
    import numpy as np

    arrays = {}
    for split, (dataset, preds) in splits.items():
        arrays.update(
            {
                f"{split}_index": np.arange(len(dataset), dtype=np.int32),
                f"{split}_label": dataset.labels.numpy().astype(np.int8),
                f"{split}_pred": preds.numpy().astype(np.int8),
                f"{split}_distance": part_distance(dataset).numpy().astype(np.int16),
            }
        )
        for name in ("positions", "shape_ids"):
            if hasattr(dataset, name):
                arrays[f"{split}_{name}"] = getattr(dataset, name).numpy().astype(np.int16)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        np.savez_compressed(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_one(
    run: Run, *, base_config: str, log_dir: Path, revision: str = "", predictions_dir: Path | None = None
) -> dict:
    """Train and test one grid point through ``vit.training.cli.main``; return its CSV row.

    With ``predictions_dir``, the per-image predictions of the test (and moved test) set go to
    ``<predictions_dir>/<run key>.npz`` (``save_predictions``) before the row is returned.
    """
    from vit.training.cli import main  # imported here so that `--help` and planning stay fast

    run_dir = log_dir / run.key
    if run_dir.exists():  # no row in the CSV, so this is what a killed run left behind
        _move_aside(run_dir)
    overrides = run_overrides(run, log_dir)
    run_dir.mkdir(parents=True)
    overrides_path = run_dir / "study_overrides.yaml"
    overrides_path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    start = time.perf_counter()
    cli = _fit(main, run, base_config, overrides_path)
    seconds = time.perf_counter() - start
    trainer = cli.trainer
    if trainer.interrupted or "test/acc" not in trainer.callback_metrics:
        raise RuntimeError(
            f"run {run.key} did not finish (interrupted={trainer.interrupted}); its logs are in {run_dir}"
        )
    test_acc = float(trainer.callback_metrics["test/acc"])
    by_distance, shift, splits = _distance_scores(run, cli.model.backbone, cli.datamodule, test_acc)
    if predictions_dir is not None:
        save_predictions(Path(predictions_dir) / f"{run.key}.npz", splits)
    return _row(run, cli, run_dir, seconds, test_acc, by_distance, shift, revision)


def _fit(main, run: Run, base_config: str, overrides_path: Path):
    """Fit and test the run through ``main`` (``train.py``'s CLI); return the CLI (its trainer, model and data)."""
    with warnings.catch_warnings():
        # main(args=...) is the documented way to call LightningCLI from Python; its warning is
        # about `python -m studies.runner`'s own sys.argv. TensorBoard and CSV share the run directory.
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        warnings.filterwarnings("ignore", message=".*exists and is not empty")
        stderr = _ErrorLine(sys.stderr)
        try:
            with contextlib.redirect_stderr(stderr):
                return main(args=["fit", "--config", base_config, "--config", str(overrides_path)])
        except SystemExit as stop:
            if stop.code not in (1, 2):  # a signal's exit status: the study's own stop handles it
                raise
            # An error of this run (2: its config, e.g. a value the model's constructor refuses; 1: in training):
            # a failed run naming itself, where a bare SystemExit would end the whole study, naming nothing.
            raise RuntimeError(failed(run) + (stderr.error() or f"train.py exited with status {stop.code}")) from None
        finally:
            finish_wandb_run()


def _distance_scores(run: Run, backbone, data, test_acc: float) -> tuple[dict, dict, dict]:
    """``(by_distance, shift columns, splits)``: the test set re-scored per distance, the moved test set scored."""
    # The tested (best) weights are in the model now; score them again per distance between the parts.
    preds = predict_images(backbone, data.test_set)
    by_distance = accuracy_by_distance(data.test_set, preds)
    recount = sum(c for c, _ in by_distance.values()) / sum(n for _, n in by_distance.values())
    if abs(recount - test_acc) > 1e-4:
        raise RuntimeError(f"run {run.key}: accuracy by distance adds up to {recount:.4f}, test/acc is {test_acc:.4f}")
    shift, splits = {}, {"test": (data.test_set, preds)}
    if run.shift_region:  # the translation test: the same weights on pairs placed in another region
        shifted = data.make_split("test", data.hparams.num_test, run.shift_region)
        splits["shift"] = (shifted, predict_images(backbone, shifted))
        shift_by_distance = accuracy_by_distance(shifted, splits["shift"][1])
        shift = {
            "shift_region": run.shift_region,
            "shift_acc": f"{sum(c for c, _ in shift_by_distance.values()) / len(shifted):.4f}",
            "shift_by_distance": json.dumps(shift_by_distance, separators=(",", ":")),
        }
    return by_distance, shift, splits


def _row(
    run: Run, cli, run_dir: Path, seconds: float, test_acc: float, by_distance: dict, shift: dict, revision: str
) -> dict:
    """The run's row of ``runs.csv``: its settings, its cost and its scores."""
    trainer = cli.trainer
    best = trainer.checkpoint_callback.best_model_score if trainer.checkpoint_callback else None
    backbone, data = cli.model.backbone, cli.datamodule
    return {
        "key": run.key,
        "experiment": run.experiment,
        "task": run.task,
        "model": run.model,
        "num_train": run.num_train,
        "seed": run.seed,
        "train_region": run.train_region,
        "test_region": run.test_region,
        "lr": cli.model.hparams.lr,
        "params": sum(p.numel() for p in backbone.parameters()),
        "flops_per_image": flops_per_image(backbone, data.in_chans, data.img_size),
        "epochs": trainer.current_epoch,
        "steps": trainer.global_step,
        "batch_size": run.overrides["data"]["init_args"]["batch_size"],
        "train_time_s": f"{seconds:.1f}",
        "train_acc": f"{_last_train_acc(run_dir):.4f}",
        "val_acc": f"{float(best) if best is not None else float('nan'):.4f}",
        "test_acc": f"{test_acc:.4f}",
        "test_by_distance": json.dumps(by_distance, separators=(",", ":")),
        **shift,
        "fingerprint": run.fingerprint,
        "revision": revision,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def code_revision() -> str:
    """The git commit of the code, ``-dirty`` if the library, the studies' code and configs, ``configs`` or
    ``train.py`` differ from it ("" outside git). The studies' results are left out: a study writes them."""
    root = Path(__file__).resolve().parents[2]
    code = ["vit", "studies", ":(exclude)studies/*/results/*", "configs", "train.py"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *code], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("-dirty" if dirty else "")


class StudyJob(submitit.helpers.Checkpointable):
    """One run as a submitit job: train with ``threads`` torch threads, return the CSV row.

    Checkpointable: on preemption or timeout under SLURM, submitit requeues the same call, and
    ``run_one`` moves the unfinished run directory aside and starts the run again.
    """

    def __init__(
        self, run: Run, base_config: str, log_dir: str, threads: int, revision: str, predictions_dir: str | None = None
    ) -> None:
        self.run, self.base_config, self.log_dir = run, base_config, log_dir
        self.threads, self.revision, self.predictions_dir = threads, revision, predictions_dir

    def __call__(self) -> dict:
        import torch

        torch.set_num_threads(self.threads)
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
        return run_one(
            self.run,
            base_config=self.base_config,
            log_dir=Path(self.log_dir),
            revision=self.revision,
            predictions_dir=self.predictions_dir and Path(self.predictions_dir),
        )
