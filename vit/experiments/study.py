"""The relation study: a resumable grid of train.py runs fanned out by submitit, and its reports.

    python -m vit.experiments.study --config configs/study/relation.yaml

The study config (YAML) names a base train.py config, the models (backbone blocks as in any
train.py config), the seeds, the training budget, and a list of experiments; each experiment is a
grid ``task x model x num_train x seed`` with one train/test placement region. One invocation:

1. the shortcut audit (``vit.experiments.shortcuts``) into ``out_dir``, if the config asks for it;
2. the learning-rate calibration runs, if the config has ``families`` and ``calibration``; the
   best rate of each family on the validation split is then fixed for its models (``choose_lr``);
3. every run of the grid;
4. the reports (``vit.experiments.report``).

Every run is one ``vit.training.cli.main(["fit", "--config", base, "--config", overrides])`` call,
the same Lightning code as ``python train.py fit``: the best checkpoint (by ``val/acc``) is tested
after fit, then scored again per distance between the two parts, and its per-image predictions go
to ``<out_dir>/predictions/<run key>.npz`` (what the report re-bins by visibility,
``vit.experiments.visibility``). Logs (TensorBoard and CSV) and checkpoints go to
``<log_dir>/<run key>/``.

Executors (submitit; ``--executor``): ``local`` runs each run in a subprocess, ``--parallel`` (2)
at a time with ``threads`` torch threads each; ``debug`` runs them one by one in this process (the
tests); ``slurm`` submits one job array (``--partition``, ``--gpus``, ``--cpus``, ``--timeout-min``;
at most ``--parallel`` tasks at a time), in which Lightning's own SLURM auto-requeue is off and
submitit requeues a preempted run (``StudyJob`` is checkpointable). Only this process writes
``runs.csv``, as the runs finish.

Resuming. A run is keyed by its grid coordinates (experiment, task, model, num_train, seed; the
learning rate too for calibration runs). Its row is appended to ``runs.csv`` in one write, only
after it has finished, so the CSV never holds a partial run. On start, every key already in the
CSV is skipped. A run that was killed midway has no row: it is redone from scratch, and its
unfinished log directory is moved aside first (to ``<run key>.unfinished-N``), never deleted or
overwritten. A row records a fingerprint of the run's settings and the code revision; if the
config changed since, the study stops with an error instead of mixing the two in one table. A row
that is damaged (cut short, edited by hand) stops the study too, naming its line.

One invocation at a time per ``out_dir``: it holds ``<out_dir>/study.lock`` (``fcntl.flock``,
released by the kernel when the process ends, ``kill -9`` included) and a second one is refused.
After a ``kill -9``, the local jobs it had started run on: the lock names them
(``vit.experiments.processes``), and the next invocation refuses to start while one still runs.
On SIGTERM or Ctrl-C the study cancels its runs under way (submitit's local jobs would outlive it)
and exits with 128 + the signal; its finished rows are kept, and the same command goes on.
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

import submitit
import yaml

from vit.experiments import processes
from vit.experiments.grid import CALIBRATE, Run, calibration_plan, choose_lr, load_config, plan
from vit.experiments.report import write_reports

COLUMNS = (
    "key", "experiment", "task", "model", "num_train", "seed", "train_region", "test_region", "lr",
    "params", "flops_per_image", "epochs", "steps", "batch_size", "train_time_s", "train_acc", "val_acc", "test_acc",
    "test_by_distance", "shift_region", "shift_acc", "shift_by_distance", "fingerprint", "revision", "finished_at",
)
INT_COLUMNS = ("num_train", "seed", "params", "flops_per_image", "epochs", "steps", "batch_size")
FLOAT_COLUMNS = ("lr", "train_time_s", "train_acc", "val_acc", "test_acc")
EXECUTORS = ("local", "debug", "slurm")
LOCK_NAME = "study.lock"  # in out_dir, held by the invocation running the study (lock_out_dir)
PREDICTIONS = "predictions"  # <out_dir>/predictions/<run key>.npz: each run's per-image test predictions


# ----------------------------------------------------------------------------- running


class StudyError(ValueError):
    """The study cannot go on as asked (runs.csv damaged or made with other settings, out_dir unusable or in use):
    ``main`` prints it as one ``error:`` line, before any run starts."""


class Stopped(BaseException):
    """SIGTERM reached the study. A BaseException, like KeyboardInterrupt, so that no ``except
    Exception`` on the way (a failed run, Lightning's handlers) takes it for an error and goes on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _row_problem(fields: list[str]) -> str | None:
    """What makes one line of runs.csv unusable (None: nothing), checked field by field as run_one writes them."""
    if len(fields) != len(COLUMNS):
        short = " (cut short?)" if len(fields) < len(COLUMNS) else ""
        return f"it has {len(fields)} of the {len(COLUMNS)} fields{short}"
    row = dict(zip(COLUMNS, fields))
    for name in INT_COLUMNS + FLOAT_COLUMNS:
        try:
            (int if name in INT_COLUMNS else float)(row[name])
        except ValueError:
            return f"{name}={row[name]!r} is not a number"
    for name in ("test_by_distance",) + (("shift_by_distance",) if row["shift_region"] else ()):
        try:
            if not isinstance(json.loads(row[name]), dict):
                raise ValueError
        except ValueError:
            return f"{name} is not the JSON mapping run_one writes (cut short?)"
    if not re.fullmatch(r"[0-9a-f]{12}", row["fingerprint"]):
        return f"fingerprint={row['fingerprint']!r} is not 12 hex digits"
    try:
        time.strptime(row["finished_at"], "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return f"finished_at={row['finished_at']!r} is not a time (cut short?)"
    lr = float(row["lr"]) if row["experiment"] == CALIBRATE else None
    key = Run(row["experiment"], row["task"], row["model"], int(row["num_train"]), int(row["seed"]), "", "", 0, {}, "",
              lr).key
    if row["key"] != key:
        return f"its key {row['key']!r} does not match its columns (they make {key!r})"
    return None


def read_rows(csv_path: Path) -> list[dict]:
    """The finished runs in ``runs.csv`` (empty if there is none yet), every line checked.

    A damaged line (cut short, edited by hand) raises ``StudyError`` naming the file and the line:
    deleting it makes the study redo that run. run_one's fields never hold a newline, so every
    line is one row.
    """
    if not csv_path.exists():
        return []
    lines = csv_path.read_text(errors="replace").splitlines()
    if not lines:
        return []
    header = next(csv.reader([lines[0]]), [])
    if tuple(header) != COLUMNS:
        raise StudyError(f"{csv_path} line 1 is not the header this study writes ({len(header)} columns, expected "
                         f"{len(COLUMNS)}: {','.join(COLUMNS)}): restore it, or use a new out_dir if another "
                         f"version of the study wrote this file")
    rows, seen = [], {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = next(csv.reader([line]))
        problem = _row_problem(fields)
        if problem is not None:
            raise StudyError(f"{csv_path} line {number} is damaged: {problem}. Delete that line to redo its run "
                             f"({fields[0] or 'no key'}), then rerun the same command")
        if fields[0] in seen:
            raise StudyError(f"{csv_path} line {number} repeats run {fields[0]} of line {seen[fields[0]]}: "
                             f"delete one of the two lines")
        seen[fields[0]] = number
        rows.append(dict(zip(COLUMNS, fields)))
    return rows


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row in a single ``write`` on an O_APPEND descriptor, then fsync: all of it or none."""
    header = not csv_path.exists() or csv_path.stat().st_size == 0
    lines = []
    if not header:
        with csv_path.open("rb") as f:  # a last line without its newline (an editor's) must not take this row in
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                lines.append("\n")
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


def run_overrides(run: Run, log_dir: Path, environ: dict | None = None) -> dict:
    """The run's train.py overrides, with its loggers. Under a submitit SLURM job, Lightning's own
    SLURM auto-requeue is switched off, so that only submitit requeues a preempted run, and the
    accelerator is Lightning's choice (the GPU the job was given), not the base config's CPU."""
    environ = os.environ if environ is None else environ
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
    if environ.get("SUBMITIT_EXECUTOR") == "slurm":
        overrides["trainer"]["accelerator"] = "auto"
        overrides["trainer"]["plugins"] = [{"class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment",
                                           "init_args": {"auto_requeue": False}}]
    return overrides


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
        return torch.cat([backbone(dataset.images[i:i + batch_size]).argmax(1)
                          for i in range(0, len(dataset), batch_size)])


def accuracy_by_distance(dataset, preds) -> dict[str, list[int]]:
    """``{distance: [correct, total]}`` of the predictions ``preds`` (``predict_images``) on ``dataset``
    (see ``part_distance``)."""
    correct = preds == dataset.labels
    dist = part_distance(dataset)
    return {str(int(d)): [int(correct[dist == d].sum()), int((dist == d).sum())] for d in dist.unique()}


def save_predictions(path: Path, splits: dict) -> None:
    """Per-image predictions ``{split: (dataset, preds)}`` as one compressed ``.npz``, written atomically.

    Per split ``s``: ``s_index``, ``s_label``, ``s_pred``, ``s_distance`` (``part_distance``), and for
    same-different ``s_positions`` and ``s_shape_ids``: what ``vit.experiments.visibility.rebin`` needs.
    Written to a temporary name, then renamed: a reader never sees half a file, and a run that is
    redone replaces the file of its killed attempt (which had no row in runs.csv).
    """
    import numpy as np

    arrays = {}
    for split, (dataset, preds) in splits.items():
        arrays.update({f"{split}_index": np.arange(len(dataset), dtype=np.int32),
                       f"{split}_label": dataset.labels.numpy().astype(np.int8),
                       f"{split}_pred": preds.numpy().astype(np.int8),
                       f"{split}_distance": part_distance(dataset).numpy().astype(np.int16)})
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


def run_one(run: Run, *, base_config: str, log_dir: Path, revision: str = "",
            predictions_dir: Path | None = None) -> dict:
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
    backbone, data = cli.model.backbone, cli.datamodule
    test_acc = float(trainer.callback_metrics["test/acc"])
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
        shift = {"shift_region": run.shift_region,
                 "shift_acc": f"{sum(c for c, _ in shift_by_distance.values()) / len(shifted):.4f}",
                 "shift_by_distance": json.dumps(shift_by_distance, separators=(",", ":"))}
    if predictions_dir is not None:
        save_predictions(Path(predictions_dir) / f"{run.key}.npz", splits)
    return {
        "key": run.key, "experiment": run.experiment, "task": run.task, "model": run.model,
        "num_train": run.num_train, "seed": run.seed, "train_region": run.train_region,
        "test_region": run.test_region, "lr": cli.model.hparams.lr,
        "params": sum(p.numel() for p in backbone.parameters()),
        "flops_per_image": flops_per_image(backbone, data.in_chans, data.img_size),
        "epochs": trainer.current_epoch, "steps": trainer.global_step,
        "batch_size": run.overrides["data"]["init_args"]["batch_size"],
        "train_time_s": f"{seconds:.1f}", "train_acc": f"{_last_train_acc(run_dir):.4f}",
        "val_acc": f"{float(best) if best is not None else float('nan'):.4f}",
        "test_acc": f"{test_acc:.4f}", "test_by_distance": json.dumps(by_distance, separators=(",", ":")), **shift,
        "fingerprint": run.fingerprint, "revision": revision, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def code_revision() -> str:
    """The git commit of the code, ``-dirty`` if the package, configs or train.py differ from it ("" outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "vit", "configs", "train.py"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("-dirty" if dirty else "")


@contextmanager
def lock_out_dir(out_dir: Path):
    """Hold ``<out_dir>/study.lock`` while the study runs; a second invocation on the same folder is refused.

    Two at once would each take the other's runs under way for killed ones, move their folders
    aside and start them again. ``fcntl.flock``: the kernel releases the lock when its process
    ends, ``kill -9`` included, so a lock file left behind never blocks; the PID in it (emptied on
    a clean end) tells that the last invocation was killed. Yields ``record_job(pid, run key)``,
    which writes a local job into the lock as it starts: the jobs of a killed invocation run on,
    and while one does, the next invocation is refused too (``processes.live_jobs``).
    """
    path = out_dir / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise _unusable("out_dir", out_dir, err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").partition("\n")[0].strip() or "unknown"
            raise StudyError(f"{out_dir} is in use by another study invocation (PID {pid}, lock {path}): wait for it "
                             f"to finish, or stop it (kill {pid}) and rerun; two at once would redo each other's "
                             "runs") from None
        except OSError as err:
            raise StudyError(f"{path} cannot be locked ({err.strerror}): put out_dir on a filesystem with "
                             "locks") from None
        text = os.pread(fd, 1 << 20, 0).decode(errors="replace")
        previous = text.partition("\n")[0].strip()
        if orphans := processes.live_jobs(text):  # a local job's run ignores SIGTERM (submitit): kill -9 stops it
            runs = ", ".join(f"{key} (PIDs {' '.join(map(str, tree))})" for key, tree in orphans)
            pids = " ".join(str(pid) for _, tree in orphans for pid in tree)
            raise StudyError(f"{out_dir}: the study invocation that held {path} (PID {previous or 'unknown'}) was "
                             f"killed, but runs it started still run: {runs}. Their results can no longer be "
                             f"recorded: stop them (kill -9 {pids}) or wait for them to end, then rerun; started "
                             "now, they would run twice in the same folders")
        if previous:
            print(f"taking over {path}: the invocation that held it (PID {previous}) ended without releasing it "
                  "(killed?); its unfinished runs are redone", file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

        def record_job(pid: int, key: str) -> None:
            os.pwrite(fd, processes.job_line(pid, key).encode(), os.fstat(fd).st_size)

        try:
            yield record_job
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: this invocation ended, it was not killed
    finally:
        os.close(fd)  # releases the lock


def _unusable(key: str, path: Path, err: OSError) -> StudyError:
    """The error of a folder from the config that cannot be created or written: one line naming the value."""
    reason = ("it exists and is not a folder" if os.path.exists(path) and not os.path.isdir(path)
              else f"creating {err.filename} failed ({err.strerror})")
    return StudyError(f"{key}={str(path)!r} cannot be used: {reason}; expected a folder that this user can create "
                      "and write in")


def _make_dirs(key: str, path: Path) -> None:
    """Create the config's folder ``key`` and its parents, or raise ``StudyError``, having removed what it created."""
    missing = [p for p in (path, *path.parents) if not os.path.exists(p)]  # the deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        for created in missing:  # rmdir leaves a folder that is not empty (not made here)
            with suppress(OSError):
                created.rmdir()
        raise _unusable(key, path, err) from None


@contextmanager
def stop_on_sigterm():
    """Turn SIGTERM into ``Stopped`` while the study runs (in the main thread; elsewhere nothing changes).

    Python's default would end the process at once, leaving submitit's local jobs running on:
    as an exception, ``fan_out`` cancels them first. Within a run of the debug executor,
    Lightning calls this handler after its own.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_stopped(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StudyJob(submitit.helpers.Checkpointable):
    """One run as a submitit job: train with ``threads`` torch threads, return the CSV row.

    Checkpointable: on preemption or timeout under SLURM, submitit requeues the same call, and
    ``run_one`` moves the unfinished run directory aside and starts the run again.
    """

    def __init__(self, run: Run, base_config: str, log_dir: str, threads: int, revision: str,
                 predictions_dir: str | None = None) -> None:
        self.run, self.base_config, self.log_dir = run, base_config, log_dir
        self.threads, self.revision, self.predictions_dir = threads, revision, predictions_dir

    def __call__(self) -> dict:
        import torch

        torch.set_num_threads(self.threads)
        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
        return run_one(self.run, base_config=self.base_config, log_dir=Path(self.log_dir), revision=self.revision,
                       predictions_dir=self.predictions_dir and Path(self.predictions_dir))


def slurm_parameters(*, partition: str | None, time_min: int, gpus: int, cpus: int, parallel: int) -> dict:
    """The ``submitit.SlurmExecutor`` parameters of ``--executor slurm``: one array, ``parallel`` tasks at a time."""
    params = {"job_name": "vit-study", "time": time_min, "gpus_per_node": gpus, "cpus_per_task": cpus,
              "array_parallelism": parallel, "nodes": 1, "ntasks_per_node": 1}
    if partition:
        params["partition"] = partition
    return params


def make_executor(kind: str, folder: Path, *, timeout_min: int, slurm: dict | None = None):
    """A submitit executor: ``local`` (subprocesses here), ``debug`` (in this process), ``slurm`` (a job array)."""
    if kind == "slurm":
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(**(slurm or {}))
        return executor
    executor = submitit.AutoExecutor(folder=folder, cluster=kind)
    executor.update_parameters(timeout_min=timeout_min)
    return executor


def fan_out(executor, jobs: list[StudyJob], *, parallel: int, on_done, on_submit=lambda job, handle: None,
            poll_s: float = 1.0) -> list[tuple[str, str]]:
    """Run ``jobs`` with at most ``parallel`` in flight, calling ``on_done(job, row)`` in the order they finish
    (and ``on_submit(job, handle)`` as each is submitted).

    Only this process writes ``runs.csv`` (in ``on_done``), so two runs never write it at once. A run
    that fails is reported and skipped; the others go on. Returns ``[(run key, error)]`` of the failures.
    """
    failures: list[tuple[str, str]] = []
    pending, running = list(jobs), []

    def collect(job: StudyJob, handle) -> None:
        try:
            row = handle.result()
        except Exception as err:  # noqa: BLE001 - every failure is reported at the end, with its log
            lines = str(err).strip().splitlines() or [type(err).__name__]
            failures.append((job.run.key, lines[-1]))
            print(f"FAILED {job.run.key}: {lines[-1]} (log: {getattr(handle, 'paths', None) and handle.paths.stderr})",
                  file=sys.stderr, flush=True)
            return
        on_done(job, row)

    try:
        if isinstance(executor, submitit.SlurmExecutor):  # one array; SLURM keeps `array_parallelism` running
            with executor.batch():
                handles = [executor.submit(job) for job in jobs]
            pending, running = [], list(zip(jobs, handles))
            for job, handle in running:
                on_submit(job, handle)
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                handle = executor.submit(job)
                on_submit(job, handle)
                if getattr(executor, "cluster", None) == "debug":
                    collect(job, handle)  # a debug job runs when its result is asked for
                    continue
                running.append((job, handle))
            finished = [(job, handle) for job, handle in running if handle.done()]
            for job, handle in finished:
                running.remove((job, handle))
                collect(job, handle)
            if running and not finished:
                time.sleep(poll_s)
    except BaseException:
        # Stopped (SIGTERM, Ctrl-C): no row of the runs under way would be written, and submitit's
        # local jobs outlive this process, so a rerun would start them again beside the old ones.
        _cancel([handle for _, handle in running], wait_s=10.0 if getattr(executor, "cluster", None) == "local" else 0)
        raise
    return failures


def _cancel(handles: list, *, wait_s: float) -> None:
    """Cancel submitit jobs and wait up to ``wait_s`` for them to end.

    A local job is killed with its processes (``kill_process_tree``): submitit cancels it with
    SIGINT, which its controller ignores when the study was started in the background from a
    script (such jobs inherit an ignored SIGINT), and its task shrugs off SIGTERM. A stopped run is
    redone from scratch, so nothing is lost by not letting it finish its step.
    """
    for handle in handles:
        try:
            if isinstance(handle, submitit.LocalJob):
                kill_process_tree(int(handle.job_id))  # the job id of a local job is its controller's PID
            else:
                handle.cancel(check=False)
        except Exception:  # noqa: BLE001 - e.g. no scancel here: cancel what can be cancelled
            pass
    deadline = time.monotonic() + wait_s
    while handles and time.monotonic() < deadline and not all(handle.done() for handle in handles):
        time.sleep(0.1)


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (``processes.process_tree``)."""
    for member in processes.process_tree(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_study(config: str | Path, *, max_runs: int | None = None, progress: bool = True, executor: str = "local",
              parallel: int = 2, slurm: dict | None = None, timeout_min: int = 120) -> list[dict]:
    """Run every unfinished run of the study (at most ``max_runs`` of them) through a submitit
    executor, ``parallel`` at a time, then write the reports.

    With a calibration in the config, its runs come first; the learning rate of each family is then
    chosen on their validation accuracy (``choose_lr``) and fixed for the study's runs. Holds
    ``<out_dir>/study.lock`` meanwhile (``lock_out_dir``); SIGTERM raises ``Stopped``.
    """
    cfg = load_config(config)
    out_dir = Path(cfg["out_dir"])
    _make_dirs("out_dir", out_dir)
    with lock_out_dir(out_dir) as record_job, stop_on_sigterm():
        return _run_study(cfg, max_runs=max_runs, progress=progress, executor=executor, parallel=parallel,
                          slurm=slurm, timeout_min=timeout_min, record_job=record_job)


def _run_study(cfg: dict, *, max_runs: int | None, progress: bool, executor: str, parallel: int, slurm: dict | None,
               timeout_min: int, record_job) -> list[dict]:
    from tqdm.auto import tqdm

    out_dir, log_dir = Path(cfg["out_dir"]), Path(cfg["log_dir"])
    csv_path = out_dir / "runs.csv"
    read_rows(csv_path)  # a damaged row stops the study here, before any work
    _make_dirs("log_dir", log_dir)
    revision = code_revision()
    pool = make_executor(executor, log_dir / "submitit", timeout_min=timeout_min, slurm=slurm)
    budget = [max_runs]

    def todo_of(runs: list[Run]) -> list[Run]:
        done = {row["key"]: row for row in read_rows(csv_path)}
        for run in runs:
            row = done.get(run.key)
            if row is not None and row["fingerprint"] != run.fingerprint:
                raise StudyError(f"{csv_path} holds run {run.key} made with other settings (fingerprint "
                                 f"{row['fingerprint']}, the config now gives {run.fingerprint}); use a new "
                                 f"out_dir/log_dir for the new settings, or move the old results away")
        todo = [run for run in runs if run.key not in done]
        if budget[0] is not None:
            todo, budget[0] = todo[:budget[0]], budget[0] - min(budget[0], len(todo))
        return todo

    def execute(runs: list[Run], desc: str) -> None:
        todo = todo_of(runs)
        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc=desc, unit="run", disable=not progress)

        def on_done(job: StudyJob, row: dict) -> None:
            append_row(csv_path, row)
            bar.update()
            bar.write(f"{row['key']}: test/acc {row['test_acc']}  val/acc {row['val_acc']}  ({row['train_time_s']} s)")

        def on_submit(job: StudyJob, handle) -> None:
            if isinstance(handle, submitit.LocalJob):  # the job id of a local job is its controller's PID
                record_job(int(handle.job_id), job.run.key)

        jobs = [StudyJob(run, cfg["base_config"], str(log_dir), cfg["threads"], revision, str(out_dir / PREDICTIONS))
                for run in todo]
        try:
            failures = fan_out(pool, jobs, parallel=parallel, on_done=on_done, on_submit=on_submit)
        finally:
            bar.close()  # also when stopped: the message that follows starts a line of its own
        if failures:
            raise RuntimeError(f"{len(failures)} runs failed (rerun the same command to retry them): "
                               + "; ".join(f"{k}: {e}" for k, e in failures))

    if "shortcuts" in cfg and not (out_dir / "shortcuts.csv").exists():
        # Measure the shortcuts before the models: every task, on fresh draws.
        from vit.experiments import shortcuts

        shortcuts.write([r for t in shortcuts.TASKS for r in shortcuts.audit(t, **cfg["shortcuts"])], out_dir)
        print(f"shortcut audit written to {out_dir / 'shortcuts.md'}", flush=True)
    lrs = None
    if "calibration" in cfg:
        execute(calibration_plan(cfg), "calibration runs")
        rows = read_rows(csv_path)
        try:
            lrs = choose_lr(cfg, rows)
        except ValueError:  # stopped by --max-runs before the calibration finished
            if rows:
                write_reports(rows, out_dir, cfg)
            return rows
    execute(plan(cfg, lrs), "study runs")
    rows = read_rows(csv_path)
    if rows:  # none with --max-runs 0 on a new study
        write_reports(rows, out_dir, cfg)
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python -m vit.experiments.study`. A config it cannot use, a damaged runs.csv, an out_dir it cannot
    create or in use (also by the runs of a killed invocation) or nothing to report is one `error:` line
    and exit status 2, before anything runs; SIGTERM and
    Ctrl-C are one line and 128 + the signal; an error during the runs keeps its traceback."""
    parser = argparse.ArgumentParser(prog="python -m vit.experiments.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="study config YAML, e.g. configs/study/relation.yaml")
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many new runs (resume later)")
    parser.add_argument("--report-only", action="store_true", help="rewrite summary and plots from runs.csv, run nothing")
    parser.add_argument("--list", action="store_true", help="print the planned runs and whether each is done")
    parser.add_argument("--executor", choices=EXECUTORS, default="local",
                        help="submitit executor: local subprocesses (default), debug (in this process), slurm (a job array)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2: one per core here)")
    parser.add_argument("--timeout-min", type=int, default=120, help="wall-time limit of one run, in minutes")
    slurm = parser.add_argument_group("slurm", "with --executor slurm")
    slurm.add_argument("--partition", default=None, help="SLURM partition")
    slurm.add_argument("--gpus", type=int, default=1, help="GPUs per run")
    slurm.add_argument("--cpus", type=int, default=8, help="CPU cores per run")
    args = parser.parse_args(argv)
    for name in ("parallel", "timeout_min", "cpus"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected an int >= 1")
    if args.gpus < 0:
        parser.error(f"--gpus={args.gpus} is not allowed: expected an int >= 0")
    if args.max_runs is not None and args.max_runs < 0:
        parser.error(f"--max-runs={args.max_runs} is not allowed: expected an int >= 0")
    try:
        cfg = load_config(args.config)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    csv_path = Path(cfg["out_dir"]) / "runs.csv"
    try:
        if args.list or args.report_only:
            _list_and_report(args, cfg, csv_path)
            return
        slurm_params = slurm_parameters(partition=args.partition, time_min=args.timeout_min, gpus=args.gpus,
                                        cpus=args.cpus, parallel=args.parallel)
        run_study(args.config, max_runs=args.max_runs, executor=args.executor, parallel=args.parallel,
                  slurm=slurm_params, timeout_min=args.timeout_min)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except (Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        print(f"stopped by {signal.Signals(signum).name}: the {len(read_rows(csv_path))} finished runs are kept in "
              f"{csv_path} and the runs under way were stopped; rerun the same command to go on (those are redone)",
              file=sys.stderr)
        raise SystemExit(128 + signum) from None


def _list_and_report(args, cfg: dict, csv_path: Path) -> None:
    """``--list`` and ``--report-only``: read runs.csv, run nothing."""
    rows = read_rows(csv_path)
    if args.list:
        keys = {r["key"] for r in rows}
        runs = calibration_plan(cfg)
        try:
            runs += plan(cfg, choose_lr(cfg, rows) if "calibration" in cfg else None)
        except ValueError:
            print("(the study's runs are planned once the calibration has finished)")
        for run in runs:
            print(f"{'done' if run.key in keys else 'todo'}  {run.key}  epochs={run.epochs}")
        print(f"{sum(r.key in keys for r in runs)}/{len(runs)} runs done")
    if args.report_only:
        if not rows:
            raise StudyError(f"no finished runs in {csv_path.parent} yet (no rows in {csv_path.name}), so there is "
                             f"nothing to report: start the study with python -m vit.experiments.study --config "
                             f"{args.config}")
        write_reports(rows, csv_path.parent, cfg)

if __name__ == "__main__":
    main()
