"""Your own images: an image-folder data module, fine-tuning from a local .safetensors file through the CLI, then predict."""

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from robust_helpers import main_in_process
from safetensors.torch import save_file

from vit.data import ImageFolderDataModule
from vit.predict import main as predict_main
from vit.training.classifier import ImageClassifier

REPO = Path(__file__).resolve().parents[1]
TINY_BACKBONE = ["--model.backbone.init_args.patch_size", "8", "--model.backbone.init_args.embed_dim", "32",
                 "--model.backbone.init_args.depth", "2", "--model.backbone.init_args.num_heads", "2",
                 "--model.backbone.init_args.drop_path_rate", "0.0"]


def write_folder(root: Path, per_class: int = 12, seed: int = 0) -> Path:
    """Red and blue squares on noise, in mixed modes and sizes (RGB, L, RGBA, P; 40 to 56 px), plus two bad files."""
    rng = np.random.default_rng(seed)
    modes = ["RGB", "RGBA", "P", "RGB"]
    for label, channel in (("blue", 2), ("red", 0)):
        folder = root / label
        folder.mkdir(parents=True)
        for i in range(per_class):
            size = int(rng.integers(40, 57))
            pixels = rng.integers(0, 60, size=(size, size, 3)).astype(np.uint8)
            x, y = rng.integers(0, size - 16, size=2)
            pixels[y:y + 16, x:x + 16, channel] = 255
            Image.fromarray(pixels).convert(modes[i % len(modes)]).save(folder / f"{i:02d}.png")
    (root / "red" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (root / "blue" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture
def weights(tmp_path) -> Path:
    """A timm ViT (random weights, no download) of the tiny test architecture, as a .safetensors file."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=2, num_heads=2)
    path = tmp_path / "tiny_vit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_fine_tune_from_safetensors_then_test_then_predict(tmp_path, weights, monkeypatch, capsys):
    images = write_folder(tmp_path / "my images", per_class=24)
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable file\(s\)"):
        main_in_process(["fit", "--config", str(REPO / "configs/folder/finetune_vit.yaml"),
                         "--data.root", str(images), "--data.img_size", "32", "--data.batch_size", "8",
                         "--data.num_workers", "0", "--data.val_fraction", "0.25", "--data.normalization", "imagenet",
                         "--trainer.precision", "32-true", "--trainer.max_epochs", "8", "--trainer.accelerator", "cpu",
                         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--model.lr", "3e-3",
                         "--model.backbone.init_args.pretrained", str(weights), *TINY_BACKBONE], monkeypatch)
    out = capsys.readouterr().out
    accuracy = float(re.search(r"test/acc = ([0-9.]+)", out)[1])
    assert accuracy >= 0.75, accuracy  # 12 held-out images of a task a linear read-out of colour solves
    [last] = (tmp_path / "runs").glob("folder/finetune_vit/version_0/checkpoints/last.ckpt")

    output = tmp_path / "predictions.csv"
    assert predict_main(["--ckpt_path", str(last), "--input_dir", str(images / "red"), "--output", str(output)]) == 0
    rows = list(csv.DictReader(output.open()))
    assert [r["file"] for r in rows] == [f"{i:02d}.png" for i in range(24)]  # broken.png listed as skipped
    assert "skipped broken.png" in capsys.readouterr().err
    # The CSV holds the model's own answer on the data module's eval transform of each file.
    model = ImageClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True).eval()
    dm = ImageFolderDataModule(root=str(images), img_size=32, normalization="imagenet")
    with torch.no_grad():
        x = torch.stack([dm.eval_transform(Image.open(images / "red" / r["file"])) for r in rows])
        probs = model(x).softmax(-1)
    for row, p in zip(rows, probs):
        assert int(row["class"]) == int(p.argmax()) and abs(float(row["probability"]) - float(p.max())) < 1e-5


def test_train_val_test_folders_are_used_as_given(tmp_path):
    for split, n in (("train", 6), ("val", 3), ("test", 2)):
        write_folder(tmp_path / "data" / split, per_class=n)
    dm = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32)
    with pytest.warns(UserWarning, match="skipped 6 unreadable"):
        dm.setup("fit")
    assert (dm.num_classes, dm.classes) == (2, ["blue", "red"])
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (12, 6, 4)
    x, y = dm.train_set[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32


def test_a_seeded_split_is_disjoint_and_repeatable(tmp_path):
    write_folder(tmp_path / "data", per_class=10)
    splits = []
    for _ in range(2):
        dm = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32, val_fraction=0.2, seed=3)
        with pytest.warns(UserWarning):
            dm.setup("fit")
        splits.append((dm.train_set.indices, dm.val_set.indices))
    assert splits[0] == splits[1] and len(splits[0][1]) == 4 and not set(splits[0][0]) & set(splits[0][1])


@pytest.mark.parametrize(("make", "message"), [
    (lambda root: root.mkdir(), "holds no class folders"),
    (lambda root: (root / "only").mkdir(parents=True), r"holds one class folder \(only\)"),
    (lambda root: None, "is not a folder"),
])
def test_folders_that_cannot_train_a_classifier_are_named(tmp_path, make, message):
    root = tmp_path / "data"
    make(root)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ImageFolderDataModule(root=str(root))


def test_a_class_folder_without_a_readable_image_is_named(tmp_path):
    root = write_folder(tmp_path / "data", per_class=2)
    (root / "empty_class").mkdir()
    (root / "empty_class" / "cut.png").write_bytes(b"nope")
    dm = ImageFolderDataModule(root=str(root), img_size=32)
    with pytest.raises(ValueError, match="empty_class.*every class folder needs at least one readable image"):
        dm.setup("fit")
