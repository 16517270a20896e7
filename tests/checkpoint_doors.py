"""Every door that opens a checkpoint, for the tests that give each of them a hostile or broken one."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from robust_helpers import main_in_process, tiny_config

from studies.runner.attention_blocking import main as blocking_main
from vit.explain.__main__ import main as explain_main
from vit.export import main as export_main
from vit.predict import main as predict_main


def train_tiny(root: Path) -> tuple[Path, Path]:
    """`(last.ckpt, config)` of one epoch of the tiny two-circles ViT trained by `train.py` under `root`."""
    config = tiny_config(root, max_epochs=1)
    with pytest.MonkeyPatch.context() as mp:
        main_in_process(["fit", "--config", str(config), "--test_after_fit", "false"], mp)
    return root / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", config


def popen(marker: Path) -> dict:
    """A jsonargparse class path that, if anything built it, would create `marker`."""
    return {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(marker)]}}


def doors(ckpt: Path, config: Path, tmp_path: Path) -> dict[str, Callable]:
    """Every command that opens a checkpoint, as a call `(monkeypatch) -> exit status`; `vit.load` is tested apart."""
    images = tmp_path / "images"
    images.mkdir(exist_ok=True)
    Image.fromarray(np.zeros((32, 32), dtype=np.uint8)).save(images / "a.png")

    def train(subcommand: str):
        def run(monkeypatch):
            try:
                main_in_process([subcommand, "--config", str(config), "--ckpt_path", str(ckpt)], monkeypatch)
            except SystemExit as exit:
                return exit.code
            return 0

        return run

    return {
        "vit.predict": lambda mp: predict_main(
            ["--ckpt_path", str(ckpt), "--input_dir", str(images), "--output", str(tmp_path / "p.csv")]
        ),
        "vit.explain": lambda mp: explain_main(
            ["--ckpt_path", str(ckpt), "--input_dir", str(images), "--out", str(tmp_path / "e.png")]
        ),
        "vit.explain (test split)": lambda mp: explain_main(
            ["--ckpt_path", str(ckpt), "--out", str(tmp_path / "t.png")]
        ),
        "vit.export": lambda mp: export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "exported")]),
        "attention_blocking": lambda mp: blocking_main(["--ckpt_paths", str(ckpt), "--out_dir", str(tmp_path / "b")]),
        **{f"train.py {s}": train(s) for s in ("validate", "test", "predict", "fit")},
    }


def hostile(base: dict, shape: str, marker: Path) -> dict:
    """`base` (a real checkpoint) with one hostile change."""
    checkpoint = copy.deepcopy(base)
    hparams, data = checkpoint["hyper_parameters"], checkpoint["datamodule_hyper_parameters"]
    if shape == "nested class path":  # the report's own case: an untyped argument holding a class path
        hparams["backbone"] = {
            "class_path": "timm.layers.Mlp",
            "init_args": {"in_features": 4, "device": popen(marker)},
        }
    elif shape == "nested under an owned backbone":
        hparams["backbone"]["init_args"]["patch_kernel"] = popen(marker)
    elif shape == "backbone outside vit.models":
        hparams["backbone"] = popen(marker)
    elif shape == "data module outside vit.data":
        data["_class_path"] = "subprocess.Popen"
        data["args"] = ["touch", str(marker)]
    elif shape == "instantiator":
        hparams["_instantiator"] = "os.system"
    else:
        raise AssertionError(shape)
    return checkpoint


SHAPES = [
    "nested class path",
    "nested under an owned backbone",
    "backbone outside vit.models",
    "data module outside vit.data",
    "instantiator",
]
# The key each refusal names.
NAMED = {
    "nested class path": "hyper_parameters.backbone.class_path='timm.layers.Mlp'",
    "nested under an owned backbone": "hyper_parameters.backbone.init_args.patch_kernel={'class_path'",
    "backbone outside vit.models": "hyper_parameters.backbone.class_path='subprocess.Popen'",
    "data module outside vit.data": "datamodule_hyper_parameters._class_path='subprocess.Popen'",
    "instantiator": "hyper_parameters._instantiator='os.system'",
}
