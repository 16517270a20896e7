"""Non-square images, `img_size: [H, W]`: through the CLI, the data modules, the models and `vit.predict`."""

import csv

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from robust_helpers import main_in_process, tiny_config

from vit.data import CIFARDataModule, SameDifferentDataset, TwoCirclesDataModule
from vit.data.same_different import SHAPE_PIXELS, SHAPE_SIZE
from vit.data.transforms import build_eval_transform
from vit.models import ResNet, VisionTransformer
from vit.models.coordconv import CoordConvResNet, coord_channels
from vit.predict import main as predict_main

RESNET = {"class_path": "vit.models.ResNet", "init_args": {"widths": [8, 16]}}


def same_different_config(tmp_path, backbone: dict | None = None):
    """The tiny two-circles test config with the same-different data (which takes [H, W]), its checkpoint callbacks
    only, and, if given, another backbone."""
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["data"] = {
        "class_path": "vit.data.SameDifferentDataModule",
        "init_args": {"num_train": 64, "num_val": 32, "num_test": 32, "batch_size": 32},
    }
    if backbone is not None:
        config["model"]["backbone"] = backbone
    # The checkpoints only: the explanation callbacks cost seconds and same-different has no masks to score.
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if "ModelCheckpoint" in c["class_path"]]
    path.write_text(yaml.safe_dump(config))
    return path


class RecordInputs(L.Callback):
    """Test aid: the backbone's class and the shape of every training batch."""

    seen: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        RecordInputs.seen.append((type(pl_module.backbone).__name__, tuple(batch[0].shape)))


@pytest.mark.slow
def test_fit_then_predict_on_32_by_48_images(tmp_path, monkeypatch):
    main_in_process(
        [
            "fit",
            "--config",
            str(same_different_config(tmp_path)),
            "--data.init_args.img_size",
            "[32,48]",
            "--trainer.max_epochs",
            "1",
            "--trainer.limit_val_batches",
            "1",
            "--test_after_fit",
            "false",
        ],
        monkeypatch,
    )
    [last] = (tmp_path / "runs" / "tiny").glob("version_0/checkpoints/last.ckpt")
    checkpoint = torch.load(last, weights_only=True)
    assert tuple(checkpoint["datamodule_hyper_parameters"]["img_size"]) == (32, 48)
    # The ViT's position table has one row per patch of the 32 x 48 grid (patch 8: 4 x 6), plus the CLS token.
    assert checkpoint["state_dict"]["backbone.pos_embed"].shape == (1, 1 + 4 * 6, 32)

    # Predict resizes any image to 32 x 48 (H x W): a wide one, a tall one, one of the right size.
    images = tmp_path / "mine"
    images.mkdir()
    for name, (width, height) in {"wide.png": (96, 32), "tall.png": (20, 60), "exact.png": (48, 32)}.items():
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width), dtype=np.uint8)).save(images / name)
    output = tmp_path / "predictions.csv"
    assert predict_main(["--ckpt_path", str(last), "--input_dir", str(images), "--output", str(output)]) == 0
    rows = list(csv.DictReader(output.open()))
    assert [r["file"] for r in rows] == ["exact.png", "tall.png", "wide.png"]
    assert all(r["class_name"] in ("different", "same") and 0.5 <= float(r["probability"]) <= 1 for r in rows)


@pytest.mark.slow
def test_resnet_fast_dev_run_on_32_by_48_images(tmp_path, monkeypatch):
    RecordInputs.seen.clear()
    main_in_process(
        [
            "fit",
            "--config",
            str(same_different_config(tmp_path, RESNET)),
            "--data.init_args.img_size",
            "[32,48]",
            "--trainer.fast_dev_run",
            "2",
            "--trainer.callbacks+=test_non_square.RecordInputs",
        ],
        monkeypatch,
    )
    assert RecordInputs.seen == [("ResNet", (32, 1, 32, 48))] * 2


@pytest.mark.slow
def test_two_circles_refuses_a_non_square_size_in_one_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_in_process(
            ["fit", "--config", str(tiny_config(tmp_path)), "--data.init_args.img_size", "[32,48]"], monkeypatch
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: img_size=(32, 48) is not allowed for two-circles: expected a square (one int), because its quadrants "
        "and inner/border regions are defined on a square image; same_different and image folders take [H, W]"
    ]
    assert not (tmp_path / "runs").exists()
    assert TwoCirclesDataModule(img_size=[24, 24]).make_split("val", 4, "all").images.shape == (4, 1, 24, 24)


def test_same_different_places_both_shapes_inside_a_32_by_48_image():
    ds = SameDifferentDataset(num_samples=300, img_size=(32, 48), noise=0.0, region="right", seed=1)
    assert ds.images.shape == (300, 1, 32, 48)
    rows, cols = ds.positions[..., 0], ds.positions[..., 1]
    assert rows.min() >= 0 and rows.max() <= 32 - SHAPE_SIZE
    assert cols.min() >= 48 - 48 * 5 // 8 and cols.max() <= 48 - SHAPE_SIZE  # the right 5/8 of the columns
    assert rows.max() > 20 and cols.max() > 36  # the whole height and width are used, not a 32 x 32 corner
    assert torch.equal(ds.images.sum(dim=(1, 2, 3)), torch.full((300,), 2.0 * SHAPE_PIXELS))  # both shapes whole


def test_resnet_and_coordconv_take_32_by_48_inputs():
    for model in (
        ResNet(img_size=(32, 48), in_chans=1, num_classes=3, widths=(8, 16)),
        CoordConvResNet(img_size=(32, 48), in_chans=1, num_classes=3, widths=(8, 16)),
    ):
        assert model(torch.randn(2, 1, 32, 48)).shape == (2, 3)
        with pytest.raises(ValueError, match=r"expected input of shape \(B, 1, 32, 48\), got \(2, 1, 48, 32\)"):
            model(torch.randn(2, 1, 48, 32))
    with pytest.raises(
        ValueError,
        match=r"img_size=\(32, 0\) is not allowed: expected an int >= 1 \(a square\) "
        r"or a pair",
    ):
        ResNet(img_size=(32, 0))
    # Each axis scaled by its own length: pixel centres (i + 0.5) / n * 2 - 1, both spanning (-1, 1).
    coords = coord_channels((32, 48))
    rows, cols = (torch.arange(32) + 0.5) / 32 * 2 - 1, (torch.arange(48) + 0.5) / 48 * 2 - 1
    torch.testing.assert_close(coords[0], rows[:, None].expand(32, 48), rtol=0, atol=1e-6)
    torch.testing.assert_close(coords[1], cols[None, :].expand(32, 48), rtol=0, atol=1e-6)


@pytest.mark.parametrize("pos_embed", ["learned", "sincos1d", "sincos2d", "none"])
def test_non_square_images_work_with_every_position_encoding_and_rollout(pos_embed):
    from vit.explain.relevance import relevance

    model = VisionTransformer(
        img_size=(16, 24),
        patch_size=8,
        in_chans=1,
        num_classes=3,
        embed_dim=16,
        depth=2,
        num_heads=2,
        pos_embed=pos_embed,
    ).eval()
    x = torch.randn(2, 1, 16, 24)
    assert model(x).shape == (2, 3)
    assert relevance(model, x, "rollout").shape == (2, 2, 3)
    maps = model.forward_intermediates(x, indices=1, intermediates_only=True)
    assert maps[0].shape == (2, 16, 2, 3)
    with pytest.raises(ValueError, match=r"expected input of shape \(B, 1, 16, 24\), got \(2, 1, 24, 16\)"):
        model(torch.randn(2, 1, 24, 16))
    with pytest.raises(ValueError, match=r"img_size=\(16, 0\) is not allowed"):
        VisionTransformer(img_size=(16, 0), patch_size=8)


def test_cifar_upsamples_to_a_non_square_size_and_refuses_shrinking():
    image = Image.fromarray(np.full((32, 32, 3), 128, dtype=np.uint8))
    assert build_eval_transform("cifar10", (64, 96))(image).shape == (3, 64, 96)
    assert CIFARDataModule(img_size=[224, 320]).eval_transform(image).shape == (3, 224, 320)
    with pytest.raises(ValueError, match=r"img_size=\[32, 16\] is not allowed: expected an int >= 32 \(a square\)"):
        CIFARDataModule(img_size=[32, 16])
