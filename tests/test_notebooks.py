"""The notebooks: committed with the outputs of `notebooks/execute.py` for their current code, and executable top to
bottom (short versions), their outputs the committed ones."""

import math
import re

import nbformat
import pytest
from notebook_helpers import MAX_BYTES, NOTEBOOKS, execute, noise_in, problems, read, structure, text_outputs

NAMES = [
    "attention_explained.ipynb",
    "attention_rollout_two_circles.ipynb",
    "attention_rollout_cifar.ipynb",
    "explain_methods.ipynb",
    "folder_to_explain.ipynb",
]


def test_the_notebooks_are_all_here():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_as_the_script_ran_its_current_code(name):
    nb = read(name)
    assert problems(nb, name) == []
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# "), "a title first"
    assert "parameters" in code_cells[0].metadata.get("tags", []), "the first code cell must be tagged `parameters`"
    assert nb.metadata.kernelspec.name == "python3"
    assert noise_in(nb) == []  # no warning the commands hide
    assert (NOTEBOOKS / name).stat().st_size < MAX_BYTES
    assert all("execution" not in cell.metadata for cell in code_cells)  # no timings: a re-run diffs cleanly


def test_a_notebook_edited_after_its_run_is_named_with_the_command_that_reruns_it():
    nb = read("explain_methods.ipynb")
    assert problems(nb, "explain_methods.ipynb") == []
    next(cell for cell in nb.cells if cell.cell_type == "code" and "TASK" in cell.source).source += "\nTASK = 'other'"
    assert problems(nb, "explain_methods.ipynb") == [
        "explain_methods.ipynb has code edited since its outputs were written: "
        "re-run it with `python notebooks/execute.py explain_methods` and commit the result"
    ]
    del nb.metadata["vit_execute"]
    assert problems(nb, "explain_methods.ipynb")[0].startswith("explain_methods.ipynb was never run by it: re-run")


def test_a_notebook_that_stopped_or_printed_nothing_is_named_with_its_cell():
    nb = read("attention_rollout_cifar.ipynb")
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    code_cells[1].outputs = [nbformat.v4.new_output("error", ename="KeyError", evalue="'x'", traceback=[])]
    code_cells[2].outputs = []
    assert problems(nb, "attention_rollout_cifar.ipynb") == [
        "attention_rollout_cifar.ipynb: code cells [2] have no output",
        "attention_rollout_cifar.ipynb: code cell 1 stopped with KeyError: 'x'",
    ]


# The notebooks that train compare with the committed run by structure (cell by cell, each output's kind) and
# not by value: a few float32 steps of training give numbers that differ in the last digits across CPUs and thread
# counts, and the printed ones would follow. `attention_explained` trains nothing and compares by text.


def images_in(nb):
    return sum("image/png" in o.get("data", {}) for cell in nb.cells for o in cell.get("outputs", []))


@pytest.mark.slow
def test_two_circles_notebook_runs_and_measures_shares(kernel_env):
    nb, printed = execute("attention_rollout_two_circles.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    text = "\n".join(printed)
    assert "trained 1 epochs on 512 images" in text
    assert images_in(nb) == 1  # the rollout grid
    # The committed run's outputs, cell by cell (by structure: see above).
    assert structure(nb) == structure(read("attention_rollout_two_circles.ipynb"))
    accuracy = float(re.search(r"test accuracy on 64 images: ([\d.]+)", text)[1])
    assert ("The model has not learned the task" in text) == (accuracy < 0.9)
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
    assert structure(nb) == structure(read("attention_rollout_cifar.ipynb"))


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
    # The note under the table, from its numbers: every AUC within 0.02 of random's (to the 3 decimals printed).
    random_auc = [float(v) for v in rows[-1][4:]]
    gap = max(abs(float(v) - r) for row in rows for v, r in zip(row[4:], random_auc))
    if "Too short to read" in text:
        assert gap <= 0.02 + 0.001, gap  # each printed AUC is within 0.0005 of the one the note read
    else:
        assert gap >= 0.02 - 0.001, gap
    assert structure(nb) == structure(read("explain_methods.ipynb"))


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
    # Untrained and seeded, it prints the same numbers and figure sizes as the committed run: the outputs GitHub
    # shows are this code's (the figures' bytes are left out: a matplotlib release may draw them differently).
    assert text_outputs(nb) == text_outputs(read("attention_explained.ipynb"))


@pytest.mark.slow
def test_folder_notebook_trains_from_the_command_line_and_explains_test_images(kernel_env):
    nb, printed = execute("folder_to_explain.ipynb")
    assert noise_in(nb) == []  # no warning the commands hide
    text = "\n".join(printed)
    assert "python train.py fit --config configs/folder/finetune_vit.yaml --data.root $WORK/my_images" in text
    assert "/tmp" not in text and "folder_to_explain_" not in text  # the temporary folder is shown as $WORK
    accuracy = re.search(r"^test/acc = ([\d.]+) on 100 images", text, flags=re.M)  # a fifth of 2 x 250, best checkpoint
    assert float(accuracy[1]) >= 0.9  # the stripes are learned: the maps below are a trained model's
    names = "(horizontal|vertical)"
    rows = re.findall(rf"^{names}/\d{{3}}\.png: {names} ([\d.]+), {names} ([\d.]+)$", text, flags=re.M)
    assert len(rows) == 6  # NUM_SHOWN test images, their two classes by name, best first
    for _, first, p1, second, p2 in rows:
        assert {first, second} == {"horizontal", "vertical"} and float(p1) >= float(p2)
        assert float(p1) + float(p2) == pytest.approx(1.0, abs=0.002)
    area = float(re.search(r"\(mean area ([\d.]+)\)", text)[1])
    shares = dict(re.findall(r"^(\w+) +([\d.]+)  share > area", text, flags=re.M))
    assert list(shares) == ["rollout", "chefer", "gradcam", "random"]
    assert float(shares["rollout"]) > 1.5 * area  # the trained model's rollout finds the stripes ...
    assert float(shares["random"]) < 1.2 * area  # ... where a random map gets about their area
    assert images_in(nb) == 2  # the images drawn, and the images x methods grid
    assert structure(nb) == structure(read("folder_to_explain.ipynb"))
