"""The CIFAR recipes through the command line, on small generated CIFAR folders (no network, no GPU)."""

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torchvision.transforms import v2

from vit.models import ResNet, VisionTransformer
from vit.training.cli import main

pytestmark = pytest.mark.slow  # every test runs train.py (in this process)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(autouse=True)
def command_line(monkeypatch, tmp_path):
    """Run as `train.py` from an empty folder: pytest's own arguments are not the CLI's, and whatever
    a run writes (runs/, data/) lands in the test's temporary folder."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def matmul_precision():
    """Start from torch's default ('highest') and restore whatever was set before, after the test."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def small_cpu_run(config: Path, data_dir: Path, *extra: str) -> list[str]:
    """`fit` of a recipe, shrunk for a CPU test: one step and one validation batch of 8 images."""
    return [
        "fit",
        "--config", str(config),
        "--data.data_dir", str(data_dir),
        "--data.download", "false",
        "--data.num_workers", "0",
        "--data.batch_size", "8",
        "--data.val_size", "12",
        "--trainer.fast_dev_run", "true",
        "--trainer.accelerator", "cpu",
        # bf16 autocast works on a CPU but is no faster than float32 here; the test does not need it.
        "--trainer.precision", "32-true",
        "--model.compile", "false",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("config", "dataset", "backbone_cls", "extra", "matmul"),
    [("cifar10/vit.yaml", "cifar10", VisionTransformer, [], "high"),  # the YAML's value
     ("cifar10/cnn.yaml", "cifar10", ResNet, ["--float32_matmul_precision", "medium"], "medium")],
)  # fmt: skip
def test_recipe_trains_one_step_through_the_cli(
    fake_cifar, matmul_precision, config, dataset, backbone_cls, extra, matmul
):
    data_dir = fake_cifar(dataset)
    cli = main(args=small_cpu_run(CONFIGS / config, data_dir, *extra))

    num_classes = {"cifar10": 10, "cifar100": 100}[dataset]
    backbone = cli.model.backbone
    assert isinstance(backbone, backbone_cls) and backbone.num_classes == num_classes  # linked from the data
    assert cli.trainer.global_step == 1
    assert torch.get_float32_matmul_precision() == matmul  # set before the trainer was built

    # The recipe as written in the YAML reached the objects.
    hp, dm = cli.model.hparams, cli.datamodule
    assert (hp.lr, hp.weight_decay, hp.label_smoothing, hp.warmup_epochs) == (1e-3, 0.05, 0.1, 10)
    assert cli.config.fit.trainer.max_epochs == 200 and cli.config.fit.trainer.precision == "32-true"
    assert "AutoAugment" in [type(t).__name__ for t in dm.train_transform.transforms]
    erasing = dm.train_transform.transforms[-1]
    assert isinstance(erasing, v2.RandomErasing) and erasing.p == 0.25
    assert (dm.mixup.mixup_alpha, dm.mixup.cutmix_alpha, dm.mixup.mix_prob) == (1.0, 1.0, 0.5)
    if backbone_cls is VisionTransformer:
        # After one small step from timm's initialisation (head weights of std 0.02) the logits are
        # still near 0, so the loss is that of a uniform prediction, ln(num_classes), whatever the
        # (smoothed, mixed) targets.
        loss = float(cli.trainer.callback_metrics["train/loss"])
        assert abs(loss - math.log(num_classes)) < 0.3
        assert len(backbone.blocks) == 9 and backbone.blocks[0].attn.num_heads == 12
        assert backbone.blocks[0].mlp.fc1.out_features == 2 * 192
        assert backbone.patch_embed.num_patches + 1 == 65
        assert backbone.blocks[-1].drop_path1.drop_prob == pytest.approx(0.1)
    else:
        assert int(backbone.stem[1].num_batches_tracked) == 1  # one training batch went through
    n_params = sum(p.numel() for p in backbone.parameters())
    # The two CIFAR-10 recipes are matched in size: 2.70M (ViT) and 2.78M (ResNet) parameters.
    assert 2.6e6 < n_params < 2.9e6


def resolved_config(*configs: str, capsys) -> dict:
    """The config LightningCLI resolves from YAML files given in order (`--print_config`)."""
    args = ["fit"] + [arg for config in configs for arg in ("--config", str(CONFIGS / config))]
    with pytest.raises(SystemExit) as exit_info:
        main(args=[*args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def leaves(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}{key}.").items()}
    if isinstance(tree, list):
        return {k: v for i, sub in enumerate(tree) for k, v in leaves(sub, f"{prefix}{i}.").items()}
    return {prefix[:-1]: tree}


def test_cifar100_overlay_changes_the_dataset_and_the_run_name_only(capsys):
    """CIFAR-100 is the CIFAR-10 recipe with a second --config: the dataset and the run's name change, nothing else."""
    c10 = leaves(resolved_config("cifar10/vit.yaml", capsys=capsys))
    c100 = leaves(resolved_config("cifar10/vit.yaml", "cifar100/vit.yaml", capsys=capsys))
    assert c10.keys() == c100.keys()
    changed = {key: (c10[key], c100[key]) for key in c10 if c10[key] != c100[key] and key != "config"}
    assert changed == {
        "trainer.logger.init_args.name": ("cifar10/vit", "cifar100/vit"),
        "data.init_args.dataset": ("cifar10", "cifar100"),
    }


def test_float32_matmul_precision_must_be_a_known_value(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", str(CONFIGS / "cifar10/vit.yaml"), "--float32_matmul_precision", "tf32"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "float32_matmul_precision" in err and "tf32" in err and "'highest', 'high', 'medium'" in err


def test_missing_data_exits_with_the_message_and_no_traceback(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(args=["fit", "--config", str(CONFIGS / "cifar10/vit.yaml"), "--data.data_dir", str(empty),
                   "--data.download", "false", "--trainer.accelerator", "cpu"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "\nerror: CIFAR-10 is not in " + str(empty / "cifar-10-batches-py") in "\n" + err
    assert "Nothing was downloaded: data.download is false." in err
    assert "--data.download true" in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # it failed before any run folder was made


def test_resumable_overlay_resolves_as_the_test_helper_merges_it(capsys):
    """The step-checkpoint overlay replaces the callbacks list and keeps the base's model and data.

    `robust_helpers.tiny_config` merges the two YAML files itself; this holds it to what the CLI does.
    """
    from robust_helpers import BASE_CONFIG, RESUMABLE_OVERLAY, overlay

    resolved = resolved_config("two_circles/vit.yaml", "two_circles/vit_resumable.yaml", capsys=capsys)
    merged = overlay(yaml.safe_load(BASE_CONFIG.read_text()), yaml.safe_load(RESUMABLE_OVERLAY.read_text()))
    callbacks = resolved["trainer"]["callbacks"]
    assert [c["init_args"].get("every_n_train_steps") for c in callbacks] == [None, 25]
    assert resolved["trainer"]["max_epochs"] == merged["trainer"]["max_epochs"] == 12
    assert resolved["trainer"]["logger"]["init_args"]["name"] == "two_circles/vit_resumable"
    for section in ("model", "data"):
        assert leaves(merged[section]).items() <= leaves(resolved[section]).items()
