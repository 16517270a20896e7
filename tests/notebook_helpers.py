"""Running the notebooks in tests: a kernel of this interpreter and checkout (`kernel_env`), and `execute`."""

import os
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """Run kernels with this interpreter and this checkout, small settings, and no real data."""
    from ipykernel.kernelspec import write_kernel_spec

    # A `python3` kernel spec pointing at sys.executable, found first through JUPYTER_PATH, so a
    # user-wide spec for another Python cannot take over.
    write_kernel_spec(path=str(tmp_path / "jupyter/kernels/python3"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    root = str(NOTEBOOKS.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("VIT_NB_FAST", "1")
    monkeypatch.setenv("VIT_NB_CHECKPOINT", "")
    monkeypatch.setenv("VIT_NB_DATA_DIR", str(tmp_path / "no-cifar-here"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: threads only add overhead


def execute(name):
    """Run a notebook top to bottom; returns the text each code cell printed, in order."""
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    printed = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            printed.append("".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"))
    return nb, printed
