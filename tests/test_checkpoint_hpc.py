"""Every checkpoint Lightning reads passes the project's reader, whichever way Lightning finds it.

A planted `hpc_ckpt_1.ckpt` in the working folder (Lightning's SLURM requeue checkpoint) whose `ModelCheckpoint`
state names files outside the run would have Lightning delete those files as the checkpoints rotate. It is given
to `fit` the three ways Lightning reaches it: `--ckpt_path hpc`, SLURM's environment with no `--ckpt_path`, and the
documented SLURM recipe `--ckpt_path last` on its first start. Each refuses in one line, exit 2, with the victim
files untouched. The reader behind Lightning (`AtomicCheckpointIO.load_checkpoint`) is tested apart: a path the CLI
never saw still comes back validated, with ModelCheckpoint's paths confined.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_doors import train_tiny
from robust_helpers import main_in_process, run_dirs

from vit.artifact.io import AtomicCheckpointIO
from vit.checks import CheckpointError

pytestmark = pytest.mark.slow  # a real train.py run makes the checkpoint the hostile one is made from

SLURM = {
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_ID": "1",
    "SLURM_NODELIST": "node1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}
PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    return train_tiny(tmp_path_factory.mktemp("trained"))


def plant(ckpt: Path, work: Path) -> list[Path]:
    """Write the hostile `work/hpc_ckpt_1.ckpt` (module doc) and the victims it points at; return the victims."""
    checkpoint = torch.load(ckpt, weights_only=True)
    next_run = work / "runs" / "tiny" / "version_0" / "checkpoints"  # where the next run writes (a fresh folder)
    victims = [work.parent / f"victim{i}.txt" for i in range(3)]
    for victim in victims:
        victim.write_text("precious")
    escape = "/".join([".."] * 5)  # from the checkpoint folder up past the working folder
    for key, state in checkpoint["callbacks"].items():
        if key.startswith("ModelCheckpoint{"):
            state["dirpath"] = str(next_run)
            score = torch.tensor(0.5)
            bad = [f"{next_run}/{escape}/{v.name}" for v in victims]
            state.update(
                best_model_path=bad[0],
                kth_best_model_path=bad[1],
                last_model_path=bad[2],
                best_k_models={bad[0]: score, bad[1]: score},
                best_model_score=score,
                kth_value=score,
            )
    torch.save(checkpoint, work / "hpc_ckpt_1.ckpt")
    return victims


@pytest.mark.parametrize("way", ["--ckpt_path hpc", "SLURM, no --ckpt_path", "SLURM, --ckpt_path last"])
def test_a_planted_hpc_checkpoint_touches_no_file_outside_the_run(way, trained, tmp_path, monkeypatch, capsys):
    ckpt, config = trained
    work = tmp_path / "work"
    work.mkdir()
    victims = plant(ckpt, work)
    monkeypatch.chdir(work)  # Lightning's default_root_dir, where it looks for hpc checkpoints
    args = [
        "fit",
        "--config",
        str(config),
        "--trainer.max_epochs",
        "3",
        "--test_after_fit",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(work / "runs"),
    ]
    if way.startswith("SLURM"):
        for name, value in SLURM.items():
            monkeypatch.setenv(name, value)
    if way.endswith("hpc"):
        args += ["--ckpt_path", "hpc"]
    elif way.endswith("last"):
        args += ["--ckpt_path", "last"]
    with pytest.raises(SystemExit) as exit:
        main_in_process(args, monkeypatch)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: checkpoint {work / 'hpc_ckpt_1.ckpt'}: callbacks.ModelCheckpoint")
    assert "which is not a checkpoint file of this run's" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert all(v.read_text() == "precious" for v in victims)


def test_hpc_and_best_name_a_file_or_say_why_not(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = trained
    monkeypatch.chdir(tmp_path)
    for value, line in (
        (
            "hpc",
            f"error: --ckpt_path hpc: there is no hpc_ckpt_N.ckpt in {tmp_path} "
            "(trainer.default_root_dir, where Lightning saves SLURM's requeue checkpoints)",
        ),
        (
            "best",
            "error: --ckpt_path best is the best checkpoint of a fit in the same process, and "
            "validate starts a new one: pass the checkpoint's file "
            "(runs/<name>/version_N/checkpoints/...)",
        ),
    ):
        with pytest.raises(SystemExit) as exit:
            main_in_process(["validate", "--config", str(config), "--ckpt_path", value], monkeypatch)
        assert exit.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == line


def test_validate_of_an_hpc_checkpoint_is_one_line_saying_what_to_do(trained, tmp_path, monkeypatch, capsys):
    ckpt, config = trained
    torch.save(torch.load(ckpt, weights_only=True), tmp_path / "hpc_ckpt_3.ckpt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main_in_process(["validate", "--config", str(config), "--ckpt_path", "hpc"], monkeypatch)
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # SLURM's requeue checkpoint has no model folder
    assert err.startswith(f"error: checkpoint {tmp_path / 'hpc_ckpt_3.ckpt'} has no model folder beside it")
    assert "python -m vit.upgrade --ckpt_path" in err


def test_the_reader_behind_lightning_confines_what_nobody_vouched_for(trained, tmp_path):
    ckpt, _ = trained
    work = tmp_path / "work"
    work.mkdir()
    plant(ckpt, work)
    loaded = AtomicCheckpointIO().load_checkpoint(work / "hpc_ckpt_1.ckpt")  # no run bound: no path survives
    states = [s for k, s in loaded["callbacks"].items() if k.startswith("ModelCheckpoint{")]
    assert states and all(s[p] == "" and s["best_k_models"] == {} for s in states for p in PATHS)
    io = AtomicCheckpointIO()
    [key] = [k for k in loaded["callbacks"] if k.startswith("ModelCheckpoint{")][:1]
    folder = (work / "runs" / "tiny" / "version_0" / "checkpoints").resolve()
    io.folders = lambda: {key: folder}  # the run's own folder: its paths are checked, not dropped
    with pytest.raises(CheckpointError, match="which is not a checkpoint file of this run's"):
        io.load_checkpoint(work / "hpc_ckpt_1.ckpt")


def test_slurms_requeue_of_a_real_hpc_checkpoint_continues_the_training(trained, tmp_path, monkeypatch):
    ckpt, config = trained
    monkeypatch.chdir(tmp_path)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    saved = torch.load(ckpt, weights_only=True)
    torch.save(saved, tmp_path / "hpc_ckpt_1.ckpt")
    main_in_process(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.max_epochs",
            "2",
            "--test_after_fit",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "runs"),
        ],
        monkeypatch,
    )
    (run,) = run_dirs(tmp_path)
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    steps_per_epoch = saved["global_step"] // (saved["epoch"] + 1)
    assert (last["epoch"], last["global_step"]) == (1, 2 * steps_per_epoch)
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["ckpt_path"] == str(tmp_path / "hpc_ckpt_1.ckpt")  # restored from it, not trained from scratch


def test_the_scores_of_a_model_checkpoint_state_are_numbers_lightning_can_compare(tmp_path):
    # Found by the fuzzer: a float8 score passed the reader, and Lightning's comparison with it failed mid-run.
    from vit.artifact.io import confine

    state = {
        "dirpath": str(tmp_path),
        "best_model_score": torch.tensor(0.5).to(torch.float8_e4m3fn),
        "best_k_models": {"": torch.tensor(0.25, dtype=torch.float64)},
        "kth_value": float("-inf"),
    }
    kept = confine(state, None, "callbacks.ModelCheckpoint")
    assert kept["best_model_score"].dtype == torch.float32 and float(kept["best_model_score"]) == 0.5
    assert kept["kth_value"] == float("-inf") and kept["best_k_models"] == {}  # another run's: its paths forgotten
    with pytest.raises(CheckpointError, match=r"callbacks.ModelCheckpoint.best_model_score: 'high' is not a score"):
        confine({**state, "best_model_score": "high"}, None, "callbacks.ModelCheckpoint")


def test_a_path_or_score_nested_too_deeply_to_print_is_refused_in_one_line(tmp_path):
    # Found by the fuzzer: the message quoting the value raised RecursionError instead.
    from vit.artifact.io import confine

    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for name in ("kth_best_model_path", "best_model_score"):
        state = {"dirpath": str(tmp_path), "best_k_models": {}, name: deep}
        with pytest.raises(CheckpointError, match=r"<a list nested too deeply to show>"):
            confine(state, tmp_path.resolve(), "callbacks.ModelCheckpoint")
