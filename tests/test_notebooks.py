"""The notebooks: committed without outputs, and executable top to bottom (short versions)."""

import math
import re

import nbformat
import pytest
from notebook_helpers import NOTEBOOKS, execute, noise_in

NAMES = [
    "attention_explained.ipynb",
    "attention_rollout_two_circles.ipynb",
    "attention_rollout_cifar.ipynb",
    "explain_methods.ipynb",
]


def test_the_notebooks_are_all_here():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs_and_with_a_parameters_cell(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    dirty = [i for i, cell in enumerate(code_cells) if cell.outputs or cell.execution_count is not None]
    assert dirty == [], f"{name}: code cells {dirty} have outputs or execution counts; clear them before committing"
    assert "parameters" in code_cells[0].metadata.get("tags", []), "the first code cell must be tagged `parameters`"
    assert nb.metadata.kernelspec.name == "python3"


def images_in(nb):
    return sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))


@pytest.mark.slow
def test_two_circles_notebook_runs_and_measures_shares(kernel_env):
    nb, printed = execute("attention_rollout_two_circles.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    text = "\n".join(printed)
    assert "trained 1 epochs on 512 images" in text
    assert images_in(nb) == 1  # the rollout grid
    # Off-diagonal quadrants: the area column is exactly half the grid for every row.
    quadrants = text.split("Top-right and bottom-left quadrants:")[1]
    rows = re.findall(r"(all|positives|negatives)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", quadrants)
    assert len(rows) == 9 and all(area == "0.500" for _, _, area, _ in rows)
    circles = text.split("Patches holding circle pixels:")[1].split("Top-right")[0]
    rows = re.findall(r"(all|positives|negatives)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", circles)
    assert len(rows) == 9
    for _, share, area, ratio in rows:
        assert 0 < float(area) < 1 and 0 < float(share) < 1
        assert float(ratio) == pytest.approx(float(share) / float(area), abs=0.02)


@pytest.mark.slow
def test_cifar_notebook_says_it_is_a_demo_and_runs_through(kernel_env):
    nb, printed = execute("attention_rollout_cifar.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    first_output = next(text for text in printed if text)
    assert first_output.startswith("DEMO model: no CHECKPOINT given")
    assert "DEMO images: cifar10 is not in" in first_output and "no-cifar-here" in first_output
    assert images_in(nb) == 2  # one image per class, and the class-mean maps per head fusion


@pytest.mark.slow
def test_explain_notebook_maps_every_method_and_scores_it(kernel_env):
    from vit.explain.relevance import METHODS

    nb, printed = execute("explain_methods.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    text = "\n".join(printed)
    assert "trained 2 epochs on 512 images of 'relative'" in text
    assert images_in(nb) == 1  # the images x methods grid
    rows = re.findall(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", text, flags=re.M)
    assert [r[0] for r in rows] == list(METHODS)
    for _, pointing, mass, ap, deletion, insertion in rows:
        assert all(0 <= float(v) <= 1 for v in (pointing, mass, ap, deletion, insertion))


@pytest.mark.slow
def test_attention_notebook_passes_its_checks_and_compares_every_score(kernel_env):
    from vit.models.scores import SCORES

    # Its claims are asserts in its cells: a false one stops the run with CellExecutionError.
    nb, printed = execute("attention_explained.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    text = "\n".join(printed)
    assert images_in(nb) == 12  # image, Q/K/V, scores 2, masks 2, heads 2, cross-attention, MAP, positions 2
    rows = re.findall(r"^(\w+)\s+([\d.]+)\s+([\d.]+)$", text, flags=re.M)  # score, max weight, entropy
    assert [r[0] for r in rows] == list(SCORES)
    entropy = {name: float(e) for name, _, e in rows}
    assert entropy["dot"] < entropy["scaled_dot"] == entropy["general"] < math.log(64)  # uniform over 64 patches
    assert "padding: weight on the 16 padding keys = 0.0" in text
    assert "attend [0.0, 0.0, 0.0]" in text  # the query with no key left: zeros, not NaN
