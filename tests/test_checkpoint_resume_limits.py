"""What `fit --ckpt_path` refuses before a run starts, in one line, where Lightning or AdamW would fail mid-run.

Each case edits a real checkpoint (one epoch of the tiny two-circles run) the way a broken or hostile file could
be, and gives it to `train.py fit`: exit 2, exactly one `error:` line naming the key and what is allowed, no run
folder made. Before, each passed the reader and then failed inside the run (a `MisconfigurationException` after
the run's files were written, an overflow at the first AdamW step, a data position restored into other data).
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
import torch
from checkpoint_doors import train_tiny
from robust_helpers import main_in_process

from vit.training.checkpoint import CheckpointError
from vit.training.checkpoint.schema import validate

pytestmark = pytest.mark.slow  # a real train.py run makes the checkpoint


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    return train_tiny(tmp_path_factory.mktemp("trained"))


def refuse_fit(checkpoint: dict, config: Path, tmp_path: Path, monkeypatch, capsys, *extra: str) -> str:
    """Give `checkpoint` to `fit` in a fresh folder; return its one error line (after asserting exit 2)."""
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    runs = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit:
        main_in_process(["fit", "--config", str(config), "--ckpt_path", str(path), "--test_after_fit", "false",
                         "--trainer.logger.init_args.save_dir", str(runs), *extra], monkeypatch)
    assert exit.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and not runs.exists()
    return lines[0]


def test_a_checkpoint_past_max_epochs_is_refused_with_the_figure(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = trained
    checkpoint = torch.load(ckpt, weights_only=True)
    done = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"]
    checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] = done + 5
    line = refuse_fit(checkpoint, config, tmp_path, monkeypatch, capsys, "--trainer.max_epochs", str(done + 2))
    assert line.endswith(f"cannot be resumed: it has trained {done + 5} epoch(s) and trainer.max_epochs={done + 2} "
                         f"is below that: pass --trainer.max_epochs above {done + 5} to train on (or -1 for no limit)")


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("lr", 1e300, "a number >= 0 and at most 100"),
    ("eps", 10.0, "a number > 0 and at most 1"),
    ("weight_decay", 1e10, "a number >= 0 and at most 100"),
])
def test_optimizer_values_that_overflow_a_step_are_refused(key, value, allowed, trained, tmp_path, monkeypatch,
                                                           capsys):
    ckpt, config = trained
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["optimizer_states"][0]["param_groups"][0][key] = value
    line = refuse_fit(checkpoint, config, tmp_path, monkeypatch, capsys)
    assert f"optimizer_states[0].param_groups[0].{key}=" in line and line.endswith(f"expected {allowed}")


def test_a_loop_counter_past_two_to_the_31_is_refused_by_every_door(trained):
    checkpoint = torch.load(trained[0], weights_only=True)
    checkpoint["loops"]["fit_loop"]["epoch_progress"]["total"]["completed"] = 2**53
    with pytest.raises(CheckpointError, match=r"loops.fit_loop.epoch_progress.total.completed=9007199254740992 is "
                                              r"not allowed: expected a counter \(an int in \[0, 2147483647\]\)"):
        validate(checkpoint, "x.ckpt")


def test_a_checkpoint_of_another_data_module_does_not_resume(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = trained
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["datamodule_hyper_parameters"] = {"_class_path": "vit.data.SameDifferentDataModule",
                                                 "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    state = checkpoint.pop("TwoCirclesDataModule", None)
    if state is not None:
        checkpoint["SameDifferentDataModule"] = state
    line = refuse_fit(checkpoint, config, tmp_path, monkeypatch, capsys)
    assert "data.class_path: vit.data.SameDifferentDataModule in the checkpoint vs vit.data.TwoCirclesDataModule " \
           "given" in line


NFC, NFD = unicodedata.normalize("NFC", "café"), unicodedata.normalize("NFD", "café")


@pytest.mark.parametrize(("names", "message"), [
    (["   ", "b"], "class_names[0]='   ' is not allowed: it is blank"),
    (["cat\u202egod", "b"], "class_names[0]='cat\\u202egod' is not allowed: it holds the invisible character U+202E"),
    (["\x1b[2Jcat", "b"], "class_names[0]='\\x1b[2Jcat' is not allowed: it holds the invisible character U+001B"),
    ([NFC, NFD], f"class_names holds {NFC!r} twice, spelt with other Unicode code points (the same name after NFC "
                 "normalisation)"),
])
def test_class_names_that_read_as_another_are_refused(names, message, trained):
    checkpoint = torch.load(trained[0], weights_only=True)
    checkpoint["class_names"] = names
    with pytest.raises(CheckpointError) as err:
        validate(checkpoint, "x.ckpt")
    assert str(err.value) == f"checkpoint x.ckpt: {message}"
