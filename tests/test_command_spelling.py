"""Every studies/benchmarks command takes its options spelt with underscores (as train.py and vit.predict) or with
dashes (as the studies' commands took them before), to the same namespace; the help shows underscores."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from vit.commands import EitherSpelling

# (module, how its command line is read: a main(argv), a main() over sys.argv, or a parser function)
COMMANDS = [
    ("studies.runner.__main__", "parse_args"),
    ("studies.arrangement.__main__", "main"),
    ("studies.arrangement.shortcuts", "main"),
    ("studies.relation.visibility", "main"),
    ("studies.relation.posthoc_visibility", "main"),
    ("studies.runner.attention_blocking", "main"),
    ("studies.runner.shortcuts", "main"),
    ("studies.position_scale", "main"),
    ("studies.recipe.screen", "main"),
    ("studies.explain.scores", "main"),
    ("benchmarks.attention_scores", "main"),
    ("benchmarks.compile_gain", "main"),
    ("benchmarks.data_pipeline", "main"),
    ("benchmarks.folder_start", "main"),
    ("benchmarks.fuzz_checkpoints", "main"),
    ("benchmarks.gpu_check", "main"),
    ("benchmarks.predict_vs_timm", "main"),
    ("benchmarks.relevance_cost", "main"),
    ("benchmarks.step_overhead", "main"),
    ("benchmarks.study_overhead", "main"),
    ("benchmarks.throughput", "main"),
]
ROOT = Path(__file__).resolve().parents[1]


class _Parser(Exception):
    """Raised where the command would parse its arguments, carrying its parser."""


def command_parser(module: str, entry: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `module`'s command builds, taken at the moment it would parse (nothing of the command runs)."""

    def caught(self, args=None, namespace=None):
        raise _Parser(self)

    monkeypatch.setattr(EitherSpelling, "parse_args", caught)
    monkeypatch.setattr(sys, "argv", [module])
    with pytest.raises(_Parser) as found:
        getattr(importlib.import_module(module), entry)()
    return found.value.args[0]


def sample(action: argparse.Action) -> list[str]:
    """A value for `action` other than its default: a choice, a number or a word."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [next((c for c in action.choices if c != action.default), list(action.choices)[0])]
    return {int: ["97"], float: ["0.625"]}.get(action.type, ["word"])


def test_the_files_listed_are_every_command_of_studies_and_benchmarks():
    # a new command that builds its own argparse parser would not take both spellings
    sources = [*ROOT.glob("studies/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    parsing = {p for p in sources if "ArgumentParser(" in p.read_text() or "EitherSpelling(" in p.read_text()}
    listed = {ROOT / (m.replace(".", "/") + ".py") for m, _ in COMMANDS}
    assert {p for p in parsing if "argparse.ArgumentParser(" in p.read_text()} == set()
    assert parsing <= listed


@pytest.mark.parametrize(("module", "entry"), COMMANDS, ids=[m for m, _ in COMMANDS])
def test_every_option_takes_both_spellings_to_the_same_namespace(module, entry, monkeypatch):
    parser = command_parser(module, entry, monkeypatch)
    assert isinstance(parser, EitherSpelling)
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    canonical, dashed = [], []
    for action in options:
        (name,) = action.option_strings  # one spelling registered: the help shows it alone
        assert "-" not in name[2:], f"{module}: {name} is spelt with dashes; the commands spell options with _"
        canonical += [name, *sample(action)]
        dashed += [name.replace("_", "-"), *sample(action)]
    parse = argparse.ArgumentParser.parse_args  # the real one
    given = parse(parser, canonical)
    assert parse(parser, dashed) == given
    for action in options:  # every value given was taken (not a default that happens to agree)
        assert getattr(given, action.dest) != action.default, action.option_strings
    shown = parser.format_help()
    for action in options:
        name = action.option_strings[0]
        assert name in shown and (name.replace("_", "-") == name or name.replace("_", "-") not in shown)


def test_runner_options_with_dashes_and_equals_and_after_a_double_dash():
    runner = importlib.import_module("studies.runner.__main__")
    dashed = runner.parse_args(["--config", "c.yaml", "--max-runs=3", "--timeout-min", "5", "--report-only"])
    plain = runner.parse_args(["--config", "c.yaml", "--max_runs=3", "--timeout_min", "5", "--report_only"])
    assert dashed == plain
    assert (plain.max_runs, plain.timeout_min, plain.report_only) == (3, 5, True)
    parser = EitherSpelling(prog="p")
    parser.add_argument("--num_train", type=int)
    parser.add_argument("rest", nargs="*")
    # after `--` every word is a value, kept as typed
    assert parser.parse_args(["--num-train", "4", "--", "--num-train"]) == argparse.Namespace(
        num_train=4, rest=["--num-train"]
    )


def test_a_refused_value_names_the_option_as_spelt_in_help(capsys):
    runner = importlib.import_module("studies.runner.__main__")
    with pytest.raises(SystemExit) as stop:
        runner.parse_args(["--config", "c.yaml", "--max-runs", "-1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m studies.runner: error: --max_runs=-1 is not allowed: expected an int >= 0"
    )
