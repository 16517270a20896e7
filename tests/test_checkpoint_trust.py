"""Opening a trained model runs no code, reaches no network, and needs none of the files it was trained from.

(Hostile model folders and trainer states: `tests/test_checkpoint_owner.py`.) A model folder whose record names a
hub repository as its `pretrained` opens without a request to the hub (a local server stands in for it and counts
requests). A fine-tuned image-folder model copied alone to another folder, with its pretrained file and training
folder renamed and the network off, gives the same predictions, explanation and export as before.
"""

from __future__ import annotations

import csv
import http.server
import json
import shutil
import socket
import threading
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import timm
import torch
from checkpoint_doors import doors as commands
from checkpoint_doors import popen, train_tiny
from notebook_helpers import execute
from PIL import Image
from robust_helpers import main_in_process
from safetensors.torch import load_file, save_file

from vit.explain.__main__ import main as explain_main
from vit.export import main as export_main
from vit.predict import main as predict_main

pytestmark = pytest.mark.slow  # every test opens a checkpoint that train.py wrote in this module

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A real `train.py` checkpoint of the tiny two-circles ViT (one epoch) and its config."""
    return train_tiny(tmp_path_factory.mktemp("trained"))


class CountingHub(http.server.BaseHTTPRequestHandler):
    """A local stand-in for the Hugging Face Hub: answers 404 to everything and counts the requests."""

    requests: list[str] = []

    def do_GET(self):  # noqa: N802
        CountingHub.requests.append(self.path)
        self.send_error(404)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CountingHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    CountingHub.requests = []
    # huggingface_hub reads its settings once, at import: set them where it reads them at a request.
    # A file's URL comes from the template, built from the endpoint at import: without it, downloads
    # went to huggingface.co (and, offline, to 23 s of retries), never reaching the stand-in.
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub cache"))
    yield CountingHub.requests
    server.shutdown()


def test_a_pretrained_hub_id_in_a_checkpoint_is_never_requested(trained, tmp_path, monkeypatch, capsys, hub):
    ckpt, config = trained
    moved = tmp_path / "hub"
    shutil.copytree(ckpt.with_suffix(""), moved)
    recorded = json.loads((moved / "config.json").read_text())
    recorded["vit"]["training"]["pretrained"] = "hf-hub:someone/anything"  # where a run records what it started from
    (moved / "config.json").write_text(json.dumps(recorded))
    # The stand-in hub is reached by a pretrained load, so that silence below means no request was made.
    from vit.models.pretrained import create_vit

    with pytest.raises(ValueError):
        create_vit(
            img_size=32,
            patch_size=8,
            in_chans=1,
            num_classes=2,
            embed_dim=32,
            depth=1,
            num_heads=2,
            mlp_ratio=2.0,
            pretrained="hf-hub:someone/anything",
        )
    # (Asked for the repository's files, not only for huggingface_hub's own registry of agents.)
    assert any(path.startswith("/someone/anything/") for path in hub), f"the stand-in hub was not asked: {hub}"
    hub.clear()
    for name, command in commands(moved, config, tmp_path).items():
        # attention_blocking needs a same_different model; train.py's subcommands open it alike (validate stands
        # for them)
        if name in ("attention_blocking", "train.py test", "train.py predict", "train.py fit"):
            continue
        assert command(monkeypatch) == 0, (name, capsys.readouterr().err)
    assert hub == []


def fine_tune(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A ViT fine-tuned for one epoch from a timm .safetensors file on a folder of two named classes."""
    rng = np.random.default_rng(0)
    images = tmp_path / "training images"
    for label, channel in (("blue", 2), ("red", 0)):
        (images / label).mkdir(parents=True)
        for i in range(8):
            pixels = rng.integers(0, 60, size=(40, 40, 3)).astype(np.uint8)
            pixels[8:24, 8:24, channel] = 255
            Image.fromarray(pixels).save(images / label / f"{i}.png")
    torch.manual_seed(0)
    timm_model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2
    )
    weights = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in timm_model.state_dict().items()}, str(weights))
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    main_in_process(
        [
            "fit",
            "--config",
            str(REPO / "configs/folder/finetune_vit.yaml"),
            "--data.root",
            images.name,
            "--data.img_size",
            "32",
            "--data.batch_size",
            "8",
            "--data.num_workers",
            "0",
            "--trainer.precision",
            "32-true",
            "--trainer.max_epochs",
            "1",
            "--trainer.accelerator",
            "cpu",
            "--trainer.logger.init_args.save_dir",
            "runs",
            "--test_after_fit",
            "false",
            "--model.pretrained",
            weights.name,
            "--model.backbone.init_args.embed_dim",
            "32",
            "--model.backbone.init_args.depth",
            "1",
            "--model.backbone.init_args.num_heads",
            "2",
            "--model.backbone.init_args.patch_size",
            "8",
        ],
        monkeypatch,
    )
    [last] = (tmp_path / "runs").glob("folder/finetune_vit/version_0/checkpoints/last.ckpt")
    return last, images, weights


def outputs(ckpt: Path, photos: Path, out: Path) -> tuple[list[dict], bytes, dict]:
    """What predict, explain and export make of `ckpt`: the CSV rows, the figure's bytes and the exported weights."""
    out.mkdir()
    assert (
        predict_main(
            ["--ckpt_path", str(ckpt), "--input_dir", str(photos), "--output", str(out / "p.csv"), "--topk", "2"]
        )
        == 0
    )
    assert (
        explain_main(
            [
                "--ckpt_path",
                str(ckpt),
                "--input_dir",
                str(photos),
                "--method",
                "rollout,gradcam",
                "--out",
                str(out / "e.png"),
            ]
        )
        == 0
    )
    assert export_main(["--ckpt_path", str(ckpt), "--out", str(out / "exported")]) == 0
    config = json.loads((out / "exported" / "config.json").read_text())
    return list(csv.DictReader((out / "p.csv").open())), config, load_file(out / "exported" / "model.safetensors")


def test_a_checkpoint_moved_alone_works_offline_without_its_training_files(tmp_path, monkeypatch, capsys):
    last, images, weights = fine_tune(tmp_path / "machine a", monkeypatch)
    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(1)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, size=(50, 60, 3)).astype(np.uint8)).save(photos / f"{i}.jpg")
    rows, config, exported = outputs(last, photos, tmp_path / "before")

    elsewhere = tmp_path / "machine b"
    elsewhere.mkdir()
    moved = elsewhere / "model"  # the run's model folder, alone
    shutil.copytree(last.with_suffix(""), moved)
    weights.rename(weights.with_name("gone.safetensors"))
    # train.py validates with the run's own config, which names the pretrained file: its weights are not loaded.
    run_config = last.parents[1] / "config.yaml"
    main_in_process(
        [
            "validate",
            "--config",
            str(run_config),
            "--ckpt_path",
            str(last),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "validate runs"),
        ],
        monkeypatch,
    )
    assert "val/acc" in capsys.readouterr().out
    images.rename(images.with_name("gone"))
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    local = socket.socket.connect  # the image loader's worker processes talk over a Unix socket: not the network

    def no_network(sock, *args, **kwargs):
        if sock.family != socket.AF_UNIX:
            raise AssertionError(f"a connection was attempted: {args}")
        return local(sock, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", no_network)
    after = outputs(moved, photos, tmp_path / "after")
    assert after[0] == rows and after[1] == config
    assert all(torch.equal(after[2][k], exported[k]) for k in exported)
    assert [r["class_name"] for r in rows] != [] and set(config["label_names"]) == {"blue", "red"}
    assert config["pretrained_cfg"]["mean"] == [0.5, 0.5, 0.5]  # the recipe's inception normalisation travelled


@pytest.mark.slow  # starts a Jupyter kernel
def test_a_hostile_checkpoint_given_to_a_notebook_builds_nothing(trained, tmp_path, kernel_env, monkeypatch):
    from nbclient.exceptions import CellExecutionError

    marker = tmp_path / "MARKER"
    bad = tmp_path / "bad"
    shutil.copytree(trained[0].with_suffix(""), bad)
    recorded = json.loads((bad / "config.json").read_text())
    recorded["vit"]["backbone"] = {
        "class_path": "timm.layers.Mlp",
        "init_args": {"in_features": 4, "device": popen(marker)},
    }
    (bad / "config.json").write_text(json.dumps(recorded))
    with pytest.raises(CellExecutionError, match=r"vit\.backbone\.class_path='timm\.layers\.Mlp'"):
        execute("attention_rollout_two_circles.ipynb", CHECKPOINT=str(bad))
    assert not marker.exists()


@pytest.mark.slow
def test_a_folder_run_fine_tuned_from_a_local_safetensors_has_model_folders_timm_and_transformers_open(
    tmp_path, monkeypatch
):
    from transformers import pipeline

    import vit

    last, images, _ = fine_tune(tmp_path, monkeypatch)
    checkpoints = sorted(last.parent.glob("*.ckpt"))
    assert checkpoints and all((path.with_suffix("") / "model.safetensors").is_file() for path in checkpoints)
    folder = last.with_suffix("")
    photos = [Image.open(path).convert("RGB") for path in sorted(images.rglob("*.png"))]
    ours = vit.load(folder).probabilities(photos)
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    with torch.no_grad():
        torch.testing.assert_close(
            model(torch.stack([transform(p) for p in photos])).softmax(-1), ours, rtol=0, atol=1e-5
        )
    rows = pipeline("image-classification", model=str(folder), device="cpu")(photos, top_k=2)
    names = vit.load(folder).class_names
    theirs = torch.tensor([[{r["label"]: r["score"] for r in row}[name] for name in names] for row in rows])
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
