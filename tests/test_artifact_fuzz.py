"""A mutated model folder is opened, or refused in one line, by `vit.load`; never worse.

Each variant (`tests/artifact_mutations.py`) changes one value of a tiny ViT's `config.json` at any key path, adds an
unknown key, or changes `model.safetensors` or `config.json` as a file (header, bytes, a FIFO or link in its place).
`vit.load(folder)` then one forward pass (and the model's test data module) must give finite logits of its classes or
one `ValueError` line; never another exception, a hang (`DOOR_SECONDS`), 1 GB more resident memory, a marker file of
code the folder named, or a file written beside it. `READABLE_VIT_FUZZ_EXAMPLES` sets the random variants (default
40); `benchmarks/fuzz_checkpoints.py --doors artifact` runs them for longer.
"""

from __future__ import annotations

import os

import pytest
from artifact_mutations import artifact_door, folder_variants, notable_folder_variants, reference_folder
from hypothesis import HealthCheck, given, settings
from input_mutations import opened

EXAMPLES = int(os.environ.get("READABLE_VIT_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifact_fuzz")
    reference_folder(root)
    return root


@pytest.mark.parametrize("variant", notable_folder_variants(), ids=repr)
def test_a_notable_hostile_model_folder_is_refused_or_harmless(variant, root):
    outcome = opened(artifact_door, variant, root / "variant")
    assert outcome.status != "failed", outcome.detail
    if variant.label == "as written":
        assert outcome.status == "accepted"


def test_random_hostile_model_folders_are_refused_or_harmless(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifact_fuzz_random")
    failures = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(folder_variants(reference_folder(root)))
    def one(variant) -> None:
        outcome = opened(artifact_door, variant, root / "variant")
        if outcome.status == "failed":
            failures.append(f"{variant!r}: {outcome.detail}")

    one()
    assert failures == []
