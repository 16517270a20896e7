"""A checkpoint never silently overrides what the user typed; bad numbers stop before anything is written."""

import copy
from pathlib import Path

import pytest
import torch
from robust_helpers import main_in_process, run_dirs, shared_run, tiny_config


@pytest.fixture
def trained(tmp_path_factory, monkeypatch) -> Path:
    """`last.ckpt` of the shared uninterrupted tiny run (ViT width 32, lr 2e-3, batch 32)."""
    root = shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)
    [run_dir] = run_dirs(root)
    return run_dir / "checkpoints" / "last.ckpt"


def cli(args, monkeypatch, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main_in_process(args, monkeypatch)
    return exit_info.value.code, capsys.readouterr().err


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return line


@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_a_width_given_on_the_command_line_that_differs_from_the_checkpoint_is_an_error(
        subcommand, trained, tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path)
    code, stderr = cli([subcommand, "--config", str(config), "--ckpt_path", str(trained),
                        "--model.backbone.init_args.embed_dim", "64"], monkeypatch, capsys)
    assert code == 2
    line = error_line(stderr)
    assert "model.backbone.init_args.embed_dim: 32 in the checkpoint vs 64 given" in line
    assert not (tmp_path / "runs").exists()  # refused before any run folder


def test_fit_from_a_checkpoint_with_another_lr_is_an_error(trained, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained),
                        "--model.lr", "0.01"], monkeypatch, capsys)
    assert code == 2
    assert "model.lr: 0.002 in the checkpoint vs 0.01 given" in error_line(stderr)


def test_fit_from_a_checkpoint_with_another_batch_size_is_an_error(trained, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained),
                        "--data.init_args.batch_size", "16"], monkeypatch, capsys)
    assert code == 2
    assert "data.batch_size: 32 in the checkpoint vs 16 given" in error_line(stderr)


def test_evaluating_with_another_lr_warns_once_and_uses_the_checkpoint(trained, tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match=r"the checkpoint's value is used for model\.lr: 0\.002 in the checkpoint vs 0\.01 given"):
        main_in_process(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained),
                         "--model.lr", "0.01"], monkeypatch)


def test_a_resnet_checkpoint_with_a_vit_config_is_an_error(trained, tmp_path, monkeypatch, capsys):
    checkpoint = torch.load(trained, weights_only=True)
    resnet = copy.deepcopy(checkpoint)
    resnet["hyper_parameters"]["backbone"] = {"class_path": "vit.models.ResNet", "init_args": {"widths": [8]}}
    path = tmp_path / "resnet.ckpt"
    torch.save(resnet, path)
    code, stderr = cli(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(path)], monkeypatch, capsys)
    assert code == 2
    assert "model.backbone.class_path: vit.models.ResNet in the checkpoint vs vit.models.VisionTransformer given" in error_line(stderr)


def test_values_left_at_their_defaults_take_the_checkpoints_silently(trained, tmp_path, monkeypatch, recwarn):
    # The tiny config sets the backbone explicitly; a config without a drop_rate line leaves it to the checkpoint.
    main_in_process(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained)], monkeypatch)
    assert not [w for w in recwarn if "checkpoint's value is used" in str(w.message)]
