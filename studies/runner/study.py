"""The study's order of work (``run_study``): the shortcut audit, the calibration, every run fanned out
through an executor (``forked``, or submitit's) at most ``parallel`` at a time, then the reports (see
``studies.runner``'s ``__main__`` for the whole story)."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import submitit
from submitit.core.utils import FailedJobError

from studies.runner import forked, processes
from studies.runner.grid import Run, calibration_plan, choose_lr, load_config, plan
from studies.runner.lock import lock_out_dir, make_dirs, stop_on_sigterm
from studies.runner.report import write_reports
from studies.runner.run import PREDICTIONS, StudyJob, code_revision, failed
from studies.runner.runs_csv import StudyError, append_row, read_rows
from vit.commands import Progress
from vit.training.run_lock import printable

ROOT = Path(__file__).resolve().parents[2]  # the repository root, which holds the `studies` package


class RunsFailed(RuntimeError):
    """Runs of the study failed, each named with why; the others finished and their rows are kept."""


def slurm_parameters(*, partition: str | None, time_min: int, gpus: int, cpus: int, parallel: int) -> dict:
    """The ``submitit.SlurmExecutor`` parameters of ``--executor slurm``: one array, ``parallel`` tasks at a time."""
    params = {
        "job_name": "vit-study",
        "time": time_min,
        "gpus_per_node": gpus,
        "cpus_per_task": cpus,
        "array_parallelism": parallel,
        "nodes": 1,
        "ntasks_per_node": 1,
    }
    if partition:
        params["partition"] = partition
    return params


def make_executor(kind: str, folder: Path, *, timeout_min: int, slurm: dict | None = None, server=None):
    """An executor: ``forked`` (processes forked here from ``server``, ``forked.serving``), or submitit's ``local``
    (a fresh interpreter per run), ``debug`` (in this process) or ``slurm`` (a job array)."""
    if kind == "forked":
        return forked.ForkedExecutor(folder, timeout_min=timeout_min, server=server)
    if kind == "slurm":
        executor = submitit.SlurmExecutor(folder=folder)
        executor.update_parameters(**(slurm or {}))
        return executor
    executor = submitit.AutoExecutor(folder=folder, cluster=kind)
    executor.update_parameters(timeout_min=timeout_min)
    return executor


def fan_out(
    executor, jobs: list[StudyJob], *, parallel: int, on_done, on_submit=lambda job, handle: None, poll_s: float = 1.0
) -> list[tuple[str, str]]:
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
            line = failure_line(err, job.run)
            failures.append((job.run.key, line))
            print(
                f"FAILED {job.run.key} (model {job.run.model}, seed {job.run.seed}): {line} (log: "
                f"{getattr(handle, 'paths', None) and handle.paths.stderr})",
                file=sys.stderr,
                flush=True,
            )
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
        local = getattr(executor, "cluster", None) in ("local", "forked")
        _cancel([handle for _, handle in running], wait_s=10.0 if local else 0)
        raise
    return failures


RULE = "----------------------\n"  # what frames the job's traceback in submitit's FailedJobError


def failure_line(err: BaseException, run: Run) -> str:
    """Why ``run`` failed, in one line: the error's last line; for a job in another process (submitit's
    ``FailedJobError``, whose message ends with the paths of its logs) the last line of its traceback, the exception.
    Without what the caller prints itself: the type's name and the run's name of ``run_one``'s errors (``failed``)."""
    text = str(err)
    if isinstance(err, FailedJobError) and text.count(RULE) >= 2:
        text = text.split(RULE)[1]
    line = printable((text.strip().splitlines() or [type(err).__name__])[-1])
    name, _, message = line.partition(": ")
    if not all(part.isidentifier() for part in name.split(".")):  # no type in front: the error itself (debug)
        message = line
    return message.removeprefix(failed(run)) if message.startswith(failed(run)) else line


def _cancel(handles: list, *, wait_s: float) -> None:
    """Cancel submitit jobs and wait up to ``wait_s`` for them to end.

    A local job is killed with its processes (``processes.kill_process_tree``): submitit cancels it with
    SIGINT, which its controller ignores when the study was started in the background from a
    script (such jobs inherit an ignored SIGINT), and its task shrugs off SIGTERM. A stopped run is
    redone from scratch, so nothing is lost by not letting it finish its step.
    """
    for handle in handles:
        try:
            if isinstance(handle, submitit.LocalJob):
                processes.kill_process_tree(int(handle.job_id))  # the job id of a local job is its controller's PID
            else:
                handle.cancel(check=False)
        except Exception:  # noqa: BLE001 - e.g. no scancel here: cancel what can be cancelled
            pass
    deadline = time.monotonic() + wait_s
    while handles and time.monotonic() < deadline and not all(handle.done() for handle in handles):
        time.sleep(0.1)


@contextmanager
def studies_importable():
    """The repository root on ``PYTHONPATH`` while jobs are submitted.

    A job's process unpickles its ``StudyJob`` by importing ``studies.runner.run``, and ``studies``
    is not installed with ``vit``: it is found from the repository root. submitit's local controller
    and ``sbatch`` both copy this process's environment as a job is submitted, so the jobs find it
    wherever they start.
    """
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([previous] if previous else [])])
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous


def run_study(
    config: str | Path,
    *,
    max_runs: int | None = None,
    progress: bool = True,
    executor: str = "forked",
    parallel: int = 2,
    slurm: dict | None = None,
    timeout_min: int = 120,
) -> list[dict]:
    """Run every unfinished run of the study (at most ``max_runs`` of them) through an executor
    (``make_executor``), ``parallel`` at a time, then write the reports.

    With a calibration in the config, its runs come first; the learning rate of each family is then
    chosen on their validation accuracy (``choose_lr``) and fixed for the study's runs. Holds
    ``<out_dir>/study.lock`` meanwhile (``lock_out_dir``); SIGTERM raises ``Stopped``.
    """
    cfg = load_config(config)
    out_dir = Path(cfg["out_dir"])
    make_dirs("out_dir", out_dir)
    # the runs' server forked first: before the lock (which it must not hold) and before any computation
    server = forked.serving() if executor == "forked" else nullcontext()
    with server as runs_server, lock_out_dir(out_dir) as record_job, stop_on_sigterm():
        return _run_study(
            cfg,
            server=runs_server,
            max_runs=max_runs,
            progress=progress,
            executor=executor,
            parallel=parallel,
            slurm=slurm,
            timeout_min=timeout_min,
            record_job=record_job,
        )


def _run_study(
    cfg: dict,
    *,
    max_runs: int | None,
    progress: bool,
    executor: str,
    parallel: int,
    slurm: dict | None,
    timeout_min: int,
    record_job,
    server,
) -> list[dict]:
    out_dir, log_dir = Path(cfg["out_dir"]), Path(cfg["log_dir"])
    csv_path = out_dir / "runs.csv"
    read_rows(csv_path)  # a damaged row stops the study here, before any work
    make_dirs("log_dir", log_dir)
    revision = code_revision()
    pool = make_executor(executor, log_dir / "submitit", timeout_min=timeout_min, slurm=slurm, server=server)
    budget = [max_runs]

    def execute(runs: list[Run], desc: str) -> None:
        """``_execute`` with this study's settings and budget."""
        _execute(
            runs,
            desc,
            cfg=cfg,
            pool=pool,
            parallel=parallel,
            progress=progress,
            record_job=record_job,
            revision=revision,
            budget=budget,
        )

    if "shortcuts" in cfg and not (out_dir / "shortcuts.csv").exists():
        _audit_shortcuts(cfg, out_dir)
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


def _audit_shortcuts(cfg: dict, out_dir: Path) -> None:
    """Write ``shortcuts.csv`` and ``shortcuts.md``: the shortcut audit of every task."""
    # Measure the shortcuts before the models: every task, on fresh draws.
    from studies.runner import shortcuts

    shortcuts.write([r for t in shortcuts.TASKS for r in shortcuts.audit(t, **cfg["shortcuts"])], out_dir)
    print(f"shortcut audit written to {printable(out_dir / 'shortcuts.md')}", flush=True)


def _todo(runs: list[Run], csv_path: Path, budget: list) -> list[Run]:
    """The runs with no row in ``csv_path``, at most ``budget[0]`` of them (None: all), taken off the budget."""
    done = {row["key"]: row for row in read_rows(csv_path)}
    for run in runs:
        row = done.get(run.key)
        if row is not None and row["fingerprint"] != run.fingerprint:
            raise StudyError(
                f"{printable(csv_path)} holds run {run.key} made with other settings (fingerprint "
                f"{row['fingerprint']}, the config now gives {run.fingerprint}); use a new "
                f"out_dir/log_dir for the new settings, or move the old results away"
            )
    todo = [run for run in runs if run.key not in done]
    if budget[0] is not None:
        todo, budget[0] = todo[: budget[0]], budget[0] - min(budget[0], len(todo))
    return todo


def _execute(
    runs: list[Run],
    desc: str,
    *,
    cfg: dict,
    pool,
    parallel: int,
    progress: bool,
    record_job,
    revision: str,
    budget: list,
) -> None:
    """Run the unfinished ones of ``runs`` (``_todo``) on ``pool``, a row in ``runs.csv`` as each finishes."""
    out_dir, log_dir = Path(cfg["out_dir"]), Path(cfg["log_dir"])
    csv_path = out_dir / "runs.csv"
    todo = _todo(runs, csv_path, budget)
    # a line per finished run, whole lines in a log file (where a redrawn bar would leave carriage returns)
    bar = Progress(desc, len(runs), "runs", done=len(runs) - len(todo), every=0) if progress else None

    def on_done(job: StudyJob, row: dict) -> None:
        append_row(csv_path, row)
        line = f"{row['key']}: test/acc {row['test_acc']}  val/acc {row['val_acc']}  ({row['train_time_s']} s)"
        if bar is None:
            print(line, flush=True)
            return
        bar.write(line, file=sys.stdout)
        bar.update()

    def on_submit(job: StudyJob, handle) -> None:
        if isinstance(handle, (submitit.LocalJob, forked.ForkedJob)):  # a local job's id is its (controller's) PID
            record_job(int(handle.job_id), job.run.key)

    jobs = [
        StudyJob(run, cfg["base_config"], str(log_dir), cfg["threads"], revision, str(out_dir / PREDICTIONS))
        for run in todo
    ]
    try:
        with studies_importable():
            poll_s = getattr(pool, "poll_s", 1.0)
            failures = fan_out(pool, jobs, parallel=parallel, on_done=on_done, on_submit=on_submit, poll_s=poll_s)
    finally:
        if bar is not None:
            bar.close()  # also when stopped: the message that follows starts a line of its own
    if failures:
        raise RunsFailed(
            f"{len(failures)} runs failed (rerun the same command to retry them): "
            + "; ".join(f"{k}: {e}" for k, e in failures)
        )
