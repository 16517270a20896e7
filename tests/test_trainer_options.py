"""Trainer settings Lightning takes without a check are refused by the pre-flight: one line, exit 2, no run folder."""

import pytest
from robust_helpers import cli, error_line, main_in_process, tiny_config


@pytest.mark.parametrize(("override", "message"), [
    # 0 divided by zero once training started: a traceback, after the run folder was made.
    (["--trainer.accumulate_grad_batches", "0"],
     "trainer.accumulate_grad_batches=0 is not allowed: expected an int >= 1 (1: a step after every batch)"),
    (["--trainer.accumulate_grad_batches", "-2"],
     "trainer.accumulate_grad_batches=-2 is not allowed: expected an int >= 1 (1: a step after every batch)"),
    # A negative value turned clipping off without a word.
    (["--trainer.gradient_clip_val", "-1"],
     "trainer.gradient_clip_val=-1.0 is not allowed: expected a finite number in [0, inf) (0 or null: no clipping)"),
    (["--trainer.gradient_clip_val", "-0.5"],
     "trainer.gradient_clip_val=-0.5 is not allowed: expected a finite number in [0, inf) (0 or null: no clipping)"),
])
def test_bad_trainer_options_stop_with_one_line_before_any_folder(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == f"error: {message}"
    assert not (tmp_path / "runs").exists()


def test_allowed_trainer_options_train(tmp_path, monkeypatch):
    main_in_process(["fit", "--config", str(tiny_config(tmp_path)), "--trainer.fast_dev_run", "true",
                     "--trainer.accumulate_grad_batches", "2", "--trainer.gradient_clip_val", "0"], monkeypatch)
