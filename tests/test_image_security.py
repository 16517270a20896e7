"""Image files made to hurt: a PostScript program named cat.jpg, a PDF named .png, NaN pixels, colour spaces the
transforms cannot read, images without pixels, names that drive the terminal. Each is refused (or read) through the
doors users have: `decode_image` (every door decodes through it), `vit.api`, `vit.predict` and the image folder."""

import csv
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import EpsImagePlugin, Image, ImageCms
from torch import nn

import vit.api
from vit.api import Predictor
from vit.data import ImageFolderDataModule
from vit.data.files import first_skipped, text_name
from vit.data.images import (
    IMAGE_FORMATS,
    ImageFiles,
    UnreadableImageError,
    build_transform,
    decode_image,
    image_files,
    readable_batches,
    to_input,
)
from vit.predict import main as predict_main

FORMATS_READ = "images are read as JPEG, PNG, GIF, BMP, TIFF, WEBP, PPM or TGA"
INPUTS = {"img_size": [8, 8], "in_chans": 1, "mean": None, "std": None, "interpolation": "bilinear"}


def predictor(in_chans: int = 1) -> Predictor:
    """A `vit.api` predictor of two classes over `(in_chans, 8, 8)` inputs, without a checkpoint: the decode path is
    the one a trained checkpoint's predictor runs."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(in_chans * 64, 2))
    return Predictor(model, {**INPUTS, "in_chans": in_chans}, ["cat", "dog"])


def reason(path: Path, size: tuple[int, int] | None = None) -> str:
    with pytest.raises(UnreadableImageError) as error:
        decode_image(path, size)
    assert str(error.value) == f"{text_name(str(path))}: {error.value.reason}"  # the file, then why: one line
    return error.value.reason


def noise(path: Path, mode: str = "RGB", size: int = 12, seed: int = 0, **save) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path, **save)
    return path


def fake_ghostscript(folder: Path, monkeypatch) -> Path:
    """A `gs` first on PATH that leaves a marker file when anything runs it; Pillow forgets any `gs` it found."""
    folder.mkdir()
    marker = folder / "ghostscript-ran"
    (folder / "gs").write_text(f"#!/bin/sh\necho \"$@\" > '{marker}'\nexit 1\n")
    (folder / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    return marker


# --- formats: only raster images are opened, whatever the name says ----------------------------------------------


def test_an_eps_file_named_jpg_is_refused_and_ghostscript_never_runs(tmp_path, monkeypatch):
    marker = fake_ghostscript(tmp_path / "bin", monkeypatch)
    Image.new("L", (4, 4), 128).save(tmp_path / "cat.jpg", format="EPS")  # PostScript text, a program for gs
    (tmp_path / "by_hand.png").write_text("%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\nshowpage\n")
    assert (tmp_path / "cat.jpg").read_bytes().startswith(b"%!PS-Adobe-3.0 EPSF-3.0")
    for name in ("cat.jpg", "by_hand.png"):
        assert reason(tmp_path / name, (8, 8)) == f"an EPS file; {FORMATS_READ}"
    with pytest.raises(UnreadableImageError) as error:
        predictor().predict(tmp_path / "cat.jpg")
    assert str(error.value) == f"{tmp_path / 'cat.jpg'}: an EPS file; {FORMATS_READ}"
    assert not marker.exists()
    # Control: Pillow opening the same file with every reader does run the gs on PATH.
    with pytest.raises(Exception), Image.open(tmp_path / "cat.jpg") as image:  # noqa: B017, PT011 - gs fails
        image.load()
    assert marker.exists()


def test_a_pdf_or_a_heic_photo_named_png_is_named_for_what_it_is(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "scan.png", format="PDF")  # Pillow writes PDF but reads none
    (tmp_path / "iphone.png").write_bytes(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic")
    Image.new("RGB", (4, 4)).save(tmp_path / "icon.png", format="ICO")  # Pillow reads it, but not here
    (tmp_path / "notes.png").write_text("not an image")
    assert reason(tmp_path / "scan.png") == f"a PDF file; {FORMATS_READ}"
    assert reason(tmp_path / "iphone.png") == f"an HEIC file; {FORMATS_READ}"
    assert reason(tmp_path / "icon.png") == f"an ICO file; {FORMATS_READ}"
    assert reason(tmp_path / "notes.png") == "cannot identify image file: not a format Pillow reads"


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_every_format_read_is_a_pillow_reader_and_opens_whatever_the_file_is_named(fmt, tmp_path):
    Image.init()
    assert fmt in Image.OPEN  # Image.open(formats=...) raises KeyError for a name it has no reader for
    noise(tmp_path / "photo.bin", format=fmt)
    image = decode_image(tmp_path / "photo.bin")
    assert image.mode == "RGB" and image.size == (12, 12)


def test_a_truncated_png_is_refused_in_one_line(tmp_path):
    data = noise(tmp_path / "whole.png", size=40).read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    assert reason(tmp_path / "cut.png", (8, 8)) == "image file is truncated"


# --- pixels: NaN, infinity, none at all --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_float_tiff_with_nan_or_infinite_pixels_is_unreadable_not_a_nan_prediction(bad, tmp_path):
    pixels = np.linspace(0, 5, 64, dtype=np.float32).reshape(8, 8)
    pixels[3, 4] = bad
    Image.fromarray(pixels).save(tmp_path / "depth.tif")
    with Image.open(tmp_path / "depth.tif") as image:
        assert image.mode == "F"
    assert reason(tmp_path / "depth.tif") == "has NaN or infinite pixels"
    Image.fromarray(np.where(np.isfinite(pixels), pixels, 0)).save(tmp_path / "fine.tif")
    files = ImageFiles(image_files(tmp_path), build_transform(8, 1, None))  # what vit.predict and vit.explain read
    [(indices, x, unread)] = readable_batches(files, batch_size=4)
    assert [files.names[i] for i in indices] == ["fine.tif"] and bool(torch.isfinite(x).all())
    assert {files.names[i]: why for i, why in unread.items()} == {"depth.tif": "has NaN or infinite pixels"}
    with pytest.raises(UnreadableImageError, match=r"^PIL image: has NaN or infinite pixels$"):
        predictor().predict(Image.fromarray(pixels))


@pytest.mark.parametrize("size", [(0, 0), (0, 5), (7, 0)])
def test_an_image_without_pixels_is_refused_with_its_size(size):
    with pytest.raises(UnreadableImageError) as error:
        to_input(Image.new("RGB", size))
    assert error.value.reason == f"has no pixels ({size[0]}x{size[1]})"
    with pytest.raises(UnreadableImageError, match=rf"^PIL image: has no pixels \({size[0]}x{size[1]}\)$"):
        predictor().predict(Image.new("L", size))
    with pytest.raises(UnreadableImageError, match=r"no pixels"):
        to_input(Image.new("F", size))


# --- modes: every one reaches the transforms as L or RGB, or is refused by name -----------------------------------


def lab_red(path: Path) -> tuple[Path, torch.Tensor]:
    """A LAB TIFF of pure red, and its sRGB pixel in [0, 1] by littleCMS (ImageCms), the reference."""
    srgb, lab = ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB")
    image = ImageCms.applyTransform(
        Image.new("RGB", (6, 6), (255, 0, 0)), ImageCms.buildTransform(srgb, lab, "RGB", "LAB")
    )
    image.save(path)
    back = ImageCms.applyTransform(image, ImageCms.buildTransform(lab, srgb, "LAB", "RGB"))
    return path, torch.tensor(back.getpixel((0, 0)), dtype=torch.float32) / 255


def pillow_converts_lab() -> bool:
    try:
        Image.new("LAB", (1, 1)).convert("RGB")
    except ValueError:
        return False
    return True


def test_a_lab_image_gives_the_models_channels_or_one_line_naming_its_mode(tmp_path):
    path, red = lab_red(tmp_path / "lab.tif")
    with Image.open(path) as stored:
        assert stored.mode == "LAB"
    if not pillow_converts_lab():
        assert reason(path) == "a LAB image, which Pillow cannot convert to RGB"
        return
    for in_chans, expected in ((3, red), (1, (red * torch.tensor([0.299, 0.587, 0.114])).sum(0, keepdim=True))):
        x = build_transform(8, in_chans, None)(decode_image(path, (8, 8)))
        assert x.shape == (in_chans, 8, 8)
        torch.testing.assert_close(x, expected[:, None, None].expand(in_chans, 8, 8), rtol=0, atol=2 / 255)
        assert predictor(in_chans).images(path).shape == (1, in_chans, 8, 8)  # vit.api, as vit.predict reads
        assert predictor(in_chans).images(Image.open(path)).shape == (1, in_chans, 8, 8)
    with pytest.raises(UnreadableImageError, match=r"^PIL image: a La image, which Pillow cannot convert to RGB$"):
        to_input(Image.new("La", (4, 4)))


def test_image_folder_training_reads_every_mode_and_skips_a_nan_image(tmp_path):
    # Augmentations work on L and RGB images only: an RGBA, palette, 1-bit or CMYK file used to crash the training
    # loader mid-run, and a LAB one crashed even without them.
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    lab_red(root / "a" / "lab.tif")
    for i, (mode, ext) in enumerate([("RGBA", "png"), ("P", "gif"), ("1", "bmp"), ("CMYK", "jpg"), ("RGB", "webp")]):
        noise(root / "b" / f"{mode}.{ext}", mode, seed=i)
    noise(root / "a" / "plain.png", seed=9)
    pixels = np.ones((8, 8), np.float32)
    pixels[0, 0] = np.nan
    Image.fromarray(pixels).save(root / "a" / "nan.tif")
    for in_chans in (1, 3):
        dm = ImageFolderDataModule(
            root=str(root),
            img_size=16,
            in_chans=in_chans,
            num_workers=0,
            val_fraction=0.2,
            test_fraction=0.2,
            normalization="none",
            auto_augment="trivialaugment",
        )
        dm.setup("fit")  # by name only: nan.tif is listed, and skipped when read
        full = dm.train_set.dataset  # every file, with the training transform
        assert sorted(Path(path).name for path, _ in full.samples) == sorted(
            ["lab.tif", "plain.png", "RGBA.png", "P.gif", "1.bmp", "CMYK.jpg", "RGB.webp", "nan.tif"]
        )
        torch.manual_seed(0)
        for _ in range(10):  # trivialaugment draws an operation per item: each file meets several
            for split in (dm.train_set, dm.val_set, dm.test_set):
                for x, _ in split:
                    assert x.shape == (in_chans, 16, 16) and bool(torch.isfinite(x).all())
        names = [Path(path).name for path, _ in full.samples]
        readable = [i for i, name in enumerate(names) if name != "nan.tif"]
        assert all(full[i][0].shape == dm.val_set.dataset[i][0].shape == (in_chans, 16, 16) for i in readable)
        with pytest.raises(UnreadableImageError, match=r"nan\.tif: has NaN or infinite pixels$"):
            full[names.index("nan.tif")]  # the folder itself refuses it; a split reads the next image instead


# --- names: control characters are shown as escapes -------------------------------------------------------------


def test_control_characters_in_names_are_escaped_wherever_a_name_is_shown():
    assert text_name("\x1b[2J.png") == "\\x1b[2J.png"
    assert text_name("a\tb\r\n\x7f\x9b.png") == "a\\tb\\r\\n\\x7f\\x9b.png"
    assert text_name("photo\u202egnp.exe") == "photo\\u202egnp.exe"  # shown reversed as photoexe.png
    assert text_name("caf" + os.fsdecode(b"\xff") + "\x1b.png") == "caf\\xff\\x1b.png"
    assert text_name("été 東京.png") == "été 東京.png"  # letters of any script stay as they are
    assert text_name(text_name("\x1b\udcff")) == text_name("\x1b\udcff")
    assert first_skipped({"\x1b[2Jbad.png": "why\x1b[1A"}, "skipped {name}: {why}") == [
        "skipped \\x1b[2Jbad.png: why\\x1b[1A"
    ]


def test_predict_shows_a_skipped_file_whose_name_holds_escape_sequences_escaped(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    noise(folder / "fine.png")
    (folder / "\x1b[2J\x1b[1A.png").write_bytes(b"not an image")  # would clear the screen and hide its own line
    noise(folder / "\x1b]0;title\x07ok.png", seed=1)
    monkeypatch.setattr(vit.api, "load", lambda path, device, precision: predictor())  # no checkpoint needed
    output = tmp_path / "p.csv"
    assert (
        predict_main(
            [
                "--ckpt_path",
                "unused.ckpt",
                "--input_dir",
                str(folder),
                "--output",
                str(output),
                "--num_workers",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert (
        "skipped \\x1b[2J\\x1b[1A.png: not a readable image (cannot identify image file: not a format Pillow reads)"
    ) in err.splitlines()
    assert sorted(row["file"] for row in csv.DictReader(output.open())) == ["\\x1b]0;title\\x07ok.png", "fine.png"]


def test_a_one_channel_image_folder_refuses_a_normalization_of_three_channels(tmp_path):
    # ImageNet's mean and std would broadcast each grey image to three channels: a model of one channel fails later.
    with pytest.raises(
        ValueError,
        match=r"^normalization='imagenet' is a mean and std for 3 \(RGB\) channels, but "
        r"in_chans=1: use normalization='none' for one channel$",
    ):
        ImageFolderDataModule(root=str(tmp_path), in_chans=1)
