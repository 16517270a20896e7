"""The grid runner's one-line errors: a junk line of runs.csv named by its file and line, escaped and cut short; a
run whose model refuses its config named with the constructor's message, by itself and in the study's summary."""

import re
from pathlib import Path

import pytest
from study_helpers import KEY, REFUSED, cnn_config, fake_row

from studies.runner import grid, runs_csv
from studies.runner import run as run_module
from studies.runner.__main__ import main as study_main

ROOT = Path(__file__).resolve().parents[1]
NOT_BY_DISTANCE = "test_by_distance is not the JSON mapping of distances to [correct, total] run_one writes"


def _row(tmp_path: Path, **changes) -> dict:
    """The row run_one would write for the study's run, made up without training, with ``changes``."""
    return {**fake_row(grid.plan(grid.load_config(cnn_config(tmp_path)))[0]), **changes}


# ----------------------------------------------------------------------------- a junk line of runs.csv


@pytest.mark.parametrize(
    ("changes", "problem", "key"),
    [
        (
            {"test_acc": "\x1b[2J\x1b[1A" + "9" * 200},
            "test_acc='\\x1b[2J\\x1b[1A" + "9" * 46 + "... (208 characters)' is not a number",
            KEY,
        ),
        ({"test_by_distance": "[" * 5000}, f"{NOT_BY_DISTANCE} (cut short?)", KEY),  # too deep for json's recursion
        ({"test_by_distance": '{"10":"x"}'}, f"{NOT_BY_DISTANCE} (cut short?)", KEY),  # what the report cannot add up
        ({"test_by_distance": "x" * 200_000}, "it is not a line of CSV", "no key"),  # over the csv module's field limit
    ],
)
def test_a_junk_field_is_named_escaped_and_cut_short(tmp_path, changes, problem, key):
    csv_path = tmp_path / "runs\x1b]0;x\x07.csv"
    runs_csv.append_row(csv_path, _row(tmp_path, **changes))
    with pytest.raises(runs_csv.StudyError) as err:
        runs_csv.read_rows(csv_path)
    assert str(err.value) == (
        f"{tmp_path}/runs\\x1b]0;x\\x07.csv line 2 is damaged: {problem}. Delete that line to "
        f"redo its run ({key}), then rerun the same command"
    )


def test_a_junk_key_is_shown_escaped_on_the_line_an_editor_numbers(tmp_path):
    # \f and \x1c end a line for str.splitlines, not for an editor or for csv: the junk is on line 3.
    csv_path = tmp_path / "runs.csv"
    runs_csv.append_row(csv_path, _row(tmp_path))
    runs_csv.append_row(csv_path, _row(tmp_path, key="\x1b[2J\x0cjunk\x1c", seed=1))
    with pytest.raises(runs_csv.StudyError) as err:
        runs_csv.read_rows(csv_path)
    junk = "\\x1b[2J\\x0cjunk\\x1c"
    assert str(err.value) == (
        f"{csv_path} line 3 is damaged: its key '{junk}' does not match its columns (they make "
        f"'position-diagonal-cnn-rf5-n32-s1'). Delete that line to redo its run ({junk}), then "
        "rerun the same command"
    )


def test_a_junk_line_stops_the_study_with_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    config = cnn_config(tmp_path)
    csv_path = tmp_path / "results" / "runs.csv"
    csv_path.parent.mkdir()
    runs_csv.append_row(csv_path, _row(tmp_path))
    with csv_path.open("a") as f:
        f.write("\x1b[2J" + "#" * 1000 + "\n")
    monkeypatch.setattr(run_module, "run_one", lambda run, **kwargs: pytest.fail(f"run {run.key} was started"))
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(config), "--executor", "debug"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"error: {csv_path} line 3 is damaged: it has 1 of the 25 fields (cut short?). "
        "Delete that line to redo its run (\\x1b[2J" + "#" * 53 + "... (1004 "
        "characters)), then rerun the same command\n"
    )


# ----------------------------------------------------------------------------- a model its constructor refuses


def test_a_model_its_constructor_refuses_fails_its_run_naming_it(tmp_path):
    config = cnn_config(tmp_path, strides=(1, 0))
    run = grid.plan(grid.load_config(config))[0]
    with pytest.raises(RuntimeError) as err:
        run_module.run_one(run, base_config=str(ROOT / "studies/relation/configs/base.yaml"), log_dir=tmp_path / "runs")
    assert str(err.value) == f"run {KEY} (model cnn-rf5, seed 0) failed: {REFUSED}"


@pytest.mark.slow  # a study job in a subprocess (submitit's local executor)
def test_a_study_whose_model_is_refused_ends_with_one_line_naming_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        study_main(["--config", str(cnn_config(tmp_path, strides=(1, 0))), "--executor", "local", "--parallel", "1"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    # (after the progress bar's \r)
    assert re.search(f"FAILED {KEY} \\(model cnn-rf5, seed 0\\): {re.escape(REFUSED)} \\(log: \\S+\\)\n", err)
    assert err.endswith(f"error: 1 runs failed (rerun the same command to retry them): {KEY}: {REFUSED}\n")
    assert "Traceback" not in err
