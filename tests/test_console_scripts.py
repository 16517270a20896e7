"""The commands a `pip install .` puts on the PATH resolve to the project's entry points, and answer `--help` and a
mistyped command line at once, without importing torch, under the name they were run by."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def entry_points() -> dict[str, str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", ["vit-train", "vit-predict", "vit-evaluate", "vit-explain", "vit-export"])
def test_each_command_resolves_to_a_callable(name):
    module, _, function = entry_points()[name].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_vit_train_gives_the_shell_an_exit_status_not_the_cli_object(monkeypatch):
    # The script wrapper calls sys.exit(entry()): an object there would print itself and exit with 1.
    import vit.training.cli as cli

    seen = []
    monkeypatch.setattr(cli, "main", lambda args=None: seen.append(args) or object())
    assert entry_points()["vit-train"] == "vit.training.cli:script"
    assert cli.script(["fit", "--config", "x.yaml"]) == 0 and seen == [["fit", "--config", "x.yaml"]]


COMMANDS = {
    "vit-predict": "vit.predict",
    "vit-evaluate": "vit.evaluate",
    "vit-explain": "vit.explain.__main__",
    "vit-export": "vit.export",
}
HEAVY = ("torch", "lightning", "timm", "matplotlib")


def help_of(module: str, argv0: str, *args: str) -> subprocess.CompletedProcess:
    """`main(args)` of `module` in a fresh interpreter run as `argv0`; prints the heavy modules it imported."""
    code = (
        f"import sys; sys.argv = [{argv0!r}]\n"
        f"from {module} import main\n"
        f"try:\n    main({list(args)!r})\n"
        f"except SystemExit:\n    pass\n"
        f"print('imported:', [m for m in {HEAVY!r} if m in sys.modules])"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_loads_no_torch_names_the_program_and_shows_defaults_and_an_example(name):
    shown = help_of(COMMANDS[name], f"/somewhere/bin/{name}", "--help")
    assert shown.stdout.startswith(f"usage: {name} [-h] --ckpt_path")
    assert shown.stdout.rstrip().endswith("imported: []")
    assert "\nexample:\n    python -m vit." in shown.stdout and "--ckpt_path CKPT_PATH" in shown.stdout
    assert "(default: None)" not in shown.stdout
    module = COMMANDS[name].removesuffix(".__main__")
    assert help_of(COMMANDS[name], f"/src/{module.replace('.', '/')}.py", "--help").stdout.startswith(
        f"usage: python -m {module} [-h]"
    )


def test_defaults_appear_in_help_and_argument_errors_load_no_torch():
    assert "(default: 256)" in help_of("vit.predict", "vit-predict", "--help").stdout
    assert "(default: rollout,chefer,gradcam)" in help_of("vit.explain.__main__", "vit-explain", "--help").stdout
    wrong = help_of("vit.predict", "vit-predict", "--ckpt_path", "x.ckpt")
    assert "vit-predict: error: the following arguments are required: --input_dir, --output" in wrong.stderr
    assert wrong.stdout.strip() == "imported: []"
