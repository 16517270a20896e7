"""A grid study on the dashboards: TensorBoard run names that sort by cell, and W&B runs grouped by cell
when READABLE_VIT_STUDY_WANDB asks for them (the loggers a run is given, and one real offline W&B run)."""

import json
import sys
import time
from itertools import groupby
from pathlib import Path

import pytest
import yaml

from studies.runner import grid
from studies.runner import run as run_module
from studies.runner.cells import per_cell

ROOT = Path(__file__).resolve().parents[1]
LRS = {"vit": 1e-3, "cnn": 3e-3}


def tiny_plan(tmp_path: Path) -> list[grid.Run]:
    cfg = yaml.safe_load((ROOT / "studies/relation/configs/tiny.yaml").read_text())
    cfg.update(
        base_config=str(ROOT / "studies/relation/configs/base.yaml"),
        out_dir=str(tmp_path / "results"),
        log_dir=str(tmp_path / "runs"),
        seeds=[0, 1, 2, 10],
    )  # 10: s10 sorts before s2, inside its cell
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cfg = grid.load_config(path)
    return grid.plan(cfg, LRS) + grid.calibration_plan(cfg)


def test_run_names_sort_by_cell_and_the_cell_key_is_the_reports_cell(tmp_path):
    runs = tiny_plan(tmp_path)
    for run in runs:
        loggers = run_module.run_overrides(run, tmp_path / "runs", environ={})["trainer"]["logger"]
        assert [entry["class_path"].rsplit(".", 1)[1] for entry in loggers] == ["TensorBoardLogger", "CSVLogger"]
        assert {entry["init_args"]["name"] for entry in loggers} == {run.key}
        assert run.key == f"{run_module.cell_key(run)}-s{run.seed}"
    # TensorBoard lists runs by name: the runs of one cell are next to each other.
    cells_in_name_order = [run_module.cell_key(run) for run in sorted(runs, key=lambda r: r.key)]
    blocks = [cell for cell, _ in groupby(cells_in_name_order)]
    assert len(blocks) == len(set(blocks))
    # The same cells as the report's (calibration aside): (experiment, task, model, num_train), every seed.
    rows = [
        {
            "experiment": r.experiment,
            "task": r.task,
            "model": r.model,
            "num_train": r.num_train,
            "seed": r.seed,
            "key": r.key,
        }
        for r in runs
    ]
    by_report = sorted(sorted(r["key"] for r in group) for group in per_cell(rows).values())
    by_key = {}
    for run in runs:
        if run.experiment != grid.CALIBRATE:
            by_key.setdefault(run_module.cell_key(run), []).append(run.key)
    assert by_report == sorted(sorted(keys) for keys in by_key.values())
    assert all(len(keys) == 4 for keys in by_report)  # the four seeds


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_the_environment_adds_a_wandb_logger_grouped_by_cell(tmp_path, mode):
    run = next(r for r in tiny_plan(tmp_path) if r.seed == 2 and r.experiment == "relation")
    loggers = run_module.run_overrides(run, tmp_path / "runs" / "relation", environ={"READABLE_VIT_STUDY_WANDB": mode})[
        "trainer"
    ]["logger"]
    assert [entry["class_path"] for entry in loggers[:2]] == [
        "lightning.pytorch.loggers.TensorBoardLogger",
        "lightning.pytorch.loggers.CSVLogger",
    ]
    assert loggers[2] == {
        "class_path": "vit.training.loggers.WandbLogger",
        "init_args": {
            "project": "study-relation",
            "name": run.key,
            "group": run.key.removesuffix("-s2"),
            "save_dir": str(tmp_path / "runs" / "relation"),
            "offline": mode == "offline",
            "config": {"cell": run.key.removesuffix("-s2"), "seed": 2},
        },
    }
    assert run.key.endswith("-n32-s2")


def test_an_unknown_wandb_mode_is_refused_with_the_allowed_values(tmp_path):
    run = tiny_plan(tmp_path)[0]
    with pytest.raises(
        ValueError,
        match=r"READABLE_VIT_STUDY_WANDB='yes' is not allowed: expected one of "
        r"\['offline', 'online'\]",
    ):
        run_module.run_overrides(run, tmp_path, environ={"READABLE_VIT_STUDY_WANDB": "yes"})


def test_a_study_run_on_wandb_offline_carries_its_cell_as_group_and_its_seed(tmp_path, monkeypatch):
    """Through train.py as the study calls it (a `validate` of the untrained model: no training)."""
    import wandb
    from dashboard_helpers import wandb_records

    from vit.training.cli import main

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    run = next(r for r in tiny_plan(tmp_path) if r.seed == 1 and r.experiment == "relation")
    log_dir = tmp_path / "runs" / "relation"
    overrides = run_module.run_overrides(run, log_dir, environ={"READABLE_VIT_STUDY_WANDB": "offline"})
    path = tmp_path / "study_overrides.yaml"
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    try:
        cli = main(
            [
                "validate",
                "--config",
                str(ROOT / "studies/relation/configs/base.yaml"),
                "--config",
                str(path),
                "--trainer.accelerator=cpu",
            ]
        )
        tensorboard, _, logger = cli.trainer.loggers
        assert Path(tensorboard.log_dir) == log_dir / run.key
        run_dir = Path(logger.experiment.dir).parent
    finally:
        wandb.finish()

    assert run_dir.parent == log_dir / "wandb"
    deadline = time.monotonic() + 30  # finish() can return before W&B's service has written the last records
    while True:
        records = wandb_records(next(run_dir.glob("*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "the offline run was never closed"
        time.sleep(0.2)
    (header,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (header.project, header.run_group, header.display_name) == (
        "study-relation",
        run.key.removesuffix("-s1"),
        run.key,
    )
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    config.update({item.key: json.loads(item.value_json) for item in header.config.update})
    assert (config["cell"], config["seed"], config["seed_everything"]) == (run.key.removesuffix("-s1"), 1, 1)


def test_each_study_run_closes_its_wandb_run_so_the_next_one_in_the_process_gets_its_own(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    first = wandb.init(mode="offline", dir=tmp_path, project="study-x")
    run_module.finish_wandb_run()
    assert wandb.run is None
    second = wandb.init(mode="offline", dir=tmp_path, project="study-x")
    try:
        assert second.id != first.id
    finally:
        run_module.finish_wandb_run()
    run_module.finish_wandb_run()  # nothing open: nothing to do
    assert wandb.run is None
