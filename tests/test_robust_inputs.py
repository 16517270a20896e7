"""Bad input gets a one-paragraph error naming the value and what is allowed, before work is lost."""

import re
from pathlib import Path

import pytest
import torch
from robust_helpers import cli, error_line, run_dirs, shared_run, tiny_config
from torchvision import datasets

import vit.data.cifar as cifar
from vit.data.cifar import CIFARCorruptedError, CIFARDataModule, CIFARNotFoundError
from vit.data.fake_cifar import write_fake_cifar
from vit.models import ResNet, VisionTransformer
from vit.training.callbacks import NonFiniteError, check_finite_weights
from vit.training.classifier import ImageClassifier


@pytest.fixture
def reference(tmp_path_factory, monkeypatch) -> Path:
    return shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch)


# --- checkpoints -----------------------------------------------------------------------------------


def write_checkpoint_variants(tmp_path: Path, good: Path) -> dict[str, Path]:
    checkpoint = torch.load(good, weights_only=True)
    paths = {"good": good}
    paths["truncated"] = tmp_path / "truncated.ckpt"
    paths["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    paths["garbage"] = tmp_path / "garbage.ckpt"
    paths["garbage"].write_bytes(b"this is not a checkpoint\n")
    paths["empty"] = tmp_path / "empty.ckpt"
    paths["empty"].write_bytes(b"")
    ten = {**checkpoint, "state_dict": dict(checkpoint["state_dict"])}
    ten["state_dict"]["backbone.head.weight"] = torch.zeros(10, 32)
    ten["state_dict"]["backbone.head.bias"] = torch.zeros(10)
    ten["hyper_parameters"] = {**checkpoint["hyper_parameters"]}
    ten["hyper_parameters"]["backbone"] = {"class_path": "vit.models.VisionTransformer",
                                           "init_args": {**checkpoint["hyper_parameters"]["backbone"]["init_args"], "num_classes": 10}}
    paths["ten_classes"] = tmp_path / "ten_classes.ckpt"
    torch.save(ten, paths["ten_classes"])
    # A model built in Python (no LightningCLI) records no backbone config: only the tensors can tell.
    resnet = ImageClassifier(ResNet(img_size=32, in_chans=1, num_classes=2, widths=(8,)))
    paths["resnet"] = tmp_path / "resnet.ckpt"
    torch.save({"state_dict": resnet.state_dict(), "hyper_parameters": dict(resnet.hparams)}, paths["resnet"])
    paths["weights_only"] = tmp_path / "weights_only.ckpt"
    torch.save({k: v for k, v in checkpoint.items() if k not in ("optimizer_states", "loops")}, paths["weights_only"])
    return paths


BAD_CHECKPOINTS = {
    "missing": r"checkpoint .*nope\.ckpt does not exist",
    "folder": r"checkpoint .* is a folder, not a checkpoint file",
    "empty": r"checkpoint .*empty\.ckpt is empty \(0 bytes\)",
    "truncated": r"checkpoint .*truncated\.ckpt is truncated: it starts like a checkpoint but its end is missing",
    "garbage": r"checkpoint .*garbage\.ckpt is not a PyTorch checkpoint",
    "ten_classes": r"checkpoint .*ten_classes\.ckpt does not fit this config: checkpoint trained with num_classes=10, "
                   r"this config has num_classes=2\. .*backbone\.head\.weight \(10, 32\) in the checkpoint, \(2, 32\) here",
    "resnet": r"checkpoint .*resnet\.ckpt does not fit this config: it holds another architecture: only 2 of its 20 "
              r"tensors have names this model uses",
}


# Every kind of bad file with `test`; one per other subcommand (each CLI call costs about a second).
CASES = [("test", name) for name in BAD_CHECKPOINTS] + [("fit", "ten_classes"), ("validate", "truncated"),
                                                        ("predict", "resnet")]


def test_bad_checkpoints_are_named_with_what_is_wrong(tmp_path, reference, monkeypatch, capsys):
    [run_dir] = run_dirs(reference)
    paths = write_checkpoint_variants(tmp_path, run_dir / "checkpoints" / "last.ckpt")
    paths["missing"], paths["folder"] = tmp_path / "nope.ckpt", tmp_path
    config = tiny_config(tmp_path / "cfg")
    for subcommand, name in CASES:
        pattern = BAD_CHECKPOINTS[name]
        code, stderr = cli([subcommand, "--config", str(config), "--ckpt_path", str(paths[name])], monkeypatch, capsys)
        assert code == 2, (subcommand, name)
        assert re.fullmatch(f"error: {pattern}.*", error_line(stderr)), (subcommand, name, stderr)
    assert not (tmp_path / "cfg" / "runs").exists()  # refused before any run folder was made


def test_weights_only_checkpoint_cannot_resume_fit(tmp_path, reference, monkeypatch, capsys):
    [run_dir] = run_dirs(reference)
    paths = write_checkpoint_variants(tmp_path, run_dir / "checkpoints" / "last.ckpt")
    config = tiny_config(tmp_path / "cfg")
    code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", str(paths["weights_only"])], monkeypatch, capsys)
    assert code == 2
    assert "weights_only.ckpt holds weights only (no optimizer or loop state), so `fit` cannot resume" in error_line(stderr)


def test_ckpt_path_last_without_any_run_is_an_error_outside_fit(tmp_path, monkeypatch, capsys):
    code, stderr = cli(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", "last"], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == f"error: --ckpt_path last: there is no last.ckpt under {tmp_path}/runs/tiny/*/checkpoints"


# --- configuration values --------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    (["--model.lr", "-1"], "error: lr=-1.0 is not allowed: expected a finite number in (0, inf)"),
    (["--trainer.max_epochs", "0"], "error: trainer.max_epochs=0 would train nothing: expected a positive number (or -1 for no limit)"),
    (["--trainer.max_epochs", "-5"], "error: `max_epochs` must be a non-negative integer or -1. You passed in -5."),
    (["--model.backbone.init_args.patch_size", "64"], "error: patch_size=64 must be in [1, img_size=32]"),
    (["--data.init_args.batch_size", "0"], "error: batch_size=0 is not allowed: expected an int >= 1"),
])
def test_out_of_range_values_stop_with_one_paragraph(override, message, tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), *override], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == message
    assert not (tmp_path / "runs").exists()


def test_unknown_option_names_are_rejected_by_the_parser(tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tiny_config(tmp_path)), "--model.lrr", "3"], monkeypatch, capsys)
    assert code == 2
    assert "error: unrecognized arguments: --model.lrr 3" in stderr and "Traceback" not in stderr


# --- run directories -------------------------------------------------------------------------------


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


def test_non_finite_loss_stops_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path, every_n_train_steps=1)
    code, stderr = cli(["fit", "--config", str(config), "--model.lr", "1e30"], monkeypatch, capsys)
    assert code == 1
    line = error_line(stderr)
    match = re.match(r"error: train/loss is (nan|inf|-inf) at training step (\d+) \(epoch 0, batch (\d+)\); "
                     r"training stopped at step \d+, and nothing from this step on was checkpointed\. "
                     r"The checkpoints written before it are kept: (\S+)\.", line)
    assert match, line
    step, last = int(match[2]), Path(match[4])
    assert step >= 1 and int(match[3]) == step
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["global_step"] == step  # written after the last finite step, nothing after it
    assert all(t.isfinite().all() for t in checkpoint["state_dict"].values() if t.is_floating_point())


def test_a_checkpoint_with_non_finite_weights_is_refused():
    model = ImageClassifier(VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=2, embed_dim=8,
                                              depth=1, num_heads=2))
    with torch.no_grad():
        model.backbone.head.bias[1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"backbone\.head\.bias holds NaN or infinite values at training step 0"):
        check_finite_weights(model.state_dict(), step=0)


# --- data folders ----------------------------------------------------------------------------------


@pytest.fixture
def fake_cifar(tmp_path, monkeypatch) -> Path:
    checksums = write_fake_cifar(tmp_path, "cifar10", num_train=20, num_test=10)
    cls = datasets.CIFAR10  # torchvision checks the official MD5s: expect those of the generated files
    monkeypatch.setattr(cls, "train_list", [[n, checksums[n]] for n, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[n, checksums[n]] for n, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": checksums[cls.meta["filename"]]})
    return tmp_path


def test_corrupted_cifar_files_are_named(fake_cifar):
    folder = fake_cifar / "cifar-10-batches-py"
    batch = folder / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:100])  # truncated pickle
    dm = CIFARDataModule(data_dir=str(fake_cifar), download=False, val_size=4, num_workers=0)
    with pytest.raises(CIFARCorruptedError) as err:
        dm.prepare_data()
    assert isinstance(err.value, CIFARNotFoundError)  # reported by whatever reports a missing dataset
    lines = str(err.value).splitlines()
    assert lines[0] == f"CIFAR-10 files in {folder} cannot be used:"
    assert lines[1] == "  data_batch_2 is not the official file (its MD5 differs): truncated, corrupted or from another dataset"
    assert "extract it into" in str(err.value)
    with pytest.raises(CIFARCorruptedError):
        dm.setup("fit")  # other ranks and notebooks call setup without prepare_data


def test_unreadable_cifar_files_are_named(fake_cifar, monkeypatch):
    real = cifar.check_integrity

    def check_integrity(path, md5):  # what a file without read permission does (root can read anything)
        if path.endswith("test_batch"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, md5)

    monkeypatch.setattr(cifar, "check_integrity", check_integrity)
    dm = CIFARDataModule(data_dir=str(fake_cifar), download=False, val_size=4, num_workers=0)
    with pytest.raises(CIFARCorruptedError, match=r"\n  test_batch cannot be read \(Permission denied\)"):
        dm.prepare_data()
