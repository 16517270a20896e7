"""An image folder starts from its listing: `setup` reads no image, the split is the one torchvision's listing and the
seed give, and a file that fails to decode is skipped when a loader reads it: named once, counted per epoch."""

import csv
import json
import os
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from torchvision import datasets

from vit.data import ImageFolderDataModule
from vit.data.image_folder import NoReadableImageError
from vit.data.images import UnreadableImageError, decode_image
from vit.models import VisionTransformer
from vit.training.classifier import ImageClassifier


def photos(root: Path, per_class: int = 6, seed: int = 0) -> Path:
    """Two class folders of small noisy JPEG and PNG photos (both extensions torchvision's `ImageFolder` lists)."""
    rng = np.random.default_rng(seed)
    for label in ("cats", "dogs"):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i:02d}.{'jpg' if i % 2 else 'png'}")
    return root


def with_bad_files(root: Path) -> dict[str, str]:
    """A truncated JPEG in cats/ and a text file named .png in dogs/: {relative name: why decode_image refuses it}."""
    cut = root / "cats" / "cut.jpg"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 48, 3), dtype=np.uint8)).save(cut, quality=90)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (root / "dogs" / "notes.png").write_text("not an image")
    return {"cats/cut.jpg": "image file is truncated", "dogs/notes.png": "cannot identify image file"}


def unreadable(dm: ImageFolderDataModule, split: str) -> set[str]:
    """The files of `split` that `decode_image` refuses, each decoded here: the brute-force count."""
    bad = set()
    for name in dm.split_files[split]:
        try:
            decode_image(dm.root / name, (16, 16))
        except UnreadableImageError:
            bad.add(name)
    return bad


def test_setup_reads_no_image_and_the_loader_does(tmp_path, monkeypatch):
    root = photos(tmp_path / "data")
    with_bad_files(root)
    opened = []
    original = Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(args[0]) or original(*args, **kwargs))
    dm = ImageFolderDataModule(root=str(root), img_size=16, num_workers=0)
    dm.setup("fit")  # no warning either: every file is named as an image
    assert opened == [] and len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 14
    x, _ = dm.train_set[0]  # control: reading goes through the patched Image.open
    assert opened and x.shape == (3, 16, 16)


def test_the_split_is_torchvisions_listing_in_the_seeds_order_byte_for_byte(tmp_path):
    root = photos(tmp_path / "data", per_class=23)
    for seed in (0, 7):
        dm = ImageFolderDataModule(root=str(root), img_size=16, val_fraction=0.15, test_fraction=0.2, seed=seed)
        dm.setup("fit")
        # The split of a folder whose files all decode, as it was drawn when setup decoded every file first.
        names = [os.path.relpath(path, root) for path, _ in datasets.ImageFolder(str(root)).samples]
        order = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()
        n_val, n_test = round(0.15 * len(names)), round(0.2 * len(names))
        expected = {
            "root": str(root),
            "train": [names[i] for i in order[n_val + n_test :]],
            "val": [names[i] for i in order[:n_val]],
            "test": [names[i] for i in order[n_val : n_val + n_test]],
        }
        assert dm.run_files()["split.json"] == json.dumps(expected, indent=1)


def test_a_class_folder_without_a_file_named_as_an_image_is_refused_at_setup(tmp_path):
    root = photos(tmp_path / "data", per_class=2)
    (root / "birds").mkdir()
    (root / "birds" / "readme.txt").write_text("photos to come")
    (root / "birds" / "raw").write_bytes(b"\0")
    dm = ImageFolderDataModule(root=str(root), img_size=16)
    with pytest.raises(NoReadableImageError) as error:
        dm.setup("fit")
    assert str(error.value) == (
        f"class folder {root / 'birds'} has no image file (raw: not named as an image (no extension); readme.txt: "
        "not named as an image (.txt)): every class folder needs at least one"
    )


def test_a_split_whose_every_file_is_broken_stops_with_one_line(tmp_path):
    root = photos(tmp_path / "data", per_class=2)
    for path in root.rglob("*.*"):
        path.write_bytes(b"broken")
    dm = ImageFolderDataModule(root=str(root), img_size=16, val_fraction=0.25)
    dm.setup("fit")
    with pytest.raises(NoReadableImageError, match=r"^none of the 2 files of this split under .* decodes as an image$"):
        dm.train_set[0]
    # An evaluation batch leaves a broken file out; a batch with none left is one line too.
    with pytest.raises(NoReadableImageError, match=r"^none of the 1 files of a batch under .* decodes as an image$"):
        dm.val_set.__getitems__([0])


def fit(root: Path, logs: Path, num_workers: int, max_epochs: int = 2) -> tuple[ImageFolderDataModule, list[str]]:
    """Two epochs of a tiny ViT on `root` (validation each epoch, then test): the data module and its warnings."""
    dm = ImageFolderDataModule(
        root=str(root), img_size=16, batch_size=4, num_workers=num_workers, val_fraction=0.25, test_fraction=0.2
    )
    torch.manual_seed(0)
    backbone = VisionTransformer(img_size=16, patch_size=8, num_classes=2, embed_dim=16, depth=1, num_heads=2)
    model = ImageClassifier(backbone, lr=0.01, warmup_epochs=0.0)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=CSVLogger(logs, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, even one Python would show once
        trainer.fit(model, datamodule=dm)
        trainer.test(model, datamodule=dm)
    return dm, [str(w.message) for w in caught if "unreadable image" in str(w.message)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_broken_files_are_skipped_when_read_named_once_and_counted_each_epoch(tmp_path, num_workers):
    root = photos(tmp_path / "data", per_class=8)
    bad = with_bad_files(root)
    dm, named = fit(root, tmp_path / "logs", num_workers)
    # Each bad file named in one warning, whatever the epoch or the worker process that met it.
    for name, why in bad.items():
        [message] = [m for m in named if name in m]
        assert f"{name}: {why}" in message and message.startswith("skipped ")
    assert len(named) <= 2 and {os.path.relpath(p, root) for p in dm.unread} == set(bad)
    # Each epoch's count of each split is the number of its files that do not decode.
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    for split in ("train", "val", "test"):
        counts = [float(row[f"{split}/skipped_images"]) for row in rows if row.get(f"{split}/skipped_images")]
        expected = len(unreadable(dm, split))
        epochs = 1 if split == "test" else 2
        assert counts == ([float(expected)] * epochs if expected else []), (split, counts)
    assert sum(len(unreadable(dm, split)) for split in ("train", "val", "test")) == 2  # each bad file in one split


def test_a_broken_file_is_replaced_by_the_next_image_of_its_split_so_batches_keep_their_size(tmp_path):
    root = photos(tmp_path / "data", per_class=8)
    with_bad_files(root)
    dm = ImageFolderDataModule(
        root=str(root),
        img_size=16,
        batch_size=4,
        num_workers=0,
        val_fraction=0.25,
        random_resized_crop=False,  # no random step: an item can be compared with the file it is
        horizontal_flip=False,
    )
    dm.setup("fit")
    split, bad = dm.train_set, unreadable(dm, "train")
    assert bad  # the seed puts at least one bad file in the training split
    names = dm.split_files["train"]
    for i in range(len(split)):
        # The first file from i on (wrapping round) that decodes: brute force over the split's order.
        k = next(k for k in range(len(names)) if names[(i + k) % len(names)] not in bad)
        x, y = split[i]
        expected_x, expected_y = split.dataset[split.indices[(i + k) % len(names)]]
        assert torch.equal(x, expected_x) and y == expected_y
    batches = [len(y) for _, y in dm.train_dataloader()]
    assert sum(batches) == len(split) and batches[:-1] == [4] * (len(batches) - 1)  # no batch shorter for a bad file


def test_a_file_left_out_by_its_name_is_named_with_the_endings_that_are_read(tmp_path):
    root = photos(tmp_path / "data", per_class=2)
    (root / "cats" / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(root=str(root), img_size=16)
    with pytest.warns(UserWarning) as warned:
        dm.setup("fit")
    skipped, endings = (str(w.message) for w in warned)
    assert skipped == f"skipped 1 file(s) under {root}: cats/notes.txt: not named as an image (.txt)"
    read = endings.split(": ")[1].split(", ")
    assert endings.startswith("an image folder lists a file as an image by its name's ending: ")
    assert {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp", ".bmp", ".gif"} <= set(read) and ".txt" not in read
    assert set(datasets.folder.IMG_EXTENSIONS) <= set(read)  # every ending torchvision's ImageFolder lists


def test_an_evaluation_split_leaves_a_broken_file_out_scores_each_image_once_and_predicts_it_under_its_name(tmp_path):
    from vit.training.predictions import PredictionWriter

    root = photos(tmp_path / "data", per_class=8)
    bad = with_bad_files(root)
    for seed in range(50):  # a seed whose test split holds a bad file (the split depends only on listing and seed)
        dm = ImageFolderDataModule(root=str(root), img_size=16, batch_size=4, seed=seed, val_fraction=0.25)
        dm.setup("test")
        if unreadable(dm, "test"):
            break
    names, broken = dm.split_files["test"], unreadable(dm, "test")
    assert broken and broken <= set(bad) and len(names) > len(broken)
    readable = [i for i, name in enumerate(names) if name not in broken]
    torch.manual_seed(0)
    backbone = VisionTransformer(img_size=16, patch_size=8, num_classes=2, embed_dim=16, depth=1, num_heads=2)
    model = ImageClassifier(backbone)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path / "logs", name="", version=""),
        callbacks=[PredictionWriter()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="each left out of its batch"):
        [metrics] = trainer.test(model, datamodule=dm)
    # Brute force: each readable test file once, through the evaluation transform, scored by the same weights.
    images = [dm.test_set.dataset[dm.test_set.indices[i]] for i in readable]
    backbone.eval()
    with torch.no_grad():
        predicted = backbone(torch.stack([x for x, _ in images])).argmax(1)
    correct = sum(int(p) == y for p, (_, y) in zip(predicted, images))
    assert metrics["test/images"] == len(readable) and metrics["test/skipped_images"] == len(broken)
    assert metrics["test/acc"] == pytest.approx(correct / len(readable))
    trainer.predict(model, datamodule=dm)
    with open(tmp_path / "logs" / "predictions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["file"] for row in rows] == [names[i] for i in readable]
    assert [row["class_index"] for row in rows] == [str(int(p)) for p in predicted]
