"""Your own images: an image-folder data module, fine-tuning from a local .safetensors file through the CLI, then
predict, explain and export."""

import csv
import json
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
from vit.data.image_folder import NoReadableImageError
from vit.explain.__main__ import main as explain_main
from vit.export import main as export_main
from vit.predict import main as predict_main
from vit.training.classifier import ImageClassifier

REPO = Path(__file__).resolve().parents[1]


def write_folder(root: Path, per_class: int = 12, seed: int = 0) -> Path:
    """Red and blue squares on noise, in mixed modes and sizes (RGB, L, RGBA, P; 40 to 56 px), plus two bad files:
    red/broken.png (listed by its name, skipped when read) and blue/notes.txt (not listed)."""
    rng = np.random.default_rng(seed)
    modes = ["RGB", "RGBA", "P", "RGB"]
    for label, channel in (("blue", 2), ("red", 0)):
        folder = root / label
        folder.mkdir(parents=True)
        for i in range(per_class):
            size = int(rng.integers(40, 57))
            pixels = rng.integers(0, 60, size=(size, size, 3)).astype(np.uint8)
            x, y = rng.integers(0, size - 16, size=2)
            pixels[y : y + 16, x : x + 16, channel] = 255
            Image.fromarray(pixels).convert(modes[i % len(modes)]).save(folder / f"{i:02d}.png")
    (root / "red" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (root / "blue" / "notes.txt").write_text("not an image")
    return root


def write_truncated_jpeg(path: Path) -> Path:
    """A real JPEG written by Pillow, then cut to half its bytes (an interrupted copy or download)."""
    pixels = np.random.default_rng(1).integers(0, 256, size=(48, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@pytest.fixture
def weights(tmp_path) -> Path:
    """A timm ViT (random weights, no download) of the tiny test architecture, as a .safetensors file."""
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2
    )
    path = tmp_path / "tiny_vit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.mark.slow
def test_own_images_end_to_end(tmp_path, weights, monkeypatch, capsys):
    # The path of docs/finetune.md: a folder of named classes -> fine-tune from a timm-made .safetensors
    # -> test -> predict with names and top-k -> explain a new image -> export -> timm loads the export.
    images = write_folder(tmp_path / "my images", per_class=40)
    write_truncated_jpeg(images / "blue" / "cut.jpg")  # skipped when read: training does not stop mid-epoch
    with pytest.warns(UserWarning) as warned:
        main_in_process(
            [
                "fit",
                "--config",
                str(REPO / "configs/folder/finetune_vit.yaml"),
                "--data.root",
                str(images),
                "--data.img_size",
                "32",
                "--data.batch_size",
                "8",
                "--data.num_workers",
                "0",
                "--data.val_fraction",
                "0.2",
                "--data.test_fraction",
                "0.2",
                "--data.normalization",
                "imagenet",
                "--trainer.precision",
                "32-true",
                "--trainer.max_epochs",
                "8",
                "--trainer.accelerator",
                "cpu",
                "--trainer.logger.init_args.save_dir",
                str(tmp_path / "runs"),
                "--model.lr",
                "3e-3",
                "--model.pretrained",
                str(weights),
                "--model.backbone.init_args.patch_size",
                "8",
                "--model.backbone.init_args.num_heads",
                "2",  # width and depth: the file's
                "--model.backbone.init_args.drop_path_rate",
                "0.0",
            ],
            monkeypatch,
        )
    messages = [str(w.message) for w in warned if "skipped" in str(w.message)]
    assert re.match(r"skipped 1 file\(s\) under .* blue/notes.txt: not named as an image", messages[0])
    # The two bad files named as images, each named once when a loader met it (train, val or test).
    for name in ("blue/cut.jpg: image file is truncated", "red/broken.png: cannot identify image file"):
        assert len([m for m in messages[1:] if name in m and "unreadable image(s)" in m]) == 1
    out = capsys.readouterr().out
    accuracy = float(re.search(r"test/acc = ([0-9.]+)", out)[1])
    assert accuracy >= 0.75, accuracy  # 16 test images (not the 16 that chose the checkpoint); colour solves the task
    [last] = (tmp_path / "runs").glob("folder/finetune_vit/version_0/checkpoints/last.ckpt")
    backbone = torch.load(last, map_location="cpu", weights_only=True)["hyper_parameters"]["backbone"]["init_args"]
    assert (backbone["embed_dim"], backbone["depth"], backbone["num_heads"]) == (32, 2, 2)  # recorded as numbers
    events = b"".join(f.read_bytes() for f in last.parents[1].glob("events.out.tfevents.*"))
    assert b"val/rollout" in events and b"val/confusion_matrix" in events  # the config's dashboard images
    split = json.loads((last.parents[1] / "split.json").read_text())  # the 16 test images, apart from val and train
    assert len(split["test"]) == 16 and not set(split["test"]) & (set(split["val"]) | set(split["train"]))

    output = tmp_path / "predictions.csv"
    assert predict_main(["--ckpt_path", str(last), "--input_dir", str(images / "red"), "--output", str(output)]) == 0
    rows = list(csv.DictReader(output.open()))
    assert [r["file"] for r in rows] == [f"{i:02d}.png" for i in range(40)]  # broken.png listed as skipped
    assert "skipped broken.png" in capsys.readouterr().err
    # The CSV holds the model's own answer on the data module's eval transform of each file.
    model = ImageClassifier.load_from_checkpoint(last, map_location="cpu", weights_only=True).eval()
    dm = ImageFolderDataModule(root=str(images), img_size=32, normalization="imagenet")
    with torch.no_grad():
        x = torch.stack([dm.eval_transform(Image.open(images / "red" / r["file"])) for r in rows])
        probs = model(x).softmax(-1)
    for row, p in zip(rows, probs):
        assert int(row["class_index"]) == int(p.argmax()) and abs(float(row["probability"]) - float(p.max())) < 1e-5
        assert row["class_name"] == ["blue", "red"][int(p.argmax())]  # the class folders' names

    # The two best classes of each image, by name, in order.
    top2 = tmp_path / "top2.csv"
    assert (
        predict_main(
            ["--ckpt_path", str(last), "--input_dir", str(images / "blue"), "--output", str(top2), "--topk", "2"]
        )
        == 0
    )
    for row in csv.DictReader(top2.open()):
        assert {row["class_name"], row["class_name_2"]} == {"blue", "red"}
        assert abs(float(row["probability"]) + float(row["probability_2"]) - 1) < 1e-5
        assert float(row["probability"]) >= float(row["probability_2"])

    # A new image, not in the data, explained by every method the model allows.
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 60, size=(48, 48, 3)).astype(np.uint8)
    pixels[10:26, 20:36, 0] = 255
    Image.fromarray(pixels).save(tmp_path / "new photo.png")
    assert (
        explain_main(
            [
                "--ckpt_path",
                str(last),
                "--image",
                str(tmp_path / "new photo.png"),
                "--method",
                "all",
                "--out",
                str(tmp_path / "explained.png"),
            ]
        )
        == 0
    )
    assert Image.open(tmp_path / "explained.png").size[0] > 0

    # Out of the project: timm reads the export with the checkpoint's logits and class names.
    assert export_main(["--ckpt_path", str(last), "--out", str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["label_names"] == ["blue", "red"]
    exported = timm.create_model(f"local-dir:{tmp_path / 'exported'}", pretrained=True).eval()
    with torch.no_grad():
        assert (exported(x) - model(x)).abs().max() < 1e-5
    # Without the training folder or the pretrained file the checkpoint still works: tests/test_checkpoint_trust.py.


def test_train_val_test_folders_are_used_as_given(tmp_path):
    for split, n in (("train", 6), ("val", 3), ("test", 2)):
        write_folder(tmp_path / "data" / split, per_class=n)
    dm = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32)
    with pytest.warns(UserWarning, match="skipped 3 file"):  # the notes.txt of each split
        dm.setup("fit")
    assert (dm.num_classes, dm.classes) == (2, ["blue", "red"])
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (13, 7, 5)  # with each red/broken.png
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


def test_the_test_split_is_held_out_from_val_and_train_and_recorded(tmp_path):
    write_folder(tmp_path / "data", per_class=10)  # 20 readable images and red/broken.png
    dm = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32, val_fraction=0.2, test_fraction=0.3, seed=3)
    with pytest.warns(UserWarning):
        dm.setup("fit")
    train, val, test = (set(dm.split_files[k]) for k in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (11, 4, 6)  # of 21: round(4.2) and round(6.3) held out
    assert not (train & val or train & test or val & test)
    assert train | val | test == {f"{c}/{i:02d}.png" for c in ("blue", "red") for i in range(10)} | {"red/broken.png"}
    assert dm.test_set is not dm.val_set and len(dm.test_set) == 6
    # The recorded names are the files the test loader reads, and the validation images stay those of test_fraction=0.
    assert [dm.test_set.dataset.samples[i][0] for i in dm.test_set.indices] == [
        str(tmp_path / "data" / name) for name in dm.split_files["test"]
    ]
    old = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32, val_fraction=0.2, test_fraction=0, seed=3)
    with pytest.warns(UserWarning):
        old.setup("fit")
    assert old.split_files["val"] == dm.split_files["val"] and old.test_set is old.val_set


def test_a_missing_test_folder_is_split_off_train_and_fractions_must_leave_training_images(tmp_path):
    for split, n in (("train", 10), ("val", 3)):
        write_folder(tmp_path / "data" / split, per_class=n)
    dm = ImageFolderDataModule(root=str(tmp_path / "data"), img_size=32, test_fraction=0.25)
    with pytest.warns(UserWarning):
        dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (16, 7, 5)  # 21 in train/: round(5.25) to test
    assert all(name.startswith("train/") for name in dm.split_files["test"])
    with pytest.raises(ValueError, match="val_fraction \\+ test_fraction = 1 leaves no image to train on"):
        ImageFolderDataModule(root=str(tmp_path / "data"), val_fraction=0.5, test_fraction=0.5)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: root.mkdir(), "holds no class folders"),
        (lambda root: (root / "only").mkdir(parents=True), r"holds one class folder \(only\)"),
        (lambda root: None, "is not a folder"),
    ],
)
def test_folders_that_cannot_train_a_classifier_are_named(tmp_path, make, message):
    root = tmp_path / "data"
    make(root)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        ImageFolderDataModule(root=str(root))


def test_a_class_folder_without_an_image_file_is_named(tmp_path):
    # At setup only the names are known: a class folder whose only file is a broken .png passes, and that file is
    # skipped when read (tests/test_image_folder_lazy.py); one with no file named as an image is refused.
    root = write_folder(tmp_path / "data", per_class=2)
    (root / "empty_class").mkdir()
    (root / "empty_class" / "cut.txt").write_bytes(b"nope")
    dm = ImageFolderDataModule(root=str(root), img_size=32)
    with pytest.raises(
        NoReadableImageError,
        match=r"class folder .*/empty_class has no image file \(cut\.txt: "
        r"not named as an image \(\.txt\)\): every "
        r"class folder needs at least one$",
    ):
        dm.setup("fit")


def test_a_truncated_jpeg_is_skipped_when_read_not_mid_epoch(tmp_path):
    root = write_folder(tmp_path / "data", per_class=4)
    cut = write_truncated_jpeg(root / "red" / "cut.jpg")
    with Image.open(cut) as image:
        image.verify()  # the check that would let it through: verify() reads none of a JPEG's image data
    dm = ImageFolderDataModule(root=str(root), img_size=32, val_fraction=0.25)
    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\) under .*: blue/notes\.txt"):
        dm.setup("fit")  # listed by name: cut.jpg and broken.png are in the splits
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (7, 2, 1)  # of 10: round(2.5), round(1.0)
    # Every item of the splits is an image: the two bad files are replaced where they are read, then named.
    assert all(x.shape == (3, 32, 32) for split in (dm.train_set, dm.val_set, dm.test_set) for x, _ in split)
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable image\(s\) of the train split"):
        for split in ("train", "val", "test"):
            dm.report_unread(split, torch.zeros_like(dm.folder_of(split).failures))
    assert dm.unread.keys() == {str(cut), str(root / "red" / "broken.png")}
    assert dm.unread[str(cut)].startswith("image file is truncated") and dm.unread[
        str(root / "red" / "broken.png")
    ] == ("cannot identify image file: not a format Pillow reads")


def test_hidden_entries_are_ignored_everywhere(tmp_path):
    """Jupyter's .ipynb_checkpoints, a .git folder, macOS's .DS_Store and ._ files, at every level of both layouts."""

    def add_hidden(folder: Path) -> None:
        (folder / ".ipynb_checkpoints").mkdir()
        Image.new("RGB", (40, 40)).save(folder / ".ipynb_checkpoints" / "00-checkpoint.png")  # a readable image
        (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")

    root = write_folder(tmp_path / "flat", per_class=4)
    (root / ".git").mkdir()
    for folder in (root, root / "red", root / "blue"):
        add_hidden(folder)
    (root / "red" / "._00.png").write_bytes(b"\0\5\26\7 AppleDouble")
    dm = ImageFolderDataModule(root=str(root), img_size=32, val_fraction=0.25)
    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\)"):  # notes.txt only (broken.png: when read)
        dm.setup("fit")
    assert dm.classes == ["blue", "red"] and len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 9
    assert sorted(Path(p).name for p in dm.skipped) == ["notes.txt"]

    given = tmp_path / "given"
    for split in ("train", "val"):
        write_folder(given / split, per_class=3)
        add_hidden(given / split)
        add_hidden(given / split / "red")
    add_hidden(given)
    dm = ImageFolderDataModule(root=str(given), img_size=32)
    with pytest.warns(UserWarning, match=r"skipped 2 file\(s\)"):
        dm.setup("fit")
    assert (dm.classes, len(dm.train_set) + len(dm.test_set), len(dm.val_set)) == (["blue", "red"], 7, 7)


@pytest.mark.parametrize(
    ("splits", "named"),
    [
        (["val"], "val/ but no train/"),
        (["test"], "test/ but no train/"),
        (["val", "test"], "val/ and test/ but no train/"),
        (["train", "valid"], r"train/ beside other folders \(valid/\)"),
    ],
)
def test_a_root_that_fits_neither_layout_is_refused_in_one_line(tmp_path, splits, named):
    root = tmp_path / "data"
    write_folder(root, per_class=2)  # class folders blue/ and red/ at the root
    for split in splits:
        write_folder(root / split, per_class=2)
    if "train" in splits:  # train/ beside a validation split named valid/, without the class folders
        for label in ("blue", "red"):
            for f in (root / label).iterdir():
                f.unlink()
            (root / label).rmdir()
    with pytest.raises(ValueError) as error:
        ImageFolderDataModule(root=str(root))
    message = str(error.value)
    assert "\n" not in message and re.match(
        rf"{re.escape(str(root))} has {named}, so it fits neither layout: expected "
        r"root/<class>/<image> \(split into train, val and test by val_fraction "
        r"and test_fraction\) or root/train/<class>/<image> with optional "
        r"root/val/ and root/test/",
        message,
    )


def test_non_square_images_keep_their_height_and_width(tmp_path):
    root = write_folder(tmp_path / "data", per_class=3)
    for crop in (True, False):
        dm = ImageFolderDataModule(root=str(root), img_size=(32, 48), random_resized_crop=crop)
        with pytest.warns(UserWarning):
            dm.setup("fit")
        assert dm.train_set[0][0].shape == dm.val_set[0][0].shape == (3, 32, 48)
    with pytest.raises(
        ValueError,
        match=r"img_size=\(32, 4\) is not allowed: expected an int >= 8 \(a square\) "
        r"or a pair",
    ):
        ImageFolderDataModule(root=str(root), img_size=(32, 4))


def test_mixup_and_cutmix_give_folder_batches_soft_targets_that_sum_to_one(tmp_path):
    from types import SimpleNamespace

    write_folder(tmp_path / "data", per_class=6)
    dm = ImageFolderDataModule(
        root=str(tmp_path / "data"),
        img_size=32,
        batch_size=4,
        num_workers=0,
        mixup_alpha=0.8,
        cutmix_alpha=1.0,
        test_fraction=0,
    )
    with pytest.warns(UserWarning):
        dm.setup("fit")
    dm.trainer = SimpleNamespace(
        training=True, world_size=1, global_rank=0
    )  # what the hook and the sampler read of the trainer
    loader = dm.train_dataloader()
    assert loader.drop_last and all(len(y) == 4 for _, y in loader)  # every batch even, for timm's flip
    x, _ = next(iter(loader))
    y = torch.tensor([0, 0, 1, 1])  # each image mixed with one of the other class (timm mixes with the flip)
    np.random.seed(0)  # timm draws the mixing weight with numpy
    x_mixed, y_out, y_soft = dm.on_after_batch_transfer((x.clone(), y), 0)
    assert x_mixed.shape == x.shape and torch.equal(y_out, y)  # the hard labels stay, for train accuracy
    assert y_soft.shape == (4, 2) and torch.allclose(y_soft.sum(1), torch.ones(4))
    assert ((y_soft > 0) & (y_soft < 1)).all()  # soft: both classes in every row
    dm.trainer = SimpleNamespace(training=False, world_size=1, global_rank=0)  # validation batches stay as they are
    assert dm.on_after_batch_transfer((x, y), 0)[1] is y
    with pytest.raises(ValueError, match="batch_size=5 must be even when Mixup/CutMix is on"):
        ImageFolderDataModule(root=str(tmp_path / "data"), batch_size=5, cutmix_alpha=1.0)
