"""A mutated checkpoint is accepted or refused in one line by every door, and never does harm.

A real checkpoint (one epoch of the tiny two-circles run) is changed at one key path anywhere in it
(`tests/checkpoint_mutations.py`: every section down to each tensor; values of another type, huge
or negative numbers, NaN, class paths also as YAML, `..` paths, URLs, tensors of another shape,
dtype or layout, a list nested 5,000 deep; keys deleted or added), saved with `torch.save`, and
opened by a door:

- `vit.load(path)` returns a model that predicts, or raises `CheckpointError`: never another exception;
- `train.py validate|fit --ckpt_path path` runs (exit 0) or exits 2 with exactly one `error:` line:
  never a traceback;

and no door runs code the file names (no marker file) or touches a file beside its run folder (a
victim file and folder stay as they were). `fit` resumes the variant in its own run folder, so
`ModelCheckpoint`'s paths are checked, not only dropped.

A hostile `hpc_ckpt_1.ckpt` (Lightning's SLURM requeue checkpoint, planted in the working folder, its
`ModelCheckpoint` paths leading out of the run with `..` to the victims) is given to the reader behind Lightning,
`AtomicCheckpointIO().load_checkpoint`, and to `train.py fit --ckpt_path hpc`: refused in one line, or read
with no path outside the run left for Lightning to rotate away; the victims stay as they were.

`READABLE_VIT_FUZZ_EXAMPLES` sets the number of random variants for `vit.load` (default 40); the
`train.py` doors get 3/20 (validate) and 1/10 (fit) of it. `benchmarks/fuzz_checkpoints.py` runs the
same strategy for longer and summarises every outcome.
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
    Lazy,
    Mutation,
    Outcome,
    Site,
    Trained,
    mutations,
    notable_mutations,
    open_with_cli,
    open_with_load,
    train_checkpoint,
)
from checkpoint_mutations import _exit_outcome as exit_outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from robust_helpers import main_in_process

from vit.training.checkpoint import CheckpointError
from vit.training.checkpoint.io import AtomicCheckpointIO

LOAD_EXAMPLES = int(os.environ.get("READABLE_VIT_FUZZ_EXAMPLES", "40"))
VALIDATE_EXAMPLES = max(1, LOAD_EXAMPLES * 3 // 20)
FIT_EXAMPLES = max(1, LOAD_EXAMPLES // 10)

# Mutations that once escaped the checks as another exception than CheckpointError (the fuzzer found them), kept as
# fixed cases: `{name: (key path, what is put there, the door it broke, what raised)}`; `None` in a key path stands
# for any index.
TENSOR = Lazy("<tensor(2, 3)>", lambda: torch.ones(2, 3))
FOUND = {
    "schema_version": (("schema_version",), TENSOR, "load", "`version != SCHEMA_VERSION` on a tensor"),
    "python RNG version": (("callbacks", "RestoreRNGState", "python", 0), TENSOR, "load", "`python[0] == 3`"),
    "numpy has_gauss": (("callbacks", "RestoreRNGState", "numpy", "has_gauss"), TENSOR, "load",
                        "`numpy['has_gauss'] in (0, 1)`"),
    "optimizer params": (("optimizer_states", None, "param_groups", None, "params", None), TENSOR, "fit",
                         "`group['params'] != ref['params']`"),
    "optimizer foreach": (("optimizer_states", None, "param_groups", None, "foreach"), TENSOR, "fit",
                          "`group.get(name) not in (None, True, False)`"),
    "optimizer fused": (("optimizer_states", None, "param_groups", None, "fused"), TENSOR, "fit",
                        "`group.get(name) not in (None, True, False)`"),
    "lightning version not a version": (("pytorch-lightning_version",), "x", "validate",
                                        "Lightning's migration: `Version('x')` raised InvalidVersion"),
    "lightning version 1.0.0": (("pytorch-lightning_version",), "1.0.0", "validate",
                                "Lightning's migration of a pre-1.6 checkpoint raised KeyError"),
}


def fuzzing(examples: int):
    # The fixtures (the trained checkpoint, the site folder) are shared by every example on purpose: `Site.reset`
    # lays out a fresh run folder for each. No example database: nothing is written into the repository.
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


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
    return open_with_load(site) if door == "load" else open_with_cli(door, site)


def assert_accepted_or_refused(door: str, mutation: Mutation, trained: Trained, site: Site) -> Outcome:
    outcome = opened(door, mutation, trained, site)
    assert outcome.status in ("accepted", "refused"), f"{door}: {mutation!r}: {outcome.detail}"
    return outcome


@pytest.mark.parametrize("door", ["load", pytest.param("validate", marks=pytest.mark.slow),
                                  pytest.param("fit", marks=pytest.mark.slow)])
def test_the_unchanged_checkpoint_opens_through_each_door(door, trained, site):
    # Without this, a fuzz run whose base checkpoint were refused would test only the first check.
    site.reset(trained)
    site.write(trained.moved_to(site))
    outcome = open_with_load(site) if door == "load" else open_with_cli(door, site)
    assert outcome.status == "accepted", outcome.detail


@fuzzing(LOAD_EXAMPLES)
@given(data=st.data())
def test_vit_load_accepts_or_refuses_any_mutated_checkpoint(data, trained, site):
    mutation = data.draw(mutations(trained.moved_to(site), site), label="mutation")
    assert_accepted_or_refused("load", mutation, trained, site)


def test_vit_load_refuses_what_an_attacker_tries_first(trained, site):
    for mutation in notable_mutations(trained.moved_to(site), site):
        outcome = assert_accepted_or_refused("load", mutation, trained, site)
        # Each names a class, a size or a tensor the schema refuses; a path inside the run's folder is refused
        # only by `fit`, which alone compares the trainer state with its run.
        assert outcome.status == "refused" or "callbacks" in mutation.where, f"{mutation!r} was accepted"


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if door != "load" else [])
                                  for name, (_, _, door, _) in FOUND.items()])
def test_a_value_that_once_escaped_the_checks_is_refused_in_one_line(name, trained, site):
    pattern, example, door, _ = FOUND[name]
    path = tuple(0 if key is None else key for key in pattern)
    mutation = Mutation(path, ".".join(map(str, path)), "replace", example)
    assert opened(door, mutation, trained, site).status == "refused"


@pytest.mark.slow
@fuzzing(VALIDATE_EXAMPLES)
@given(data=st.data())
def test_train_py_validate_runs_or_refuses_any_mutated_checkpoint_in_one_line(data, trained, site):
    mutation = data.draw(mutations(trained.moved_to(site), site), label="mutation")
    assert_accepted_or_refused("validate", mutation, trained, site)


@pytest.mark.slow
@fuzzing(FIT_EXAMPLES)
@given(data=st.data())
def test_train_py_fit_resumes_or_refuses_any_mutated_checkpoint_in_one_line(data, trained, site):
    mutation = data.draw(mutations(trained.moved_to(site), site, weigh_trainer_state=True), label="mutation")
    assert_accepted_or_refused("fit", mutation, trained, site)


@pytest.mark.slow
def test_train_py_fit_refuses_what_an_attacker_tries_first(trained, site):
    for mutation in notable_mutations(trained.moved_to(site), site):
        outcome = assert_accepted_or_refused("fit", mutation, trained, site)
        # Every path here leaves the run's checkpoint folder or is a URL: `fit` must refuse, not drop, them.
        assert outcome.status == "refused", f"{mutation!r} was accepted"


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
            state.update(dict(zip(HPC_PATHS, bad, strict=True)), best_k_models={bad[0]: score, bad[1]: score},
                         best_model_score=score, kth_value=score)
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
        with (pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stderr(stderr),
              contextlib.redirect_stdout(io.StringIO())):
            try:
                main_in_process(["fit", "--config", str(site.config), "--ckpt_path", "hpc", "--test_after_fit",
                                 "false"], monkeypatch)
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
        assert "it must be a checkpoint file inside this run's checkpoint folder" in outcome.detail
