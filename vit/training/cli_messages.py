"""The command line's refusals in one line: an unknown option with the closest valid one, LightningCLI's optimizer
options with the model's, a config file that does not exist or sets an option the command does not have
(`ViTArgumentParser`, the parser `train.py` builds)."""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path
from typing import ClassVar

import yaml
from lightning.pytorch.cli import LightningArgumentParser


class ViTArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose refusal of an unknown option is one line naming the closest valid option, and of a
    config file that does not exist or sets an option the command does not have, one line naming the file."""

    configs: ClassVar[list[str]] = []  # the --config files of the command line being parsed (`ViTCLI.parse_arguments`)

    def error(self, message: str, ex: Exception | None = None):
        line = config_file_message(message, self.configs, self._all_options())
        if self.exit_on_error and line is not None:
            self.exit(2, f"error: {line}\n")
        prefix = "unrecognized arguments: "
        # jsonargparse's message lists every unknown token, values included: the options are those starting with -.
        unknown = [
            token.split("=", 1)[0]
            for token in message.removeprefix(prefix).split()
            if token.startswith("-") and token.lstrip("-")[:1].isalpha()
        ]
        if not (self.exit_on_error and message.startswith(prefix) and unknown):
            super().error(message, ex)  # every other message, and a parser nested in another, as jsonargparse does
        self.exit(2, f"error: {unknown_options_message(unknown, list(self._option_string_actions), self.prog)}\n")

    def _all_options(self) -> list[str]:
        """This parser's option strings and its subcommands' (a config file's keys are a subcommand's options)."""
        options = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # `choices`: argparse's map of subcommand parsers
                options += [o for sub in action.choices.values() for o in sub._option_string_actions]
        return options


def config_file_message(message: str, configs: list[str], options: list[str]) -> str | None:
    """One line for jsonargparse's refusal of a config file: one that does not exist, or a key in one that names no
    option (`Subcommand 'fit' does not accept option 'model.learning_rate'`), with the file and the closest option;
    None for any other message."""
    missing = re.search(r'Parser key "config":\s*File does not exist: (.+)', message)
    if missing:
        return f"--config {missing[1].strip().strip(chr(39))} does not exist"  # jsonargparse quotes the path
    refused = re.search(r"Subcommand '(\w+)' does not accept option '([^']+)'", message)
    if refused is None:
        return None
    subcommand, key = refused[1], refused[2]
    where = [path for path in configs if _sets(path, key.split("."))]
    close = difflib.get_close_matches(f"--{key}", options, n=1, cutoff=0.8)
    hint = f"; did you mean {close[0].removeprefix('--')}?" if close else "."
    files = f" (set in {', '.join(where)})" if where else ""
    return f"{key}{files} is not an option of {subcommand}{hint} `train.py {subcommand} --help` lists the options."


def _sets(path: str, keys: list[str]) -> bool:
    """Whether the YAML file `path` sets the nested key `keys` (`["model", "learning_rate"]`)."""
    try:
        node = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


# LightningCLI's optimizer options, which this CLI leaves out, and what to give instead.
LIGHTNING_OPTIMIZER_OPTIONS = {
    "--optimizer": "--optimizer is not an option here: the optimizer is --model.opt, by timm's name (adamw, sgd, "
    "lamb, ...), with --model.lr, --model.weight_decay and --model.betas.",
    "--lr_scheduler": "--lr_scheduler is not an option here: the schedule is a warmup and a cosine "
    "(--model.warmup_epochs, --model.min_lr_ratio), over each parameter group's own rate.",
}


def unknown_options_message(unknown: list[str], options: list[str], prog: str) -> str:
    """`unknown option --model.layer_decy; did you mean --model.layer_decay?`, a sentence per unknown option."""
    sentences = []
    for option in unknown:  # a high cutoff: the options of one group share their prefix (`--model.`)
        if option.split(".")[0] in LIGHTNING_OPTIMIZER_OPTIONS:
            sentences.append(LIGHTNING_OPTIMIZER_OPTIONS[option.split(".")[0]])
            continue
        # A prefix of one option (abbreviations are refused) names it; else the closest spelling.
        extended = sorted(o for o in options if o.startswith(option))
        close = extended[:1] if len(extended) == 1 else difflib.get_close_matches(option, options, n=1, cutoff=0.8)
        sentences.append(f"unknown option {option}" + (f"; did you mean {close[0]}?" if close else "."))
    if len(sentences) > 1 or not sentences[0].endswith("?"):
        sentences.append(f"`{prog.replace(' [options]', '')} --help` lists the options.")
    return " ".join(sentences)
