"""What a user sees when a run is set up wrongly without an error: a misspelt option, an EMA longer than the run,
more loader workers than cores, a progress bar written to a log file."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from robust_helpers import BASE_CONFIG, cli, error_line, main_in_process, subprocess_env, tiny_config, train_command
from torch.utils.data import DataLoader, TensorDataset

from vit.data import ImageFolderDataModule, TwoCirclesDataModule
from vit.data.images import usable_workers
from vit.models import VisionTransformer
from vit.training.callbacks import PlainProgress
from vit.training.classifier import ImageClassifier
from vit.training.cli import main
from vit.training.cli_messages import unknown_options_message

THREE_CORES = {0, 1, 2}  # the cores a job may run on, as `os.sched_getaffinity` gives them

# --- A misspelt option: one line with the closest valid option -------------------------------------


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        (["--model.layer_decy", "0.7"], "error: unknown option --model.layer_decy; did you mean --model.layer_decay?"),
        (["--model.lrr=3"], "error: unknown option --model.lrr; did you mean --model.lr?"),
        (
            ["--trainer.fast_dev_runn", "1"],
            "error: unknown option --trainer.fast_dev_runn; did you mean --trainer.fast_dev_run?",
        ),
        (["--model.banana", "1"], "error: unknown option --model.banana. `train.py fit --help` lists the options."),
        # a prefix is not taken for the option it starts (argparse's abbreviations): named, not run
        (["--trainer.max_ep", "3"], "error: unknown option --trainer.max_ep; did you mean --trainer.max_epochs?"),
        (["--model.weight_d", "0.1"], "error: unknown option --model.weight_d; did you mean --model.weight_decay?"),
    ],
)
def test_an_unknown_option_is_one_line_naming_the_closest_option(typed, expected, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(BASE_CONFIG), *typed], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == expected
    assert "usage:" not in stderr  # not jsonargparse's 60-line usage


def test_several_unknown_options_are_named_in_the_one_line(monkeypatch, capsys):
    code, stderr = cli(
        ["fit", "--config", str(BASE_CONFIG), "--model.ema_decy", "0.9", "--model.zzz", "2"], monkeypatch, capsys
    )
    assert code == 2
    assert error_line(stderr) == (
        "error: unknown option --model.ema_decy; did you mean --model.ema_decay? "
        "unknown option --model.zzz. `train.py fit --help` lists the options."
    )


def test_a_suggestion_needs_a_close_option_not_just_the_shared_prefix():
    options = ["--model.lr", "--model.betas", "--model.layer_decay"]
    assert unknown_options_message(["--model.foo"], options, "train.py [options] fit") == (
        "unknown option --model.foo. `train.py fit --help` lists the options."
    )
    assert unknown_options_message(["--model.lx"], options, "train.py") == (
        "unknown option --model.lx; did you mean --model.lr?"
    )


def test_a_typo_inside_a_config_file_is_one_line_naming_the_file_and_the_closest_option(tmp_path, monkeypatch, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  lrr: 0.01\n")
    code, stderr = cli(["fit", "--config", str(BASE_CONFIG), "--config", str(typo)], monkeypatch, capsys)
    assert code == 2 and "usage:" not in stderr
    assert error_line(stderr) == (
        f"error: model.lrr (set in {typo}) is not an option of fit; did you mean model.lr? `train.py fit --help` "
        "lists the options."
    )


def test_a_missing_config_file_is_one_line_without_the_usage(tmp_path, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(tmp_path / "nope.yaml")], monkeypatch, capsys)
    assert code == 2 and "usage:" not in stderr
    assert error_line(stderr) == f"error: --config {tmp_path / 'nope.yaml'} does not exist"


@pytest.mark.parametrize("option, names", [("--optimizer", "--model.opt"), ("--lr_scheduler", "--model.warmup_epochs")])
def test_lightnings_optimizer_options_are_refused_naming_the_models(option, names, monkeypatch, capsys):
    code, stderr = cli(["fit", "--config", str(BASE_CONFIG), option, "SGD"], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in stderr
    assert error_line(stderr).startswith(f"error: {option} is not an option here: ") and names in error_line(stderr)


def test_a_backbone_size_the_data_link_would_replace_is_refused_naming_the_data_option(monkeypatch, capsys):
    args = ["fit", "--config", str(BASE_CONFIG), "--model.backbone.init_args.img_size", "96"]
    code, stderr = cli(args, monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == (
        "error: model.backbone.init_args.img_size=96 differs from the data's img_size=32, which the backbone takes "
        "(train.py links the data module's img_size into it): set --data.img_size instead"
    )


def test_a_backbone_whose_sizes_are_its_bases_defaults_takes_the_datas_without_a_word(tmp_path, monkeypatch, capsys):
    # StudyViT passes **kwargs to VisionTransformer: its img_size / num_classes defaults are its base's, not given.
    args = ["fit", "--config", str(tiny_config(tmp_path, max_epochs=1)), "--data.img_size", "64"]
    args += ["--model.backbone.class_path", "studies.runner.models.StudyViT", "--test_after_fit", "false"]
    main_in_process(args, monkeypatch)  # trains: no refusal (it used to name num_classes=10 against the data's 2)
    [last] = (tmp_path / "runs").glob("*/version_0/checkpoints/last.ckpt")
    assert "'img_size': 64" in str(torch.load(last, weights_only=True)["hyper_parameters"]["backbone"])


def test_other_refusals_keep_jsonargparse_message(monkeypatch, capsys):
    # A stray positional word is no option to suggest for: jsonargparse's own message (with its usage).
    code, stderr = cli(["fit", "--config", str(BASE_CONFIG), "extra"], monkeypatch, capsys)
    assert code == 2
    assert error_line(stderr) == "error: unrecognized arguments: extra"
    assert "usage:" in stderr


# --- EMA horizon longer than the run ------------------------------------------------------------------


def _fit(ema_decay: float | None, *, steps: int, **trainer) -> list[str]:
    """`fit` for `steps` optimizer steps on random images; the messages of the warnings it raised."""
    backbone = VisionTransformer(
        img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=1, num_heads=2
    )
    model = ImageClassifier(backbone, ema_decay=ema_decay)
    x, y = torch.rand(4 * steps, 1, 32, 32), torch.tensor([0, 1] * 2 * steps)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return [str(w.message) for w in caught if "ema_decay" in str(w.message)]


def test_an_ema_longer_than_the_run_is_warned_naming_both_numbers():
    assert _fit(0.99, steps=6) == [
        "ema_decay=0.99 averages over ~100 optimizer steps, but this run makes 6: validation, test and the "
        "checkpoint use the average, which stays near the initial weights; lower ema_decay or train longer"
    ]


def test_an_ema_shorter_than_the_run_or_none_is_not_warned():
    assert _fit(0.5, steps=6) == []  # horizon 2 steps
    assert _fit(None, steps=3) == []
    assert _fit(0.99, steps=3, fast_dev_run=True) == []  # a smoke test runs one step by design


def test_the_ema_warning_counts_optimizer_steps_not_batches():
    # 12 batches with gradients accumulated over 4: 3 optimizer steps, under the horizon of 0.8 (5 steps).
    [message] = _fit(0.8, steps=12, accumulate_grad_batches=4)
    assert "averages over ~5 optimizer steps, but this run makes 3:" in message


# --- Loader workers capped at the machine's cores ------------------------------------------------------


def test_usable_workers_caps_at_the_cores_and_keeps_zero(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: THREE_CORES, raising=False)
    assert usable_workers(0) == 0
    assert usable_workers(1) == 1
    assert usable_workers(64) == 3


def test_a_data_module_asked_for_64_workers_builds_loaders_with_at_most_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: THREE_CORES, raising=False)
    data = TwoCirclesDataModule(num_train=8, num_val=8, num_test=8, batch_size=4, num_workers=64)
    data.setup()
    for loader in (data.train_dataloader(), data.val_dataloader(), data.test_dataloader(), data.predict_dataloader()):
        assert loader.num_workers == 3
    assert data.hparams.num_workers == 64  # the config's value is what is recorded


def _image_folder(root) -> str:
    from PIL import Image

    for label in ("cats", "dogs"):
        (root / label).mkdir()
        for i in range(4):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / label / f"{i}.png")
    return str(root)


@pytest.fixture
def one_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)


def test_a_data_module_with_its_own_loader_is_capped_too_without_torch_warning(tmp_path, one_core):
    data = ImageFolderDataModule(
        root=_image_folder(tmp_path), img_size=8, val_fraction=0.25, test_fraction=0.25, num_workers=64
    )
    data.setup("fit")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaders = data.train_dataloader(), data.val_dataloader()
    assert [loader.num_workers for loader in loaders] == [1, 1]
    assert not [w for w in caught if "worker" in str(w.message)]


def test_the_cap_survives_lightning_rebuilding_the_loader(tmp_path, one_core):
    # `predict` rebuilds the loader from its constructor's arguments (to track indices); the cap must hold there.
    class Mean(L.LightningModule):
        def predict_step(self, batch, batch_idx):
            return batch[0].mean()

    data = ImageFolderDataModule(
        root=_image_folder(tmp_path), img_size=8, val_fraction=0.25, test_fraction=0.5, num_workers=64, batch_size=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path / "run",
    )  # where the image folder writes split.json
    assert len(trainer.predict(Mean(), datamodule=data)) == 2
    assert trainer.predict_dataloaders.num_workers == 1


# --- Progress in a log file: plain lines, no carriage returns ------------------------------------------


# Lightning's default in a terminal: Rich's bar where `rich` is installed (transformers brings it), else tqdm's.
DEFAULT_BAR = RichProgressBar if importlib.util.find_spec("rich") else TQDMProgressBar


@pytest.mark.parametrize(("terminal", "progress"), [(True, DEFAULT_BAR), (False, PlainProgress)])
def test_the_progress_bar_is_tqdm_in_a_terminal_and_plain_lines_in_a_log_file(
    terminal, progress, monkeypatch, tmp_path
):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: terminal)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    run = main(
        [
            "fit",
            "--config",
            str(tiny_config(tmp_path)),
            "--trainer.enable_progress_bar",
            "true",
            "--trainer.fast_dev_run",
            "1",
        ]
    )
    shown = [c for c in run.trainer.callbacks if isinstance(c, (TQDMProgressBar, RichProgressBar, PlainProgress))]
    assert [type(c) for c in shown] == [progress]


@pytest.mark.slow
def test_plain_progress_writes_a_line_every_n_seconds_within_an_epoch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    main(
        [
            "fit",
            "--config",
            str(tiny_config(tmp_path, max_epochs=1)),
            "--test_after_fit",
            "false",
            "--trainer.callbacks+=vit.training.callbacks.PlainProgress",
            "--trainer.callbacks.every_n_seconds=0",
        ]
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch 0: ")]
    # A line after each batch (every 0 seconds), then the epoch's line with the validation metrics.
    assert [line.split(", ")[0] for line in lines] == [f"Epoch 0: {b}/8 batches" for b in range(1, 9)] + [
        "Epoch 0: 8/8 batches"
    ]
    assert "val/acc=" not in lines[0] and "val/acc=" in lines[-1]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs a CPU affinity to set")
def test_a_fit_logged_to_a_file_prints_plain_progress_lines_and_says_once_that_workers_are_capped(tmp_path):
    config = tiny_config(tmp_path, num_workers=2)  # on one core: one worker per loader
    log = tmp_path / "train.log"
    with log.open("w") as out:  # `python train.py fit ... > train.log 2>&1`
        done = subprocess.run(
            train_command("fit", "--config", str(config), "--trainer.enable_progress_bar", "true"),
            cwd=tmp_path,
            env=subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
            preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        )
    text = log.read_text()
    assert done.returncode == 0, text
    assert "\r" not in text
    lines = [line for line in text.splitlines() if line.startswith("Epoch ")]
    assert [line.split(", ")[:2] for line in lines] == [
        [f"Epoch {epoch}: 8/8 batches", f"step {8 * (epoch + 1)}"] for epoch in range(3)
    ]
    for line in lines:
        assert re.search(r", \d+\.\d\d it/s, train/loss_step=\d\.\d+, val/loss=\d\.\d+, val/acc=", line), line
    assert text.count("num_workers=2 is capped at 1, the number of cores this process may use") == 1
    assert "worker processes in total" not in text  # torch's warning about too many workers
    assert "test/acc = " in text  # the test after fit printed as ever
