"""The shared grid runner (studies/runner): the grid and its schedule, the shipped grids (relation, arrangement), and
tiny resumable studies end to end (in this process, as local submitit jobs, killed, stopped, resumed)."""

import csv
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from study_helpers import cnn_config, fake_row, tiny_config

from studies.runner import grid, lock, processes, runs_csv, study
from studies.runner import run as run_module
from studies.runner.__main__ import main as study_main
from studies.runner.cells import model_rf

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    "num_train, expected",
    [
        (500, (16, 4, 0)),
        (2000, (4, 1, 0)),
        (3000, (3, 1, 0)),
        (100, (80, 20, 0)),
        (1200, (7, 1, 0)),
        (4096, (2, 1, 32)),  # 2 epochs of 64 batches, 2 checks per epoch wanted: at batches 32 and 64
        (4000, (2, 1, 21)),  # 63 batches: 2 checks would miss the last batch, so 3 (63 = 3 x 21)
        (8000, (1, 1, 25)),  # 1 epoch of 125 batches, 4 checks wanted: 125 = 5 x 25, so 5 checks
        (32000, (1, 1, 125)),  # 500 batches, 4 checks of 125
        (8128, (1, 1, 0)),
    ],  # 127 batches, a prime: one check, at the end of the epoch
)
def test_schedule_gives_equal_samples_and_validates_after_the_last_step(num_train, expected):
    # epochs = round(8000 / n) but at least 1; validation every max(1, epochs // 4) epochs (epochs
    # rounded up to a multiple of it), or, with fewer than 4 epochs, every val_batches batches.
    epochs, val_every, val_batches = grid.schedule(num_train, train_samples=8000, num_val_checks=4, batch_size=64)
    assert (epochs, val_every, val_batches) == expected
    assert epochs % val_every == 0
    if val_batches:
        assert math.ceil(num_train / 64) % val_batches == 0  # the epoch's last batch is a validation


LRS = {"vit": 1e-3, "cnn": 3e-3}


def test_plan_covers_the_grid_with_unique_keys(tmp_path):
    cfg = grid.load_config(tiny_config(tmp_path))
    calibration = grid.calibration_plan(cfg)
    # each family's model at each of the 2 rates, on the calibration seed
    assert [(r.model, r.lr, r.seed) for r in calibration] == [
        ("vit-learned", 1e-3, 100),
        ("cnn-rf5", 1e-3, 100),
        ("vit-learned", 3e-3, 100),
        ("cnn-rf5", 3e-3, 100),
    ]
    runs = grid.plan(cfg, LRS)
    # relation: 1 task x 2 models, position: 1 x 1; times 2 seeds
    assert len(runs) == (1 * 2 + 1) * 2
    assert len({r.key for r in runs + calibration}) == len(runs) + len(calibration)
    relation = [r for r in runs if r.experiment == "relation"]
    assert {(r.train_region, r.test_region, r.shift_region) for r in relation} == {("left", "left", "right")}
    assert relation[0].overrides["data"] == {
        "class_path": "vit.data.SameDifferentDataModule",
        "init_args": {
            "num_train": 32,
            "num_val": 32,
            "num_test": 32,
            "batch_size": 32,
            "seed": 0,
            "train_region": "left",
            "test_region": "left",
        },
    }
    position = [r for r in runs if r.experiment == "position"]
    assert {(r.task, r.shift_region, r.overrides["data"]["class_path"]) for r in position} == {
        ("diagonal", None, "vit.data.TwoCirclesDataModule")
    }
    # The experiment's own budget: 32 images (1 epoch) against the study's 64 (2 epochs).
    assert {r.epochs for r in position} == {1} and {r.epochs for r in relation + calibration} == {2}
    assert {(r.model, r.overrides["model"]["lr"]) for r in runs} == {("vit-learned", 1e-3), ("cnn-rf5", 3e-3)}
    # The second test placement is part of what a finished row was made with.
    moved = grid.Run(**{**relation[0].__dict__, "shift_region": "all"})
    assert moved.key == relation[0].key and moved.fingerprint != relation[0].fingerprint
    with pytest.raises(ValueError, match="calibrates its learning rates: pass lrs"):
        grid.plan(cfg)


def test_fixed_rates_replace_the_calibration(tmp_path):
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    del cfg["calibration"]
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump({**cfg, "lrs": LRS}))
    fixed = grid.load_config(path)
    assert grid.calibration_plan(fixed) == []
    assert {(r.model, r.overrides["model"]["lr"]) for r in grid.plan(fixed)} == {
        ("vit-learned", 1e-3),
        ("cnn-rf5", 3e-3),
    }
    path.write_text(yaml.safe_dump({**cfg, "lrs": {"vit": 1e-3}}))
    with pytest.raises(
        ValueError,
        match=r"lrs=\{'vit': 0.001\} is not allowed: expected one rate in \(0, 1\) "
        r"for each family",
    ):
        grid.load_config(path)
    # The shipped side check: the study's relation experiment for the ViT, twice the steps, a fixed rate.
    long = grid.load_config(ROOT / "studies/relation/configs/relation_long.yaml")
    runs = grid.plan(long)
    assert len(runs) == 2 and {(r.model, r.overrides["model"]["lr"]) for r in runs} == {("vit-learned", 1e-3)}
    assert {r.epochs * r.num_train // long["batch_size"] for r in runs} == {4000}
    assert {(r.train_region, r.test_region, r.shift_region) for r in runs} == {("left", "left", "right")}


def test_an_experiments_data_options_reach_the_data_module_and_its_fingerprint():
    cfg = grid.load_config(ROOT / "studies/arrangement/configs/arrangement.yaml")
    runs = {r.key: r for r in grid.plan(cfg)}
    ood = runs["span_ood-arrangement-cnn-rf45-n64000-s0"]
    plain = runs["relation-arrangement-cnn-rf45-n64000-s0"]
    held = runs["held_out-same_different-cnn-rf11-max-n64000-s0"]
    assert ood.overrides["data"]["class_path"] == "studies.runner.arrangement.ArrangementDataModule"
    assert {k: ood.overrides["data"]["init_args"][k] for k in ("train_max_span", "test_min_span")} == {
        "train_max_span": 20,
        "test_min_span": 21,
    }
    assert "task" not in ood.overrides["data"]["init_args"]
    assert "train_max_span" not in plain.overrides["data"]["init_args"]
    assert held.overrides["data"]["init_args"]["held_out_shape"] == 3
    assert ood.fingerprint != plain.fingerprint
    from vit.registry import data_module  # the plan's data module is one checkpoints can name

    data = data_module(ood.overrides["data"]["class_path"])(**ood.overrides["data"]["init_args"])
    data.setup("test")
    assert int(data.test_set.span.min()) == 21


def test_choose_lr_takes_the_best_validation_accuracy_and_the_smaller_rate_on_ties(tmp_path):
    cfg = grid.load_config(tiny_config(tmp_path))
    val = {
        ("vit-learned", 1e-3): "0.60",
        ("vit-learned", 3e-3): "0.75",
        ("cnn-rf5", 1e-3): "0.70",
        ("cnn-rf5", 3e-3): "0.70",
    }
    rows = [{"key": r.key, "val_acc": val[(r.model, r.lr)]} for r in grid.calibration_plan(cfg)]
    assert grid.choose_lr(cfg, rows) == {"vit": 3e-3, "cnn": 1e-3}
    with pytest.raises(ValueError, match="calibration run calibrate-same_different-cnn-rf5-lr0.003-n32-s100 has not"):
        grid.choose_lr(cfg, rows[:-1])


def test_default_study_is_the_documented_grid():
    # The relation study (studies/relation/README.md, configs/relation.yaml): 5 seeds in every cell; one
    # learning rate per family from 2 rates x 3 calibration seeds; 2000 optimiser steps of 64 images
    # for every relation and calibration run, 200 for every run of the absolute-position task.
    cfg = grid.load_config(ROOT / "studies/relation/configs/relation.yaml")
    calibration = grid.calibration_plan(cfg)
    assert len(calibration) == 12 and {r.seed for r in calibration} == {100, 101, 102}
    assert {r.seed for r in calibration}.isdisjoint(cfg["seeds"])
    assert {(r.model, r.lr) for r in calibration} == {
        (m, lr) for m in ("vit-learned", "cnn-rf45") for lr in (1e-3, 2e-3)
    }
    runs = grid.plan(cfg, LRS)
    assert len(runs) == 23 * 5 and len({r.key for r in runs}) == 115
    cells: dict[tuple, set] = {}
    for r in runs:
        cells.setdefault((r.experiment, r.task, r.model), set()).add(r.seed)
    assert all(seeds == {0, 1, 2, 3, 4} for seeds in cells.values())
    vits = {f"vit-{pos}{pool}" for pos in ("learned", "sincos1d", "sincos2d", "none") for pool in ("", "-cls")}
    cnns = {"cnn-rf11", "cnn-rf11-max", "cnn-rf11-mlp", "cnn-rf13", "cnn-rf21", "cnn-rf29", "cnn-rf45", "cnn-rf45-wide"}
    assert {m for (e, t, m) in cells if e == "relation"} == vits | cnns
    assert {m for (e, t, m) in cells if e == "position"} == {
        "vit-learned",
        "vit-sincos1d",
        "vit-sincos2d",
        "vit-none",
        "cnn-rf21",
        "cnn-rf21-circular",
        "cnn-rf21-valid",
    }
    assert {m: model_rf(cfg, m) for m in sorted(cnns)} == {
        "cnn-rf11": 11,
        "cnn-rf11-max": 11,
        "cnn-rf11-mlp": 11,
        "cnn-rf13": 13,
        "cnn-rf21": 21,
        "cnn-rf29": 29,
        "cnn-rf45": 45,
        "cnn-rf45-wide": 45,
    }
    # The readout controls are cnn-rf11 with one thing changed; the wide variant is cnn-rf45 twice as wide.
    args = {m: cfg["models"][m]["init_args"] for m in cnns}
    assert {k: v for k, v in args["cnn-rf11-max"].items() if k != "pool"} == args["cnn-rf11"]
    assert args["cnn-rf11-max"]["pool"] == "max" and args["cnn-rf11-mlp"]["head"] == "mlp"
    assert args["cnn-rf45-wide"] == {**args["cnn-rf45"], "widths": [64] * 7}
    # Every ViT is the recipe of configs/same_different/vit.yaml, but for its pooling and position encoding.
    recipe = yaml.safe_load((ROOT / "configs/same_different/vit.yaml").read_text())["model"]["backbone"]["init_args"]
    for m in vits:
        vit_args = cfg["models"][m]["init_args"]
        assert {k: v for k, v in vit_args.items() if k not in ("pool", "pos_embed")} == {
            k: v for k, v in recipe.items() if k not in ("pool", "pos_embed")
        }
        assert vit_args["pool"] == ("cls" if m.endswith("-cls") else "mean")
    steps = {"relation": 2000, "position": 200, grid.CALIBRATE: 2000}
    for r in runs + calibration:
        trainer = r.overrides["trainer"]
        assert r.epochs * r.num_train // cfg["batch_size"] == steps[r.experiment]  # equal steps within an experiment
        assert trainer["max_epochs"] % trainer["check_val_every_n_epoch"] == 0
        assert r.overrides["model"]["lr"] in (LRS["vit"], LRS["cnn"], *cfg["calibration"]["lrs"])
        assert r.shift_region == ("right" if r.experiment == "relation" else None)
        if r.experiment == "relation":
            assert (r.train_region, r.test_region) == ("left", "left")
            assert r.overrides["model"]["warmup_epochs"] == 0.2  # the recipe's 200 steps
    # The runs go in the order of the claims: the core relation cells, the receptive-field series and
    # the MLP head, the other ViTs, the 200-step runs, then the dearest cell (cnn-rf45-wide).
    assert [r.model for r in runs[:6]] == [
        "vit-learned",
        "vit-none",
        "cnn-rf11",
        "cnn-rf11-max",
        "cnn-rf21",
        "cnn-rf45",
    ]
    assert [r.experiment for r in runs] == ["relation"] * 75 + ["position"] * 35 + ["relation"] * 5
    assert {r.model for r in runs[-5:]} == {"cnn-rf45-wide"}
    # The comparisons named before the runs: one family per question, each pair of models in its experiment.
    assert set(cfg["comparisons"]["relation"]) == {
        "readout",
        "capacity",
        "vit_against_cnn",
        "position_encoding",
        "pooling",
        "receptive_field",
    }
    assert ["cnn-rf11", "cnn-rf11-max"] in cfg["comparisons"]["relation"]["readout"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seeds": []}, r"seeds=\[\] is not allowed"),
        (
            {"experiments": []},
            (
                r"experiments=\[\] is not allowed: expected a non-empty list of experiments \(each "
                r"a mapping with name, tasks, models, num_train\)"
            ),
        ),
        (
            {"experiments": [{"name": "a", "tasks": ["diagonl"], "models": ["cnn-rf5"], "num_train": [8]}]},
            r"tasks='diagonl' is not allowed: expected one of "
            r"\['diagonal', 'relative', 'same_different', 'arrangement'\]",
        ),
        (
            {"experiments": [{"name": "a", "tasks": ["diagonal"], "models": ["resnet"], "num_train": [8]}]},
            r"models='resnet' is not allowed: expected one of \['vit-learned', 'cnn-rf5'\]",
        ),
        (
            {
                "experiments": [
                    {
                        "name": "a",
                        "tasks": ["same_different"],
                        "models": ["cnn-rf5"],
                        "num_train": [8],
                        "test_region": "border",
                    }
                ]
            },
            r"test_region \(task same_different\)='border' is not allowed: expected one of \['all', 'left', 'right'\]",
        ),
        ({"epochs": 3}, r"unknown keys \['epochs'\]"),
        (
            {"families": {"vit": ["vit-learned"]}},
            r"models \['cnn-rf5'\] are in no family, so no learning rate would be calibrated",
        ),
        (
            {
                "calibration": {
                    "task": "same_different",
                    "num_train": 32,
                    "seed": 0,
                    "lrs": [1e-3],
                    "models": {"vit": "vit-learned", "cnn": "cnn-rf5"},
                }
            },
            r"calibration: seed=0 is one of the study's seeds \[0, 1\]",
        ),
        (
            {
                "calibration": {
                    "task": "same_different",
                    "num_train": 32,
                    "seed": 100,
                    "lrs": [2.0],
                    "models": {"vit": "vit-learned", "cnn": "cnn-rf5"},
                }
            },
            r"lrs=\[2.0\] is not allowed",
        ),
        (
            {
                "calibration": {
                    "task": "same_different",
                    "num_train": 32,
                    "seed": 100,
                    "seeds": [101],
                    "lrs": [1e-3],
                    "models": {"vit": "vit-learned", "cnn": "cnn-rf5"},
                }
            },
            r"calibration: give either seed \(one\) or seeds \(a list\), got both \(100 and \[101\]\)",
        ),
        (
            {
                "calibration": {
                    "task": "same_different",
                    "num_train": 32,
                    "seeds": [100, 1],
                    "lrs": [1e-3],
                    "models": {"vit": "vit-learned", "cnn": "cnn-rf5"},
                }
            },
            r"calibration: seed=1 is one of the study's seeds \[0, 1\]",
        ),
        (
            {"comparisons": {"relation": {"readout": [["cnn-rf5", "cnn-rf9"]]}}},
            r"comparisons.relation.readout='cnn-rf9' is not allowed: expected one of \['vit-learned', 'cnn-rf5'\]",
        ),
        (
            {"comparisons": {"relation": {"readout": [["cnn-rf5", "cnn-rf5"]]}}},
            r"comparisons.relation.readout=\[\['cnn-rf5', 'cnn-rf5'\]\] is not allowed: expected a non-empty list",
        ),
        ({"shortcuts": {"num_train": 10, "num_test": 200}}, r"shortcuts.num_train=10 is not allowed"),
        (
            {"lrs": {"vit": 1e-3, "cnn": 1e-3}},
            r"'families' goes with either 'calibration' or fixed 'lrs' \(one of them\), "
            r"got \['families', 'calibration', 'lrs'\]",
        ),
        (
            {
                "experiments": [
                    {
                        "name": "a",
                        "tasks": ["same_different"],
                        "models": ["cnn-rf5"],
                        "num_train": [8],
                        "shift_region": "inner",
                    }
                ]
            },
            r"shift_region \(task same_different\)='inner' is not allowed: expected one of \['all', 'left', 'right'\]",
        ),
        (
            {
                "experiments": [
                    {"name": "a", "tasks": ["diagonal"], "models": ["cnn-rf5"], "num_train": [8], "train_samples": 0}
                ]
            },
            r"train_samples=0 is not allowed: expected an int >= 1",
        ),
        (
            {
                "experiments": [
                    {"name": "a", "tasks": ["diagonal"], "models": ["cnn-rf5"], "num_train": [8]},
                    {"name": "a", "tasks": ["diagonal"], "models": ["cnn-rf5"], "num_train": [16], "train_samples": 16},
                ]
            },
            r"experiment 'a' is listed with .* entries that share a name must share them",
        ),
        (
            {
                "experiments": [
                    {
                        "name": "a",
                        "tasks": ["arrangement"],
                        "models": ["cnn-rf5"],
                        "num_train": [8],
                        "data": {"seed": 3},
                    }
                ]
            },
            r"data=\{'seed': 3\} is not allowed: expected a mapping of the data module's other options",
        ),
        (
            {
                "experiments": [
                    {
                        "name": "a",
                        "tasks": ["arrangement"],
                        "models": ["cnn-rf5"],
                        "num_train": [8],
                        "data": {"train_max_span": [20]},
                    }
                ]
            },
            r"data=\{'train_max_span': \[20\]\} is not allowed",
        ),
    ],
)
def test_bad_study_config_is_reported_with_the_value(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        grid.load_config(tiny_config(tmp_path, **change))


# ----------------------------------------------------------------------------- the study end to end


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # trains
def test_tiny_study_writes_reports_resumes_and_never_recomputes(tmp_path, monkeypatch):
    config = tiny_config(tmp_path)
    cfg = grid.load_config(config)
    calibration = grid.calibration_plan(cfg)
    results, logs = tmp_path / "results", tmp_path / "runs"
    csv_path = results / "runs.csv"

    # 1. A partial study: the shortcut audit, then two runs, then stop. The predictions written before
    #    the runs (python -m studies.relation.visibility) are in out_dir already and must stay as they are.
    results.mkdir()
    (results / "predictions.md").write_text("predicted before the runs\n")
    study.run_study(config, max_runs=2, progress=False, executor="debug")
    first = _rows(csv_path)
    assert [r["key"] for r in first] == [r.key for r in calibration[:2]]
    assert {r["task"] for r in _rows(results / "shortcuts.csv")} == {"diagonal", "relative", "same_different"}

    # 2. A run killed midway: it left a log directory but no row. Then an interruption during the
    #    next-but-one run: the run in between finishes and is recorded, the interrupted one is not.
    killed = logs / calibration[2].key
    (killed / "marker").parent.mkdir(parents=True)
    (killed / "marker").write_text("partial")
    real_run_one, calls = run_module.run_one, []

    def interrupted_on_second_call(run, **kwargs):
        calls.append(run.key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run_one(run, **kwargs)

    monkeypatch.setattr(run_module, "run_one", interrupted_on_second_call)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(config, progress=False, executor="debug")
    monkeypatch.setattr(run_module, "run_one", real_run_one)
    second = _rows(csv_path)
    assert second[:2] == first  # finished rows untouched
    assert [r["key"] for r in second] == [r.key for r in calibration[:3]]
    # The killed run's directory was moved aside, not deleted, and the run was redone from scratch.
    assert (logs / f"{calibration[2].key}.unfinished-1" / "marker").read_text() == "partial"
    assert (logs / calibration[2].key / "metrics.csv").exists()

    # 3. Resume: the calibration finishes, the rates are chosen, the study's runs follow, each key once.
    before = csv_path.read_text()
    study.run_study(config, progress=False, executor="debug")
    rows = _rows(csv_path)
    lrs = grid.choose_lr(cfg, rows)
    runs = calibration + grid.plan(cfg, lrs)
    assert csv_path.read_text().startswith(before)
    assert sorted(r["key"] for r in rows) == sorted(r.key for r in runs)
    revision = run_module.code_revision()
    for r in rows:
        assert 0.0 <= float(r["test_acc"]) <= 1.0 and 0.0 <= float(r["val_acc"]) <= 1.0
        assert int(r["params"]) > 0 and int(r["flops_per_image"]) > 0 and float(r["train_time_s"]) > 0
        assert r["revision"] == revision
        by_distance = json.loads(r["test_by_distance"])
        assert sum(n for _, n in by_distance.values()) == cfg["num_test"]
        correct = sum(c for c, _ in by_distance.values())
        assert correct / cfg["num_test"] == pytest.approx(float(r["test_acc"]), abs=1e-4)
        if r["experiment"] != grid.CALIBRATE:
            assert float(r["lr"]) == lrs[grid.family_of(cfg, r["model"])]
        if r["experiment"] == "relation":  # the translation test: the same weights on the moved test set
            shifted = json.loads(r["shift_by_distance"])
            assert r["shift_region"] == "right" and sum(n for _, n in shifted.values()) == cfg["num_test"]
            assert sum(c for c, _ in shifted.values()) / cfg["num_test"] == pytest.approx(float(r["shift_acc"]))
        else:
            assert r["shift_region"] == r["shift_acc"] == r["shift_by_distance"] == ""

    # 4. A rerun of a finished study computes nothing and rewrites no row.
    mtime, text = csv_path.stat().st_mtime_ns, csv_path.read_text()

    def must_not_run(run, **kwargs):
        raise AssertionError(f"finished run {run.key} was recomputed")

    monkeypatch.setattr(run_module, "run_one", must_not_run)
    study.run_study(config, progress=False, executor="debug")
    assert csv_path.stat().st_mtime_ns == mtime and csv_path.read_text() == text

    # 5. Reports: the figures are PNGs; every cell's median and runs are those of the CSV.
    for name in (
        "relation_same_different_runs.png",
        "relation_same_different_by_distance.png",
        "relation_same_different_shift.png",
        "position_diagonal_runs.png",
    ):
        assert (results / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (results / "summary.csv").open() as f:
        summary = {(r["experiment"], r["model"]): r for r in csv.DictReader(f)}
    for (experiment, model), cell in summary.items():
        accs = [float(r["test_acc"]) for r in rows if (r["experiment"], r["model"]) == (experiment, model)]
        assert float(cell["test_acc_median"]) == pytest.approx(statistics.median(accs), abs=1e-4)
        assert int(cell["n_seeds"]) == 2
        moved = [
            float(r["shift_acc"])
            for r in rows
            if (r["experiment"], r["model"]) == (experiment, model) and r["shift_acc"]
        ]
        assert cell["shift_acc_median"] == ("" if not moved else f"{statistics.median(moved):.4f}")
    # Each run's per-image predictions, and the CNN's test set re-binned by visibility.
    for r in rows:
        with np.load(results / "predictions" / f"{r['key']}.npz") as f:
            assert len(f["test_pred"]) == cfg["num_test"]
            assert (f["test_pred"] == f["test_label"]).mean() == pytest.approx(float(r["test_acc"]), abs=1e-4)
            if r["task"] == "same_different":
                assert f["test_positions"].shape == (cfg["num_test"], 2, 2)
            if r["shift_region"]:
                assert (f["shift_pred"] == f["shift_label"]).mean() == pytest.approx(float(r["shift_acc"]), abs=1e-4)
    assert "| relation | cnn-rf5 | 5 | yes | 2 |" in (results / "visibility.md").read_text()
    assert (results / "predictions.md").read_text() == "predicted before the runs\n"
    translation = (results / "translation.md").read_text()
    assert "## relation: task `same_different`, trained in `left`, moved to `right`" in translation
    assert "position" not in translation
    chosen = (results / "calibration.md").read_text()
    assert "| vit (vit-learned) | " in chosen and chosen.count(f" | {lrs['vit']:g} |") >= 1

    # 6. Changing the settings of finished runs is refused rather than mixed into the same table.
    changed = tiny_config(tmp_path, train_samples=128)
    with pytest.raises(ValueError, match="made with other settings"):
        study.run_study(changed, progress=False, executor="debug")


@pytest.mark.slow  # trains
def test_relation_runs_stop_at_the_first_validation_past_the_threshold(tmp_path):
    # studies/relation/configs/relation_base.yaml is base.yaml plus EarlyStopping on val/acc at 99.5%, which
    # must stop a run at a validation in the middle of an epoch (the study's runs are 1-2 epochs
    # with checks every 500 batches). Here the threshold is 0, so the first of the two validations
    # of a one-epoch run (after batch 2 of 4) stops it: 2 steps of 32 images instead of 4.
    shipped = yaml.safe_load((ROOT / "studies/relation/configs/relation_base.yaml").read_text())
    base = yaml.safe_load((ROOT / "studies/relation/configs/base.yaml").read_text())
    stop = shipped["trainer"]["callbacks"][-1]
    assert stop["class_path"] == "lightning.pytorch.callbacks.EarlyStopping"
    assert (stop["init_args"]["monitor"], stop["init_args"]["mode"], stop["init_args"]["stopping_threshold"]) == (
        "val/acc",
        "max",
        0.995,
    )
    shipped["trainer"]["callbacks"] = shipped["trainer"]["callbacks"][:-1]
    assert shipped == base  # nothing else differs
    relation = grid.load_config(ROOT / "studies/relation/configs/relation.yaml")
    assert relation["base_config"] == "studies/relation/configs/relation_base.yaml"
    base["trainer"]["callbacks"].append({**stop, "init_args": {**stop["init_args"], "stopping_threshold": 0.0}})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    steps = {}
    for name, base_config in (("stops", tmp_path / "base.yaml"), ("full", ROOT / "studies/relation/configs/base.yaml")):
        (tmp_path / name).mkdir()
        cfg = yaml.safe_load(cnn_config(tmp_path / name).read_text())
        cfg.update(base_config=str(base_config), num_val_checks=2, train_samples=128)
        cfg["experiments"][0].update(train_samples=128, num_train=[128])
        path = tmp_path / name / "study.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        (row,) = study.run_study(path, progress=False, executor="debug")
        steps[name] = int(row["steps"])
    assert steps == {"stops": 2, "full": 4}


@pytest.mark.slow  # trains
def test_local_executor_resumes_a_partly_finished_study(tmp_path, monkeypatch):
    # One run in this process, then the other two as subprocesses at once (submitit's local
    # executor): the finished row is kept byte for byte and no run is done twice.
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    csv_path = tmp_path / "results" / "runs.csv"
    study.run_study(config, max_runs=1, progress=False, executor="debug")
    before = csv_path.read_text()
    real_job_line, written = processes.job_line, []

    def job_line(pid, key):
        written.append((pid, key, real_job_line(pid, key)))
        return written[-1][2]

    monkeypatch.setattr(processes, "job_line", job_line)
    study.run_study(config, progress=False, executor="local", parallel=2)
    rows = _rows(csv_path)
    expected = grid.plan(grid.load_config(config))
    assert csv_path.read_text().startswith(before) and len(before.splitlines()) == 2
    assert sorted(r["key"] for r in rows) == sorted(r.key for r in expected)
    results = list((tmp_path / "runs" / "submitit").glob("*_result.pkl"))
    assert len(results) == len(expected) - 1
    assert {r["revision"] for r in rows} == {run_module.code_revision()}
    # Each local job went into the lock as it started (what a rerun after kill -9 checks): its
    # controller's PID (the job id), while it ran.
    assert sorted(key for _, key, _ in written) == sorted(r.key for r in expected[1:])
    assert {str(pid) for pid, _, _ in written} == {p.name.split("_")[0] for p in results}
    assert all(line.startswith(f"job {pid} ") and line.endswith(f" {key}\n") for pid, key, line in written)
    assert (tmp_path / "results" / "study.lock").read_text() == ""


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, monkeypatch):
    class Handle:
        def __init__(self, job):
            self.job = job

        def done(self):
            return True

        def result(self):
            if self.job.run.key.endswith("s100") and "cnn" in self.job.run.key:
                raise RuntimeError("boom\nlast line of the error")
            return {"key": self.job.run.key}

    class Executor:
        def submit(self, job):
            return Handle(job)

    cfg = grid.load_config(tiny_config(tmp_path))
    jobs = [run_module.StudyJob(run, "", "", 1, "") for run in grid.calibration_plan(cfg)]
    done = []
    failures = study.fan_out(Executor(), jobs, parallel=2, on_done=lambda job, row: done.append(row["key"]))
    assert [k for k, _ in failures] == [r.key for r in grid.calibration_plan(cfg) if "cnn" in r.key]
    assert {e for _, e in failures} == {"last line of the error"}
    assert done == [r.key for r in grid.calibration_plan(cfg) if "vit" in r.key]


def test_slurm_parameters_make_a_job_array_script_and_lightning_does_not_requeue(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    params = study.slurm_parameters(partition="gpu", time_min=30, gpus=1, cpus=8, parallel=16)
    script = _make_sbatch_string(command="python -m submitit.core._submit", folder=str(tmp_path), **params)
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --job-name=vit-study",
        "#SBATCH --signal=USR2@90",
    ):
        assert line in script
    run = grid.plan(grid.load_config(tiny_config(tmp_path)), LRS)[0]
    under_slurm = run_module.run_overrides(run, tmp_path, environ={"SUBMITIT_EXECUTOR": "slurm"})
    plugin = under_slurm["trainer"]["plugins"][0]
    assert plugin == {
        "class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment",
        "init_args": {"auto_requeue": False},
    }
    assert under_slurm["trainer"]["accelerator"] == "auto"
    assert "plugins" not in run_module.run_overrides(run, tmp_path, environ={})["trainer"]
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    assert SLURMEnvironment(auto_requeue=False).auto_requeue is False


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "study config '{path}' does not exist"),
        ("", "{path}: expected a mapping at the top level, got an empty file"),
        ("seeds: [0\n", "study config '{path}' is not valid YAML"),
        ("folder", "study config '{path}' is a folder, not a YAML file"),
    ],
)
def test_study_config_errors_are_one_line_and_exit_2(content, message, tmp_path, capsys):
    path = tmp_path / "study.yaml"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: " + message.format(path=path))


def test_an_unknown_model_in_the_study_is_one_line(tmp_path, capsys):
    config = tiny_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["experiments"][0]["models"].append("nosuchmodel")
    config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config)])
    assert exit_info.value.code == 2
    assert "nosuchmodel" in capsys.readouterr().err


# ----------------------------------------------------------------------------- robustness of the runner


def test_report_only_before_any_run_finished_is_one_line(tmp_path, capsys):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config), "--report-only"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: no finished runs in {tmp_path / 'results'} yet (no rows in runs.csv), so there is nothing to report: "
        f"start the study with python -m studies.runner --config {config}\n"
    )
    assert not (tmp_path / "results").exists()


def _cut_last_row(text: str) -> str:
    return text[: text.rindex('""10"":')]  # in the middle of the last row's test_by_distance, no newline


def _edit_line(number: int, old: str, new: str):
    def edit(text: str) -> str:
        lines = text.splitlines(keepends=True)
        lines[number - 1] = lines[number - 1].replace(old, new, 1)
        return "".join(lines)

    return edit


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            _cut_last_row,
            r"line 4 is damaged: it has 19 of the 25 fields \(cut short\?\)\. Delete that line to redo its "
            r"run \(position-diagonal-cnn-rf5-n32-s2\), then rerun the same command",
        ),
        (
            _edit_line(2, ",0.1,", ",0,1,"),
            r"line 2 is damaged: it has 26 of the 25 fields\. Delete that line to redo its "
            r"run \(position-diagonal-cnn-rf5-n32-s0\)",
        ),
        (
            _edit_line(3, '0.5000,"{', '0.5x,"{'),
            r"line 3 is damaged: test_acc='0.5x' is not a number\. Delete that line",
        ),
        (
            _edit_line(3, "-s1,", "-s9,"),
            r"line 3 is damaged: its key 'position-diagonal-cnn-rf5-n32-s9' does not match "
            r"its columns \(they make 'position-diagonal-cnn-rf5-n32-s1'\)",
        ),
        (
            lambda text: text + text.splitlines(keepends=True)[1],
            r"line 5 repeats run position-diagonal-cnn-rf5-n32-s0 of line 2: delete one of the two lines",
        ),
    ],
)
def test_a_damaged_runs_csv_row_is_named_by_its_line_before_any_work(tmp_path, capsys, monkeypatch, damage, message):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    csv_path = tmp_path / "results" / "runs.csv"
    csv_path.parent.mkdir()
    for run in grid.plan(grid.load_config(config)):
        runs_csv.append_row(csv_path, fake_row(run))
    assert len(runs_csv.read_rows(csv_path)) == 3  # the undamaged file is read as it is
    csv_path.write_text(damage(csv_path.read_text()))
    damaged = csv_path.read_text()
    monkeypatch.setattr(run_module, "run_one", lambda run, **kwargs: pytest.fail(f"run {run.key} was started"))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config), "--executor", "debug"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.fullmatch(f"error: {re.escape(str(csv_path))} {message}.*\n", err)
    assert csv_path.read_text() == damaged and not (tmp_path / "runs").exists()


def test_a_row_appended_after_a_last_line_without_newline_stays_a_row_of_its_own(tmp_path):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    csv_path = tmp_path / "runs.csv"
    first, second = grid.plan(grid.load_config(config))[:2]
    runs_csv.append_row(csv_path, fake_row(first))
    csv_path.write_text(csv_path.read_text().rstrip("\n"))  # as some editors save it
    runs_csv.append_row(csv_path, fake_row(second))
    assert [r["key"] for r in runs_csv.read_rows(csv_path)] == [first.key, second.key]


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"%d\\n" % os.getpid())
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # starts a subprocess
def test_one_invocation_per_out_dir_and_a_killed_ones_lock_is_taken_over(tmp_path, capsys, monkeypatch):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    out_dir, csv_path = tmp_path / "results", tmp_path / "results" / "runs.csv"
    out_dir.mkdir()
    run0 = grid.plan(grid.load_config(config))[0]
    runs_csv.append_row(csv_path, fake_row(run0))
    before = csv_path.read_text()
    monkeypatch.setattr(study, "write_reports", lambda *args: None)

    # 1. Another process holds the lock (as a study invocation does while it runs): refused, nothing written.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out_dir / "study.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setattr(run_module, "run_one", lambda run, **kwargs: pytest.fail(f"run {run.key} was started"))
        with pytest.raises(SystemExit) as exit_info:
            study_main(["--config", str(config), "--executor", "debug"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (
            f"error: {out_dir} is in use by another study invocation (PID {holder.pid}, lock "
            f"{out_dir / 'study.lock'}): "
            f"wait for it to finish, or stop it (kill {holder.pid}) and rerun; two at once would redo each other's "
            f"runs\n"
        )
        assert csv_path.read_text() == before and not (tmp_path / "runs").exists()
    finally:
        holder.kill()  # SIGKILL: no chance to clean up, as after kill -9
        holder.wait()

    # 2. Its lock file is left with its PID, but the kernel released the lock: taken over with a note.
    #    While this invocation runs, it holds the lock itself.
    def run_while_locked(run, **kwargs):
        with pytest.raises(runs_csv.StudyError, match=f"in use by another study invocation \\(PID {os.getpid()},"):
            with lock.lock_out_dir(out_dir):
                pass
        return fake_row(run)

    monkeypatch.setattr(run_module, "run_one", run_while_locked)
    study.run_study(config, progress=False, executor="debug")
    assert capsys.readouterr().err.startswith(
        f"taking over {out_dir / 'study.lock'}: the invocation that held it (PID {holder.pid}) ended without "
        "releasing it (killed?); its unfinished runs are redone\n"
    )
    assert len(runs_csv.read_rows(csv_path)) == 3 and csv_path.read_text().startswith(before)
    assert (out_dir / "study.lock").read_text() == ""  # a clean end: the next invocation has nothing to take over


KILLED_OWNER = """
import sys, time
from pathlib import Path
from studies.runner import lock, study
out_dir, key, folder = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with lock.lock_out_dir(out_dir) as record_job:
    job = study.make_executor("local", folder, timeout_min=10).submit(time.sleep, 600)
    record_job(int(job.job_id), key)
    print(job.job_id, flush=True)
    time.sleep(600)
"""


def _ended(pid: int) -> bool:
    """Whether process ``pid`` is gone or a zombie (``/proc/<pid>/stat``'s state)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


def _wait_for_child(pid: int) -> int:
    """The one process that ``pid`` started, as ``ps`` lists it (waiting up to a minute for it to start)."""
    deadline = time.monotonic() + 60
    while not (
        children := subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
        ).stdout.split()
    ):  # ps exits 1 while there is none
        assert time.monotonic() < deadline, f"process {pid} started no process"
        time.sleep(0.1)
    (child,) = children
    return int(child)


@pytest.mark.slow  # trains
def test_a_rerun_after_kill_9_is_refused_while_the_killed_invocations_jobs_run(tmp_path, capsys, monkeypatch):
    # kill -9 of a study leaves its local jobs running (a submitit controller and the run it started),
    # writing their run folders, and the kernel frees the lock: a rerun that took it over would start
    # the same run again in the same folder. Here a real invocation holds the lock, starts a real
    # submitit local job (a sleep, standing in for the run) and writes it into the lock, then is killed.
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    out_dir, logs = tmp_path / "results", tmp_path / "runs"
    csv_path, lock = out_dir / "runs.csv", out_dir / "study.lock"
    runs = grid.plan(grid.load_config(config))
    out_dir.mkdir()
    runs_csv.append_row(csv_path, fake_row(runs[0]))
    orphaned = logs / runs[1].key  # what the orphaned run has written so far
    orphaned.mkdir(parents=True)
    (orphaned / "metrics.csv").write_text("epoch,step,train/acc\n0,1,0.5\n")
    real_run_one, job = run_module.run_one, []
    owner = subprocess.Popen(
        [sys.executable, "-c", KILLED_OWNER, str(out_dir), runs[1].key, str(logs / "submitit")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )  # from the root, where `studies` is
    try:
        controller = int(owner.stdout.readline())
        job = [controller, _wait_for_child(controller)]  # the controller and the process that runs the job
        owner.kill()  # SIGKILL, as kill -9: the job runs on
        owner.wait()
        assert not any(_ended(pid) for pid in job)

        def files():
            return {p: p.read_bytes() for folder in (out_dir, orphaned) for p in sorted(folder.rglob("*"))}

        before, entries = files(), sorted(logs.iterdir())
        monkeypatch.setattr(run_module, "run_one", lambda run, **kwargs: pytest.fail(f"run {run.key} was started"))
        with pytest.raises(SystemExit) as exit_info:
            study_main(["--config", str(config), "--executor", "debug"])
        assert exit_info.value.code == 2
        pids = " ".join(map(str, job))
        assert capsys.readouterr().err == (
            f"error: {out_dir}: the study invocation that held {lock} (PID {owner.pid}) was killed, but runs it "
            f"started still run: {runs[1].key} (PIDs {pids}). Their results can no longer be recorded: stop them "
            f"(kill -9 {pids}) or wait for them to end, then rerun; started now, they would run twice in the same "
            "folders\n"
        )
        assert files() == before and sorted(logs.iterdir()) == entries  # nothing written, moved or created

        # Done as the message says, the same command goes on: the orphan's folder is moved aside and its run redone.
        subprocess.run(["kill", "-9", *pids.split()], check=True)
        deadline = time.monotonic() + 30
        while not all(_ended(pid) for pid in job):
            assert time.monotonic() < deadline, f"{job} still run after kill -9"
            time.sleep(0.05)
        started = []

        def run_one(run, **kwargs):
            started.append(run.key)
            return real_run_one(run, **kwargs) if run.key == runs[1].key else fake_row(run)

        monkeypatch.setattr(run_module, "run_one", run_one)
        monkeypatch.setattr(study, "write_reports", lambda *args: None)
        study_main(["--config", str(config), "--executor", "debug"])
    finally:
        owner.kill()
        owner.wait()
        for pid in job:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
    assert capsys.readouterr().err.startswith(
        f"taking over {lock}: the invocation that held it (PID {owner.pid}) ended without releasing it"
    )
    assert started == [runs[1].key, runs[2].key]
    assert [r["key"] for r in runs_csv.read_rows(csv_path)] == [r.key for r in runs]
    assert (logs / f"{runs[1].key}.unfinished-1" / "metrics.csv").read_bytes() == before[orphaned / "metrics.csv"]
    assert "val/acc" in (orphaned / "metrics.csv").read_text() and lock.read_text() == ""


@pytest.mark.slow  # starts a subprocess
def test_a_job_in_the_lock_counts_while_its_process_runs_and_not_once_its_pid_is_reused():
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        start = Path(f"/proc/{sleeper.pid}/stat").read_text().split()[21]  # field 22; "(sleep)" holds no space
        line = processes.job_line(sleeper.pid, "run-a")
        assert line == f"job {sleeper.pid} {start} run-a\n"
        assert processes.live_jobs(f"4242\n{line}not a job\njob x 1 run-b\n") == [("run-a", [sleeper.pid])]
        # The same PID with another start time: a process that took the PID of a job that ended.
        assert processes.live_jobs(f"job {sleeper.pid} {int(start) + 1} run-a\n") == []
        sleeper.kill()
        deadline = time.monotonic() + 30
        while not _ended(sleeper.pid):  # a zombie until waited for: its PID cannot be taken meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert processes.live_jobs(line) == [] and processes.job_line(sleeper.pid, "run-a") == ""
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("where", ["under /proc", "a file", "a name too long"])
def test_an_unusable_out_dir_is_one_line_and_leaves_nothing_behind(tmp_path, capsys, monkeypatch, where):
    out_dir, reason = {
        "under /proc": (Path("/proc/vit-study-results"), "creating /proc/vit-study-results failed ("),
        "a file": (tmp_path / "results", "it exists and is not a folder"),
        # a name that fails after its new parent folder was made: that folder is removed again
        "a name too long": (
            tmp_path / "new" / ("x" * 300),
            f"creating {tmp_path / 'new' / ('x' * 300)} failed (File name too long)",
        ),
    }[where]
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "out_dir": str(out_dir)}))
    if where == "a file":
        out_dir.write_text("not a folder\n")
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    monkeypatch.setattr(run_module, "run_one", lambda run, **kwargs: pytest.fail(f"run {run.key} was started"))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config), "--executor", "debug"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: out_dir={str(out_dir)!r} cannot be used: {reason}") and err.count("\n") == 1
    assert err.endswith("; expected a folder that this user can create and write in\n")
    assert {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))} == before
    assert not Path("/proc/vit-study-results").exists()


def test_a_study_of_no_experiments_is_one_line_and_exit_2(tmp_path, capsys):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "experiments": []}))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config), "--executor", "debug"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {config}: experiments=[] is not allowed: expected a non-empty list of experiments (each a mapping "
        "with name, tasks, models, num_train)\n"
    )
    assert not (tmp_path / "results").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow  # trains
def test_sigterm_stops_the_study_and_the_same_command_finishes_it(tmp_path, capsys, monkeypatch):
    config = cnn_config(tmp_path, seeds=(0, 1, 2))
    csv_path, logs = tmp_path / "results" / "runs.csv", tmp_path / "runs"
    runs = grid.plan(grid.load_config(config))
    # Should the study not catch SIGTERM, this handler keeps pytest alive (and the test fails).
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)

    def sigterm_once_the_second_run_started():
        started, deadline = logs / runs[1].key / "study_overrides.yaml", time.monotonic() + 300
        while not started.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, while the run is under way

    sender = threading.Thread(target=sigterm_once_the_second_run_started, daemon=True)
    sender.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            study_main(["--config", str(config), "--executor", "debug"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_info.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (
        f"stopped by SIGTERM: the 1 finished runs are kept in {csv_path} and the runs under way were "
        "stopped; rerun the same command to go on (those are redone)"
    )
    stopped = csv_path.read_text()
    assert [r["key"] for r in runs_csv.read_rows(csv_path)] == [runs[0].key]
    assert (tmp_path / "results" / "study.lock").read_text() == ""

    # The same command: the run under way is redone (its folder moved aside), the finished one is not.
    real_run_one, started = run_module.run_one, []

    def record_and_run(run, **kwargs):
        started.append(run.key)
        return real_run_one(run, **kwargs)

    monkeypatch.setattr(run_module, "run_one", record_and_run)
    study_main(["--config", str(config), "--executor", "debug"])
    assert started == [runs[1].key, runs[2].key]
    assert csv_path.read_text().startswith(stopped)
    assert [r["key"] for r in runs_csv.read_rows(csv_path)] == [r.key for r in runs]
    assert (logs / f"{runs[1].key}.unfinished-1" / "study_overrides.yaml").exists()
    assert "taking over" not in capsys.readouterr().err


def test_a_stopped_fan_out_cancels_the_runs_under_way(tmp_path):
    # SIGTERM or Ctrl-C while local jobs run: they are cancelled, not left to run on without this process.
    cancelled, polls = [], []

    class Handle:
        def __init__(self, job):
            self.job = job

        def done(self):
            polls.append(self.job.run.key)
            if len(polls) == 3:
                raise lock.Stopped(signal.SIGTERM)
            return False

        def cancel(self, check=True):
            cancelled.append(self.job.run.key)

    class Executor:
        def submit(self, job):
            return Handle(job)

    runs = grid.plan(grid.load_config(cnn_config(tmp_path, seeds=(0, 1, 2))))
    jobs = [run_module.StudyJob(run, "", "", 1, "") for run in runs]
    with pytest.raises(lock.Stopped):
        study.fan_out(Executor(), jobs, parallel=2, on_done=lambda job, row: None, poll_s=0.0)
    assert cancelled == [runs[0].key, runs[1].key]


@pytest.mark.slow  # starts a subprocess
def test_kill_process_tree_kills_the_processes_a_local_job_started():
    # A local job's controller started the run's process; both must go, or the run goes on unseen.
    shell = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    child = int(shell.stdout.readline())
    processes.kill_process_tree(shell.pid)
    assert shell.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] != "Z":
        assert time.monotonic() < deadline, "the controller's child is still running"
        time.sleep(0.05)


def test_a_calibration_trains_and_validates_on_the_data_options_it_names(tmp_path):
    cfg = grid.load_config(Path(__file__).resolve().parents[1] / "studies/arrangement/configs/positions.yaml")
    calibration = grid.calibration_plan(cfg)
    assert len(calibration) == 6 * 3 * 2  # families x rates x seeds
    for run in calibration:
        init_args = run.overrides["data"]["init_args"]
        assert init_args["train_max_span"] == 20 and "test_min_span" not in init_args
        assert run.overrides["trainer"]["max_epochs"] == 3  # 3000 steps of 64 over 64,000 images
    config = yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "studies/arrangement/configs/positions.yaml").read_text()
    )
    config["calibration"]["data"] = {"train_max_span": [20]}
    config["base_config"] = str(Path(__file__).resolve().parents[1] / config["base_config"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(
        ValueError,
        match=r"calibration: data=\{'train_max_span': \[20\]\} is not allowed: expected a "
        r"mapping of the data module's options to plain values",
    ):
        grid.load_config(path)
