"""Running the notebooks in tests: `execute` one from `NOTEBOOKS`, in the kernel the `kernel_env` fixture sets up."""

from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# What the commands keep off the screen (vit.training.cli filters the same), and the notebooks do too: tqdm without
# ipywidgets, torch's LeafSpec deprecation inside Lightning, Lightning's litlogger tip and its `weights_only` default.
NOISE = ("TqdmWarning", "IProgress not found", "LeafSpec", "litlogger", "`weights_only` was not set")


def execute(name):
    """Run a notebook top to bottom; returns the text each code cell printed, in order."""
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    printed = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            stdout = (o for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
            printed.append("".join(o.get("text", "") for o in stdout))
    return nb, printed


def noise_in(nb):
    """The lines of the executed notebook's outputs (printed, logged, warned or raised) that hold one of `NOISE`."""
    texts = [
        o.get("text", "") or "\n".join(o.get("traceback", [])) or o.get("data", {}).get("text/plain", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
    ]
    return [line for text in texts for line in text.splitlines() if any(n in line for n in NOISE)]
