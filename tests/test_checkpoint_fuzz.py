"""A mutated trainer state is resumed or refused in one line, and never does harm.

A real checkpoint (one epoch of the tiny two-circles run) is changed at one key path anywhere in it
(`tests/checkpoint_mutations.py`: every section down to each tensor; values of another type, huge
or negative numbers, NaN, class paths also as YAML, `..` paths, URLs, tensors of another shape,
dtype or layout, a list nested 5,000 deep; keys deleted or added), saved with `torch.save` as the run's
`last.ckpt`, and opened by a door:

- the reader behind Lightning (`AtomicCheckpointIO.load_checkpoint`, bound to the run as `train.py` binds it)
  returns a dict whose `ModelCheckpoint` paths are all files of the run's checkpoint folder, or raises
  `CheckpointError`: never another exception;
- `train.py fit --ckpt_path path` runs (exit 0) or exits with exactly one `error:` line: never a traceback.

No door may create the marker file, touch the victims beside the run or request a URL. The inference doors read
the model folder beside the checkpoint, never the checkpoint: their fuzzing is `tests/test_artifact_fuzz.py`.

`READABLE_VIT_FUZZ_EXAMPLES` sets the number of random variants for the reader (default 40); `fit` gets 1/10 of it.
`benchmarks/fuzz_checkpoints.py` runs the same strategy for longer and summarises every outcome.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_mutations import (
    Mutation,
    Outcome,
    Site,
    Trained,
    mutations,
    notable_mutations,
    open_with_cli,
    open_with_reader,
    train_checkpoint,
)
from checkpoint_mutations import _exit_outcome as exit_outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from robust_helpers import main_in_process

from vit.artifact.io import AtomicCheckpointIO
from vit.checks import CheckpointError

READER_EXAMPLES = int(os.environ.get("READABLE_VIT_FUZZ_EXAMPLES", "40"))
FIT_EXAMPLES = max(1, READER_EXAMPLES // 10)


def fuzzing(examples: int):
    # The fixtures (the trained checkpoint, the site folder) are shared by every example on purpose: `Site.reset`
    # lays out a fresh run folder for each. No example database: nothing is written into the repository.
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    return train_checkpoint(tmp_path_factory.mktemp("fuzz_reference"))


@pytest.fixture
def site(tmp_path) -> Site:
    return Site.make(tmp_path / "site")


def opened(door: str, mutation: Mutation, trained: Trained, site: Site) -> Outcome:
    """What `door` does with the trained checkpoint changed by `mutation`."""
    site.reset(trained)
    site.write(mutation.apply(trained.moved_to(site)))
    return open_with_reader(site, trained) if door == "reader" else open_with_cli(door, site)


def assert_accepted_or_refused(door: str, mutation: Mutation, trained: Trained, site: Site) -> Outcome:
    outcome = opened(door, mutation, trained, site)
    assert outcome.status in ("accepted", "refused"), f"{door}: {mutation!r}: {outcome.detail}"
    return outcome


@pytest.mark.parametrize("door", ["reader", pytest.param("fit", marks=pytest.mark.slow)])
def test_the_unchanged_checkpoint_opens_through_each_door(door, trained, site):
    # Without this, a fuzz run whose base checkpoint were refused would test only the first check.
    site.reset(trained)
    site.write(trained.moved_to(site))
    outcome = open_with_reader(site, trained) if door == "reader" else open_with_cli(door, site)
    assert outcome.status == "accepted", outcome.detail


@fuzzing(READER_EXAMPLES)
@given(data=st.data())
def test_the_reader_accepts_or_refuses_any_mutated_checkpoint(data, trained, site):
    mutation = data.draw(mutations(trained.moved_to(site), site), label="mutation")
    assert_accepted_or_refused("reader", mutation, trained, site)


@pytest.mark.parametrize("door", ["reader", pytest.param("fit", marks=pytest.mark.slow)])
def test_what_an_attacker_tries_first_is_refused_or_harmless(door, trained, site):
    for mutation in notable_mutations(trained.moved_to(site), site):
        outcome = assert_accepted_or_refused(door, mutation, trained, site)
        # A path out of the run's checkpoint folder is refused, not dropped: the run it names is this one.
        if "ModelCheckpoint" in mutation.where and "dirpath" not in mutation.where:
            assert outcome.status == "refused", f"{door}: {mutation!r} was accepted"


@pytest.mark.slow
@fuzzing(FIT_EXAMPLES)
@given(data=st.data())
def test_train_py_fit_resumes_or_refuses_any_mutated_checkpoint_in_one_line(data, trained, site):
    mutation = data.draw(mutations(trained.moved_to(site), site, weigh_trainer_state=True), label="mutation")
    assert_accepted_or_refused("fit", mutation, trained, site)


HPC_PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


def plant_hpc(trained: Trained, site: Site) -> Path:
    """The hostile `hpc_ckpt_1.ckpt` (module doc) in the site's working folder, where Lightning looks for it; each
    `ModelCheckpoint` path climbs from the run's checkpoint folder to the victim file or into the victim folder."""
    site.reset(trained)
    # No run in the working folder yet: the next one is version_0, the folder the planted state names, so Lightning
    # would reload (and later rotate) every path in it rather than only best_model_path.
    shutil.rmtree(site.run / "runs")
    checkpoint = trained.moved_to(site)
    up = f"{site.checkpoint.parent}/../../../../.."  # the site's root, where the victims are
    bad = [f"{up}/victim", f"{up}/victim_dir/keep", f"{up}/victim"]
    score = torch.tensor(0.5)
    for key, state in checkpoint["callbacks"].items():
        if key.startswith("ModelCheckpoint{"):
            state.update(
                dict(zip(HPC_PATHS, bad, strict=True)),
                best_k_models={bad[0]: score, bad[1]: score},
                best_model_score=score,
                kth_value=score,
            )
    path = site.run / "hpc_ckpt_1.ckpt"
    torch.save(checkpoint, path)
    return path


def escaping_paths(checkpoint: dict, site: Site) -> list[str]:
    """The `ModelCheckpoint` paths of a loaded checkpoint that name a file outside the site's run folder."""
    found = []
    for key, state in checkpoint.get("callbacks", {}).items():
        if str(key).startswith("ModelCheckpoint{"):
            for path in [*(state.get(p) for p in HPC_PATHS), *state.get("best_k_models", {})]:
                if path and site.run.resolve() not in Path(path).resolve().parents:
                    found.append(f"{key}: {path}")
    return found


def open_hpc(door: str, site: Site) -> Outcome:
    """The planted checkpoint through `door`: `reader` (`AtomicCheckpointIO().load_checkpoint`, no run bound:
    accepted only with every path confined to the run) or `fit` (`train.py fit --ckpt_path hpc` in the working
    folder: exit 0, or exit 2 with one `error:` line); failed on any other exception or a victim touched."""
    with contextlib.chdir(site.run):
        if door == "reader":
            try:
                loaded = AtomicCheckpointIO().load_checkpoint(site.run / "hpc_ckpt_1.ckpt")
                escaping = escaping_paths(loaded, site)
                outcome = Outcome("failed", f"handed Lightning {escaping}") if escaping else Outcome("accepted")
            except CheckpointError as err:
                outcome = Outcome("refused", str(err))
            except Exception as err:  # noqa: BLE001  (the property: no other exception, whatever the file holds)
                outcome = Outcome("failed", f"{type(err).__name__}: {err}")
            return outcome.with_harm(site.harm())
        stderr = io.StringIO()
        with (
            pytest.MonkeyPatch.context() as monkeypatch,
            contextlib.redirect_stderr(stderr),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            try:
                main_in_process(
                    ["fit", "--config", str(site.config), "--ckpt_path", "hpc", "--test_after_fit", "false"],
                    monkeypatch,
                )
                code = 0
            except SystemExit as exit_info:
                code = exit_info.code
            except Exception as err:  # noqa: BLE001  (the property: no exception escapes the CLI)
                return Outcome("failed", f"{type(err).__name__}: {err}").with_harm(site.harm())
        return exit_outcome(code, stderr.getvalue()).with_harm(site.harm())


@pytest.mark.parametrize("door", ["reader", pytest.param("fit", marks=pytest.mark.slow)])
def test_a_planted_hpc_checkpoint_is_refused_or_harmless_and_the_victims_are_untouched(door, trained, site):
    plant_hpc(trained, site)
    outcome = open_hpc(door, site)
    assert outcome.status in ("accepted", "refused"), f"{door}: {outcome.detail}"
    if door == "fit":  # it alone knows the run: a path out of it is refused, not dropped
        assert outcome.status == "refused" and "callbacks." in outcome.detail, outcome.detail
        assert "which is not a checkpoint file of this run's" in outcome.detail
