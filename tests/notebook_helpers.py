"""Running the notebooks in tests: `execute` one from `NOTEBOOKS` as `notebooks/execute.py` runs it (the same settings,
kernel environment and figure size), and `problems` of a committed one: what says its outputs are not its code's."""

import nbformat

from notebooks.execute import COMMAND, METADATA_KEY, NOTEBOOKS, SETTINGS, code_hash
from notebooks.execute import execute as execute_notebook

# What the commands keep off the screen (vit.training.cli filters the same), and the notebooks do too: tqdm without
# ipywidgets, torch's LeafSpec deprecation inside Lightning, Lightning's litlogger tip and its `weights_only` default.
NOISE = ("TqdmWarning", "IProgress not found", "LeafSpec", "litlogger", "`weights_only` was not set")
MAX_BYTES = 1_500_000  # a committed notebook with its figures: GitHub renders it, a clone stays small


def execute(name, **settings):
    """Run a notebook top to bottom (`settings`: `VIT_NB_<NAME>` values over the standard ones); returns it and the
    text each code cell printed, in order."""
    nb = execute_notebook(NOTEBOOKS / name, settings)
    return nb, printed(nb)


def printed(nb):
    """The text each code cell printed to stdout, in order (one string per code cell)."""
    return [
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        for cell in nb.cells
        if cell.cell_type == "code"
    ]


def text_outputs(nb):
    """Per code cell, its outputs without their images: `(type, stream name, text)`; a figure's text is its size."""
    return [
        [(o.output_type, o.get("name", ""), o.get("text", "") or o.get("data", {}).get("text/plain", "")) for o in outs]
        for outs in (cell.outputs for cell in nb.cells if cell.cell_type == "code")
    ]


def structure(nb):
    """Per code cell, each output's type and kinds of data (`image/png`, `text/plain`), without the values."""
    return [
        [(o.output_type, o.get("name", ""), tuple(sorted(o.get("data", {})))) for o in cell.outputs]
        for cell in nb.cells
        if cell.cell_type == "code"
    ]


def problems(nb, name):
    """What says the committed notebook `name` is not `notebooks/execute.py`'s run of its current code, one line each
    (the first names the command that re-runs it); empty when there is none."""
    stem = name.removesuffix(".ipynb")
    stamp = nb.metadata.get(METADATA_KEY, {})
    if stamp.get("code_sha256") != code_hash(nb):
        why = "was never run by it" if not stamp else "has code edited since its outputs were written"
        return [f"{name} {why}: re-run it with `{COMMAND} {stem}` and commit the result"]
    found = []
    if stamp.get("settings") != SETTINGS:
        found.append(f"{name} was run with {stamp.get('settings')}, not {SETTINGS}: re-run `{COMMAND} {stem}`")
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    if counts != list(range(1, len(code) + 1)):
        found.append(f"{name}: execution counts {counts}, not one run top to bottom: re-run `{COMMAND} {stem}`")
    silent = [
        i for i, cell in enumerate(code) if not cell.outputs and "parameters" not in cell.metadata.get("tags", [])
    ]
    if silent:
        found.append(f"{name}: code cells {silent} have no output")
    for i, cell in enumerate(code):
        for o in cell.outputs:
            if o.output_type == "error":
                found.append(f"{name}: code cell {i} stopped with {o.ename}: {o.evalue}")
    return found


def noise_in(nb):
    """The lines of the executed notebook's outputs (printed, logged, warned or raised) that hold one of `NOISE`."""
    texts = [
        o.get("text", "") or "\n".join(o.get("traceback", [])) or o.get("data", {}).get("text/plain", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    ]
    return [line for text in texts for line in text.splitlines() if any(n in line for n in NOISE)]


def read(name):
    """The committed notebook `name` of `NOTEBOOKS`, checked against the notebook format."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    return nb
