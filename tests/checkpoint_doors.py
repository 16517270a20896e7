"""Every door that opens a checkpoint, for the tests that give each of them a hostile or broken one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image
from robust_helpers import main_in_process

from studies.recipe.attention_blocking import main as blocking_main
from vit.explain.__main__ import main as explain_main
from vit.export import main as export_main
from vit.predict import main as predict_main


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
        "vit.predict": lambda mp: predict_main(["--ckpt_path", str(ckpt), "--input_dir", str(images),
                                                "--output", str(tmp_path / "p.csv")]),
        "vit.explain": lambda mp: explain_main(["--ckpt_path", str(ckpt), "--input_dir", str(images),
                                                "--out", str(tmp_path / "e.png")]),
        "vit.explain (test split)": lambda mp: explain_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "t.png")]),
        "vit.export": lambda mp: export_main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "exported")]),
        "attention_blocking": lambda mp: blocking_main(["--ckpt_paths", str(ckpt), "--out_dir", str(tmp_path / "b")]),
        **{f"train.py {s}": train(s) for s in ("validate", "test", "predict", "fit")},
    }
