"""Dashboard callbacks and loggers: what a short run writes to W&B (offline), TensorBoard and CSV files."""

import json
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from dashboard_helpers import TINY, wandb_records
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

import vit.training.loggers
from vit.data import TwoCirclesDataModule
from vit.explain.callbacks import RolloutImages
from vit.models import ResNet, VisionTransformer
from vit.training.classifier import ImageClassifier
from vit.training.cli import main
from vit.training.dashboard import ConfusionMatrix

ROOT = Path(__file__).resolve().parents[1]
VIT_CONFIG = str(ROOT / "configs/two_circles/vit.yaml")
WANDB_CONFIG = str(ROOT / "configs/logger/wandb.yaml")
# A tiny version of the two-circles experiment: one epoch, a few batches, a small ViT.
# RolloutImages in vit.yaml: 8 rows of 3-inch cells at 64 dpi; columns: image, rollout, grad rollout; 0.75 inch of
# colour bars.
ROLLOUT_PIXELS = (8 * 3 * 64, int((3 * 3 + 0.75) * 64))  # (height, width)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second thread only adds synchronisation, and on a busy machine it costs several times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def run_cli(args, tmp_path, monkeypatch):
    """`python train.py ARGS` in `tmp_path`, in this process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # pytest's own arguments are not the CLI's
    return main(args)


@pytest.mark.slow
def test_wandb_offline_run_holds_metrics_images_and_config(tmp_path, monkeypatch, offline_wandb):
    cli = run_cli(["fit", "--config", VIT_CONFIG, "--config", WANDB_CONFIG, *TINY], tmp_path, monkeypatch)
    logger = cli.trainer.logger
    assert isinstance(logger, vit.training.loggers.WandbLogger) and logger.is_offline
    val_acc = cli.trainer.checkpoint_callback.best_model_score.item()  # one epoch: its val/acc
    run_dir = Path(logger.experiment.dir).absolute().parent
    import wandb

    wandb.finish()

    assert run_dir.parent == tmp_path / "runs/wandb" and run_dir.name.startswith("offline-run-")
    # wandb names media files <key>_<history step>_<hash>.png
    images = {p.name.rsplit("_", 2)[0] for p in (run_dir / "files/media/images/val").glob("*.png")}
    assert images == {"rollout", "confusion_matrix"}
    rollout_png = next((run_dir / "files/media/images/val").glob("rollout_*.png"))
    assert Image.open(rollout_png).size[::-1] == ROLLOUT_PIXELS

    # wandb.finish() can return before W&B's service has written the last records: wait for "exit".
    deadline = time.monotonic() + 30
    while True:
        records = wandb_records(next(run_dir.glob("*.wandb")))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    logged = {}
    for record in records:
        for item in record.history.item:
            logged.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    assert logged["val/acc"][-1] == pytest.approx(val_acc)
    assert {"test/acc", "test/loss", "train/loss_step", "train/lr", "train/loss_epoch", "val/loss"} <= set(logged)
    assert (logged["val/rollout/height"], logged["val/rollout/width"]) == ([ROLLOUT_PIXELS[0]], [ROLLOUT_PIXELS[1]])
    config = {item.key: json.loads(item.value_json) for record in records for item in record.config.update}
    # The resolved config of both YAML files, as the run's config: the second file's logger wins.
    assert config["trainer"]["logger"]["class_path"] == "vit.training.loggers.WandbLogger"
    assert "default_hp_metric" not in config["trainer"]["logger"]["init_args"]
    # Logged once, nested: Lightning's flattened copy of the hyperparameters is not logged beside it.
    assert config["model"]["lr"] == 0.002 and not {"lr", "backbone", "_instantiator", "batch_size"} & set(config)
    keys = [item.key for record in records for item in record.config.update if item.key != "_wandb"]  # _wandb: charts
    assert len(keys) == len(set(keys))

    # W&B's own confusion matrix of the test set, with the class names: a table of (Actual, Predicted, nPredictions).
    charts = [
        entry.local_path
        for record in records
        if record.WhichOneof("record_type") == "artifact"
        for entry in record.artifact.manifest.contents
        if entry.path == "test/confusion_matrix_table.table.json"
    ]
    assert len(charts) == 1
    chart = json.loads(Path(charts[0]).read_text())
    assert {row[0] for row in chart["data"]} == set(cli.model.class_names)
    assert sum(row[2] for row in chart["data"]) == 32

    # The overlay adds TestPredictionsTable to the experiment's callbacks (`callbacks+`), not in their place.
    callbacks = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"TestPredictionsTable", "RolloutImages", "ConfusionMatrix"} <= callbacks
    # test/predictions: every test image (32 < num_rows=64), mistakes first, most confident mistake first.
    # W&B keeps a table with its images in a run_table artifact; offline, its files wait in the staging folder.
    staged = [
        entry.local_path
        for record in records
        if record.WhichOneof("record_type") == "artifact"
        for entry in record.artifact.manifest.contents
        if entry.path == "test/predictions.table.json"
    ]
    assert len(staged) == 1
    table = json.loads(Path(staged[0]).read_text())
    assert table["columns"] == ["image", "true", "predicted", "probability", "rollout"]
    rows = table["data"]
    assert len(rows) == 32
    names = cli.model.class_names
    assert {r[1] for r in rows} <= set(names) and {r[2] for r in rows} <= set(names)
    assert all(r[0]["_type"] == r[4]["_type"] == "image-file" for r in rows)
    assert all(r[0]["width"] == r[4]["width"] == 32 for r in rows)
    wrong = [r[1] != r[2] for r in rows]
    assert any(wrong) and not all(wrong)  # one tiny epoch: both kinds of row, so the order below is tested
    assert wrong == sorted(wrong, reverse=True)  # no mistake after a correct prediction
    mistakes = [r[3] for r in rows if r[1] != r[2]]
    assert mistakes == sorted(mistakes, reverse=True)
    assert all(1 / len(names) <= r[3] <= 1 for r in rows)
    assert config["model"]["backbone"]["init_args"]["embed_dim"] == 16
    assert config["data"]["init_args"]["num_train"] == 64
    # ... and as config.yaml beside the run's checkpoints, not a config.yaml shared by all runs.
    saved = (tmp_path / "runs/vit" / logger.version / "config.yaml").read_text()
    assert "class_path: vit.training.loggers.WandbLogger" in saved and "name: null" in saved
    assert not (tmp_path / "runs/config.yaml").exists()
    assert list((tmp_path / "runs/vit" / logger.version / "checkpoints").glob("*.ckpt"))


@pytest.mark.slow
def test_tensorboard_run_holds_rollout_and_confusion_images(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = run_cli(["fit", "--config", VIT_CONFIG, *TINY], tmp_path, monkeypatch)
    events = EventAccumulator(cli.trainer.logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    assert {"val/rollout", "val/confusion_matrix"} <= set(events.Tags()["images"])
    (rollout,) = events.Images("val/rollout")  # one epoch: logged once, after the last epoch
    assert (rollout.height, rollout.width) == ROLLOUT_PIXELS
    assert rollout.step == cli.trainer.global_step
    val_acc = cli.trainer.checkpoint_callback.best_model_score.item()  # one epoch: its val/acc
    assert events.Scalars("val/acc")[-1].value == pytest.approx(val_acc)
    # TensorBoard keeps config.yaml in its own run folder, as Lightning does.
    assert (Path(cli.trainer.logger.log_dir) / "config.yaml").is_file()


def tiny_trainer(tmp_path, callbacks, max_epochs):
    return L.Trainer(
        max_epochs=max_epochs,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )


def tiny_data():
    return TwoCirclesDataModule(num_train=32, num_val=40, num_test=8, batch_size=16, seed=3)


def test_csv_rollout_every_n_epochs_fixed_images_and_confusion_matrix(tmp_path, monkeypatch):
    drawn_with = []
    figure = ConfusionMatrix.figure
    monkeypatch.setattr(
        ConfusionMatrix,
        "figure",
        lambda self, title, names=None: (drawn_with.append(names), figure(self, title, names))[1],
    )
    torch.manual_seed(0)
    backbone = VisionTransformer(
        img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2
    )
    rollout = RolloutImages(every_n_epochs=2, num_images=5, methods=["rollout"], class_names=["neg", "pos"])
    confusion = ConfusionMatrix()
    trainer = tiny_trainer(tmp_path, [rollout, confusion], max_epochs=3)
    data = tiny_data()
    model = ImageClassifier(backbone, lr=1e-3)
    trainer.fit(model, data)

    # After epoch 2 (index 1) and after the last epoch (index 2).
    assert rollout.logged_epochs == [1, 2]
    images = sorted(p.name for p in (Path(trainer.logger.log_dir) / "images").glob("*.png"))
    steps_per_epoch = 2
    assert images == [
        f"val_confusion_matrix-step{3 * steps_per_epoch:06d}.png",
        f"val_rollout-step{2 * steps_per_epoch:06d}.png",
        f"val_rollout-step{3 * steps_per_epoch:06d}.png",
    ]
    # The rows are the first validation images, alternating between the classes in order of first appearance.
    labels = data.val_set.labels[:32].tolist()
    first, second = labels[0], 1 - labels[0]
    by_class = {c: [i for i, y in enumerate(labels) if y == c] for c in (0, 1)}
    expected = [by_class[first][0], by_class[second][0], by_class[first][1], by_class[second][1], by_class[first][2]]
    torch.testing.assert_close(rollout.images, data.val_set.images[expected])
    assert rollout.labels.tolist() == [labels[i] for i in expected]

    # The confusion matrix of the final weights, counted by hand.
    model.eval()
    with torch.no_grad():
        predicted = model(data.val_set.images).argmax(-1)
    truth = data.val_set.labels
    by_hand = torch.bincount(truth * 2 + predicted, minlength=4).view(2, 2)
    torch.testing.assert_close(confusion.matrix, by_hand)
    assert confusion.matrix.sum() == len(data.val_set)
    assert drawn_with == [["not_diagonal", "diagonal"]]  # the data module's class names label the axes


def test_cnn_backbone_skips_rollout_with_one_warning_but_logs_confusion_matrix(tmp_path):
    torch.manual_seed(0)
    backbone = ResNet(img_size=32, in_chans=1, num_classes=2, widths=(8, 16), blocks_per_stage=1)
    rollout = RolloutImages(every_n_epochs=1, num_images=4)
    trainer = tiny_trainer(tmp_path, [rollout, ConfusionMatrix()], max_epochs=2)
    with pytest.warns(UserWarning, match="ResNet has no attention layers and `patch_embed`") as caught:
        trainer.fit(ImageClassifier(backbone, lr=1e-3), tiny_data())
    assert sum("RolloutImages" in str(w.message) for w in caught) == 1
    assert rollout.logged_epochs == []
    images = [p.name for p in (Path(trainer.logger.log_dir) / "images").glob("*.png")]
    assert images == ["val_confusion_matrix-step000004.png"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_epochs": 0}, "every_n_epochs=0"),
        ({"num_images": 0}, "num_images=0"),
        ({"methods": ["saliency"]}, r"methods=\['saliency'\].*rollout.*grad_rollout.*chefer"),
        ({"methods": []}, "non-empty"),
        ({"head_fusion": "median"}, "head_fusion='median'.*mean.*max.*min"),
        ({"discard_ratio": 1.0}, r"discard_ratio=1.0 must be in \[0, 1\)"),
        ({"scale": "image"}, r"scale='image' must be one of \['panel', 'row', 'figure'\]"),
    ],
)
def test_rollout_images_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutImages(**kwargs)


def test_wandb_mode_decision_never_touches_the_network_without_a_key(tmp_path, monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the network was tried")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert vit.training.loggers.wandb_online() == (False, "WANDB_MODE=offline")
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # an empty netrc: no stored key
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path))
    online, reason = vit.training.loggers.wandb_online()
    assert not online and "no W&B API key" in reason


def test_wandb_mode_is_offline_when_the_server_cannot_be_reached(monkeypatch):
    import socket

    import wandb

    # A key is "found", but the server is a closed local port: the probe fails at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(wandb, "login", lambda **kwargs: True)
    online, reason = vit.training.loggers.wandb_online(probe_timeout=1.0)
    assert not online and f"http://127.0.0.1:{port} cannot be reached" in reason
    with socket.socket() as server:  # and online once something answers there
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert vit.training.loggers.wandb_online(probe_timeout=1.0)[0]


def test_relevance_scores_are_logged_and_equal_the_scores_of_the_maps(tmp_path):
    from vit.explain.callbacks import RelevanceScores
    from vit.explain.relevance import relevance
    from vit.explain.scores import pointing_game, relevance_mass

    torch.manual_seed(0)
    backbone = VisionTransformer(
        img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2
    )
    scores = RelevanceScores(methods=["rollout", "gradcam"], num_images=10)
    trainer = tiny_trainer(tmp_path, [scores], max_epochs=1)
    data = tiny_data()
    model = ImageClassifier(backbone, lr=1e-3)
    trainer.fit(model, data)
    x = torch.stack([data.val_set[i][0] for i in range(10)])
    masks = torch.stack([data.val_set.circle_mask(i) for i in range(10)])
    for method in ("rollout", "gradcam"):
        maps = relevance(backbone.eval(), x, method)
        logged = trainer.callback_metrics
        assert float(logged[f"val/pointing_game/{method}"]) == pytest.approx(float(pointing_game(maps, masks).mean()))
        assert float(logged[f"val/relevance_mass/{method}"]) == pytest.approx(
            float(relevance_mass(maps, masks).mean()), abs=1e-6
        )
    csv_metrics = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()
    assert "val/pointing_game/rollout" in csv_metrics  # on the dashboard (CSV here; TensorBoard and W&B alike)


def test_rollout_images_draws_any_relevance_method(tmp_path):
    torch.manual_seed(0)
    backbone = VisionTransformer(
        img_size=32, patch_size=8, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2
    )
    rollout = RolloutImages(every_n_epochs=1, num_images=3, methods=["rollout", "chefer", "gradcam"])
    trainer = tiny_trainer(tmp_path, [rollout], max_epochs=1)
    trainer.fit(ImageClassifier(backbone, lr=1e-3), tiny_data())
    assert rollout.logged_epochs == [0]
    figure = rollout.render(backbone.eval())
    assert [ax.get_title() for ax in figure.axes[1:4]] == ["rollout", "chefer", "gradcam"]
    with pytest.raises(ValueError, match="must be a non-empty list of"):
        RolloutImages(methods=["saliency"])


def test_figures_name_the_epoch_and_step_as_the_checkpoints_do(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from vit.training import dashboard

    titles = []
    to_array = dashboard.figure_to_array

    def rollout_array(figure, dpi):
        titles.append(("rollout", figure.get_suptitle()))
        return to_array(figure, dpi)

    figure = ConfusionMatrix.figure

    def confusion_figure(self, title, names=None):
        titles.append(("confusion", title))
        return figure(self, title, names)

    monkeypatch.setattr("vit.explain.callbacks.figure_to_array", rollout_array)
    monkeypatch.setattr(ConfusionMatrix, "figure", confusion_figure)
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", filename="epoch{epoch:02d}-step{step}", auto_insert_metric_name=False, save_top_k=-1
    )
    trainer = L.Trainer(
        max_epochs=2,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[checkpoints, RolloutImages(num_images=2, every_n_epochs=1), ConfusionMatrix()],
    )
    model = ImageClassifier(
        VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, in_chans=1, num_classes=2)
    )
    trainer.fit(model, datamodule=tiny_data())  # 2 steps an epoch

    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch00-step2.ckpt", "epoch01-step4.ckpt"]
    assert titles == [
        ("rollout", "after epoch 00 (step 2)"),
        ("rollout", "after epoch 01 (step 4)"),
        ("confusion", "the last validation, after epoch 01 (step 4)"),
    ]


@pytest.mark.slow
def test_on_wandb_an_image_folders_split_is_written_into_the_runs_own_folder(tmp_path, monkeypatch, offline_wandb):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                tmp_path / "images" / name / f"{i}.png"
            )
    folder_data = ["--data", "vit.data.ImageFolderDataModule", "--data.root", str(tmp_path / "images")]
    folder_data += ["--data.img_size", "32", "--data.batch_size", "4", "--data.num_workers", "0"]
    args = ["fit", "--config", VIT_CONFIG, "--config", WANDB_CONFIG, *folder_data, "--trainer.max_epochs", "1"]
    cli = run_cli([*args, "--trainer.accelerator", "cpu", "--test_after_fit", "false"], tmp_path, monkeypatch)
    run = Path(cli.trainer.checkpoint_callback.dirpath).parent  # runs/<project>/<run id>/, beside checkpoints/
    split = json.loads((run / "split.json").read_text())
    assert len(split["train"]) + len(split["val"]) + len(split["test"]) == 16 and (run / "config.yaml").is_file()
    assert not (tmp_path / "runs" / "split.json").exists()  # not the shared save_dir, which each run overwrote
