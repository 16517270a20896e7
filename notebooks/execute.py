"""Re-execute the notebooks in place, with their short CPU settings, so that GitHub shows what they print and draw.

    .venv/bin/python notebooks/execute.py                      # every notebook, one after the other
    .venv/bin/python notebooks/execute.py explain_methods      # one (the name, with or without .ipynb)

Each runs offline on the CPU in a kernel of this interpreter, with `SETTINGS` (the `VIT_NB_<NAME>` variables) and
figures at `DPI`; what would change from one run to the next without the code changing (execution timings, the
kernel's Python version) is left out, and the hash of the code cells is recorded in the notebook's metadata
(`METADATA_KEY`), so the tests can tell a notebook edited since it was run from one whose outputs are its code's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from ipykernel.kernelspec import write_kernel_spec
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent
COMMAND = "python notebooks/execute.py"
METADATA_KEY = "vit_execute"  # nb.metadata[METADATA_KEY] = {"code_sha256": ..., "settings": ...}
DPI = 72  # the figures' dots per inch: the largest figure, 6 x 5 panels, stays under 0.4 MB
TIMEOUT_S = 600  # per cell; the longest, a short training run, takes well under a minute
# The short CPU run of every notebook: the suite's settings (tests/conftest.py's `kernel_env`), no checkpoint, and a
# data folder that does not exist (relative to notebooks/, where a notebook runs), so the CIFAR one says it runs a demo.
SETTINGS = {"FAST": "1", "CHECKPOINT": "", "DATA_DIR": "no-cifar-here"}


def code_hash(nb: nbformat.NotebookNode) -> str:
    """The sha256 of the notebook's code cells' sources, in order: what its outputs depend on (markdown does not)."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode() + b"\0")
    return digest.hexdigest()


def kernel_env(workdir: Path, settings: dict[str, str] | None = None) -> dict[str, str]:
    """The kernel's environment: this one without any `VIT_NB_` variable of the caller's, plus `SETTINGS` (and the
    `settings` a test gives over them), this
    checkout on the path, one thread (the tests' count: a float sum's order, and so a trained model's digits, can
    depend on it), no network, figures at `DPI`."""
    (workdir / "matplotlibrc").write_text(f"figure.dpi: {DPI}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIT_NB_")}
    env.update({f"VIT_NB_{name}": value for name, value in {**SETTINGS, **(settings or {})}.items()})
    root = str(NOTEBOOKS.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", MATPLOTLIBRC=str(workdir))
    return env


def execute(path: Path, settings: dict[str, str] | None = None) -> nbformat.NotebookNode:
    """The notebook at `path` run top to bottom (stopping at the first error), stripped of what varies between runs
    and stamped with its code's hash; nothing is written. `settings` replace some of `SETTINGS` (a test's)."""
    if (NOTEBOOKS / SETTINGS["DATA_DIR"]).exists():
        raise FileExistsError(f"{NOTEBOOKS / SETTINGS['DATA_DIR']} exists; the CIFAR notebook's demo needs it absent")
    nb = nbformat.read(path, as_version=4)
    kept = {key: nb.metadata[key] for key in ("kernelspec", "language_info") if key in nb.metadata}
    with tempfile.TemporaryDirectory() as tmp:
        # A `python3` kernel spec for sys.executable, found first, so a user-wide spec for another Python cannot run.
        write_kernel_spec(path=os.path.join(tmp, "jupyter/kernels/python3"))
        saved = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.path.join(tmp, "jupyter")
        try:
            client = NotebookClient(
                nb,
                timeout=TIMEOUT_S,
                kernel_name="python3",
                record_timing=False,
                resources={"metadata": {"path": str(path.parent)}},
            )
            client.execute(env=kernel_env(Path(tmp), settings))
        finally:
            if saved is None:
                os.environ.pop("JUPYTER_PATH")
            else:
                os.environ["JUPYTER_PATH"] = saved
    nb.metadata.update(kept)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.outputs)
    nb.metadata[METADATA_KEY] = {"code_sha256": code_hash(nb), "settings": dict(SETTINGS), "command": COMMAND}
    return nb


def coalesce_streams(outputs: list) -> list:
    """`outputs` with each run of consecutive prints to one stream joined into one output, as Jupyter shows them: a
    table printed row by row between computations is then one block, and one diff hunk."""
    joined = []
    for output in outputs:
        previous = joined[-1] if joined else None
        if output.output_type == "stream" and previous and previous.get("name") == output.name:
            previous.text += output.text  # only streams have a name
        else:
            joined.append(output)
    return joined


def notebook_path(name: str) -> Path:
    """The notebook of notebooks/ that `name` names (with or without `.ipynb`), or a one-line error listing them."""
    path = NOTEBOOKS / (name if name.endswith(".ipynb") else f"{name}.ipynb")
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
        print(f"error: no notebook {name!r} in {NOTEBOOKS}; there are: {names}", file=sys.stderr)
        raise SystemExit(2)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks to run (default: all of notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = [notebook_path(n) for n in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"executing {path.name} ...", flush=True)
        try:
            nb = execute(path)
        except CellExecutionError as error:
            print(error, file=sys.stderr)  # the cell and its traceback
            print(f"error: {path.name} stopped with {error.ename}: {error.evalue}; the file is left as it was")
            return 1
        nbformat.validate(nb)
        nbformat.write(nb, path)  # only after the whole notebook ran: a failed run leaves the file as it was
        print(f"wrote {path.relative_to(NOTEBOOKS.parent)} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
