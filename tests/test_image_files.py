"""Files users really have: names that are not UTF-8, link loops, pipes, formula-like names, phone photos, huge
and broken images, met by the image-folder data module, `vit.predict` and `vit.explain` (which reads as predict)."""

import csv
import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin
from robust_helpers import cli, error_line, main_in_process, run_dirs, shared_run

from vit.data import ImageFolderDataModule
from vit.data.images import ImageFiles, UnreadableImageError, build_transform, decode_image, image_files
from vit.predict import main as predict_main
from vit.prediction_csv import prediction_table

REPO = Path(__file__).resolve().parents[1]
FF = os.fsdecode(b"\xff")  # how Python spells the byte 0xFF of a file name that is not UTF-8 (a lone surrogate)


@pytest.fixture
def checkpoint(tmp_path_factory, monkeypatch) -> Path:
    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    return run_dir / "checkpoints" / "last.ckpt"


def square(path: Path, size: int = 40, seed: int = 0) -> Path:
    """A small noisy RGB image, different for each seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def two_classes(root: Path, per_class: int = 3) -> Path:
    for label, seed in (("a", 0), ("b", 100)):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            square(root / label / f"{i}.png", seed=seed + i)
    return root


def predict(checkpoint: Path, folder: Path, output: Path) -> int:
    return predict_main(["--ckpt_path", str(checkpoint), "--input_dir", str(folder), "--output", str(output)])


def train_folder(root: Path, runs: Path, monkeypatch) -> None:
    """`train.py fit` (then test) of a tiny ViT on `root` for one epoch, from no pretrained weights."""
    main_in_process(
        [
            "fit",
            "--config",
            str(REPO / "configs/folder/finetune_vit.yaml"),
            "--data.root",
            str(root),
            "--data.img_size",
            "32",
            "--data.batch_size",
            "4",
            "--data.num_workers",
            "0",
            "--data.val_fraction",
            "0.25",
            "--trainer.precision",
            "32-true",
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(runs),
            "--model.pretrained",
            "null",
            "--model.backbone.init_args.patch_size",
            "8",
            "--model.backbone.init_args.embed_dim",
            "32",
            "--model.backbone.init_args.depth",
            "1",
            "--model.backbone.init_args.num_heads",
            "2",
        ],
        monkeypatch,
    )


@pytest.mark.slow
def test_a_file_name_that_is_not_utf8_is_written_with_a_backslash_escape(checkpoint, tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    square(folder / f"caf{FF}.png")
    square(folder / "plain.png", seed=1)
    (folder / f"bad{FF}.png").write_bytes(b"not an image")
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    assert [row["file"] for row in csv.DictReader(output.open(encoding="utf-8"))] == ["caf\\xff.png", "plain.png"]
    assert "skipped bad\\xff.png: not a readable image" in capsys.readouterr().err


@pytest.mark.slow
def test_a_class_folder_whose_name_is_not_utf8_trains_tests_and_names_the_class_as_text(tmp_path, monkeypatch, capsys):
    root = tmp_path / "data"
    for split in ("train", "val", "test"):  # as given, so that the test after fit has images of both classes
        two_classes(root / split, per_class=4)
        (root / split / "a").rename(root / split / f"caf{FF}")
    dm = ImageFolderDataModule(root=str(root), img_size=32)
    assert dm.class_names == ["b", "caf\\xff"]  # sorted as the folders are on disk: b'b' < b'caf\xff'
    dm.setup("fit")  # the files are read from the folder's real name
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (8, 8, 8)
    # Before, TensorBoard failed to encode `test/class_acc/caf\udcff` after fit; now the run ends and its
    # checkpoint and metrics hold the name as text.
    train_folder(root, tmp_path / "runs", monkeypatch)
    assert re.search(r"^ +caf\\xff +[0-9.]+$", capsys.readouterr().out, re.MULTILINE)  # accuracy per class
    [run] = (tmp_path / "runs").glob("folder/finetune_vit/version_0")
    assert any(b"test/class_acc/caf\\xff" in events.read_bytes() for events in run.glob("events.out.tfevents.*"))
    last = run / "checkpoints" / "last.ckpt"
    names = torch.load(last, map_location="cpu", weights_only=True)["class_names"]
    assert names == ["b", "caf\\xff"] and json.dumps(names).encode("utf-8")


def test_a_symlink_loop_and_a_second_link_to_a_file_count_each_image_once(tmp_path):
    root = two_classes(tmp_path / "data")
    os.symlink(".", root / "b" / "current")  # `ln -s . data/b/current`: b/current/current/... to the link limit
    os.symlink("0.png", root / "a" / "again.png")
    dm = ImageFolderDataModule(root=str(root), img_size=32, val_fraction=0.34)
    with pytest.warns(UserWarning) as warned:
        dm.setup("fit")
    [message] = [str(w.message) for w in warned]
    assert message == (
        f"skipped 2 file(s) under {root}: a/again.png: the same file as 0.png, listed once; "
        "b/current: a link to a folder listed already (not entered again)"
    )
    train, val, test = (
        {os.path.realpath(split.dataset.samples[i][0]) for i in split.indices}
        for split in (dm.train_set, dm.val_set, dm.test_set)
    )
    assert len(train) + len(val) + len(test) == 6 and not (train & val or train & test or val & test)  # no image twice


def open_fifo_for_writing(path: Path) -> None:
    """Give a reader blocked on the FIFO `path` an end of file, so that a failing test does not hang the session."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: nobody is reading it
        pass


def test_a_fifo_and_devices_in_a_class_folder_are_skipped_not_waited_on(tmp_path):
    root = two_classes(tmp_path / "data")
    os.mkfifo(root / "a" / "pipe.png")
    os.symlink("/dev/zero", root / "b" / "zero.png")
    dm = ImageFolderDataModule(root=str(root), img_size=32, num_workers=0)
    caught = []

    def setup() -> None:
        with pytest.warns(UserWarning) as warned:
            dm.setup("fit")
        caught.extend(str(w.message) for w in warned)

    thread = threading.Thread(target=setup, daemon=True)
    thread.start()
    thread.join(timeout=30)
    hung = thread.is_alive()
    open_fifo_for_writing(root / "a" / "pipe.png")
    thread.join(timeout=10)
    assert not hung, "setup waited on the FIFO"
    assert caught == [
        (
            f"skipped 2 file(s) under {root}: a/pipe.png: a named pipe (FIFO), not a regular file; "
            "b/zero.png: a character device, not a regular file"
        )
    ]
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 6


@pytest.mark.slow
def test_predict_lists_fifos_and_links_to_devices_as_skipped(checkpoint, tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    square(folder / "fine.png")
    os.mkfifo(folder / "pipe.png")
    os.symlink("/dev/zero", folder / "zero.png")
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    err = capsys.readouterr().err
    assert "skipped pipe.png: not a readable image (a named pipe (FIFO), not a regular file)" in err
    assert "skipped zero.png: not a readable image (a character device, not a regular file)" in err
    assert [row["file"] for row in csv.DictReader(output.open())] == ["fine.png"]


@pytest.mark.slow
def test_names_a_spreadsheet_would_run_as_formulas_are_quoted(checkpoint, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    names = ["=HYPERLINK(1).png", "+1.png", "-2.png", "@SUM(1).png", "plain.png", "x=1.png"]
    for i, name in enumerate(names):
        square(folder / name, seed=i)
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    assert sorted(row["file"] for row in csv.DictReader(output.open())) == sorted(
        ["'=HYPERLINK(1).png", "'+1.png", "'-2.png", "'@SUM(1).png", "plain.png", "x=1.png"]
    )
    # Class names come from folder names (or a checkpoint): the same rule, and valid text.
    _, rows = prediction_table(["x.png"], torch.tensor([[0.1, 0.2, 0.7]]), ["ok", "-cats", f"=caf{FF}"], topk=3)
    assert rows[0][1::3] == ["'=caf\\xff", "'-cats", "ok"]


def upright_and_sideways(folder: Path) -> tuple[Path, Path]:
    """The same picture as an upright JPEG and as a phone stores it: turned, with EXIF Orientation 6 to turn it back."""
    pixels = np.zeros((32, 48, 3), np.uint8)  # (H, W, C): wider than high
    pixels[:16, :16] = (255, 0, 0)  # red top-left, green top-right, blue along the bottom: no symmetry
    pixels[:16, 32:] = (0, 255, 0)
    pixels[24:, :] = (0, 0, 255)
    upright = Image.fromarray(pixels)
    upright.save(folder / "upright.jpg", quality=95, subsampling=0)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    upright.transpose(Image.Transpose.ROTATE_90).save(folder / "phone.jpg", quality=95, subsampling=0, exif=exif)
    return folder / "upright.jpg", folder / "phone.jpg"


def test_a_phone_photo_is_turned_upright_by_its_exif_orientation(tmp_path):
    root = two_classes(tmp_path / "data")
    _, phone = upright_and_sideways(root / "a")
    with Image.open(phone) as stored:
        assert stored.size == (32, 48)  # sideways on disk
    transform = build_transform(32, 3, None)
    files = ImageFiles(image_files(root / "a"), transform)  # what vit.predict and vit.explain read
    x = {files.names[i]: image for i, image in (files[i] for i in range(len(files)))}
    assert (x["phone.jpg"] - x["upright.jpg"]).abs().mean() < 0.02
    dm = ImageFolderDataModule(root=str(root), img_size=32, normalization="none")
    dm.setup("fit")  # training: the image folder's loader
    full = dm.val_set.dataset
    index = {Path(path).name: i for i, (path, _) in enumerate(full.samples)}
    assert (full[index["phone.jpg"]][0] - full[index["upright.jpg"]][0]).abs().mean() < 0.02


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_but_never_below_four_times_the_input(tmp_path, monkeypatch):
    ramp = np.linspace(0, 255, 2048, dtype=np.float32)
    pixels = np.stack([np.add.outer(ramp[:1536] / 2, ramp / 2)] * 3, axis=-1).astype(np.uint8)  # (1536, 2048, 3)
    Image.fromarray(pixels).save(tmp_path / "big.jpg", quality=80)  # smooth: a few hundred kB
    assert decode_image(tmp_path / "big.jpg").size == (2048, 1536)
    assert decode_image(tmp_path / "big.jpg", size=(32, 32)).size == (256, 192)  # 1/8: both sides >= 4 x 32
    assert decode_image(tmp_path / "big.jpg", size=(224, 224)).size == (2048, 1536)  # 1536 < 2 x 4 x 224: whole
    Image.fromarray(pixels[:200, :200]).save(tmp_path / "small.jpg")
    assert decode_image(tmp_path / "small.jpg", size=(32, 32)).size == (200, 200)

    # The data module and vit.predict ask for it with their own input size.
    asked = []
    original = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(
        JpegImagePlugin.JpegImageFile,
        "draft",
        lambda image, mode, size: asked.append(size) or original(image, mode, size),
    )
    files = ImageFiles(image_files(tmp_path), build_transform((24, 40), 3, None))
    [files[i] for i in range(len(files))]
    assert asked == [(160, 160)] * 2
    root = two_classes(tmp_path / "data")
    (tmp_path / "big.jpg").rename(root / "a" / "big.jpg")
    asked.clear()
    dm = ImageFolderDataModule(root=str(root), img_size=16, val_fraction=0.2, test_fraction=0.2)
    dm.setup("fit")
    assert asked == []  # setup reads no image; the loader decodes it when read
    split = next(split for split in ("train", "val", "test") if "a/big.jpg" in dm.split_files[split])
    getattr(dm, f"{split}_set")[dm.split_files[split].index("a/big.jpg")]
    assert asked == [(64, 64)]


def test_an_image_over_the_decompression_bomb_limit_is_refused_with_its_name(tmp_path, monkeypatch):
    square(tmp_path / "bomb.png", size=64)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 = 4096 > 2 x 1000
    with pytest.raises(UnreadableImageError) as error:
        decode_image(tmp_path / "bomb.png", size=(32, 32))
    assert str(error.value) == (
        f"{tmp_path / 'bomb.png'}: too large to decode safely (Image size (4096 pixels) "
        "exceeds limit of 2000 pixels, twice PIL.Image.MAX_IMAGE_PIXELS, Pillow's guard "
        "against decompression bombs; raise that limit only for a file you trust)"
    )


@pytest.mark.slow
def test_a_class_without_an_image_file_is_named_with_the_file_and_why(tmp_path, monkeypatch, capsys):
    # Setup reads no image: a class whose only file is named .png but broken is skipped when read instead
    # (tests/test_image_folder_lazy.py).
    root = two_classes(tmp_path / "data")
    for path in (root / "b").iterdir():
        path.unlink()
    (root / "b" / "only.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    code, err = cli(
        [
            "fit",
            "--config",
            str(REPO / "configs/folder/finetune_vit.yaml"),
            "--data.root",
            str(root),
            "--data.img_size",
            "32",
            "--data.num_workers",
            "0",
            "--trainer.accelerator",
            "cpu",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
            "--model.pretrained",
            "null",
        ],
        monkeypatch,
        capsys,
    )
    assert code == 1 and error_line(err) == (
        f"error: class folder {root / 'b'} has no image file (only.heic: "
        "not named as an image (.heic)): every class folder needs at least one"
    )


def test_a_file_broken_after_setup_is_skipped_and_named_when_the_loader_reads_it(tmp_path):
    root = two_classes(tmp_path / "data")
    dm = ImageFolderDataModule(root=str(root), img_size=32, random_resized_crop=False, horizontal_flip=False)
    dm.setup("fit")
    first, second = (dm.train_set.dataset.samples[j][0] for j in dm.train_set.indices[:2])
    Path(first).write_bytes(Path(first).read_bytes()[:60])  # cut short while training runs
    x, y = dm.train_set[0]  # the next image of the split in its place
    expected_x, expected_y = dm.train_set[1]
    assert torch.equal(x, expected_x) and y == expected_y
    with pytest.warns(
        UserWarning, match=rf"unreadable image\(s\) of the train split .*: {re.escape(Path(first).parent.name)}/"
    ):
        assert dm.report_unread("train", torch.zeros_like(dm.folder_of("train").failures)) == 1
    assert list(dm.unread) == [first] and second not in dm.unread


def test_a_folder_is_decoded_a_batch_at_a_time_and_unreadable_files_are_reported_with_their_batch(
    tmp_path, monkeypatch
):
    import vit.data.images as images

    for i in range(5):
        Image.fromarray(np.full((8, 8), 40 * i, dtype=np.uint8)).save(tmp_path / f"{i}.png")
    (tmp_path / "2.png").write_bytes(b"not an image")
    decoded = []
    original = images.decode_image
    monkeypatch.setattr(
        images, "decode_image", lambda path, size=None: decoded.append(path.name) or original(path, size)
    )
    files = images.ImageFiles(image_files(tmp_path), build_transform(8, 1, None))
    batches = images.readable_batches(files, batch_size=2)
    indices, x, unread = next(batches)
    assert decoded == ["0.png", "1.png"] and indices == [0, 1] and x.shape == (2, 1, 8, 8) and unread == {}
    indices, x, unread = next(batches)  # the unreadable file is reported, its neighbour predicted
    assert indices == [3] and x.shape == (1, 1, 8, 8) and list(unread) == [2] and "cannot identify" in unread[2]
    assert [i for i, _, _ in batches] == [[4]] and decoded == [f"{i}.png" for i in range(5)]
