"""Bad input to train.py: one `error:` line naming the value and what is allowed, before work is lost.

A checkpoint never silently overrides what the user typed, and one that cannot be used is named with what is
wrong; numbers, trainer settings and run folders are checked before anything is written; a loss that blows
up stops at its step and keeps the last good checkpoint; damaged CIFAR files are named.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from robust_helpers import (
    STEPS_PER_EPOCH,
    cli,
    error_line,
    main_in_process,
    run_dirs,
    save_with_folder,
    shared_run,
    tiny_config,
)
from torchvision import datasets

import vit.data.cifar as cifar
from vit.data.cifar import CIFARCorruptedError, CIFARDataModule, CIFARNotFoundError
from vit.data.fake_cifar import write_fake_cifar
from vit.models import VisionTransformer
from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.classifier import ImageClassifier

NO_CLIPPING = "(0 or null: no clipping)"


@pytest.fixture
def trained(tmp_path_factory, monkeypatch) -> Path:
    """`last.ckpt` of the shared uninterrupted tiny run (ViT width 32, lr 2e-3, batch 32)."""
    root = shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)
    [run_dir] = run_dirs(root)
    return run_dir / "checkpoints" / "last.ckpt"


# --- a checkpoint against what the user typed ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("subcommand", ["fit", "test"])
def test_a_width_given_on_the_command_line_that_differs_from_the_checkpoint_is_an_error(
    subcommand, trained, tmp_path, monkeypatch, capsys
):
    config = tiny_config(tmp_path)
    code, stderr = cli(
        [
            subcommand,
            "--config",
            str(config),
            "--ckpt_path",
            str(trained),
            "--model.backbone.init_args.embed_dim",
            "64",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2
    line = error_line(stderr)
    assert "model.backbone.init_args.embed_dim: 32 in the checkpoint vs 64 given" in line
    assert not (tmp_path / "runs").exists()  # refused before any run folder


@pytest.mark.slow
def test_fit_from_a_checkpoint_with_another_lr_is_an_error(trained, tmp_path, monkeypatch, capsys):
    code, stderr = cli(
        ["fit", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained), "--model.lr", "0.01"],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert "model.lr: 0.002 in the checkpoint vs 0.01 given" in error_line(stderr)


@pytest.mark.slow
def test_fit_from_a_checkpoint_with_another_batch_size_is_an_error(trained, tmp_path, monkeypatch, capsys):
    code, stderr = cli(
        [
            "fit",
            "--config",
            str(tiny_config(tmp_path)),
            "--ckpt_path",
            str(trained),
            "--data.init_args.batch_size",
            "16",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert "data.batch_size: 32 in the checkpoint vs 16 given" in error_line(stderr)


@pytest.mark.slow
def test_evaluating_a_model_folder_gives_what_its_checkpoint_gives_and_reads_no_checkpoint(
    trained, tmp_path, monkeypatch, capsys
):
    import vit.artifact.io as checkpoint_io

    config = str(tiny_config(tmp_path))
    monkeypatch.setattr(
        checkpoint_io.AtomicCheckpointIO, "load_checkpoint", lambda *a, **k: pytest.fail("Lightning read a checkpoint")
    )
    outputs = []
    for given in (trained, trained.with_suffix("")):  # the .ckpt (its folder is opened) and the folder itself
        main_in_process(["test", "--config", config, "--ckpt_path", str(given)], monkeypatch)
        outputs.append(capsys.readouterr().out)
        assert f"({trained.with_suffix('')})" in outputs[-1] and "test/acc = " in outputs[-1]
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_a_model_folder_whose_backbone_is_not_its_weights_is_refused_naming_a_tensor(
    trained, tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "resnet"
    shutil.copytree(trained.with_suffix(""), folder)
    config = json.loads((folder / "config.json").read_text())
    config["vit"]["backbone"] = {"class_path": "vit.models.ResNet", "init_args": {"widths": [8]}}
    (folder / "config.json").write_text(json.dumps(config))
    code, stderr = cli(
        ["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(folder)], monkeypatch, capsys
    )
    assert code == 2
    line = error_line(stderr)
    assert line.startswith(
        f"error: model folder {folder}: model.safetensors does not fit the backbone config.json "
        "records (50 tensors differ): head.bias: (2,) in the weights, (10,) here; "
    ), line  # the head's shapes, then 18 missing and 30 unexpected
    assert "stages.0.0.bn1.bias missing from the weights" in line, line


@pytest.mark.slow
def test_values_left_at_their_defaults_take_the_checkpoints_silently(trained, tmp_path, monkeypatch, recwarn):
    # The tiny config sets the backbone explicitly; a config without a drop_rate line leaves it to the checkpoint.
    main_in_process(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(trained)], monkeypatch)
    assert not [w for w in recwarn if "checkpoint's value is used" in str(w.message)]


@pytest.mark.slow
def test_loader_settings_may_change_on_resume(trained, tmp_path, monkeypatch):
    from vit.training.classifier import ImageClassifier
    from vit.training.preflight import config_differences

    checkpoint = torch.load(trained, weights_only=True)
    config = {"model": {}, "data": {"init_args": {**checkpoint["datamodule_hyper_parameters"], "num_workers": 4}}}
    config["data"]["init_args"].pop("_class_path", None)
    errors, _ = config_differences("fit", config, checkpoint, ImageClassifier)
    assert errors == []
    config["data"]["init_args"]["num_train"] = 999
    errors, _ = config_differences("fit", config, checkpoint, ImageClassifier)
    assert errors == ["data.num_train: 256 in the checkpoint vs 999 given"]


# --- checkpoints that cannot be used ---------------------------------------------------------------


def write_checkpoint_variants(tmp_path: Path, good: Path) -> dict[str, Path]:
    """Bad model sources for validate, test and predict."""
    checkpoint = torch.load(good, weights_only=True)
    paths = {"missing": tmp_path / "nope.ckpt", "folder": tmp_path}
    paths["alone"] = tmp_path / "alone.ckpt"
    paths["alone"].write_bytes(good.read_bytes())
    ten = {**checkpoint, "state_dict": dict(checkpoint["state_dict"])}
    ten["state_dict"]["backbone.head.weight"] = torch.zeros(10, 32)
    ten["state_dict"]["backbone.head.bias"] = torch.zeros(10)
    ten["hyper_parameters"] = {**checkpoint["hyper_parameters"]}
    init_args = {**checkpoint["hyper_parameters"]["backbone"]["init_args"], "num_classes": 10}
    ten["hyper_parameters"]["backbone"] = {"class_path": "vit.models.VisionTransformer", "init_args": init_args}
    ten["class_names"] = [f"class {i}" for i in range(10)]
    paths["ten_classes"] = save_with_folder(ten, tmp_path / "ten_classes.ckpt")
    return paths


BAD_CHECKPOINTS = {
    "missing": r"checkpoint .*nope\.ckpt does not exist",
    # validate, test and predict open a model folder: a folder without its config.json is not one
    "folder": r"model folder .* has no config\.json: it is not a model folder",
    "alone": r"checkpoint .*alone\.ckpt has no model folder beside it \(alone/\)",
    "ten_classes": r"model folder .*ten_classes does not fit this config: its model was trained with "
    r"num_classes=10, the data module gives num_classes=2",
}


@pytest.mark.slow
def test_bad_models_are_named_with_what_is_wrong(tmp_path, trained, monkeypatch, capsys):
    paths = write_checkpoint_variants(tmp_path, trained)
    config = tiny_config(tmp_path / "cfg")
    cases = [("test", name) for name in BAD_CHECKPOINTS] + [("validate", "alone"), ("predict", "ten_classes")]
    for subcommand, name in cases:
        pattern = BAD_CHECKPOINTS[name]
        code, stderr = cli([subcommand, "--config", str(config), "--ckpt_path", str(paths[name])], monkeypatch, capsys)
        assert code == 2, (subcommand, name)
        assert re.fullmatch(f"error: {pattern}.*", error_line(stderr)), (subcommand, name, stderr)
    assert not (tmp_path / "cfg" / "runs").exists()  # refused before any run folder was made


def in_a_run(trained: Path, tmp_path: Path, content: bytes | None = None) -> tuple[Path, Path]:
    """A copy of the trained run where `tiny_config(tmp_path)` writes, its last.ckpt replaced by `content`."""
    run = tmp_path / "runs" / "tiny" / "version_0"
    shutil.copytree(trained.parent.parent, run)
    last = run / "checkpoints" / "last.ckpt"
    if content is not None:
        last.write_bytes(content)
    return last, tiny_config(tmp_path, max_epochs=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["empty", "truncated", "garbage", "weights only", "a plain state dict"])
def test_a_trainer_state_that_cannot_be_read_is_named_in_one_line(name, tmp_path, trained, monkeypatch, capsys):
    good = trained.read_bytes()
    checkpoint = torch.load(trained, weights_only=True)
    saved = tmp_path / "saved.ckpt"
    if name == "weights only":
        torch.save({k: v for k, v in checkpoint.items() if k not in ("optimizer_states", "loops")}, saved)
    elif name == "a plain state dict":
        torch.save({"state_dict": checkpoint["state_dict"]}, saved)
    content = {"empty": b"", "truncated": good[: len(good) // 2], "garbage": b"this is not a checkpoint\n"}.get(name)
    last, config = in_a_run(trained, tmp_path / "work", saved.read_bytes() if content is None else content)
    code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", str(last)], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in stderr
    expected = {
        "empty": "is empty (0 bytes)",
        "truncated": "cannot be loaded as data",
        "garbage": "cannot be loaded as data",
        "weights only": "cannot be resumed: KeyError: 'Trying to restore optimizer state but checkpoint "
        "contains only the model",
        "a plain state dict": "cannot be resumed",
    }[name]
    assert error_line(stderr).startswith(f"error: checkpoint {last}") and expected in error_line(stderr), stderr


@pytest.mark.slow
def test_ckpt_path_last_without_any_run_is_an_error_outside_fit(tmp_path, monkeypatch, capsys):
    code, stderr = cli(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", "last"], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == (
        f"error: --ckpt_path last: there is no last.ckpt under {tmp_path}/runs/tiny/*/checkpoints"
    )


def test_a_checkpoint_with_non_finite_weights_is_refused():
    model = ImageClassifier(
        VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=2, embed_dim=8, depth=1, num_heads=2)
    )
    with torch.no_grad():
        model.backbone.head.bias[1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"backbone\.head\.bias holds NaN or infinite values at training step 0"):
        check_finite_weights(model.state_dict(), step=0)


# --- configuration values --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.backbone.init_args.num_heads", "0"], "num_heads=0 is not allowed: expected an int in [1, 32]"),
        (["--model.backbone.init_args.num_heads", "-2"], "num_heads=-2 is not allowed: expected an int in [1, 32]"),
        (["--model.backbone.init_args.embed_dim", "0"], "embed_dim=0 is not allowed: expected an int in [1, 65536]"),
        (["--model.backbone.init_args.embed_dim", "-4"], "embed_dim=-4 is not allowed: expected an int in [1, 65536]"),
        (
            ["--model.backbone.init_args.mlp_ratio", "-1"],
            "mlp_ratio=-1.0 is not allowed: expected a finite number in (0, 64]",
        ),
        (
            ["--model.backbone.init_args.mlp_ratio", "0"],
            "mlp_ratio=0.0 is not allowed: expected a finite number in (0, 64]",
        ),
        (
            ["--model.backbone.init_args.depth", "100000000"],
            "depth=100000000 is not allowed: expected an int in [1, 1024]",
        ),
        (["--model.betas", "[1.5, 0.9]"], "betas[0]=1.5 is not allowed: expected a finite number in [0, 1)"),
        (
            ["--seed_everything", "99999999999999"],
            "seed_everything=99999999999999 is not allowed: expected an int in [0, 4294967295]",
        ),
    ],
)
def test_bad_numbers_stop_with_one_line_before_any_folder(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == f"error: {message}"
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.lr", "-1"], "error: lr=-1.0 is not allowed: expected a finite number in (0, inf)"),
        (
            ["--trainer.max_epochs", "0"],
            "error: trainer.max_epochs=0 would train nothing: expected a positive number (or -1 for no limit)",
        ),
        (["--trainer.max_epochs", "-5"], "error: `max_epochs` must be a non-negative integer or -1. You passed in -5."),
        (["--model.backbone.init_args.patch_size", "64"], "error: patch_size=64 must be in [1, img_size=32]"),
        (["--data.init_args.batch_size", "0"], "error: batch_size=0 is not allowed: expected an int >= 1"),
    ],
)
def test_out_of_range_values_stop_with_one_paragraph(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == message
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_unknown_option_names_are_rejected_by_the_parser(tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--model.lrr", "3"], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == "error: unknown option --model.lrr; did you mean --model.lr?"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "message"),
    [
        # 0 divided by zero once training started: a traceback, after the run folder was made.
        (
            ["--trainer.accumulate_grad_batches", "0"],
            "trainer.accumulate_grad_batches=0 is not allowed: expected an int >= 1 (1: a step after every batch)",
        ),
        (
            ["--trainer.accumulate_grad_batches", "-2"],
            "trainer.accumulate_grad_batches=-2 is not allowed: expected an int >= 1 (1: a step after every batch)",
        ),
        # A negative value turned clipping off without a word.
        (
            ["--trainer.gradient_clip_val", "-1.0"],
            f"trainer.gradient_clip_val=-1.0 is not allowed: expected a finite number in [0, inf) {NO_CLIPPING}",
        ),
        (
            ["--trainer.gradient_clip_val", "-0.5"],
            f"trainer.gradient_clip_val=-0.5 is not allowed: expected a finite number in [0, inf) {NO_CLIPPING}",
        ),
    ],
)
def test_bad_trainer_options_stop_with_one_line_before_any_folder(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == f"error: {message}"
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_smallest_allowed_trainer_options_train_as_they_say(tmp_path, monkeypatch):
    # accumulate_grad_batches=2: one optimizer step every second batch; gradient_clip_val=0: no clipping at all.
    from lightning.pytorch.plugins.precision import Precision

    clipped = []
    monkeypatch.setattr(Precision, "clip_grad_by_norm", lambda self, optimizer, value: clipped.append(value))
    monkeypatch.setattr(Precision, "clip_grad_by_value", lambda self, optimizer, value: clipped.append(value))
    main_in_process(
        [
            "fit",
            "--config",
            str(tiny_config(tmp_path, max_epochs=1)),
            "--test_after_fit",
            "false",
            "--trainer.accumulate_grad_batches",
            "2",
            "--trainer.gradient_clip_val",
            "0",
        ],
        monkeypatch,
    )
    [run_dir] = run_dirs(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == STEPS_PER_EPOCH // 2
    assert clipped == []


# --- run folders -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_save_dir_that_is_a_file_or_read_only_is_refused_before_any_folder(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    code, stderr = cli(
        ["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(a_file / "runs")],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert error_line(stderr) == (
        f"error: trainer.logger.init_args.save_dir={str(a_file / 'runs')!r} cannot be "
        f"created: {a_file} is a file, not a folder"
    )
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
        code, stderr = cli(
            ["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(read_only)], monkeypatch, capsys
        )
        assert code == 2
        assert "cannot be written" in error_line(stderr) and "Permission denied" in error_line(stderr)
    finally:
        read_only.chmod(0o755)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_fast_dev_run_writes_nothing_outside_a_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main_in_process(["fit", "--config", str(tiny_config(tmp_path / "cfg")), "--trainer.fast_dev_run", "2"], monkeypatch)
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["cfg/tiny.yaml"]


@pytest.mark.slow
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
    assert error_line(stderr).startswith(
        f"error: {folder / 'config.yaml'} was written by another run while this one started"
    )
    assert (folder / "config.yaml").read_text() == "the other run's config\n"


@pytest.mark.slow
@pytest.mark.parametrize("earlier", ["config.yaml", "checkpoints/epoch00.ckpt"])
def test_a_run_directory_in_use_is_never_overwritten(earlier, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    (run_dir / earlier).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / earlier).write_text("from an earlier run")
    args = ["fit", "--config", str(tiny_config(tmp_path)), "--trainer.logger.init_args.version", "0"]
    code, stderr = cli(args, monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr).startswith(f"error: the run directory {run_dir} already holds a run")
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()) == [earlier]
    assert (run_dir / earlier).read_text() == "from an earlier run"


# --- a loss that blows up --------------------------------------------------------------------------


@pytest.mark.slow
def test_non_finite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path, every_n_train_steps=1)
    code, stderr = cli(["fit", "--config", str(config), "--model.lr", "1e30"], monkeypatch, capsys)
    assert code == 1
    line = error_line(stderr)
    match = re.match(
        r"error: train/loss is (nan|inf|-inf) at training step (\d+) \(epoch 0, batch (\d+)\); "
        r"training stopped at step \d+, and nothing from this step on was checkpointed\. "
        r"The checkpoints written before it are kept: (\S+)\.",
        line,
    )
    assert match, line
    step, last = int(match[2]), Path(match[4])
    assert step >= 1 and int(match[3]) == step
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == step  # written after the last finite step, nothing after it
    assert all(t.isfinite().all() for t in checkpoint["state_dict"].values() if t.is_floating_point())


# --- data folders ----------------------------------------------------------------------------------


@pytest.fixture
def cifar10_folder(tmp_path, monkeypatch) -> Path:
    """A generated CIFAR-10 folder of the test's own: the tests damage it, and conftest's `fake_cifar` is shared."""
    checksums = write_fake_cifar(tmp_path, "cifar10", num_train=20, num_test=10)
    cls = datasets.CIFAR10  # torchvision checks the official MD5s: expect those of the generated files
    monkeypatch.setattr(cls, "train_list", [[n, checksums[n]] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, checksums[n]] for n, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": checksums[cls.meta["filename"]]})
    return tmp_path


def test_corrupted_cifar_files_are_named(cifar10_folder):
    folder = cifar10_folder / "cifar-10-batches-py"
    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:100])  # truncated pickle
    dm = CIFARDataModule(data_dir=str(cifar10_folder), download=False, val_size=4, num_workers=0)
    with pytest.raises(CIFARCorruptedError) as err:
        dm.prepare_data()
    assert isinstance(err.value, CIFARNotFoundError)  # reported by whatever reports a missing dataset
    lines = str(err.value).splitlines()
    assert lines[0] == f"CIFAR-10 files in {folder} cannot be used:"
    assert lines[1] == (
        "  data_batch_2 is not the official file (its MD5 differs): truncated, corrupted or from another dataset"
    )
    assert "extract it into" in str(err.value)
    with pytest.raises(CIFARCorruptedError):
        dm.setup("fit")  # other ranks and notebooks call setup without prepare_data


def test_unreadable_cifar_files_are_named(cifar10_folder, monkeypatch):
    real = cifar.check_integrity

    def check_integrity(path, md5):  # what a file without read permission does (root can read anything)
        if path.endswith("test_batch"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, md5)

    monkeypatch.setattr(cifar, "check_integrity", check_integrity)
    dm = CIFARDataModule(data_dir=str(cifar10_folder), download=False, val_size=4, num_workers=0)
    with pytest.raises(CIFARCorruptedError, match=r"\n  test_batch cannot be read \(Permission denied\)"):
        dm.prepare_data()
