"""Every hostile or broken file a review found, given to every door that opens it.

Inference doors (`vit.load`, `vit.predict`, `vit.explain` on images and on the test split, `vit.export`,
attention blocking, `train.py validate|test|predict`) open a model folder: its `config.json` is changed the way a
hostile or broken file could be, and each door answers one `error:` line naming the key, exit status 2, with no
marker file made and nothing written. `train.py fit --ckpt_path` resumes a run: its `config.yaml` and its trainer
state are changed; a class path outside the project, a path out of the run, code in the pickle, a compressed
archive, a URL are refused in one line, and a state that does not fit the run fails in one line, never a
traceback, with every file outside the run untouched.
"""

from __future__ import annotations

import http.server
import json
import pickle
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_doors import doors, popen, train_tiny
from robust_helpers import REPO, cli, error_line, main_in_process, subprocess_env, tiny_config

import vit
from vit.checks import CheckpointError

pytestmark = pytest.mark.slow  # every test opens what train.py wrote in this module


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A real `train.py` run of the tiny two-circles ViT (one epoch): its `last.ckpt` and config."""
    return train_tiny(tmp_path_factory.mktemp("trained"))


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def change(own: dict, case: str, marker: Path) -> str:
    """Apply `case` to a config.json's "vit" section in place; return what the error line must contain."""
    args = own["backbone"]["init_args"]
    if case == "backbone a YAML string naming Popen":
        own["backbone"] = f"{{class_path: subprocess.Popen, init_args: {{args: [touch, {marker}]}}}}"
        return "vit.backbone='{class_path: subprocess.Popen"
    if case == "backbone outside vit.models":
        own["backbone"] = popen(marker)
        return "vit.backbone.class_path='subprocess.Popen' is not allowed"
    if case == "a class path nested under an argument":
        args["patch_kernel"] = popen(marker)
        return "vit.backbone.init_args.patch_kernel="
    if case == "embed_dim 4096 with small weights":
        args.update(embed_dim=4096, depth=8, num_heads=16)
        return "model.safetensors does not fit the backbone config.json records"
    if case == "num_classes 10**9":
        args["num_classes"] = 10**9
        return "vit.backbone.init_args.num_classes=1000000000 is not allowed: expected at most 10000000"
    if case == "mean of the wrong length":
        own["inputs"].update(mean=[0.5, 0.5], std=[0.2, 0.2])
        return "inputs.mean=[0.5, 0.5] is not allowed: expected 1 finite numbers (one per channel)"
    if case == "std 0":
        own["inputs"].update(mean=[0.5], std=[0])
        return "inputs.std=[0] is not allowed: expected 1 finite numbers > 0"
    if case == "mean a string":
        own["inputs"].update(mean="abc", std=[1.0])
        return "inputs.mean='abc' is not allowed"
    if case == "inputs img_size not the backbone's":
        own["inputs"]["img_size"] = [64, 64]
        return "inputs.img_size=[64, 64] disagrees with the backbone's img_size=32"
    if case == "a list nested 5,000 deep":
        own["inputs"]["mean"] = nested(5000)
        return "is not valid JSON"
    if case == "a class name with a terminal escape":
        own["class_names"][0] = "a\x1b[2Jb"
        return "class_names[0]='a\\x1b[2Jb' is not allowed: it holds the invisible character U+001B"
    if case == "format version 2":
        own["format_version"] = 2
        return "vit.format_version=2 is not allowed"
    raise AssertionError(case)


CASES = [
    "backbone a YAML string naming Popen",
    "backbone outside vit.models",
    "a class path nested under an argument",
    "embed_dim 4096 with small weights",
    "num_classes 10**9",
    "mean of the wrong length",
    "std 0",
    "mean a string",
    "inputs img_size not the backbone's",
    "a list nested 5,000 deep",
    "a class name with a terminal escape",
    "format version 2",
]


def hostile_folder(trained, tmp_path: Path, case: str, marker: Path) -> tuple[Path, str]:
    """A copy of the run's model folder whose config.json has `case` applied; and the expected message."""
    folder = tmp_path / "model"
    shutil.copytree(trained[0].with_suffix(""), folder)
    config = json.loads((folder / "config.json").read_text())
    expected = change(config["vit"], case, marker)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # json.dumps writes the deep list recursively
    try:
        (folder / "config.json").write_text(json.dumps(config))
    finally:
        sys.setrecursionlimit(limit)
    return folder, expected


@pytest.mark.parametrize("case", CASES)
def test_every_door_refuses_a_hostile_model_folder_in_one_line_naming_the_key(
    case, trained, tmp_path, monkeypatch, capsys
):
    marker = tmp_path / "MARKER"
    folder, expected = hostile_folder(trained, tmp_path, case, marker)
    with pytest.raises(CheckpointError) as refused:
        vit.load(folder)
    assert str(folder) in str(refused.value) and expected in str(refused.value)
    for name, door in doors(folder, trained[1], tmp_path).items():
        if name == "train.py fit":  # fit resumes a run from its .ckpt: tested below
            continue
        assert door(monkeypatch) == 2, name
        line = error_line(capsys.readouterr().err)
        assert expected in line, (name, line)
    assert not marker.exists()
    assert not (tmp_path / "runs").exists() and not (tmp_path / "exported").exists()


def test_a_data_module_of_a_test_split_too_large_is_refused_before_it_is_generated(trained, tmp_path, capsys):
    from vit.explain.__main__ import main as explain_main

    folder = tmp_path / "model"
    shutil.copytree(trained[0].with_suffix(""), folder)
    config = json.loads((folder / "config.json").read_text())
    config["vit"]["data"]["init_args"]["num_test"] = 10**9
    (folder / "config.json").write_text(json.dumps(config))
    assert explain_main(["--ckpt_path", str(folder), "--out", str(tmp_path / "t.png")]) == 2
    assert "vit.data.init_args.num_test=1000000000 is not allowed: expected at most 1000000" in capsys.readouterr().err


def test_an_oversize_architecture_is_refused_before_memory_is_spent(trained, tmp_path):
    """A model folder recording a ViT of 1.6 billion parameters beside small weights: refused by comparing shapes on
    the meta device. The peak memory of the process grows by less than 1 GB over what importing the library takes."""
    folder, _ = hostile_folder(trained, tmp_path, "embed_dim 4096 with small weights", tmp_path / "m")
    script = (
        "import resource, vit.api\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"try:\n    vit.api.load({str(folder)!r})\nexcept ValueError as err:\n    print('refused:', err)\n"
        "print('grew_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=300
    ).stdout
    assert "refused: model folder" in out and "does not fit the backbone" in out, out
    grew_kb = int(out.split("grew_kb")[1])
    assert grew_kb < 2**20, f"peak memory grew by {grew_kb / 2**20:.2f} GB"


# --- What fit restores of a run ------------------------------------------------------------------


def run_copy(trained, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the trained run under `tmp_path/runs/tiny/version_0` (where the config writes), and the config."""
    config = tiny_config(tmp_path, max_epochs=2)
    run = tmp_path / "runs" / "tiny" / "version_0"
    shutil.copytree(trained[0].parent.parent, run)
    ckpt = run / "checkpoints" / "last.ckpt"
    # As if the run had been written here: its ModelCheckpoint paths name this copy's files.
    checkpoint = torch.load(ckpt, weights_only=True)
    old, new = str(trained[0].parent.parent), str(run)

    def move(value):
        if isinstance(value, str):
            return value.replace(old, new)
        return {move(k): move(v) for k, v in value.items()} if isinstance(value, dict) else value

    checkpoint["callbacks"] = move(checkpoint["callbacks"])
    torch.save(checkpoint, ckpt)
    return ckpt, config


def edited(trained, tmp_path: Path, edit) -> tuple[Path, Path]:
    """`run_copy` with `edit(checkpoint dict, the run's checkpoint folder)` applied to its last.ckpt."""
    ckpt, config = run_copy(trained, tmp_path)
    checkpoint = torch.load(ckpt, weights_only=True)
    edit(checkpoint, ckpt.parent)
    torch.save(checkpoint, ckpt)
    return ckpt, config


def model_checkpoint_state(checkpoint: dict) -> dict:
    return next(v for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint{"))


def fit(ckpt: Path, config: Path, monkeypatch, capsys) -> tuple[int, str]:
    return cli(
        ["fit", "--config", str(config), "--ckpt_path", str(ckpt), "--test_after_fit", "false"], monkeypatch, capsys
    )


def test_fit_refuses_checkpoint_paths_that_lead_out_of_the_run_and_deletes_nothing(
    trained, tmp_path, monkeypatch, capsys
):
    victim = tmp_path / "victim"
    (victim / "inside").mkdir(parents=True)
    (victim / "inside" / "precious.txt").write_text("keep me")

    def edit(checkpoint, folder):
        escape = f"{folder}/../../../../victim/inside/precious.txt"
        model_checkpoint_state(checkpoint).update(
            dirpath=str(folder),
            last_model_path=escape,
            best_model_path=escape,
            kth_best_model_path=escape,
            best_k_models={escape: torch.tensor(0.1)},
        )

    ckpt, config = edited(trained, tmp_path, edit)
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2, stderr
    assert "which is not a checkpoint file of this run's" in error_line(stderr)
    assert (victim / "inside" / "precious.txt").read_text() == "keep me"


def test_a_link_in_the_run_folder_that_leads_out_is_refused(trained, tmp_path, monkeypatch, capsys):
    (tmp_path / "precious.ckpt").write_text("keep me")

    def edit(checkpoint, folder):
        (folder / "link.ckpt").symlink_to(tmp_path / "precious.ckpt")
        model_checkpoint_state(checkpoint).update(dirpath=str(folder), best_model_path=str(folder / "link.ckpt"))

    ckpt, config = edited(trained, tmp_path, edit)
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2 and "link.ckpt" in error_line(stderr)
    assert (tmp_path / "precious.ckpt").read_text() == "keep me"


class Counting(http.server.BaseHTTPRequestHandler):
    requests = 0

    def do_GET(self):  # noqa: N802  (http.server's name)
        Counting.requests += 1
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_best_model_path_url_is_refused_and_never_requested(trained, tmp_path, monkeypatch, capsys):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/best.ckpt"
    try:
        ckpt, config = edited(trained, tmp_path, lambda c, f: model_checkpoint_state(c).update(best_model_path=url))
        code, stderr = fit(ckpt, config, monkeypatch, capsys)
        assert code == 2 and "best.ckpt', which is not a checkpoint file of this run's" in error_line(stderr)
        code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", url], monkeypatch, capsys)
        assert code == 2 and "is a URL: fit resumes a run from its own folder" in error_line(stderr)
    finally:
        server.shutdown()
        server.server_close()
    assert Counting.requests == 0


class Payload:
    """Unpickled by a full `pickle.load`, this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


def test_code_in_the_trainer_state_never_runs(trained, tmp_path, monkeypatch, capsys):
    marker = tmp_path / "MARKER"
    ckpt, config = run_copy(trained, tmp_path)
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["callbacks"]["Payload"] = Payload(marker)
    torch.save(checkpoint, ckpt, pickle_module=pickle)
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2 and "cannot be loaded as data" in error_line(stderr)
    assert not marker.exists()


def test_a_compressed_or_oversize_archive_is_refused_before_it_is_unpacked(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = run_copy(trained, tmp_path)
    packed = ckpt.with_name("packed.ckpt")
    with zipfile.ZipFile(ckpt) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    packed.replace(ckpt)
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2 and "has a compressed entry" in error_line(stderr)
    ckpt, config = run_copy(trained, tmp_path / "second")
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_MAX_BYTES", "1000")
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2 and "above the limit of 1000 bytes" in error_line(stderr)


@pytest.mark.parametrize("where", ["model.backbone", "model.backbone.init_args.patch_kernel", "data"])
def test_a_class_path_planted_in_the_runs_config_is_refused_and_never_built(
    where, trained, tmp_path, monkeypatch, capsys
):
    marker = tmp_path / "MARKER"
    ckpt, config = run_copy(trained, tmp_path)
    recorded = yaml.safe_load((ckpt.parent.parent / "config.yaml").read_text())
    section, *rest = where.split(".")
    target = recorded[section]
    for key in rest[:-1]:
        target = target[key]
    target[rest[-1] if rest else "class_path"] = popen(marker) if rest else "subprocess.Popen"
    (ckpt.parent.parent / "config.yaml").write_text(yaml.safe_dump(recorded))
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2, stderr
    assert "subprocess.Popen" in error_line(stderr)
    assert not marker.exists()


def test_a_checkpoint_outside_a_run_folder_is_refused(trained, tmp_path, monkeypatch, capsys):
    alone = tmp_path / "alone.ckpt"
    shutil.copy(trained[0], alone)
    code, stderr = fit(alone, tiny_config(tmp_path, max_epochs=2), monkeypatch, capsys)
    assert code == 2 and "is not in a run folder" in error_line(stderr)
    assert not (tmp_path / "runs").exists()


def _set(keys: tuple, value):
    def edit(checkpoint, folder):
        target = checkpoint
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


RESUME_CASES = {
    "torch RNG state of the wrong size": (("callbacks", "RestoreRNGState", "torch"), torch.zeros(10).byte()),
    "a negative data position": (("TwoCirclesDataModule", "train_position", "batches_done"), -1),
    "a string data position": (("TwoCirclesDataModule", "train_position", "epoch"), "one"),
    "another number of processes": (("TwoCirclesDataModule", "world_size"), 4),
    "loops of the wrong type": (("loops", "fit_loop", "epoch_progress", "total", "ready"), "4"),
    "a moment of the wrong shape": (("optimizer_states", 0, "state", 0, "exp_avg"), torch.zeros(3)),
    "a scheduler of the wrong type": (("lr_schedulers", 0, "last_epoch"), "x"),
    "optimizer groups missing": (("optimizer_states", 0, "param_groups"), []),
    "weights of another shape": (("state_dict", "backbone.head.bias"), torch.zeros(7)),
    # Found by benchmarks/fuzz_checkpoints.py: numpy's OverflowError as the random states are restored.
    "a numpy random state out of range": (("callbacks", "RestoreRNGState", "numpy", "pos"), 2**53 + 1),
    # Found by benchmarks/fuzz_checkpoints.py (in torch's schedule then): a rate list shorter than the groups.
    "the schedule's rates for fewer groups": (("lr_schedulers", 0, "base_values"), [1e-3]),
    "a schedule's rate that is not finite": (("lr_schedulers", 0, "lr_min"), float("nan")),
    # What an earlier version saved: torch's warmup + cosine (SequentialLR).
    "torch's schedule of an earlier version": (
        ("lr_schedulers",),
        [{"_milestones": [2], "last_epoch": 4, "_schedulers": [{}, {}], "_last_lr": [1e-3, 1e-3]}],
    ),
    # Found by benchmarks/fuzz_checkpoints.py: a step count past int64, which failed in ModelCheckpoint mid-run.
    "a step count past int64": (
        ("loops", "fit_loop", "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total")
        + ("completed",),
        2**64,
    ),
    # What an earlier version saved: a LambdaLR's state (its lambda itself is not saved).
    "the schedule of an earlier version": (
        ("lr_schedulers",),
        [{"base_lrs": [1e-3, 1e-3], "last_epoch": 8, "_step_count": 9, "lr_lambdas": [None]}],
    ),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_a_trainer_state_that_does_not_fit_the_run_fails_in_one_line(case, trained, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    ckpt, config = edited(trained, tmp_path, _set(*RESUME_CASES[case]))
    code, stderr = fit(ckpt, config, monkeypatch, capsys)
    assert code == 2, stderr
    line = error_line(stderr)
    assert line.startswith(f"error: checkpoint {ckpt} cannot be resumed: "), line
    if case == "another number of processes":
        assert line.endswith(
            "the data position was written by 4 process(es) and this run has 1: resume with 4 "
            "(trainer.devices x trainer.num_nodes)"
        ), line
    assert victim.read_text() == "keep me"


def test_a_resumed_run_resumes_again_and_its_checkpoints_open(tmp_path, monkeypatch, caplog):
    """The checkpoints a resumed run writes have their model folders, which every door opens; a run resumed with
    more epochs than it was started with says that its schedule follows the new config."""
    caplog.set_level("INFO")
    for epochs in (1, 2, 3):
        config = tiny_config(tmp_path, max_epochs=epochs)
        main_in_process(
            [
                "fit",
                "--config",
                str(config),
                "--test_after_fit",
                "false",
                *(["--ckpt_path", "last"] if epochs > 1 else []),
            ],
            monkeypatch,
        )
    last = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == 2
    notices = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    assert notices == [
        f"The learning-rate schedule goes on from update {step} as this config sets it, not as saved"
        for step in (8, 16)
    ]
    main_in_process(["validate", "--config", str(config), "--ckpt_path", str(last)], monkeypatch)
    assert vit.load(last).class_names == ["not_diagonal", "diagonal"]


def test_fit_refuses_model_settings_other_than_the_runs(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = run_copy(trained, tmp_path)
    code, stderr = cli(
        ["fit", "--config", str(config), "--ckpt_path", str(ckpt), "--model.backbone.init_args.depth", "3"],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert "model.backbone.init_args.depth: 2 in the checkpoint vs 3 given" in error_line(stderr)
