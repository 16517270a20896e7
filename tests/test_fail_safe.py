"""A checkpoint never silently overrides what the user typed; bad numbers stop before anything is written."""

import copy
from pathlib import Path

import pytest
import torch
from robust_helpers import cli, error_line, main_in_process, run_dirs, shared_run, tiny_config


@pytest.fixture
def trained(tmp_path_factory, monkeypatch) -> Path:
    """`last.ckpt` of the shared uninterrupted tiny run (ViT width 32, lr 2e-3, batch 32)."""
    root = shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)
    [run_dir] = run_dirs(root)
    return run_dir / "checkpoints" / "last.ckpt"


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


@pytest.mark.parametrize(("override", "message"), [
    (["--model.backbone.init_args.num_heads", "0"], "num_heads=0 is not allowed: expected an int in [1, 32]"),
    (["--model.backbone.init_args.num_heads", "-2"], "num_heads=-2 is not allowed: expected an int in [1, 32]"),
    (["--model.backbone.init_args.embed_dim", "0"], "embed_dim=0 is not allowed: expected an int in [1, 65536]"),
    (["--model.backbone.init_args.embed_dim", "-4"], "embed_dim=-4 is not allowed: expected an int in [1, 65536]"),
    (["--model.backbone.init_args.mlp_ratio", "-1"], "mlp_ratio=-1.0 is not allowed: expected a finite number in (0, 64]"),
    (["--model.backbone.init_args.mlp_ratio", "0"], "mlp_ratio=0.0 is not allowed: expected a finite number in (0, 64]"),
    (["--model.backbone.init_args.depth", "100000000"], "depth=100000000 is not allowed: expected an int in [1, 1024]"),
    (["--model.betas", "[1.5, 0.9]"], "betas[0]=1.5 is not allowed: expected a finite number in [0, 1)"),
    (["--seed_everything", "99999999999999"], "seed_everything=99999999999999 is not allowed: expected an int in [0, 4294967295]"),
])
def test_bad_numbers_stop_with_one_line_before_any_folder(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == f"error: {message}"
    assert not (tmp_path / "runs").exists()


def test_a_save_dir_that_is_a_file_or_read_only_is_refused_before_any_folder(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    code, stderr = cli(["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(a_file / "runs")],
                       monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == (f"error: trainer.logger.init_args.save_dir={str(a_file / 'runs')!r} cannot be "
                                  f"created: {a_file} is a file, not a folder")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        probe = read_only / "probe"
        try:
            probe.write_text("")  # root ignores permissions: then there is nothing to test
            probe.unlink()
            pytest.skip("this user can write to a read-only folder")
        except PermissionError:
            pass
        code, stderr = cli(["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(read_only)],
                           monkeypatch, capsys)
        assert code == 2
        assert "cannot be written" in error_line(stderr) and "Permission denied" in error_line(stderr)
    finally:
        read_only.chmod(0o755)
    assert not (tmp_path / "runs").exists()


def test_fast_dev_run_writes_nothing_outside_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main_in_process(["fit", "--config", str(tiny_config(tmp_path / "cfg")), "--trainer.fast_dev_run", "2"], monkeypatch)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["cfg/tiny.yaml"]


def test_a_run_folder_is_claimed_by_an_exclusive_create(tmp_path, monkeypatch, capsys):
    """Two runs that pass the "is this folder free" check at once: the second to write its config is refused."""
    from vit.training import run_dir

    real_check = run_dir.check_run_dir

    def other_run_claims_it_first(folder, **kwargs):
        real_check(folder, **kwargs)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.yaml").write_text("the other run's config\n")

    monkeypatch.setattr(run_dir, "check_run_dir", other_run_claims_it_first)
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path))], monkeypatch, capsys)
    assert code == 2
    folder = tmp_path / "runs" / "tiny" / "version_0"
    assert error_line(stderr).startswith(f"error: {folder / 'config.yaml'} was written by another run while this one started")
    assert (folder / "config.yaml").read_text() == "the other run's config\n"


def test_resuming_with_another_number_of_processes_is_refused(trained, tmp_path, monkeypatch, capsys):
    checkpoint = torch.load(trained, weights_only=True)
    assert checkpoint["TwoCirclesDataModule"]["world_size"] == 1
    checkpoint["TwoCirclesDataModule"]["world_size"] = 2  # as if two DDP processes had written it
    path = tmp_path / "two_processes.ckpt"
    torch.save(checkpoint, path)
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(path)], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr).startswith(f"error: checkpoint {path} was written by 2 process(es) and this run has 1")


def test_fit_from_a_checkpoint_of_the_lambdalr_schedule_is_refused_and_evaluating_it_is_not(
    trained, tmp_path, monkeypatch, capsys
):
    checkpoint = torch.load(trained, weights_only=True)
    # What the earlier version saved: a LambdaLR's state (its lambda itself is not saved).
    checkpoint["lr_schedulers"] = [{"base_lrs": [1e-3, 1e-3], "last_epoch": 8, "_step_count": 9, "lr_lambdas": [None]}]
    path = tmp_path / "lambdalr.ckpt"
    torch.save(checkpoint, path)
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(path)], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == (
        f"error: checkpoint {path} was written by an earlier version of this project (a LambdaLR schedule), whose "
        "optimizer and schedule states this version cannot continue; validate, test and predict can use it, "
        "or fine-tune from its weights in a new run"
    )
    assert not (tmp_path / "runs").exists()
    # validate loads only the weights: it runs (a refusal would be a SystemExit here).
    main_in_process(["validate", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(path)], monkeypatch)


def test_loader_settings_may_change_on_resume(trained, tmp_path, monkeypatch):
    from vit.training.preflight import config_differences
    from vit.training.classifier import ImageClassifier

    checkpoint = torch.load(trained, weights_only=True)
    config = {"model": {}, "data": {"init_args": {**checkpoint["datamodule_hyper_parameters"], "num_workers": 4}}}
    config["data"]["init_args"].pop("_class_path", None)
    errors, _ = config_differences("fit", config, checkpoint, ImageClassifier)
    assert errors == []
    config["data"]["init_args"]["num_train"] = 999
    errors, _ = config_differences("fit", config, checkpoint, ImageClassifier)
    assert errors == ["data.num_train: 256 in the checkpoint vs 999 given"]
