"""Predict reads every image a user may have, and refuses what cannot work before decoding any; models name bad dtypes."""

import copy
import csv
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from robust_helpers import run_dirs, shared_run

from vit.data.image_folder import to_input
from vit.models import ResNet, VisionTransformer
from vit.predict import main
from vit.training.checkpointing import CheckpointError, read_checkpoint


@pytest.fixture
def checkpoint(tmp_path_factory, monkeypatch) -> Path:
    [run_dir] = run_dirs(shared_run(tmp_path_factory.getbasetemp() / "robust_reference", monkeypatch))
    return run_dir / "checkpoints" / "last.ckpt"


def predict(checkpoint: Path, folder: Path, output: Path, *extra: str) -> int:
    return main(["--ckpt_path", str(checkpoint), "--input_dir", str(folder), "--output", str(output), *extra])


def test_sixteen_bit_and_float_images_are_scaled_by_their_real_range(checkpoint, tmp_path, capsys):
    gray = np.zeros((32, 32), np.float64)
    gray[4:12, 4:12] = 0.8  # a bright square on black
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray((gray * 255).round().astype(np.uint8)).save(folder / "eight.png")
    Image.fromarray((gray * 65535).round().astype(np.uint16)).save(folder / "sixteen.png")  # opens as I;16 or I
    Image.fromarray((gray * 65535).round().astype(np.uint16)).save(folder / "sixteen.tif")
    Image.fromarray(gray.astype(np.float32)).save(folder / "float.tif")  # mode F, already in [0, 1]
    for name in ("sixteen.png", "sixteen.tif", "float.tif"):
        with Image.open(folder / name) as image:
            x = to_input(image)
            assert isinstance(x, torch.Tensor) and x.shape == (1, 32, 32)
            assert abs(float(x.max()) - 0.8) < 1e-4 and float(x.min()) == 0.0  # not clipped to white
    assert abs(float(to_input(Image.fromarray((gray * 4 - 1).astype(np.float32))).max()) - 1.0) < 1e-6  # min-max
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    rows = {r["file"]: r for r in csv.DictReader(output.open())}
    assert set(rows) == {"eight.png", "sixteen.png", "sixteen.tif", "float.tif"}
    for name in ("sixteen.png", "sixteen.tif", "float.tif"):  # the same picture gives the same answer
        assert rows[name]["class_index"] == rows["eight.png"]["class_index"]
        assert abs(float(rows[name]["probability"]) - float(rows["eight.png"]["probability"])) < 0.02


def test_bombs_and_broken_links_are_skipped_with_the_reason(checkpoint, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    Image.fromarray(np.zeros((64, 64), np.uint8)).save(folder / "bomb.png")
    os.symlink(folder / "missing.png", folder / "dangling.png")
    os.symlink(folder / "loop_b.png", folder / "loop_a.png")
    os.symlink(folder / "loop_a.png", folder / "loop_b.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64 x 64 = 4096 > 2 x 1000: a "bomb"
    output = tmp_path / "p.csv"
    assert predict(checkpoint, folder, output) == 0
    err = capsys.readouterr().err
    assert "skipped dangling.png: not a readable image (a symbolic link to nothing (dangling))" in err
    assert "skipped loop_a.png: not a readable image (a symbolic link loop)" in err
    assert "skipped bomb.png: not a readable image (too large to decode safely" in err
    assert [r["file"] for r in csv.DictReader(output.open())] == ["fine.png"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch_size", "0"], "--batch_size 0 is not allowed: expected an int >= 1"),
    (["--device", "tpu9"], "--device 'tpu9' is not"),
    pytest.param(["--device", "cuda"], "--device cuda was asked for, but this machine has no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there")),
])
def test_bad_options_are_refused_before_any_image_is_decoded(extra, message, checkpoint, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("an image was decoded"))
    assert predict(checkpoint, folder, tmp_path / "p.csv", *extra) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "p.csv").exists()


def test_a_checkpoint_with_non_finite_weights_is_refused_by_predict(checkpoint, tmp_path, capsys):
    broken = torch.load(checkpoint, weights_only=True)
    broken["state_dict"]["backbone.head.bias"] = torch.full_like(broken["state_dict"]["backbone.head.bias"], float("nan"))
    path = tmp_path / "nan.ckpt"
    torch.save(broken, path)
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(folder / "fine.png")
    assert predict(path, folder, tmp_path / "p.csv") == 2
    assert "backbone.head.bias holds NaN or infinite values" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()


def test_checkpoints_of_other_layouts_are_refused_in_one_line(checkpoint, tmp_path):
    good = torch.load(checkpoint, weights_only=True)
    as_list = tmp_path / "list.ckpt"
    torch.save([1, 2], as_list)
    with pytest.raises(CheckpointError, match="it holds a list, not a dict"):
        read_checkpoint(as_list)
    string_hparams = tmp_path / "string.ckpt"
    torch.save({**copy.copy(good), "hyper_parameters": "lr=0.1"}, string_hparams)
    with pytest.raises(CheckpointError, match="is not a checkpoint of this project: its 'hyper_parameters' is a str"):
        read_checkpoint(string_hparams)


@pytest.mark.parametrize("model", [VisionTransformer(img_size=8, patch_size=4, in_chans=1, num_classes=2, embed_dim=8,
                                                     depth=1, num_heads=2),
                                   ResNet(img_size=8, in_chans=1, num_classes=2, widths=(4,))], ids=["vit", "resnet"])
def test_inputs_of_the_wrong_dtype_are_named(model):
    with pytest.raises(ValueError, match=r"expected a floating-point input, got torch\.uint8: .*x\.float\(\) / 255"):
        model(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))
    for dtype in (torch.float64, torch.float16):
        with pytest.raises(ValueError, match=rf"input dtype {dtype} does not match the model's weights \(torch\.float32\)"):
            model(torch.zeros(2, 1, 8, 8, dtype=dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision keeps float32 inputs: allowed
        assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 2)


def test_a_plain_state_dict_is_not_taken_for_a_checkpoint_of_this_project(checkpoint, tmp_path, monkeypatch, capsys):
    from robust_helpers import main_in_process, tiny_config

    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": torch.load(checkpoint, weights_only=True)["state_dict"]}, plain)
    with pytest.raises(SystemExit) as exit_info:
        main_in_process(["test", "--config", str(tiny_config(tmp_path)), "--ckpt_path", str(plain)], monkeypatch)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"error: checkpoint {plain} is not a checkpoint of this project: Lightning did not write it" in err
