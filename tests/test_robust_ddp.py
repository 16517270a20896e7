"""Two processes with Lightning's DDP strategy on the CPU (gloo): metrics agree across processes."""

import pytest
import torch
from robust_helpers import read_metrics, run, run_dirs, tiny_config


@pytest.mark.slow
def test_two_process_ddp_on_cpu_trains_with_synchronised_metrics(tmp_path):
    config = tiny_config(tmp_path)
    metrics = tmp_path / "metrics_rank{rank}.jsonl"
    result = run(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.devices",
            "2",
            "--trainer.strategy",
            "ddp",
            "--trainer.accelerator",
            "cpu",
            "--trainer.callbacks+=robust_helpers.RecordMetrics",
            f"--trainer.callbacks.path={metrics}",
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stderr
    # The test after fit runs in both processes (it is a collective) and prints once.
    assert result.stdout.count("test/acc = ") == 1

    rank0, rank1 = (read_metrics(tmp_path / f"metrics_rank{r}.jsonl") for r in (0, 1))
    assert sorted(rank0) == [0, 1, 2]
    # Each process trains on and validates its own half of the images; the logged metrics are
    # reduced over both processes, so both see the same values.
    assert rank0 == rank1
    assert {"val/loss", "val/acc", "train/loss_step"} <= set(rank0[2])
    # 256 training images, batches of 32 per process: 4 optimizer steps per epoch.
    assert [rank0[e]["step"] for e in range(3)] == [4, 8, 12]

    [run_dir] = run_dirs(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 12
    assert checkpoint["TwoCirclesDataModule"]["train_position"] == {"epoch": 3, "batches_done": 0}
