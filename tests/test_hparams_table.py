"""TensorBoard's HParams tab: each `train.py` run's settings beside its final validation and test metrics."""

from __future__ import annotations

import math
import sys

import lightning as L
import pytest
from dashboard_helpers import hparams_plugin_data
from lightning.pytorch.loggers import CSVLogger
from robust_helpers import run_dirs, tiny_config

from vit.data import TwoCirclesDataModule
from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier
from vit.training.dashboard import HParamsTable, hp_tag


def test_metric_names_in_the_table():
    assert hp_tag("val/acc") == "hp/val_acc"
    assert hp_tag("test/class_acc/a") == "hp/test_class_acc_a"


@pytest.mark.slow
def test_a_run_fills_the_hparams_table_with_its_settings_and_final_metrics(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vit.training.cli import main

    config = tiny_config(tmp_path, max_epochs=2)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = main(["fit", "--config", str(config), "--model.lr=0.003"])  # the test after fit runs too
    [run_dir] = run_dirs(tmp_path)
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    plugin = hparams_plugin_data(events)

    # No experiment summary: TensorBoard then builds the table from every run's row, the settings
    # that differ between runs first, and every scalar tag as a metric (epoch and hp/* the first five).
    assert set(plugin) == {"session_start_info"}
    columns = {"hp/val_acc", "hp/val_loss", "hp/test_acc", "hp/test_loss"}
    assert sorted(events.Tags()["scalars"])[:5] == ["epoch", *sorted(columns)]
    settings = {
        name: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for name, value in plugin["session_start_info"].hparams.items()
    }
    assert settings["backbone/class_path"] == "vit.models.VisionTransformer"
    assert settings["backbone/init_args/embed_dim"] == 32  # tiny_config's, over the YAML's 64
    assert settings["backbone/init_args/pos_embed"] == "learned"
    assert settings["lr"] == pytest.approx(0.003)
    assert settings["weight_decay"] == pytest.approx(0.05)
    assert settings["batch_size"] == 32
    assert settings["task"] == "diagonal"
    assert settings["seed_everything"] == 0
    assert settings["trainer/max_epochs"] == 2
    assert not [name for name in settings if name.startswith("_")]  # no _class_path, _instantiator

    # The table shows each metric's last value in the run: the last validation's, then the test's.
    last = {tag: events.Scalars(tag)[-1] for tag in columns}
    assert math.isnan(events.Scalars("hp/val_acc")[0].value)  # declared at the start, not known yet
    assert last["hp/val_acc"].value == pytest.approx(events.Scalars("val/acc")[-1].value)
    assert last["hp/val_loss"].value == pytest.approx(events.Scalars("val/loss")[-1].value)
    assert last["hp/val_acc"].step == cli.trainer.global_step == 2 * 8
    assert last["hp/test_acc"].value == pytest.approx(cli.trainer.callback_metrics["test/acc"].item())
    assert last["hp/test_loss"].value == pytest.approx(cli.trainer.callback_metrics["test/loss"].item())


def test_loggers_other_than_tensorboard_are_left_alone(tmp_path):
    model = ImageClassifier(
        VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, in_chans=1, num_classes=2)
    )
    data = TwoCirclesDataModule(num_train=16, num_val=16, num_test=16, batch_size=16, seed=3)
    trainer = L.Trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[HParamsTable()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data, verbose=False)
    metrics = (tmp_path / "csv/version_0/metrics.csv").read_text()
    assert "test/acc" in metrics and "hp/" not in metrics
