"""The spatial-relation study: CoordConv channels, the schedule, and a tiny resumable study end to end."""

import csv
import math
import re
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from vit.experiments import grid, report, study
from vit.models import CoordConvResNet, ResNet
from vit.models.coordconv import coord_channels

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- CoordConv


def test_coord_channels_are_normalised_pixel_centres():
    c = coord_channels(4)
    assert c.shape == (2, 4, 4)
    centres = torch.tensor([-0.75, -0.25, 0.25, 0.75])  # (i + 0.5) / 4 * 2 - 1
    assert torch.equal(c[0], centres[:, None].expand(4, 4))  # row (y) varies down the image
    assert torch.equal(c[1], centres[None, :].expand(4, 4))  # column (x) varies across


def test_coordconv_appends_coordinates_and_reuses_resnet():
    torch.manual_seed(0)
    model = CoordConvResNet(img_size=16, in_chans=3, num_classes=5, widths=(4, 8)).eval()
    x = torch.randn(2, 3, 16, 16)
    with_coords = model.add_coords(x)
    assert with_coords.shape == (2, 5, 16, 16)
    assert torch.equal(with_coords[:, :3], x)
    assert torch.equal(with_coords[:, 3:], coord_channels(16).expand(2, -1, -1, -1))
    assert model(x).shape == (2, 5)
    assert torch.equal(model(x), model.resnet(with_coords))
    # Same parameters as a ResNet with two more input channels; the coordinates are not state.
    plain = ResNet(img_size=16, in_chans=5, num_classes=5, widths=(4, 8))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert not any("coords" in k for k in model.state_dict())
    with pytest.raises(ValueError, match=r"expected input of shape \(B, 3, 16, 16\), got \(2, 1, 16, 16\)"):
        model(torch.randn(2, 1, 16, 16))


# ----------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    "num_train, expected",
    [(500, (16, 4, 0)), (2000, (4, 1, 0)), (3000, (3, 1, 0)), (100, (80, 20, 0)), (1200, (7, 1, 0)),
     (4096, (2, 1, 32)),     # 2 epochs of 64 batches, 2 checks per epoch wanted: at batches 32 and 64
     (4000, (2, 1, 21)),     # 63 batches: 2 checks would miss the last batch, so 3 (63 = 3 x 21)
     (8000, (1, 1, 25)),     # 1 epoch of 125 batches, 4 checks wanted: 125 = 5 x 25, so 5 checks
     (32000, (1, 1, 125)),   # 500 batches, 4 checks of 125
     (8128, (1, 1, 0))],     # 127 batches, a prime: one check, at the end of the epoch
)
def test_schedule_gives_equal_samples_and_validates_after_the_last_step(num_train, expected):
    # epochs = round(8000 / n) but at least 1; validation every max(1, epochs // 4) epochs (epochs
    # rounded up to a multiple of it), or, with fewer than 4 epochs, every val_batches batches.
    epochs, val_every, val_batches = grid.schedule(num_train, train_samples=8000, num_val_checks=4, batch_size=64)
    assert (epochs, val_every, val_batches) == expected
    assert epochs % val_every == 0
    if val_batches:
        assert math.ceil(num_train / 64) % val_batches == 0  # the epoch's last batch is a validation


def _tiny_config(tmp_path: Path, **changes) -> Path:
    cfg = yaml.safe_load((ROOT / "configs/study/tiny.yaml").read_text())
    cfg.update(base_config=str(ROOT / "configs/study/base.yaml"), out_dir=str(tmp_path / "results"),
               log_dir=str(tmp_path / "runs"), **changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_plan_covers_the_grid_with_unique_keys(tmp_path):
    cfg = grid.load_config(_tiny_config(tmp_path))
    runs = grid.plan(cfg)
    # sweep: 1 task x 2 models x 2 sizes, shift: 1 x 1 x 1; times 2 seeds
    assert len(runs) == (1 * 2 * 2 + 1) * 2
    assert len({r.key for r in runs}) == len(runs)
    shift = [r for r in runs if r.experiment == "shift"]
    assert {(r.train_region, r.test_region) for r in shift} == {("inner", "border")}
    assert shift[0].overrides["data"]["init_args"]["test_region"] == "border"


def test_default_study_is_the_documented_grid():
    # The shipped study: 3 seeds, both tasks in every entry, the four encodings and both CNNs at
    # n=2000, sizes from hundreds to tens of thousands, and validation settings Lightning accepts.
    cfg = grid.load_config(ROOT / "configs/study/two_circles.yaml")
    runs = grid.plan(cfg)
    assert len(runs) == 78 and len({r.key for r in runs}) == 78
    assert {r.seed for r in runs} == {0, 1, 2}
    assert {r.task for r in runs} == {"diagonal", "relative"}
    at_2000 = {r.model for r in runs if r.experiment == "sweep" and r.num_train == 2000}
    assert at_2000 == {"vit-learned", "vit-sincos1d", "vit-sincos2d", "vit-none", "cnn", "coordconv"}
    assert {r.num_train for r in runs if r.model == "vit-learned"} == {500, 2000, 20000}
    for r in runs:
        trainer = r.overrides["trainer"]
        batches = math.ceil(r.num_train / cfg["batch_size"])
        assert r.epochs * r.num_train >= cfg["train_samples"] * 0.95  # the equal-compute floor
        assert trainer["max_epochs"] % trainer["check_val_every_n_epoch"] == 0
        assert batches % trainer.get("val_check_interval", batches) == 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seeds": []}, r"seeds=\[\] is not allowed"),
        ({"experiments": [{"name": "a", "tasks": ["diagonl"], "models": ["coordconv"], "num_train": [8]}]},
         r"tasks='diagonl' is not allowed: expected one of \['diagonal', 'relative'\]"),
        ({"experiments": [{"name": "a", "tasks": ["diagonal"], "models": ["resnet"], "num_train": [8]}]},
         r"models='resnet' is not allowed: expected one of \['vit-learned', 'coordconv'\]"),
        ({"experiments": [{"name": "a", "tasks": ["diagonal"], "models": ["coordconv"], "num_train": [8],
                           "test_region": "edge"}]}, r"test_region='edge' is not allowed"),
        ({"epochs": 3}, r"unknown keys \['epochs'\]"),
    ],
)
def test_bad_study_config_is_reported_with_the_value(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        grid.load_config(_tiny_config(tmp_path, **change))


# ----------------------------------------------------------------------------- the study end to end


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_tiny_study_writes_reports_resumes_and_never_recomputes(tmp_path, monkeypatch):
    config = _tiny_config(tmp_path)
    runs = grid.plan(grid.load_config(config))
    results, logs = tmp_path / "results", tmp_path / "runs"
    csv_path = results / "runs.csv"

    # 1. A partial study: two runs, then stop.
    study.run_study(config, max_runs=2, progress=False)
    first = _rows(csv_path)
    assert [r["key"] for r in first] == [r.key for r in runs[:2]]

    # 2. A run killed midway: it left a log directory but no row. Then an interruption during the
    #    next-but-one run: the run in between finishes and is recorded, the interrupted one is not.
    killed = logs / runs[2].key
    (killed / "marker").parent.mkdir(parents=True)
    (killed / "marker").write_text("partial")
    real_run_one, calls = study.run_one, []

    def interrupted_on_second_call(run, **kwargs):
        calls.append(run.key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run_one(run, **kwargs)

    monkeypatch.setattr(study, "run_one", interrupted_on_second_call)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(config, progress=False)
    monkeypatch.setattr(study, "run_one", real_run_one)
    second = _rows(csv_path)
    assert second[:2] == first  # finished rows untouched
    assert [r["key"] for r in second] == [r.key for r in runs[:3]]
    # The killed run's directory was moved aside, not deleted, and the run was redone from scratch.
    assert (logs / f"{runs[2].key}.unfinished-1" / "marker").read_text() == "partial"
    assert (logs / runs[2].key / "metrics.csv").exists()

    # 3. Resume: the rest of the grid runs, each key exactly once, old rows byte-identical.
    before = csv_path.read_text()
    study.run_study(config, progress=False)
    rows = _rows(csv_path)
    assert csv_path.read_text().startswith(before)
    assert sorted(r["key"] for r in rows) == sorted(r.key for r in runs)
    for r in rows:
        assert 0.0 <= float(r["test_acc"]) <= 1.0 and 0.0 <= float(r["val_acc"]) <= 1.0
        assert int(r["params"]) > 0 and int(r["epochs"]) >= 1 and float(r["train_time_s"]) > 0

    # 4. A rerun of a finished study computes nothing and rewrites no row.
    mtime, text = csv_path.stat().st_mtime_ns, csv_path.read_text()

    def must_not_run(run, **kwargs):
        raise AssertionError(f"finished run {run.key} was recomputed")

    monkeypatch.setattr(study, "run_one", must_not_run)
    study.run_study(config, progress=False)
    assert csv_path.stat().st_mtime_ns == mtime and csv_path.read_text() == text

    # 5. Reports: plots are PNGs, and the summary cells are the mean ± std (ddof=1) of the CSV rows.
    for name in ("sweep_vs_size.png", "sweep_models.png", "shift_models.png"):
        assert (results / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (results / "summary.md").read_text()
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["experiment"], r["task"], r["model"], r["num_train"]), []).append(float(r["test_acc"]))
    assert len(groups) == 5
    for (experiment, task, model, n), accs in groups.items():
        expected = f"{100 * statistics.mean(accs):.1f} ± {100 * statistics.stdev(accs):.1f} ({len(accs)})"
        section = summary.split(f"## {experiment}: task `{task}`")[1].split("##")[0]
        line = next(line for line in section.splitlines() if line.startswith(f"| {model} |"))
        sizes = re.findall(r"n=(\d+) test|n=(\d+)", section.splitlines()[2])
        columns = [a or b for a, b in sizes]
        assert line.split(" | ")[1 + columns.index(n)].rstrip(" |") == expected

    # 6. Changing the settings of finished runs is refused rather than mixed into the same table.
    changed = _tiny_config(tmp_path, train_samples=128)
    with pytest.raises(ValueError, match="made with other settings"):
        study.run_study(changed, progress=False)


def test_summary_cells_are_mean_and_sample_std_of_rows(tmp_path):
    cfg = grid.load_config(_tiny_config(tmp_path))
    rows = [{"experiment": "sweep", "task": "diagonal", "model": "coordconv", "num_train": "32", "test_acc": a,
             "val_acc": "1.0"} for a in ("0.5", "0.75", "1.0")]
    rows.append({"experiment": "sweep", "task": "diagonal", "model": "vit-learned", "num_train": "64",
                 "test_acc": "0.6", "val_acc": "0.6"})
    out = tmp_path / "out"
    out.mkdir()
    report.write_reports(rows, out, cfg)
    summary = (out / "summary.md").read_text()
    # mean 0.75, sample std sqrt(((-.25)^2 + 0 + .25^2) / 2) = 0.25; one seed: std 0.
    assert "| coordconv | 75.0 ± 25.0 (3) | – |" in summary
    assert "| vit-learned | – | 60.0 ± 0.0 (1) |" in summary
    with (out / "summary.csv").open() as f:
        table = {(r["model"], r["num_train"]): r for r in csv.DictReader(f)}
    assert table[("coordconv", "32")]["test_acc_mean"] == "0.7500"
    assert table[("coordconv", "32")]["test_acc_std"] == "0.2500"
    assert (out / "sweep_models.png").exists() and not (out / "sweep_vs_size.png").exists()


@pytest.mark.parametrize(("content", "message"), [
    (None, "study config '{path}' does not exist"),
    ("", "{path}: expected a mapping at the top level, got an empty file"),
    ("seeds: [0\n", "study config '{path}' is not valid YAML"),
    ("folder", "study config '{path}' is a folder, not a YAML file"),
])
def test_study_config_errors_are_one_line_and_exit_2(content, message, tmp_path, capsys):
    path = tmp_path / "study.yaml"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: " + message.format(path=path))


def test_an_unknown_model_in_the_study_is_one_line(tmp_path, capsys):
    config = _tiny_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["experiments"][0]["models"].append("nosuchmodel")
    config.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit) as exit_info:
        study.main(["--config", str(config)])
    assert exit_info.value.code == 2
    assert "nosuchmodel" in capsys.readouterr().err
