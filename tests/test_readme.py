"""The README's Python example runs as written, and its install and test commands are the ones CI uses."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_example_runs():
    model, checkpoint = blocks("python")  # the second, on a trained checkpoint: tests/test_api.py runs it
    assert "vit.load(" in checkpoint
    exec(compile(model, "README.md", "exec"), {})  # its own asserts check the timm equality


def test_install_and_test_commands_are_what_ci_runs():
    commands = [line for block in blocks("bash") for line in block.splitlines()]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert 'pip install -e ".[dev]"' in commands and 'pip install -e ".[dev]"' in ci
    assert "pytest -n 2" in commands and "pytest -n 2" in ci


def test_relative_links_point_to_files():
    for page in [README, *sorted((README.parent / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
