"""The arrangement study: its shortcut audit (every shortcut at chance, the relation itself not), its report, and its
one command (the audit in the runner's format before the grid, attention blocking after it, the committed tables
rewritten as committed)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from studies.arrangement import __main__ as command
from studies.arrangement import report, settings, shortcuts
from studies.runner.grid import load_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "studies/arrangement/results/arrangement"  # the first grid's
FIRST_CONFIG = ROOT / "studies/arrangement/configs/arrangement.yaml"
INPUTS = ("runs.csv", "blocking.csv", "predictions")  # what the runs and the blocking wrote; the rest is report


def test_audit_shortcuts_stay_at_chance_on_every_subset_and_the_relation_does_not(tmp_path):
    from studies.runner.arrangement import ArrangementDataset

    fit = shortcuts.Images.of([ArrangementDataset(num_samples=4000, seed=11)])
    scored = shortcuts.Images.of(
        [ArrangementDataset(num_samples=1500, seed=12), ArrangementDataset(num_samples=1500, seed=13)]
    )
    setting = shortcuts.Setting("relation", scored, fit, {(11, 32): "every image", (25, 32): "spans >= 25"})
    rows = shortcuts.audit(setting, mlp=False)
    by_name = {(r["region"], r["baseline"]): r for r in rows}
    every = {
        "disc_a",
        "disc_b",
        "disc_random",
        "midpoint",
        "span",
        "distance",
        "ink",
        "parts",
        "quadrants",
        "pixels_logreg",
        "centres_logreg",
    }
    assert {b for (g, b) in by_name if g == "relation 25-32"} == every  # the subsets: the shortcuts only
    assert {b for (g, b) in by_name if g == "relation 11-32"} == every | {"grid4", "positions_sorted"}
    assert by_name[("relation 11-32", "ink")]["n"] == 3000
    assert by_name[("relation 25-32", "ink")]["n"] == int((scored.span >= 25).sum())
    for r in rows:
        assert r["low"] <= r["accuracy"] <= r["high"], r
        if r["shortcut"]:
            assert r["low"] < 0.53, r  # at chance: the interval reaches below 53% (about +-3 points at 1,000 images)
    assert by_name[("relation 11-32", "positions_sorted")]["accuracy"] > 0.9
    shortcuts.write(rows, [setting], tmp_path, 1.0, "cmd")
    text = (tmp_path / "shortcuts.md").read_text()
    assert "Shortcuts above 55%: none." in text and "| 25-32 | " in text and "| relation 11-32 | " in text
    assert len((tmp_path / "shortcuts.csv").read_text().splitlines()) == len(rows) + 1


def test_the_audit_scores_the_span_bins_the_tables_score():
    cfg = load_config(FIRST_CONFIG)
    relation = settings.span_subsets(cfg, "relation", 11, 32)
    # every image; by_distance.md's bins; within and beyond 11 px (cnn-rf11*) and 21 px (cnn-rf21); spans >= 25
    assert list(relation) == [
        (11, 32),
        (11, 13),
        (14, 16),
        (17, 19),
        (20, 22),
        (23, 25),
        (26, 28),
        (29, 32),
        (11, 11),
        (12, 32),
        (11, 21),
        (22, 32),
        (25, 32),
    ]
    ood = settings.span_subsets(cfg, "span_ood", 21, 32)
    assert list(ood) == [(21, 32), (21, 23), (24, 26), (27, 29), (30, 32), (21, 24), (25, 28), (29, 32), (25, 32)]
    committed = (ROOT / "studies/arrangement/results/arrangement/by_distance.md").read_text()
    assert "| 11-13 | 14-16 | 17-19 | 20-22 | 23-25 | 26-28 | 29-32 |" in committed
    assert "| 21-23 | 24-26 | 27-29 | 30-32 |" in committed
    header = next(line for line in report.span_ood_table([], RESULTS) if line.startswith("| model"))  # its bins
    assert all(f"test {a}-{b}" in header for a, b in settings.SPAN_OOD_BINS)


def test_the_audit_scores_the_images_the_study_draws():
    from studies.runner.arrangement import ArrangementDataModule

    settings = shortcuts.study_settings(load_config(FIRST_CONFIG), num_fit=200)
    assert [s.name for s in settings] == ["relation", "span_ood", "span_ood/val"]
    relation, ood, val = settings
    assert len(relation.scored.labels) == len(ood.scored.labels) == 5 * 4000 and len(val.scored.labels) == 5 * 1000
    assert (ood.scored.span.min(), val.scored.span.max()) == (21, 20)
    # seed 3's test split, made as the runner makes it (num_test and the experiment's data options of the config)
    test = ArrangementDataModule(num_test=4000, seed=3, test_min_span=21, train_max_span=20).make_split(
        "test", 4000, "all"
    )
    assert np.array_equal(ood.scored.centres[3 * 4000 : 4 * 4000], test.positions.numpy() + 2)
    assert len(relation.fit.labels) == 200 and not np.array_equal(relation.fit.centres, relation.scored.centres[:200])


def test_the_report_splits_the_held_out_test_by_class_and_the_unseen_spans_by_bin(tmp_path):
    (tmp_path / "predictions").mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(3):
        label = rng.integers(2, size=400)
        pred = np.where(label == 1, label, rng.integers(2, size=400))  # every "same" right, "different" by chance
        np.savez(
            tmp_path / "predictions" / f"held_out-s{seed}.npz",
            test_label=label,
            test_pred=pred,
            test_distance=np.full(400, 15),
        )
        span = rng.integers(21, 33, size=400)
        ood_pred = np.where(span <= 24, label, 1 - label)  # right up to 24 px, wrong beyond
        np.savez(
            tmp_path / "predictions" / f"ood-s{seed}.npz", test_label=label, test_pred=ood_pred, test_distance=span
        )
        rows += [
            {
                "key": f"held_out-s{seed}",
                "experiment": "held_out",
                "model": "m",
                "val_acc": "0.99",
                "test_acc": f"{(pred == label).mean():.4f}",
            },
            {
                "key": f"ood-s{seed}",
                "experiment": "span_ood",
                "model": "m",
                "val_acc": "0.98",
                "test_acc": f"{(ood_pred == label).mean():.4f}",
            },
        ]
    held = report.held_out_table(rows, tmp_path)[-2]
    cells = [c.strip() for c in held.split("|")[1:-1]]
    assert cells[0] == "m" and cells[1] == "3" and cells[4] == "100.0 [100.0-100.0]"
    assert 40 < float(cells[5].split()[0]) < 60  # the "different" pairs at chance
    ood = [c.strip() for c in report.span_ood_table(rows, tmp_path)[-2].split("|")[1:-1]]
    assert ood[2] == "98.0 [98.0-98.0]" and ood[4] == "100.0 [100.0-100.0] / 100.0"  # the median, then pooled
    assert ood[5] == "0.0 [0.0-0.0] / 0.0" and ood[6] == "0.0 [0.0-0.0] / 0.0"


GRIDS = {  # grid -> (its config, its committed results, its committed audit)
    "first": (FIRST_CONFIG, RESULTS, ROOT / report.FIRST_AUDIT),
    "matched": (
        ROOT / command.CONFIG,
        ROOT / "studies/arrangement/results/matched",
        ROOT / "studies/arrangement/results/matched/audit/shortcuts.csv",
    ),
    "positions": (
        ROOT / "studies/arrangement/configs/positions.yaml",
        ROOT / "studies/arrangement/results/positions",
        ROOT / "studies/arrangement/results/positions/audit/shortcuts.csv",
    ),
}


def _study_in(tmp_path: Path, monkeypatch, grid: str = "first") -> Path:
    """A grid's config with its out_dir and log_dir in ``tmp_path``, the committed inputs and audit copied there;
    the working directory the repository root, whose relative paths the config and the report use."""
    config_path, results, audit = GRIDS[grid]
    monkeypatch.chdir(ROOT)
    out_dir = tmp_path / "arrangement"
    out_dir.mkdir()
    for name in INPUTS:
        if not (results / name).exists():  # a grid without a relation experiment blocks nothing
            continue
        copy = shutil.copytree if (results / name).is_dir() else shutil.copyfile
        copy(results / name, out_dir / name)
    (out_dir / "audit").mkdir()
    shutil.copyfile(audit, out_dir / "audit" / "shortcuts.csv")  # the grid's audit, where a grid's goes
    cfg = load_config(config_path)
    text = config_path.read_text()
    config = tmp_path / "arrangement.yaml"
    config.write_text(
        text.replace(f"out_dir: {cfg['out_dir']}", f"out_dir: {out_dir}").replace(
            f"log_dir: {cfg['log_dir']}", f"log_dir: {tmp_path / 'runs'}"
        )
    )
    assert config.read_text().count(str(tmp_path)) == 2
    return config


def test_the_command_gives_the_runner_the_audit_before_the_grid_and_blocks_after_it(tmp_path, monkeypatch):
    config = _study_in(tmp_path, monkeypatch)
    out_dir, steps = tmp_path / "arrangement", []

    def grid(args, cfg, *, prog):
        # the runner's report counts successes against shortcuts.csv: it must be there when the grid starts
        steps.append(
            (
                "grid",
                (out_dir / "shortcuts.csv").read_text().startswith("task,baseline,accuracy,what\n"),
                args.report_only,
                prog,
            )
        )

    monkeypatch.setattr(command, "run", grid)
    monkeypatch.setattr(shortcuts, "main", lambda argv: steps.append(("audit", argv)))
    monkeypatch.setattr(report, "run_blocking", lambda rows, results, runs_dir: steps.append(("blocking", runs_dir)))
    monkeypatch.setattr(report, "write", lambda rows, results: steps.append(("tables", len(rows), results)))
    command.main(["--config", str(config)])
    assert steps == [
        ("grid", True, False, "python -m studies.arrangement"),
        ("blocking", tmp_path / "runs"),
        ("tables", 85, out_dir),
    ]  # the audit is there: not measured again
    (out_dir / "audit" / "shortcuts.csv").unlink()
    steps.clear()
    with pytest.raises(FileNotFoundError):  # the audit (stubbed here) writes nothing, so the runner's copy fails
        command.main(["--config", str(config)])
    assert steps == [("audit", ["--out", str(out_dir / "audit"), "--config", str(config)])]  # of this config
    shutil.copyfile(ROOT / report.FIRST_AUDIT, out_dir / "audit" / "shortcuts.csv")
    steps.clear()
    command.main(["--config", str(config), "--report-only"])
    assert steps == [("grid", True, True, "python -m studies.arrangement"), ("tables", 85, out_dir)]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_report_only_rewrites_the_committed_tables_from_the_committed_results(tmp_path, monkeypatch, grid):
    # Every table the study commits is what its command writes from its runs, blocking rows and predictions
    # (the figures are checked for existence only: their bytes depend on the matplotlib version).
    config = _study_in(tmp_path, monkeypatch, grid)
    results = GRIDS[grid][1]
    out_dir = tmp_path / "arrangement"
    command.main(["--config", str(config), "--report-only"])
    written = sorted(p.name for p in out_dir.iterdir() if p.name not in (*INPUTS, "audit"))
    assert written == sorted(p.name for p in results.iterdir() if p.name not in (*INPUTS, "audit"))
    for name in written:
        if name.endswith(".png"):
            assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert (out_dir / name).read_text() == (results / name).read_text(), name


def test_the_matched_grid_audits_the_moved_test_too_and_its_own_folder():
    cfg = load_config(ROOT / command.CONFIG)
    assert command.CONFIG == "studies/arrangement/configs/matched.yaml"
    settings = shortcuts.study_settings(cfg, num_fit=200)
    names = [s.name for s in settings]
    assert names == ["relation", "local", "translation", "translation/shift", "efficiency"]
    moved, shifted = settings[2], settings[3]
    columns = moved.scored.centres[:, :, 1]  # the right region's columns start 12 px right of the left one's
    assert columns.max() < 20 <= shifted.scored.centres[:, :, 1].max() and shifted.scored.centres[:, :, 1].min() >= 12
    assert report.audit_path(Path(cfg["out_dir"])) == Path("studies/arrangement/results/matched/audit/shortcuts.csv")
    assert report.audit_path(report.FIRST_GRID) == report.FIRST_AUDIT


def test_the_success_threshold_comes_from_every_image_not_from_a_small_span_bin(tmp_path):
    audit = tmp_path / "audit.csv"
    audit.write_text(
        "region,n,baseline,accuracy,low,high,shortcut,what\n"
        "relation 11-32,20000,span,0.504,0.497,0.511,True,x\n"
        "relation 11,880,centres_logreg,0.547,0.513,0.58,True,x\n"
        "relation 11-32,20000,positions_sorted,0.99,0.98,1.0,False,x\n"
        "translation/shift 11-20,20000,disc_a,0.51,0.5,0.52,True,x\n"
        "translation/shift 11-13,3000,disc_a,0.56,0.54,0.58,True,x\n"
    )
    relation = tmp_path / "relation.csv"
    relation.write_text("task,baseline,accuracy,what\nsame_different,ink,0.5,y\n")
    report.runner_shortcuts(tmp_path, audit, relation)
    lines = (tmp_path / "shortcuts.csv").read_text().splitlines()
    assert lines == [
        "task,baseline,accuracy,what",
        "arrangement,span@relation 11-32,0.504,x",
        "arrangement,disc_a@translation/shift 11-20,0.51,x",
        "same_different,ink,0.5,y",
    ]
