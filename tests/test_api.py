"""`vit.load`: a checkpoint in Python gives what the commands give, opened under the same rules.

On a real `train.py` checkpoint: `.predict` gives the classes and probabilities of `python -m vit.predict`'s
CSV for the same files, `.explain` the map `relevance` computes and `python -m vit.explain` draws; a
hostile checkpoint raises `CheckpointError` and builds nothing; bad arguments get the commands' messages.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_doors import hostile
from PIL import Image
from robust_helpers import main_in_process, save_with_folder, tiny_config

import vit
import vit.explain.plot
from vit.api import Prediction, Predictor
from vit.checks import CheckpointError
from vit.explain.__main__ import main as explain_main
from vit.explain.relevance import relevance
from vit.predict import main as predict_main

pytestmark = pytest.mark.slow  # every test opens a checkpoint that train.py wrote in this session


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A real `train.py` checkpoint of the tiny two-circles ViT (one epoch)."""
    root = tmp_path_factory.mktemp("api")
    config = tiny_config(root, max_epochs=1)
    with pytest.MonkeyPatch.context() as mp:
        main_in_process(["fit", "--config", str(config), "--test_after_fit", "false"], mp)
    return root / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.fixture
def images(tmp_path) -> Path:
    """Images of every kind the commands read: 8-bit gray, RGB at another size, 16-bit, and a JPEG stored sideways."""
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32), dtype=np.uint8)).save(folder / "gray.png")
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(folder / "rgb.png")
    Image.fromarray(rng.integers(0, 65536, (32, 32), dtype=np.uint16)).save(folder / "deep.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees to show it upright
    Image.fromarray(rng.integers(0, 256, (32, 64), dtype=np.uint8)).save(folder / "sideways.jpg", exif=exif)
    return folder


def test_import_vit_does_not_import_torch():
    code = "import sys, vit; assert callable(vit.load); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_predict_gives_the_csv_of_vit_predict(checkpoint, images, tmp_path):
    output = tmp_path / "p.csv"
    assert (
        predict_main(
            [
                "--ckpt_path",
                str(checkpoint),
                "--input_dir",
                str(images),
                "--output",
                str(output),
                "--topk",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(output.open()))
    predictor = vit.load(checkpoint)
    assert isinstance(predictor, Predictor) and not predictor.model.training
    assert predictor.class_names == ["not_diagonal", "diagonal"]

    files = [images / row["file"] for row in rows]
    predictions = predictor.predict(files, topk=2)
    assert len(predictions) == len(rows) == 4
    for row, top in zip(rows, predictions):
        assert [p.class_name for p in top] == [row["class_name"], row["class_name_2"]]
        assert all(isinstance(p, Prediction) for p in top)
        assert top[0].probability == pytest.approx(float(row["probability"]), abs=1e-6)
        assert top[1].probability == pytest.approx(float(row["probability_2"]), abs=1e-6)

    # A single path, a PIL image and a batch of model inputs give the same predictions (to float rounding: a
    # batch of one and a batch of four run through differently blocked matrix products).
    def same(a: list[Prediction], b: list[Prediction]) -> bool:
        return [p.class_name for p in a] == [p.class_name for p in b] and all(
            p.probability == pytest.approx(q.probability, abs=1e-6) for p, q in zip(a, b)
        )

    [one] = predictor.predict(str(files[0]), topk=2)
    assert same(one, predictions[0])
    with Image.open(files[3]) as image:  # the sideways JPEG: turned upright as the file is
        assert same(predictor.predict(image, topk=2)[0], predictions[3])
    batch = predictor.images(files)
    assert batch.shape == (4, 1, 32, 32)
    assert predictor.predict(batch, topk=2) == predictions  # the same batch: the same numbers, exactly


def test_explain_gives_the_map_of_relevance_and_of_vit_explain(checkpoint, images, tmp_path, monkeypatch):
    predictor = vit.load(checkpoint)
    file = images / "rgb.png"
    x = predictor.images([file])  # (1, 1, 32, 32); patches of 8: a (4, 4) grid
    rollout = predictor.explain(file)
    assert rollout.shape == (4, 4) and float(rollout.sum()) == pytest.approx(1.0)
    torch.testing.assert_close(rollout, relevance(predictor.model, x, "rollout")[0], rtol=0, atol=0)
    chefer = predictor.explain(file, method="chefer", target="diagonal")
    torch.testing.assert_close(chefer, relevance(predictor.model, x, "chefer", 1)[0], rtol=0, atol=0)
    assert torch.equal(predictor.explain(file, method="chefer", target=1), chefer)
    assert torch.equal(predictor.explain(x[0], method="chefer", target=1), chefer)

    drawn = {}

    def keep(images, maps, titles=None, scale="row"):  # what vit.explain draws, kept instead of drawn
        from matplotlib.figure import Figure

        drawn.update(maps)
        return Figure()

    monkeypatch.setattr(vit.explain.plot, "rollout_grid", keep)
    assert (
        explain_main(
            [
                "--ckpt_path",
                str(checkpoint),
                "--image",
                str(file),
                "--method",
                "rollout,chefer",
                "--target",
                "diagonal",
                "--out",
                str(tmp_path / "maps.png"),
            ]
        )
        == 0
    )
    assert torch.equal(drawn["rollout"][0], rollout)
    assert torch.equal(drawn["chefer: diagonal"][0], chefer)


@pytest.mark.parametrize("shape", ["nested class path", "nested under an owned backbone"])
def test_a_hostile_checkpoint_raises_and_builds_nothing(shape, checkpoint, tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    bad = tmp_path / "bad.ckpt"
    torch.save(hostile(torch.load(checkpoint, weights_only=True), shape, marker), bad)
    # The doors read a checkpoint's model folder, never its hyperparameters: one without a folder is refused.
    with pytest.raises(CheckpointError, match="has no model folder beside it"):
        vit.load(bad)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, f: p.predict(f, topk=0), "topk=0 is not allowed: expected an int >= 1"),
        (
            lambda p, f: p.explain(f, method="lime"),
            (
                "method='lime' is not allowed: expected one of ['attention', "
                "'rollout', 'grad_rollout', 'flow', 'chefer', 'gradcam', 'random']"
            ),
        ),
        (
            lambda p, f: p.explain(f, method="chefer", target="cat"),
            (
                "target='cat' is not a class of this model: expected "
                "one of ['not_diagonal', 'diagonal'] or an index in [0, 1]"
            ),
        ),
        (
            lambda p, f: p.explain(f, method="chefer", target=2),
            (
                "target=2 is not a class of this model: expected "
                "one of ['not_diagonal', 'diagonal'] or an index in [0, 1]"
            ),
        ),
        (
            lambda p, f: p.explain(f, method="rollout", target="diagonal"),
            (
                "target='diagonal' applies to the "
                "class-specific methods ['grad_rollout', 'chefer', 'gradcam'] only; method='rollout' is class-agnostic"
            ),
        ),
    ],
)
def test_bad_arguments_get_the_commands_messages(call, message, checkpoint, images):
    with pytest.raises(ValueError) as err:
        call(vit.load(checkpoint), images / "gray.png")
    assert str(err.value) == message


def test_a_predict_run_prints_no_head_or_lightning_noise(checkpoint, images, tmp_path):
    # A fine-tuned checkpoint records the pretrained file it started from; opening it loads no pretrained
    # weights, so no head is replaced and nothing says one was.
    recorded = torch.load(checkpoint, weights_only=True)
    recorded["hyper_parameters"]["pretrained"] = str(tmp_path / "gone.safetensors")
    finetuned = save_with_folder(recorded, tmp_path / "finetuned.ckpt")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vit.predict",
            "--ckpt_path",
            str(finetuned),
            "--input_dir",
            str(images),
            "--output",
            str(tmp_path / "p.csv"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for noise in ("re-initialised", "litlogger", "LeafSpec", "Warning"):
        assert noise not in done.stderr, done.stderr


def test_explain_from_many_threads_equals_the_serial_maps_exactly(checkpoint, images):
    from concurrent.futures import ThreadPoolExecutor

    predictor = vit.load(checkpoint, device="cpu")
    assert next(predictor.model.parameters()).device == torch.device("cpu")
    files = sorted(images.iterdir())
    calls = [(f, m) for f in files for m in ("rollout", "chefer", "gradcam")]
    serial = [predictor.explain(f, method=m) for f, m in calls]
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(lambda call: predictor.explain(call[0], method=call[1]), calls * 3))
    for got, expected in zip(concurrent, serial * 3, strict=True):
        assert torch.equal(got, expected)


def test_explain_decodes_only_the_images_it_draws(checkpoint, images, tmp_path, capsys, monkeypatch):
    import vit.data.images

    decoded = []
    original = vit.data.images.decode_image
    monkeypatch.setattr(
        vit.data.images, "decode_image", lambda path, size=None: decoded.append(path.name) or original(path, size)
    )
    files = sorted(p.name for p in images.iterdir())
    assert (
        explain_main(
            [
                "--ckpt_path",
                str(checkpoint),
                "--input_dir",
                str(images),
                "--num_images",
                "1",
                "--method",
                "rollout",
                "--out",
                str(tmp_path / "maps.png"),
            ]
        )
        == 0
    )
    assert decoded == files[:1]  # the first readable file only, not the whole folder
    assert f"note: explaining the first 1 readable images of {len(files)} files" in capsys.readouterr().err


def test_vit_load_and_a_prediction_import_no_lightning(checkpoint, images):
    code = (
        "import sys, vit; p = vit.load(sys.argv[1]); p.predict([sys.argv[2]]); p.explain(sys.argv[2]); "
        "print(sorted(m for m in ('lightning', 'torchmetrics', 'jsonargparse') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(images / "rgb.png")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout == "[]\n"


def test_predict_streams_any_iterable_in_batches_with_the_one_pass_result(checkpoint, images, monkeypatch):
    predictor = vit.load(checkpoint)
    files = sorted(images.iterdir())
    with torch.no_grad():  # the whole folder in one forward pass: what predict computed before it streamed
        one_pass = predictor.model(predictor.images(files)).softmax(dim=-1)
    passes, pulled = [], []
    predictor.model.register_forward_hook(lambda module, args, out: passes.append(args[0].shape[0]))

    def lazily():  # a generator: read one image at a time, as the batches need them
        for file in files:
            pulled.append((file.name, len(passes)))
            yield file

    predictions = predictor.predict(lazily(), topk=2, batch_size=3)
    assert passes == [3, 1] and pulled[3] == (files[3].name, 1)  # the 4th image is read after the first pass
    for top, probs in zip(predictions, one_pass, strict=True):
        assert [p.class_name for p in top] == [predictor.class_names[k] for k in probs.topk(2).indices]
        torch.testing.assert_close(torch.tensor([p.probability for p in top]), probs.topk(2).values, rtol=0, atol=1e-6)
    torch.testing.assert_close(predictor.probabilities(files, batch_size=1), one_pass, rtol=0, atol=1e-6)


def test_vit_predict_streaming_equals_the_one_pass_result(checkpoint, images, tmp_path):
    output = tmp_path / "p.csv"
    assert (
        predict_main(
            [
                "--ckpt_path",
                str(checkpoint),
                "--input_dir",
                str(images),
                "--output",
                str(output),
                "--batch_size",
                "3",
                "--num_workers",
                "2",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(output.open()))
    predictor = vit.load(checkpoint)
    with torch.no_grad():
        one_pass = predictor.model(predictor.images([images / row["file"] for row in rows])).softmax(dim=-1)
    assert [row["class_name"] for row in rows] == [predictor.class_names[k] for k in one_pass.argmax(-1)]
    written = torch.tensor([float(row["probability"]) for row in rows])
    torch.testing.assert_close(written, one_pass.max(-1).values, rtol=0, atol=1e-6)  # the CSV keeps 6 decimals


def test_to_device_and_precision(checkpoint, images):
    predictor = vit.load(checkpoint, device="auto", precision="bf16")
    assert predictor.to("cpu") is predictor and predictor.device == torch.device("cpu")
    full = vit.load(checkpoint).probabilities(sorted(images.iterdir()))
    bf16 = predictor.probabilities(sorted(images.iterdir()))
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, full)  # computed in bfloat16, returned as float
    torch.testing.assert_close(bf16, full, rtol=0, atol=3e-2)
    for call, message in [
        (
            lambda: vit.load(checkpoint, precision="fp8"),
            "precision='fp8' is not allowed: expected one of ['32', 'bf16', 'fp16']",
        ),
        (lambda: predictor.to("tpu"), "device='tpu' is not allowed: expected auto, cpu, cuda, cuda:N or mps"),
        (
            lambda: vit.load(checkpoint, precision="fp16"),
            "precision='fp16' runs on a GPU; on the CPU use precision='bf16' or '32'",
        ),
    ]:
        if torch.cuda.is_available() and "fp16" in message:
            continue
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message


def test_the_readme_snippet_runs_on_a_trained_checkpoint(checkpoint, images, tmp_path, monkeypatch):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[1]
    where = tmp_path / re.search(r'vit\.load\("([^"]+)"', snippet)[1]
    where.parent.mkdir(parents=True)
    shutil.copytree(checkpoint.with_suffix(""), where)  # the run's model folder where the snippet expects one
    for name in re.findall(r'"(\w+\.(?:jpg|png))"', snippet):
        Image.open(images / "rgb.png").save(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["relevance"].shape == (4, 4) and float(scope["relevance"].sum()) == pytest.approx(1.0)


def test_the_predict_command_imports_no_lightning(checkpoint, images, tmp_path):
    out = tmp_path / "predictions.csv"
    code = (
        "import sys; from vit.predict import main; "
        "code = main(['--ckpt_path', sys.argv[1], '--input_dir', sys.argv[2], '--output', sys.argv[3]]); "
        "print(code, sorted(m for m in ('lightning', 'torchmetrics', 'jsonargparse') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(checkpoint), str(images), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "0 []" and out.read_text().startswith("file,class_name,class_index")


def test_pixels_in_every_form_a_pipeline_user_has_give_the_files_probabilities(checkpoint, images):
    import torchvision.io

    p = vit.load(checkpoint)
    file = images / "rgb.png"
    expected = p.probabilities([file])
    pixels = np.asarray(Image.open(file).convert("RGB"))  # H x W x 3 uint8, as PIL and OpenCV (after BGR->RGB) give
    decoded = torchvision.io.decode_image(str(file))  # (3, H, W) uint8
    for image in (pixels, decoded, Image.fromarray(pixels)):
        assert torch.allclose(p.probabilities([image]), expected, atol=1e-6), type(image)
        assert torch.allclose(p.probabilities(image), expected, atol=1e-6), type(image)  # one image, not a batch
    gray = images / "gray.png"
    assert torch.allclose(p.probabilities(np.asarray(Image.open(gray))), p.probabilities([gray]), atol=1e-6)
    model_input = p.images([file])  # (1, C, H, W) float: the model's input
    assert torch.equal(p.probabilities(model_input[0]), p.probabilities(model_input))  # one (C, H, W) input
    assert torch.allclose(p.explain(decoded, "rollout"), p.explain(file, "rollout"), atol=1e-6)


def test_topk_above_the_classes_gives_all_of_them_and_the_predictor_is_callable(checkpoint, images):
    p = vit.load(checkpoint)
    file = images / "rgb.png"
    [everything] = p.predict([file], topk=10)
    assert sorted(c.class_name for c in everything) == sorted(p.class_names)
    assert [c.probability for c in everything] == sorted((c.probability for c in everything), reverse=True)
    assert len(everything) == len(p.class_names) and p(file, topk=10) == [everything]
    assert repr(p) == (
        f"Predictor(VisionTransformer, classes [{', '.join(map(repr, p.class_names))}], input 1 x 32 x 32, "
        "device cpu, precision '32')"
    )


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((8, 8, 3), dtype=np.float32), "images[0]: an array of pixels is uint8 (0-255), got float32"),
        (np.zeros((8, 8, 4), dtype=np.uint8), "images[0]: an array of pixels is H x W x 3 (RGB) or H x W, got shape"),
        (torch.zeros(2, 8, 8, dtype=torch.uint8), "images[0]: a uint8 tensor is (C, H, W) with 1 or 3 channels"),
        (torch.zeros(8, 8), "images: a float tensor is the model's input, (C, H, W) or (B, C, H, W)"),
        ("https://example.com/cat.jpg", "images[0]='https://example.com/cat.jpg': a URL is not downloaded here"),
    ],
)
def test_an_image_of_another_form_is_refused_naming_it(checkpoint, image, message):
    with pytest.raises(ValueError) as err:
        vit.load(checkpoint).probabilities([image] if not isinstance(image, torch.Tensor) else image)
    assert str(err.value).startswith(message), str(err.value)


def test_a_missing_file_is_named_as_missing(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="not found"):
        vit.load(checkpoint).predict([tmp_path / "nowhere.png"])
