"""Every hostile or broken checkpoint a review found, given to every door that opens one.

Each door (`vit.load`, `vit.predict`, `vit.explain` on images and on the test split, `vit.export`,
attention blocking, `train.py validate|test|predict|fit`) answers one `error:` line naming the key,
exit status 2: no marker file appears, no file outside the run is touched, no run folder is made,
no request reaches a local server standing in for a remote host, and an oversize architecture is
refused before memory is spent on it.
"""

from __future__ import annotations

import copy
import http.server
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from checkpoint_doors import doors, train_tiny
from robust_helpers import REPO, cli, error_line, main_in_process, subprocess_env, tiny_config

import vit
from vit.training.checkpoint import CheckpointError

pytestmark = pytest.mark.slow  # every test opens a checkpoint that train.py wrote in this module


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict, Path]:
    """A real `train.py` checkpoint of the tiny two-circles ViT (one epoch) as a dict, and its config."""
    path, config = train_tiny(tmp_path_factory.mktemp("trained"))
    return torch.load(path, weights_only=True), config


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def yaml_class_path(marker: Path) -> str:
    return ("{class_path: timm.layers.Mlp, init_args: {in_features: 4, device: {class_path: subprocess.Popen, "
            f"init_args: {{args: [touch, {marker}]}}}}}}}}")


def change(checkpoint: dict, case: str, marker: Path) -> str:
    """Apply `case` to `checkpoint` in place; return what the error line must contain."""
    hp, args = checkpoint["hyper_parameters"], checkpoint["hyper_parameters"]["backbone"]["init_args"]
    callbacks = checkpoint["callbacks"]
    [mc_key] = [k for k in callbacks if k.startswith("ModelCheckpoint{")][:1]
    if case == "backbone a YAML string naming Popen":
        hp["backbone"] = yaml_class_path(marker)
        return "hyper_parameters.backbone='{class_path: timm.layers.Mlp"
    if case == "backbone a module path":
        hp["backbone"] = "this.Foo"
        return "hyper_parameters.backbone='this.Foo' is not allowed: expected a mapping of class_path and init_args"
    if case == "embed_dim 4096 with small weights":
        args.update(embed_dim=4096, depth=8, num_heads=16)
        return "state_dict does not fit the backbone its hyper_parameters record (VisionTransformer)"
    if case == "num_classes 10**9":
        args["num_classes"] = 10**9
        return "hyper_parameters.backbone.init_args.num_classes=1000000000 is not allowed: expected at most 10000000"
    if case == "mean of the wrong length":
        checkpoint["inputs"].update(mean=[0.5, 0.5], std=[0.2, 0.2])
        return "inputs.mean=[0.5, 0.5] is not allowed: expected 1 finite numbers (one per channel)"
    if case == "std 0":
        checkpoint["inputs"].update(mean=[0.5], std=[0])
        return "inputs.std=[0] is not allowed: expected 1 finite numbers > 0"
    if case == "mean a string":
        checkpoint["inputs"].update(mean="abc", std=[1.0])
        return "inputs.mean='abc' is not allowed"
    if case == "mean NaN":
        checkpoint["inputs"].update(mean=[float("nan")], std=[1.0])
        return "inputs.mean[0]=nan is not allowed: expected a finite number"
    if case == "inputs img_size not the backbone's":
        checkpoint["inputs"]["img_size"] = [64, 64]
        return "inputs.img_size=[64, 64] disagrees with the backbone's img_size=32"
    if case == "global_step inf":
        checkpoint["global_step"] = float("inf")
        return "global_step=inf is not allowed: expected a finite number"
    if case == "global_step a string":
        checkpoint["global_step"] = "abc"
        return "global_step='abc' is not allowed: expected an int >= 0"
    if case == "a list nested 5,000 deep":
        hp["lr"] = nested(5000)
        return "is nested more than 24 levels deep; refused"
    if case == "an int key in the state dict":
        checkpoint["state_dict"][7] = torch.zeros(1)
        return "state_dict has 7: Tensor, not a name and a tensor"
    if case == "a sparse tensor":
        checkpoint["state_dict"]["backbone.head.bias"] = torch.zeros(2).to_sparse()
        return "state_dict.backbone.head.bias is a torch.sparse_coo tensor"
    if case == "best_model_score a list":
        callbacks[mc_key]["best_model_score"] = [1, 2]
        return "best_model_score=[1, 2] is not allowed: expected a score (one number)"
    if case == "callbacks a list":
        checkpoint["callbacks"] = [1]
        return "callbacks is a list, not a mapping"
    if case == "an unknown top-level key":
        checkpoint["payload"] = {"class_path": "subprocess.Popen"}
        return "it has a key 'payload' that this project does not write; refused"
    if case == "data module num_test 10**9":
        checkpoint["datamodule_hyper_parameters"]["num_test"] = 10**9
        return "datamodule_hyper_parameters.num_test=1000000000 is not allowed: expected at most 1000000"
    raise AssertionError(case)


CASES = ["backbone a YAML string naming Popen", "backbone a module path", "embed_dim 4096 with small weights",
         "num_classes 10**9", "mean of the wrong length", "std 0", "mean a string", "mean NaN",
         "inputs img_size not the backbone's", "global_step inf", "global_step a string", "a list nested 5,000 deep",
         "an int key in the state dict", "a sparse tensor", "best_model_score a list", "callbacks a list",
         "an unknown top-level key", "data module num_test 10**9"]


@pytest.mark.parametrize("case", CASES)
def test_every_door_refuses_the_checkpoint_in_one_line_naming_the_key(case, trained, tmp_path, monkeypatch,
                                                                       capsys):
    checkpoint, config = copy.deepcopy(trained[0]), trained[1]
    marker = tmp_path / "MARKER"
    expected = change(checkpoint, case, marker)
    path = tmp_path / "bad.ckpt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # torch.save pickles the deep list recursively
    try:
        torch.save(checkpoint, path)
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointError) as refused:
        vit.load(path)
    assert str(refused.value).startswith(f"checkpoint {path}") and expected in str(refused.value)
    for name, door in doors(path, config, tmp_path).items():
        assert door(monkeypatch) == 2, name
        line = error_line(capsys.readouterr().err)
        assert expected in line, (name, line)
    assert not marker.exists()
    assert not (tmp_path / "runs").exists() and not (tmp_path / "exported").exists()


def test_a_compressed_archive_is_refused_before_it_is_unpacked(trained, tmp_path):
    plain, packed = tmp_path / "plain.ckpt", tmp_path / "packed.ckpt"
    torch.save(trained[0], plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    with pytest.raises(CheckpointError, match=r"has a compressed entry .*torch.save stores its entries uncompressed"):
        vit.load(packed)


def test_the_byte_limit_counts_what_the_archive_unpacks_to(trained, tmp_path, monkeypatch):
    path = tmp_path / "x.ckpt"
    torch.save(trained[0], path)
    monkeypatch.setenv("READABLE_VIT_DOWNLOAD_MAX_BYTES", "1000")
    with pytest.raises(CheckpointError, match=r"holds \d+ bytes, above the limit of 1000 bytes \(set "
                                              r"READABLE_VIT_DOWNLOAD_MAX_BYTES to allow more\)"):
        vit.load(path)


def test_an_oversize_architecture_is_refused_before_memory_is_spent(trained, tmp_path):
    """A 100 KB checkpoint recording a ViT of 1.6 billion parameters: refused by comparing shapes on the meta device.
    The peak memory of the process grows by less than 1 GB over what importing the library takes."""
    checkpoint = copy.deepcopy(trained[0])
    change(checkpoint, "embed_dim 4096 with small weights", tmp_path / "m")
    path = tmp_path / "big.ckpt"
    torch.save(checkpoint, path)
    script = ("import resource, vit.api\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              f"try:\n    vit.api.load({str(path)!r})\nexcept ValueError as err:\n    print('refused:', err)\n"
              "print('grew_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(),
                         cwd=REPO, timeout=300).stdout
    assert "refused: checkpoint" in out and "does not fit the backbone" in out, out
    grew_kb = int(out.split("grew_kb")[1])
    assert grew_kb < 2**20, f"peak memory grew by {grew_kb / 2**20:.2f} GB"


# --- What fit restores of a run ------------------------------------------------------------------


def resumed(trained, tmp_path: Path, edit) -> tuple[Path, Path]:
    """A copy of the checkpoint with `edit(checkpoint, new_run_checkpoint_folder)` applied, and the config."""
    checkpoint = copy.deepcopy(trained[0])
    config = tiny_config(tmp_path, max_epochs=2)
    edit(checkpoint, tmp_path / "runs" / "tiny" / "version_0" / "checkpoints")
    path = tmp_path / "resume.ckpt"
    torch.save(checkpoint, path)
    return path, config


def model_checkpoint_state(checkpoint: dict) -> dict:
    return next(v for k, v in checkpoint["callbacks"].items() if k.startswith("ModelCheckpoint{"))


def test_fit_refuses_checkpoint_paths_that_lead_out_of_the_new_run_and_deletes_nothing(trained, tmp_path,
                                                                                        monkeypatch, capsys):
    victim = tmp_path / "victim"
    (victim / "inside").mkdir(parents=True)
    (victim / "inside" / "precious.txt").write_text("keep me")

    def edit(checkpoint, folder):
        state = model_checkpoint_state(checkpoint)
        escape = f"{folder}/../../../../victim"
        state.update(dirpath=str(folder), last_model_path=escape, best_model_path=escape, kth_best_model_path=escape,
                     best_k_models={escape: torch.tensor(0.1)})

    path, config = resumed(trained, tmp_path, edit)
    code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", str(path)], monkeypatch, capsys)
    assert code == 2
    assert "is not allowed: it must be a checkpoint file inside this run's checkpoint folder" in error_line(stderr)
    assert (victim / "inside" / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "runs").exists()


def test_a_link_in_the_run_folder_that_leads_out_is_refused(trained, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    (tmp_path / "precious.ckpt").write_text("keep me")
    (folder / "link.ckpt").symlink_to(tmp_path / "precious.ckpt")

    def edit(checkpoint, folder):
        model_checkpoint_state(checkpoint).update(dirpath=str(folder), best_model_path=str(folder / "link.ckpt"))

    path, config = resumed(trained, tmp_path, edit)
    code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", str(path),
                        "--trainer.logger.init_args.version", "0"], monkeypatch, capsys)
    assert code == 2 and "best_model_path=" in error_line(stderr)
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
        path, config = resumed(trained, tmp_path, lambda c, f: model_checkpoint_state(c).update(best_model_path=url))
        for subcommand in ("fit", "test"):
            code, stderr = cli([subcommand, "--config", str(config), "--ckpt_path", str(path)], monkeypatch, capsys)
            assert code == 2 and "a checkpoint's paths are local files of its run, never URLs" in error_line(stderr)
    finally:
        server.shutdown()
        server.server_close()
    assert Counting.requests == 0


def _set(keys: tuple, value):
    def edit(checkpoint, folder):
        target = checkpoint
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return edit


MODEL_CHECKPOINT = ("ModelCheckpoint{'monitor': 'val/acc', 'mode': 'max', 'every_n_train_steps': 0, "
                    "'every_n_epochs': 1, 'train_time_interval': None}")
RESUME_CASES = {
    "torch RNG state of the wrong size": (("callbacks", "RestoreRNGState", "torch"), torch.zeros(10, dtype=torch.uint8),
                                          "callbacks.RestoreRNGState.torch is a torch.uint8 tensor of shape (10,)"),
    "a negative data position": (("TwoCirclesDataModule", "train_position", "batches_done"), -1,
                                 "TwoCirclesDataModule.train_position="),
    "a string data position": (("TwoCirclesDataModule", "train_position", "epoch"), "one",
                               "TwoCirclesDataModule.train_position="),
    "loops of the wrong type": (("loops", "fit_loop", "epoch_progress", "total", "ready"), "4",
                                "loops.fit_loop.epoch_progress.total.ready='4' is not allowed"),
    "betas (5, 5)": (("optimizer_states", 0, "param_groups", 0, "betas"), (5, 5),
                     "optimizer_states[0].param_groups[0].betas=(5, 5) is not allowed: expected two numbers in [0, 1)"),
    "a moment of the wrong shape": (("optimizer_states", 0, "state", 0, "exp_avg"), torch.zeros(3),
                                    "optimizer_states[0].state.0.exp_avg is not a float tensor of its parameter's "
                                    "shape"),
    "a scheduler of the wrong type": (("lr_schedulers", 0, "last_epoch"), "x",
                                      "lr_schedulers[0].last_epoch='x' is not allowed"),
    # Found by benchmarks/fuzz_checkpoints.py: each raised in Lightning or the sampler once the run had started.
    "a data position past the end of the epoch": (
        ("TwoCirclesDataModule", "train_position", "batches_done"), 2**31,
        "train_position.batches_done=2147483648 is past the end of the epoch"),
    "a kth best path that is not a best path": (("callbacks", MODEL_CHECKPOINT, "kth_best_model_path"), "",
                                                "kth_best_model_path='' is not one of its best_k_models"),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_fit_refuses_a_malformed_trainer_state_before_the_run_folder_is_made(case, trained, tmp_path, monkeypatch,
                                                                            capsys):
    keys, value, expected = RESUME_CASES[case]
    path, config = resumed(trained, tmp_path, _set(keys, value))
    code, stderr = cli(["fit", "--config", str(config), "--ckpt_path", str(path)], monkeypatch, capsys)
    assert code == 2
    assert expected in error_line(stderr)
    assert not (tmp_path / "runs").exists()


def test_a_resumed_run_resumes_again_and_its_checkpoints_open(tmp_path, monkeypatch):
    """The checkpoints a resumed run writes record the backbone as the first run did, so they pass the same checks."""
    for epochs in (1, 2, 3):
        config = tiny_config(tmp_path, max_epochs=epochs)
        main_in_process(["fit", "--config", str(config), "--test_after_fit", "false",
                         *(["--ckpt_path", "last"] if epochs > 1 else [])], monkeypatch)
    last = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    assert checkpoint["epoch"] == 2
    assert checkpoint["hyper_parameters"]["backbone"]["class_path"] == "vit.models.VisionTransformer"
    main_in_process(["validate", "--config", str(config), "--ckpt_path", str(last)], monkeypatch)
    assert vit.load(last).class_names == ["not_diagonal", "diagonal"]


def test_a_schedule_stopped_during_warmup_resumes_and_only_its_not_started_counters_may_be_minus_one():
    from vit.models import VisionTransformer
    from vit.training.checkpoint.resume import _schedulers
    from vit.training.classifier import ImageClassifier, warmup_cosine_schedule

    model = ImageClassifier(VisionTransformer(img_size=8, patch_size=4, num_classes=2, embed_dim=8, depth=1,
                                              num_heads=1))
    schedule = warmup_cosine_schedule(model.optimizer(), warmup_steps=8, total_steps=20)
    for _ in range(3):  # preempted at step 3 of an 8-step warmup
        schedule.optimizer.step()
        schedule.step()
    state = schedule.state_dict()
    assert state["_schedulers"][1]["last_epoch"] == -1  # PyTorch's mark of the cosine not yet started
    _schedulers([state], model)
    state["_schedulers"][1]["last_epoch"] = -2
    with pytest.raises(CheckpointError, match=r"lr_schedulers\[0\]\._schedulers\[1\]\.last_epoch=-2 is not allowed: "
                                              r"expected an int >= -1"):
        _schedulers([state], model)
    state["_schedulers"][1]["last_epoch"], state["_schedulers"][0]["last_epoch"] = 0, -1
    with pytest.raises(CheckpointError, match=r"_schedulers\[0\]\.last_epoch=-1 is not allowed: expected an int >= 0"):
        _schedulers([state], model)
