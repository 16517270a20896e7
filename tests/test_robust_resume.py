"""Fault tolerance and reproducibility: a run killed with SIGKILL mid-epoch resumes to the same result."""

import json
import os
import random
import signal
import subprocess
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from jsonargparse import Namespace
from lightning.fabric.utilities.seed import pl_worker_init_function
from robust_helpers import (
    REPO,
    STEPS_PER_EPOCH,
    main_in_process,
    read_metrics,
    run_dirs,
    shared_run,
    subprocess_env,
    tiny_config,
    train_command,
)
from torch.utils.data import DataLoader

from vit.artifact.io import AtomicCheckpointIO
from vit.data import TwoCirclesDataModule
from vit.data.resumable import ResumableSampler
from vit.training.preflight import resolve_resume
from vit.training.run_dir import find_last_checkpoint


@pytest.fixture
def reference(tmp_path_factory, monkeypatch) -> Path:
    """The uninterrupted tiny run (trained once per session, in this process)."""
    return shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)


def final_weights(run_dir: Path) -> dict:
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3 * STEPS_PER_EPOCH  # last.ckpt holds the end of training
    return checkpoint["state_dict"]


def pause_at_step_13(marker: Path) -> list[str]:
    """The test aid that holds training after its 13th step (step 12's checkpoint on disk), touching `marker`."""
    return [
        "--trainer.callbacks+=robust_helpers.PauseAtStep",
        "--trainer.callbacks.step=13",
        f"--trainer.callbacks.marker={marker}",
    ]


def wait_until_paused(process: subprocess.Popen, marker: Path) -> None:
    deadline = time.monotonic() + 150
    while not marker.exists():
        assert process.poll() is None, f"training ended before step 13:\n{''.join(filter(None, process.communicate()))}"
        assert time.monotonic() < deadline, "training did not reach step 13 in time"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_stopped_mid_epoch_then_ckpt_path_last_ends_like_an_uninterrupted_run(
    stop, tmp_path, reference, monkeypatch, caplog
):
    config = tiny_config(tmp_path)  # checkpoint every 3 steps; 8 steps per epoch
    metrics, marker = tmp_path / "metrics.jsonl", tmp_path / "paused"
    record = [
        "--test_after_fit",
        "false",
        "--trainer.callbacks+=robust_helpers.RecordMetrics",
        f"--trainer.callbacks.path={metrics}",
    ]
    # The test aid holds the process after its 13th step (the 5th batch of epoch 1), where the last
    # step checkpoint is that of step 12; the signal itself is a real one from here. A SIGKILL loses
    # step 13; SIGTERM and SIGINT let it finish and write last.ckpt at step 13.
    process = subprocess.Popen(
        train_command("fit", "--config", str(config), *record, *pause_at_step_13(marker)),
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_paused(process, marker)
        [run_dir] = run_dirs(tmp_path)
        checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == 12
        position = checkpoint["TwoCirclesDataModule"]["train_position"]
        assert position == {"epoch": 1, "batches_done": 12 - STEPS_PER_EPOCH}
        os.kill(process.pid, stop)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.communicate()
    if stop == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL
        stopped_at = 12
    else:
        assert process.returncode == 128 + stop, output  # what shells report for a process a signal stopped
        last = run_dir / "checkpoints" / "last.ckpt"
        assert f"stopped by {stop.name} after training step 13: {last} holds step 13" in output
        assert "test/acc" not in output  # the test after fit did not run
        stopped_at = 13
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == stopped_at
    assert checkpoint["TwoCirclesDataModule"]["train_position"] == {
        "epoch": 1,
        "batches_done": stopped_at - STEPS_PER_EPOCH,
    }
    # A temporary file left by a kill during a checkpoint write is removed when the run resumes.
    leftover = run_dir / "checkpoints" / ".last.ckpt.0123456789abcdef.tmp"
    leftover.write_bytes(b"PK\x03\x04 half a checkpoint")

    # The resumed part runs in this process: a fresh Trainer either way, without another import cost.
    main_in_process(["fit", "--config", str(config), "--ckpt_path", "last", *record], monkeypatch)
    assert f"Resuming the run in {run_dir.resolve()}" in caplog.text
    assert not leftover.exists()
    assert run_dirs(tmp_path) == [run_dir]  # continued in the stopped run's folder, not a new version
    assert (run_dir / "config.yaml").is_file() and (run_dir / "config_resume1.yaml").is_file()
    info = json.loads((run_dir / "run_info_resume1.json").read_text())
    assert info["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")

    expected, got = read_metrics(reference / "metrics.jsonl"), read_metrics(metrics)
    assert sorted(got) == [0, 1, 2]
    for epoch in range(3):
        for key in ("val/loss", "val/acc"):
            assert got[epoch][key] == pytest.approx(expected[epoch][key], abs=1e-6), (epoch, key)
    [reference_dir] = run_dirs(reference)
    torch.testing.assert_close(final_weights(run_dir), final_weights(reference_dir), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_same_config_and_seed_give_identical_metrics_and_record_how_to_rerun(tmp_path, reference, monkeypatch):
    config = tiny_config(tmp_path)
    main_in_process(
        [
            "fit",
            "--config",
            str(config),
            "--test_after_fit",
            "false",
            "--trainer.callbacks+=robust_helpers.RecordMetrics",
            f"--trainer.callbacks.path={tmp_path / 'metrics.jsonl'}",
        ],
        monkeypatch,
    )
    assert read_metrics(tmp_path / "metrics.jsonl") == read_metrics(reference / "metrics.jsonl")
    [run_dir], [reference_dir] = run_dirs(tmp_path), run_dirs(reference)
    torch.testing.assert_close(final_weights(run_dir), final_weights(reference_dir), rtol=0, atol=0)

    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["seed"] == 0 and info["subcommand"] == "fit" and info["resumed_from"] is None
    assert info["packages"]["torch"] == torch.__version__
    assert "--config" in info["command"] and str(config) in info["command"]
    assert info["devices"]["world_size"] == 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert info["git"]["commit"] == head.stdout.strip()


def test_resumable_sampler_shards_permutes_per_epoch_and_starts_mid_epoch():
    data = list(range(10))
    shards = [list(ResumableSampler(data, num_replicas=2, rank=r, seed=3)) for r in (0, 1)]
    assert sorted(shards[0] + shards[1]) == data  # the two processes split one permutation
    sampler = ResumableSampler(data, seed=3)
    epoch0 = list(sampler)
    assert sorted(epoch0) == data and epoch0 == list(sampler)  # a pure function of (seed, epoch)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0
    sampler.resume_at(1, 4)
    assert list(sampler) == epoch1[4:]
    assert list(sampler) == epoch1  # the skip applies to one iteration only
    with pytest.raises(ValueError, match="cannot resume at epoch=1, sample 11 of 10"):
        sampler.resume_at(1, 11)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")  # stands for any failure half-way through writing


def test_atomic_checkpoint_io_leaves_the_old_file_whole_when_a_save_fails(tmp_path):
    io, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "step": 1}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "step": 2, "bad": Unpicklable()}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no temporary file left behind
    assert (path.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _config(tmp_path, ckpt_path, version=None) -> Namespace:
    logger = Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=str(tmp_path / "runs"), name="tiny", version=version),
    )
    return Namespace(ckpt_path=ckpt_path, trainer=Namespace(logger=logger))


def test_ckpt_path_last_finds_the_newest_run_and_continues_in_its_folder(tmp_path):
    for i, version in enumerate(["version_0", "version_1", "version_2"]):
        folder = tmp_path / "runs" / "tiny" / version / "checkpoints"
        folder.mkdir(parents=True)
        if version != "version_2":  # version_2 was a run that never wrote a checkpoint
            (folder / "last.ckpt").write_bytes(b"x")
            os.utime(folder / "last.ckpt", (1000 + 100 * (1 - i), 1000 + 100 * (1 - i)))  # version_0 is newer
    (tmp_path / "runs" / "tiny" / "version_1" / "checkpoints" / ".last.ckpt.x1.tmp").write_bytes(b"x")
    newest = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert find_last_checkpoint(tmp_path / "runs" / "tiny") == newest

    config = _config(tmp_path, "last")
    resolve_resume("fit", config)
    assert config.ckpt_path == str(newest) and config.trainer.logger.init_args.version == "version_0"

    older = tmp_path / "runs" / "tiny" / "version_1" / "checkpoints" / "epoch00.ckpt"
    older.write_bytes(b"x")
    config = _config(tmp_path, str(older))  # branching from an older checkpoint leaves its run alone
    resolve_resume("fit", config)
    assert config.ckpt_path == str(older) and config.trainer.logger.init_args.version is None

    config = _config(tmp_path, "last", version=1)  # a fixed version searches only that run
    resolve_resume("fit", config)
    assert config.ckpt_path.endswith("version_1/checkpoints/last.ckpt")

    config = _config(tmp_path, "last")
    resolve_resume("test", config)  # validate/test/predict use the file but log a run of their own
    assert config.ckpt_path == str(newest) and config.trainer.logger.init_args.version is None

    empty = _config(tmp_path / "elsewhere", "last")
    with pytest.warns(UserWarning, match="no last.ckpt under .*starting a new run"):
        resolve_resume("fit", empty)
    assert empty.ckpt_path is None


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_whole_process_group_with_loader_workers_stops_in_one_line(
    stop, tmp_path, reference, monkeypatch
):
    # `timeout`, SLURM and Ctrl-C signal every process of the job: the loader workers get the signal too. The
    # pause is past the warmup (8 steps), like the test above's.
    config = tiny_config(tmp_path, num_workers=2)
    marker = tmp_path / "paused"
    process = subprocess.Popen(
        train_command("fit", "--config", str(config), "--test_after_fit", "false", *pause_at_step_13(marker)),
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # its own process group, as a job's
    try:
        wait_until_paused(process, marker)
        [run_dir] = run_dirs(tmp_path)
        assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 12
        os.killpg(process.pid, stop)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + stop, stderr
    last = run_dir / "checkpoints" / "last.ckpt"
    assert [line for line in stderr.splitlines() if "stopped" in line or "killed" in line] == [
        f"stopped by {stop.name} after training step 13: {last} holds step 13. Resume with the same command and "
        "--ckpt_path last (or --ckpt_path <that file>)"
    ]
    assert "Traceback" not in stderr and "DataLoader worker" not in stderr
    assert torch.load(last, weights_only=True)["global_step"] == 13

    main_in_process(["fit", "--config", str(config), "--ckpt_path", "last", "--test_after_fit", "false"], monkeypatch)
    assert run_dirs(tmp_path) == [run_dir]
    [reference_dir] = run_dirs(reference)
    torch.testing.assert_close(final_weights(run_dir), final_weights(reference_dir), rtol=0, atol=1e-6)


class _WorkerState(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> tuple:
        ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]
        return ignored, random.random(), float(np.random.rand()), float(torch.rand(()))


def test_loader_workers_ignore_stop_signals_and_are_seeded_as_lightning_seeds_them():
    data = TwoCirclesDataModule(num_train=8, num_val=8, num_test=8, batch_size=1, num_workers=2)
    data.test_set = _WorkerState()
    ours = list(data.test_dataloader())
    lightnings = DataLoader(
        _WorkerState(),
        batch_size=1,
        num_workers=2,
        generator=data.loader_generator(),
        worker_init_fn=partial(pl_worker_init_function, rank=0),
    )  # what Lightning adds alone
    assert [ignored for ignored, *_ in ours] == [[torch.tensor([True])] * 2] * 2
    assert [draws for _, *draws in ours] == [draws for _, *draws in lightnings]
    assert ours[0][1:] != ours[1][1:]  # each worker draws its own numbers


def test_sgd_with_a_step_schedule_stopped_after_an_epoch_and_resumed_ends_like_an_uninterrupted_run(
    tmp_path, monkeypatch
):
    """timm's optimizer and schedule by name resume exactly: the rates follow the update count, and the run that
    stopped after its first epoch and went on to the third has the uninterrupted run's weights and rates."""
    options = ["--model.opt", "sgd", "--model.lr", "0.05", "--model.sched", "step", "--model.warmup_epochs", "0.5"]
    options += ["--model.decay_epochs", "1", "--model.decay_rate", "0.5", "--test_after_fit", "false"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    main_in_process(["fit", "--config", str(tiny_config(whole)), *options], monkeypatch)
    for epochs, resume in ((1, []), (3, ["--ckpt_path", "last"])):
        main_in_process(["fit", "--config", str(tiny_config(split, max_epochs=epochs)), *options, *resume], monkeypatch)
    [uninterrupted], [resumed] = (run_dirs(root) for root in (whole, split))
    ours, theirs = (torch.load(d / "checkpoints" / "last.ckpt", weights_only=True) for d in (resumed, uninterrupted))
    assert ours["global_step"] == theirs["global_step"] == 3 * STEPS_PER_EPOCH
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    # The rate of the next update, written out: a warmup of half an epoch, then halved every epoch after it.
    warmup = STEPS_PER_EPOCH // 2
    expected = 0.05 * 0.5 ** ((3 * STEPS_PER_EPOCH - (warmup - 1)) // STEPS_PER_EPOCH)
    for checkpoint in (ours, theirs):
        assert [g["lr"] for g in checkpoint["optimizer_states"][0]["param_groups"]] == pytest.approx([expected] * 2)
        assert checkpoint["optimizer_states"][0]["param_groups"][0]["momentum"] == 0.9  # timm's sgd
