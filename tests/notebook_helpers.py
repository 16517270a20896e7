"""Running the notebooks in tests: `execute` one from `NOTEBOOKS`, in the kernel the `kernel_env` fixture sets up."""

from pathlib import Path

import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


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
