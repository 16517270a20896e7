"""What the grid runner's tests share: a tiny study's config, the smallest CNN's one-run config and the messages it
gives, and a made-up row of runs.csv."""

from pathlib import Path

import yaml

from studies.runner import grid

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "studies/relation/configs/tiny.yaml"
KEY = "position-diagonal-cnn-rf5-n32-s0"  # the one run of `cnn_config`
REFUSED = "strides=(1, 0) is not allowed: expected 2 ints >= 1, one per width"  # ConvNet's own message


def tiny() -> dict:
    """The tiny study's config (`studies/relation/configs/tiny.yaml`), as a fresh dict."""
    return yaml.safe_load(TINY.read_text())


def tiny_config(tmp_path: Path, cfg: dict | None = None, **changes) -> Path:
    """`cfg` (the tiny study's by default) with its paths under `tmp_path` and `changes`, as `tmp_path/study.yaml`."""
    cfg = {**(tiny() if cfg is None else cfg)}
    cfg.update(
        base_config=str(ROOT / "studies/relation/configs/base.yaml"),
        out_dir=str(tmp_path / "results"),
        log_dir=str(tmp_path / "runs"),
        **changes,
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def without_audit(cfg: dict) -> dict:
    """`cfg` without its learning-rate calibration and shortcut audit: its runs only, at the rates it gives."""
    return {k: v for k, v in cfg.items() if k not in ("calibration", "shortcuts")}


def cnn_config(tmp_path: Path, strides=(1, 1), seeds=(0,)) -> Path:
    """One one-batch run per seed of the smallest CNN at a fixed rate (``strides``: its ConvNet's), no calibration."""
    cnn = {"class_path": "vit.models.ConvNet", "init_args": {"widths": [4, 4], "strides": list(strides)}}
    return tiny_config(
        tmp_path,
        without_audit(tiny()),
        seeds=list(seeds),
        models={"cnn-rf5": cnn},
        families={"cnn": ["cnn-rf5"]},
        lrs={"cnn": 3e-3},
        experiments=[
            {"name": "position", "tasks": ["diagonal"], "models": ["cnn-rf5"], "num_train": [32], "train_samples": 32}
        ],
    )


def fake_row(run: grid.Run) -> dict:
    """The row run_one would write for ``run``, made up without training (for tests of the runner's bookkeeping)."""
    return {
        "key": run.key,
        "experiment": run.experiment,
        "task": run.task,
        "model": run.model,
        "num_train": run.num_train,
        "seed": run.seed,
        "train_region": run.train_region,
        "test_region": run.test_region,
        "lr": run.lr,
        "params": 100,
        "flops_per_image": 1000,
        "epochs": run.epochs,
        "steps": 1,
        "batch_size": 32,
        "train_time_s": "0.1",
        "train_acc": "0.5000",
        "val_acc": "0.5000",
        "test_acc": "0.5000",
        "test_by_distance": '{"10":[16,32]}',
        "fingerprint": run.fingerprint,
        "revision": "",
        "finished_at": "2026-11-25T08:00:00",
    }
