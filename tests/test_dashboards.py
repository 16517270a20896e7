"""What the dashboards show a user: the most confident test mistakes on TensorBoard, the best checkpoint as a
W&B artifact and the best monitored values in W&B's summary (offline), and the tags a finished `train.py` run
holds in its TensorBoard event files."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from vit.data import TwoCirclesDataModule
from vit.explain import callbacks
from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier
from vit.training.dashboard import RankedPredictions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second thread only adds synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_vit(depth: int = 1) -> ImageClassifier:
    torch.manual_seed(0)
    return ImageClassifier(
        VisionTransformer(img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=depth, num_heads=2),
        lr=1e-3,
    )


def quiet_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, **kwargs
    )


def brute_force_order(
    probability: torch.Tensor, predicted: torch.Tensor, labels: torch.Tensor, mistakes_only: bool
) -> list[int]:
    """The test indices a predictions view shows, by a plain sort over the whole test set at once."""
    n = len(labels)
    mistakes = sorted((i for i in range(n) if predicted[i] != labels[i]), key=lambda i: (-float(probability[i]), i))
    correct = [i for i in range(n) if predicted[i] == labels[i]]
    return mistakes if mistakes_only else mistakes + correct


@pytest.mark.parametrize("mistakes_only", [False, True])
@pytest.mark.parametrize("size", [1, 7, 100])
def test_ranked_predictions_batch_by_batch_equal_one_sort_of_the_whole_test_set(size, mistakes_only):
    torch.manual_seed(size)
    images, labels, logits = torch.randn(60, 1, 4, 4), torch.randint(0, 3, (60,)), torch.randn(60, 3)
    logits[10] = logits[11]  # a tie: the earlier image first
    labels[10] = labels[11] = (logits[10].argmax() + 1) % 3
    kept = RankedPredictions(size, mistakes_only=mistakes_only)
    for start in range(0, 60, 16):  # batches of 16, the last of 12
        kept.update(images[start : start + 16], labels[start : start + 16], logits[start : start + 16])

    probability, predicted = logits.softmax(-1).max(-1)
    expected = brute_force_order(probability, predicted, labels, mistakes_only)[:size]
    torch.testing.assert_close(kept.images, images[expected])
    assert kept.labels.tolist() == labels[expected].tolist()
    assert kept.predicted.tolist() == predicted[expected].tolist()
    torch.testing.assert_close(kept.probability, probability[expected])
    assert (kept.seen, kept.mistakes) == (60, int((predicted != labels).sum()))
    if size == 100:  # all of them kept
        assert len(kept) == (kept.mistakes if mistakes_only else 60)


def test_mistakes_grid_logs_the_most_confident_mistakes_with_class_names_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = tiny_vit()
    data = TwoCirclesDataModule(num_train=16, num_val=16, num_test=64, batch_size=16, seed=3)
    grid = callbacks.TestMistakesGrid(num_images=5, columns=3)
    trainer = quiet_trainer(
        logger=TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False),
        callbacks=[grid],
        enable_checkpointing=False,
    )
    trainer.test(model, datamodule=data, verbose=False)  # an untrained model: about half of them wrong

    model.eval()
    with torch.no_grad():
        probability, predicted = model(data.test_set.images).softmax(-1).max(-1)
    labels = data.test_set.labels
    expected = brute_force_order(probability, predicted, labels, mistakes_only=True)[:5]
    assert len(expected) == 5 and grid.kept.mistakes > 5
    torch.testing.assert_close(grid.kept.images, data.test_set.images[expected])
    torch.testing.assert_close(grid.kept.probability, probability[expected])
    assert (grid.kept.labels != grid.kept.predicted).all()

    names = ["not_diagonal", "diagonal"]
    assert model.class_names == names
    figure = grid.render(lambda i: names[int(i)])
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles == [
        f"true {names[labels[i]]}\npredicted {names[predicted[i]]} ({probability[i]:.2f})" for i in expected
    ]
    assert figure.get_suptitle() == f"the 5 most confident of {grid.kept.mistakes} mistakes in 64 test images"

    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("test/mistakes")
    assert (image.width, image.height) == (3 * 160, 2 * 160 + 50)  # 3 columns, 2 rows of 1.6-inch cells at 100 dpi


def test_mistakes_grid_goes_to_csv_as_a_png_and_is_left_to_the_table_on_wandb(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from vit.training.loggers import WandbLogger

    csv = CSVLogger(tmp_path, name="csv")
    grid = callbacks.TestMistakesGrid(num_images=4, columns=4)
    trainer = quiet_trainer(
        logger=[csv, WandbLogger(save_dir=str(tmp_path), offline=True)], callbacks=[grid], enable_checkpointing=False
    )
    assert grid._loggers(trainer) == [csv]  # W&B shows the mistakes in TestPredictionsTable's table instead
    trainer = quiet_trainer(logger=csv, callbacks=[grid], enable_checkpointing=False)
    trainer.test(
        tiny_vit(),
        datamodule=TwoCirclesDataModule(num_train=16, num_val=16, num_test=32, batch_size=16, seed=3),
        verbose=False,
    )
    (png,) = (Path(csv.log_dir) / "images").glob("*.png")
    assert png.name == "test_mistakes-step000000.png" and len(grid.kept) == 4
    with pytest.raises(ValueError, match="num_images"):
        callbacks.TestMistakesGrid(num_images=0)
    with pytest.raises(ValueError, match="columns"):
        callbacks.TestMistakesGrid(columns=0)


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B kept off the network and out of the home folder; the run is finished afterwards."""
    import wandb

    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    wandb.finish()


def test_best_checkpoint_is_a_wandb_artifact_offline_when_asked_for(tmp_path, offline_wandb):
    import wandb

    from vit.training.loggers import WandbLogger

    # The W&B overlay spells the option out, off: a checkpoint can be large, and is uploaded only when asked for.
    overlay = yaml.safe_load((ROOT / "configs/logger/wandb.yaml").read_text())
    assert overlay["trainer"]["logger"]["init_args"]["log_model"] is False

    logger = WandbLogger(save_dir=str(tmp_path / "runs"), log_model=True)
    assert logger.is_offline
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        monitor="val/acc",
        mode="max",
        save_last=True,
        filename="epoch{epoch:02d}",
        auto_insert_metric_name=False,
    )
    trainer = quiet_trainer(max_epochs=2, logger=logger, callbacks=[best])
    trainer.fit(tiny_vit(), TwoCirclesDataModule(num_train=32, num_val=32, num_test=16, batch_size=16, seed=3))
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()

    artifacts = [r.artifact for r in closed_run_records(run_dir) if r.WhichOneof("record_type") == "artifact"]
    assert {a.type for a in artifacts} == {"model"} and {a.name for a in artifacts} == {f"model-{logger.version}"}
    (artifact,) = [a for a in artifacts if "best" in a.aliases]
    metadata = json.loads(artifact.metadata)
    assert metadata["original_filename"] == Path(best.best_model_path).name
    assert metadata["score"] == pytest.approx(best.best_model_score.item())
    # Offline, the file waits in W&B's staging folder until `wandb sync` uploads it with the run: the same bytes.
    (entry,) = artifact.manifest.contents
    assert entry.path == "model.ckpt"
    digest = hashlib.sha256(Path(best.best_model_path).read_bytes()).hexdigest()
    assert hashlib.sha256(Path(entry.local_path).read_bytes()).hexdigest() == digest
    assert Path(entry.local_path).is_relative_to(tmp_path / "wandb-home")


@pytest.mark.slow
def test_a_finished_run_holds_the_scalars_images_and_hparams_tensorboard_shows(tmp_path, monkeypatch):
    from dashboard_helpers import TINY, hparams_plugin_data
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vit.training.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = main(["fit", "--config", str(ROOT / "configs/two_circles/vit.yaml"), *TINY])  # the test after fit too
    events = EventAccumulator(cli.trainer.logger.log_dir, size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()

    assert {
        "train/loss_step",
        "train/lr",
        "val/acc",
        "val/loss",
        "test/acc",
        "test/loss",
        "val/pointing_game/rollout",
        "hp/val_acc",
        "hp/test_acc",
    } <= set(tags["scalars"])
    assert set(tags["images"]) == {"val/rollout", "val/confusion_matrix", "test/mistakes"}
    (mistakes,) = events.Images("test/mistakes")
    grid = next(c for c in cli.trainer.callbacks if isinstance(c, callbacks.TestMistakesGrid))
    assert grid.kept.seen == 32 and 0 < len(grid.kept) <= 16
    columns = min(8, len(grid.kept))
    assert mistakes.width == columns * 160
    plugin = hparams_plugin_data(events)
    assert set(plugin) == {"session_start_info"}  # no experiment summary: see write_session_start
    settings = plugin["session_start_info"].hparams
    assert settings["lr"].number_value == pytest.approx(0.002) and settings["task"].string_value == "diagonal"
    assert events.Scalars("hp/test_acc")[-1].value == pytest.approx(cli.trainer.callback_metrics["test/acc"].item())


def test_a_relative_wandb_folder_is_the_callers_not_the_wandb_services(tmp_path, monkeypatch):
    # W&B's service, started once per process, would resolve "runs" against its own working directory.
    from vit.training.loggers import WandbLogger

    monkeypatch.chdir(tmp_path)
    assert WandbLogger(save_dir="runs", offline=True).save_dir == str(tmp_path / "runs")


class ScriptedAccuracy(L.LightningModule):
    """A linear model whose validation logs `val/acc` from a script, one value per epoch, `val/loss` = 1 - it, and
    `val/last`, the same as `val/acc` but monitored by nothing."""

    def __init__(self, accuracies: list[float]) -> None:
        super().__init__()
        self.accuracies, self.linear = accuracies, torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.linear(batch[0]).square().mean()

    def validation_step(self, batch, batch_idx):
        accuracy = self.accuracies[self.current_epoch]
        self.log_dict({"val/acc": accuracy, "val/loss": 1.0 - accuracy, "val/last": accuracy})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def closed_run_records(run_dir: Path) -> list:
    """The records of an offline W&B run once it is closed: finish() can return before W&B's service has written
    the last of them."""
    from dashboard_helpers import wandb_records

    deadline = time.monotonic() + 30
    while True:
        records = wandb_records(next(run_dir.glob("*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, "the offline run was never closed"
        time.sleep(0.2)


def offline_summary(records: list) -> dict:
    """The summary an offline W&B run has once synced: its summary records' updates, replayed in order."""
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary["/".join(item.nested_key) if item.nested_key else item.key] = json.loads(item.value_json)
    return summary


def test_wandb_summary_holds_the_best_monitored_value_and_the_run_keeps_its_config_files(tmp_path, offline_wandb):
    import wandb
    from jsonargparse import ArgumentParser
    from torch.utils.data import DataLoader, TensorDataset

    from vit.training.dashboard import HParamsTable
    from vit.training.loggers import WandbLogger
    from vit.training.run_dir import RunConfig

    parser = ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    logger = WandbLogger(save_dir=str(tmp_path / "runs"))
    best = ModelCheckpoint(monitor="val/acc", mode="max")
    trainer = quiet_trainer(
        max_epochs=3,
        logger=logger,
        callbacks=[best, HParamsTable(), RunConfig(parser, parser.parse_args([]), command=["train.py", "fit"])],
    )
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=4)
    trainer.fit(ScriptedAccuracy([0.5, 0.75, 0.625]), data, data)  # the last epoch is worse than the second
    run_dir, run_folder = Path(logger.experiment.dir).parent, Path(best.dirpath).parent
    wandb.finish()

    records = closed_run_records(run_dir)
    summary = offline_summary(records)
    assert summary["val/acc"] == {"max": 0.75} and best.best_model_score.item() == 0.75
    assert summary["val/loss"] == {"min": 0.25}
    assert summary["val/last"] == 0.625  # a metric nothing monitors keeps its last value
    metrics = {r.metric.name: r.metric for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["val/acc"].step_metric == "trainer/global_step"  # the x-axis of the other curves
    assert run_folder == tmp_path / "runs" / "vit" / logger.version
    for name in ("config.yaml", "run_info.json"):
        assert (run_dir / "files" / name).read_text() == (run_folder / name).read_text()
    assert json.loads((run_dir / "files" / "run_info.json").read_text())["command"] == ["python", "train.py", "fit"]
