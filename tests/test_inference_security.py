"""The inference doors (`vit.load` / `Predictor`, `vit.predict`, `vit.explain`, `vit.export`) against hostile input.

One `Predictor` shared by threads gives each call the serial result exactly; a checkpoint's image size cannot make a
batch hold more than `INPUT_BYTES`; a NaN or infinite probability is an error naming the image, never a row or a
returned number; huge or mistyped arguments are one line naming the value; the model card's `base_model` is a Hub id
or absent. Every model here is a small random one built in the test: no training run.
"""

from __future__ import annotations

import argparse
import csv
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import vit
from vit.api import INPUT_BYTES, MAX_BATCH_SIZE, NonFiniteError, Predictor, fitting_batch_size
from vit.checks import CheckpointError
from vit.models import VisionTransformer

INPUTS = {"img_size": [16, 16], "in_chans": 1, "mean": None, "std": None, "interpolation": "bilinear"}
NAMES = ["circle", "square"]
HUGE = "1" + "0" * 30  # far beyond any C integer


def tiny_vit(**kwargs) -> VisionTransformer:
    """A random 16 x 16 grayscale ViT on a (4, 4) patch grid, its weights large enough that every layer matters."""
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, patch_size=4, in_chans=1, num_classes=2, embed_dim=16, depth=2, num_heads=2, **kwargs
    ).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model


def overflowing_vit() -> VisionTransformer:
    """`tiny_vit` with finite head weights whose logits overflow float32: 1e38 times 16 features that sum to 16 (the
    final norm's output, of mean 0, shifted by its bias of 1)."""
    model = tiny_vit()
    model.norm.weight.data.fill_(1.0)
    model.norm.bias.data.fill_(1.0)
    model.head.weight.data.fill_(1e38)
    model.head.bias.data.zero_()
    return model


@pytest.fixture
def images(tmp_path) -> Path:
    """Five random 8-bit grayscale PNGs at the model's size."""
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(folder / f"image_{i}.png")
    return folder


def command_args(images: Path, output: Path, **overrides) -> argparse.Namespace:
    """The parsed options `vit.predict`'s `predict` works from, as `prepare` leaves them."""
    return argparse.Namespace(
        **{
            "ckpt_path": "model.ckpt",
            "input_dir": images,
            "output": output,
            "topk": 1,
            "batch_size": 256,
            "num_workers": 0,
            "device": "cpu",
            "recursive": False,
            **overrides,
        }
    )


# ----------------------------------------------------------------------------- one Predictor, many threads


def test_predict_probabilities_and_explain_from_many_threads_equal_the_serial_results_exactly(images):
    predictor = Predictor(tiny_vit(), INPUTS, NAMES)
    files = sorted(images.iterdir())
    calls = (
        [("predict", f) for f in files]
        + [("probabilities", files)]
        + [("explain", f, m) for f in files for m in ("rollout", "chefer", "gradcam")]
    )

    def call(c):
        if c[0] == "predict":
            return predictor.predict(c[1], topk=2)
        if c[0] == "probabilities":
            return predictor.probabilities(c[1], batch_size=2)
        return predictor.explain(c[1], method=c[2])

    serial = [call(c) for c in calls]
    mixed = calls * 4
    np.random.default_rng(1).shuffle(mixed)  # predictions and maps interleaved across the threads
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(call, mixed))
    expected = {id(c): result for c, result in zip(calls, serial)}
    for c, got in zip(mixed, concurrent, strict=True):
        want = expected[id(c)]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, c


# ----------------------------------------------------------------------------- what one batch may hold


def test_the_batch_shrinks_to_hold_at_most_one_gib_of_input():
    assert INPUT_BYTES == 2**30
    big = {"img_size": [4096, 4096], "in_chans": 3}  # the schema's largest side: 192 MiB per float32 image
    assert fitting_batch_size(256, big) == 2**30 // (4 * 3 * 4096 * 4096) == 5
    assert fitting_batch_size(3, big) == 3  # a batch within the budget is kept
    assert fitting_batch_size(256, {"img_size": [4096, 4096], "in_chans": 64}) == 1  # 4 GiB each: one at a time
    assert fitting_batch_size(256, {"img_size": [32, 32], "in_chans": 3}) == 256
    assert fitting_batch_size(10, {"img_size": [2, 3], "in_chans": 1}, budget=4 * 6 * 3) == 3
    with pytest.raises(ValueError) as err:
        fitting_batch_size(int(HUGE), big)
    assert str(err.value) == f"batch_size={HUGE} is not allowed: expected an int in [1, {MAX_BATCH_SIZE}]"


def test_predict_reads_a_large_image_checkpoints_images_five_at_a_time_and_says_so_once(monkeypatch):
    class Constant(torch.nn.Module):  # stands for a model at 4096 x 4096: no such input is allocated here
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return self.bias.expand(len(x), 2)

    predictor = Predictor(Constant(), {**INPUTS, "img_size": [4096, 4096], "in_chans": 3}, NAMES)
    pulled = []
    monkeypatch.setattr(predictor, "images", lambda chunk: pulled.append(len(chunk)) or torch.zeros(len(chunk), 1))
    with pytest.warns(UserWarning) as caught:
        assert predictor.probabilities(iter(range(12))).shape == (12, 2)  # batch_size=256 by default
    assert pulled == [5, 5, 2]  # the iterator is read five images at a time
    assert [str(w.message) for w in caught] == [
        "batch_size=256 images of 3 x 4096 x 4096 would hold 48.0 GiB of input; running 5 per forward pass "
        "(at most 1 GiB)"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per predictor
        predictor.predict(iter(range(6)))
    assert pulled == [5, 5, 2, 5, 1]


def test_vit_predict_decodes_a_large_image_checkpoints_images_five_per_batch(images, tmp_path, capsys, monkeypatch):
    import vit.data.images
    from vit.predict import predict

    asked = []

    def readable_batches(files, batch_size, num_workers=0):  # what the command asks the decoder for: nothing decoded
        asked.append(batch_size)
        yield from ()

    monkeypatch.setattr(vit.data.images, "readable_batches", readable_batches)
    predictor = Predictor(tiny_vit(), {**INPUTS, "img_size": [4096, 4096], "in_chans": 3}, NAMES)
    assert predict(command_args(images, tmp_path / "p.csv"), predictor) == 1  # nothing decoded: no row
    assert asked == [5]
    err = capsys.readouterr().err
    assert err.startswith(
        "note: --batch_size 256 images of 3 x 4096 x 4096 would hold 48.0 GiB of input; decoding 5 "
        "per batch (at most 1 GiB)\n"
    )
    assert err.count("note:") == 1


# ----------------------------------------------------------------------------- NaN and infinity


def test_logits_that_overflow_are_an_error_naming_the_image(images):
    predictor = Predictor(overflowing_vit(), INPUTS, NAMES)
    assert all(math.isfinite(p) for p in predictor.model.head.weight.flatten().tolist())  # finite weights
    file = sorted(images.iterdir())[2]
    overflow = (
        "the model's probabilities are NaN or infinite although the image is finite: its logits overflow "
        "float32; the checkpoint's weights cannot classify it"
    )
    with pytest.raises(NonFiniteError) as err:
        predictor.predict([file, images / "image_0.png"])
    assert str(err.value) == f"{file}: {overflow}"
    assert isinstance(err.value, CheckpointError)  # the weights' fault, whatever the image: what vit.load refuses
    with pytest.raises(NonFiniteError) as err:
        predictor.probabilities(torch.zeros(3, 1, 16, 16))
    assert str(err.value) == f"images[0]: {overflow}"


def test_a_nan_input_is_an_error_naming_it_never_a_nan_probability():
    predictor = Predictor(tiny_vit(), INPUTS, NAMES)
    x = torch.zeros(4, 1, 16, 16)
    x[2, 0, 3, 5] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        predictor.predict(x, batch_size=2)  # the second batch: its place in the call is still 2
    assert str(err.value) == "images[2]: the image has NaN or infinite pixels; the model cannot classify it"
    assert err.value.index == 2 and not isinstance(err.value, CheckpointError)  # the input's fault
    with pytest.raises(NonFiniteError) as err:
        predictor.explain(x[2])
    assert str(err.value) == ("the input: its rollout map is NaN or infinite: the image holds NaN or infinite values")
    assert len(predictor.predict(x[:2])) == 2  # the finite ones classify


def test_vit_predict_writes_no_csv_when_the_model_overflows_and_skips_a_nan_image(images, tmp_path, capsys):
    from vit.predict import predict

    output = tmp_path / "p.csv"
    assert predict(command_args(images, output), Predictor(overflowing_vit(), INPUTS, NAMES)) == 1
    err = capsys.readouterr().err
    assert err.endswith(
        "error: image_0.png: the model's probabilities are NaN or infinite although the image is "
        "finite: its logits overflow float32; the checkpoint's weights cannot classify it; nothing "
        "was written\n"
    )
    assert not output.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["images"]  # no temporary file

    pixels = np.full((16, 16), 0.5, np.float32)
    pixels[4, 4] = np.nan
    Image.fromarray(pixels).save(images / "nan.tif")  # mode F: a float image with a NaN pixel
    assert predict(command_args(images, output, batch_size=4), Predictor(tiny_vit(), INPUTS, NAMES)) == 0
    err = capsys.readouterr().err
    assert "skipped nan.tif: not a readable image (" in err
    rows = list(csv.DictReader(output.open()))
    assert [row["file"] for row in rows] == [f"image_{i}.png" for i in range(5)]
    assert all(math.isfinite(float(row["probability"])) for row in rows)


def test_vit_explain_draws_nothing_when_the_model_overflows(images, tmp_path, capsys):
    from vit.explain.__main__ import Prepared, explain
    from vit.registry import inference_transform

    transforms = inference_transform(INPUTS), inference_transform({**INPUTS, "in_chans": 3})
    args = argparse.Namespace(
        input_dir=images,
        image=None,
        num_images=2,
        out=tmp_path / "maps.png",
        scale="row",
        save_maps=tmp_path / "maps.npz",
    )
    prepared = Prepared(overflowing_vit(), NAMES, *transforms, ["rollout", "gradcam"], None, None)
    assert explain(args, prepared) == 1
    assert capsys.readouterr().err.endswith(
        "error: image_0.png: the model's probabilities or relevance maps are NaN or infinite although the image is "
        "finite (its logits overflow float32); nothing was written\n"
    )
    assert not args.out.exists() and not args.save_maps.exists()
    prepared = Prepared(tiny_vit(), NAMES, *transforms, ["rollout", "gradcam"], None, None)
    assert explain(args, prepared) == 0 and args.out.is_file()  # the same images through a sound model draw


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("value", [None, 123, b"", b"last.ckpt"])
def test_vit_load_refuses_what_is_not_a_path_or_url_naming_the_value(value):
    with pytest.raises(TypeError) as err:
        vit.load(value)
    assert str(err.value) == (
        f"path_or_url={value!r} is not allowed: expected a path (a str or os.PathLike) or an http(s) URL"
    )


def test_vit_load_refuses_an_empty_string():
    with pytest.raises(ValueError) as err:
        vit.load("")
    assert str(err.value) == "path_or_url='' is not allowed: expected a path or an http(s) URL, not an empty string"


def test_predicting_no_images_gives_an_empty_list():
    predictor = Predictor(tiny_vit(), INPUTS, NAMES)
    assert predictor.predict([]) == [] and predictor.predict(iter(())) == []
    assert predictor.probabilities([]).shape == (0, 2)


def test_a_huge_batch_size_is_refused_in_one_line_before_anything_is_read(images, tmp_path, capsys):
    from vit.predict import main

    # The checkpoint is not there: the bound is checked before it is opened.
    assert (
        main(
            [
                "--ckpt_path",
                str(tmp_path / "x.ckpt"),
                "--input_dir",
                str(images),
                "--output",
                str(tmp_path / "p.csv"),
                "--batch_size",
                HUGE,
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        f"error: --batch_size {HUGE} is not allowed: expected an int in [1, {MAX_BATCH_SIZE}]\n"
    )
    with pytest.raises(ValueError) as err:
        Predictor(tiny_vit(), INPUTS, NAMES).predict(torch.zeros(1, 1, 16, 16), batch_size=int(HUGE))
    assert str(err.value) == f"batch_size={HUGE} is not allowed: expected an int in [1, {MAX_BATCH_SIZE}]"


def test_a_huge_num_workers_is_capped_at_the_cores(images, tmp_path, capsys):
    from vit.predict import predict

    output = tmp_path / "p.csv"
    assert predict(command_args(images, output, num_workers=int(HUGE)), Predictor(tiny_vit(), INPUTS, NAMES)) == 0
    assert len(list(csv.DictReader(output.open()))) == 5


# ----------------------------------------------------------------------------- the model card's base_model


@pytest.mark.parametrize(
    "pretrained",
    [
        "a" * 4000,  # longer than a file name may be: looking it up as a path raised
        "hf-hub:org/name\nlicense: mit",  # two lines would be two keys of the front matter
        "org/name\n",
        "hf-hub:/home/me/weights",  # a local path, not a Hub id
        "hf-hub:org/" + "n" * 97,  # longer than the Hub allows
        "hf-hub:org/na me",
        "hf-hub:örg/name",
    ],
)
def test_the_card_has_no_base_model_that_is_not_a_hub_id(pretrained):
    from vit.export import hub_base_model, model_card
    from vit.models.timm_compat import timm_args
    from vit.training.record import training_record

    assert hub_base_model(pretrained) is None
    record = training_record({"hyper_parameters": {"pretrained": pretrained}})
    assert "base_model" not in record
    data = dict(
        input_size=(1, 16, 16), mean=(0.0,), std=(1.0,), interpolation="bilinear", crop_pct=1.0, crop_mode="squash"
    )
    card = model_card(timm_args(tiny_vit()), data, NAMES, record)
    front = yaml.safe_load(card.split("---\n")[1])
    assert set(front) == {"library_name", "pipeline_tag", "metrics", "tags"}


def test_a_base_model_that_is_a_hub_id_is_kept_on_one_line():
    from vit.export import hub_base_model

    assert hub_base_model("hf-hub:org/my-vit.v2@main") == "org/my-vit.v2"
    assert hub_base_model("hf-hub:org/" + "n" * 96) == "org/" + "n" * 96
