"""Mutated copies of a real checkpoint, for the fuzz test of the doors that open one and for its longer run.

- `train_checkpoint` trains a tiny run once and returns its `last.ckpt` (`Trained`).
- `Site` is the folder one door is fuzzed in: a run folder the variants are written into, and beside
  it what a hostile value would aim at: a victim file, a victim folder, a YAML file that names
  `subprocess.Popen`, and the marker file that code run from a checkpoint would create.
- `mutations` is the hypothesis strategy: one key path anywhere in the checkpoint (every section, down
  to each tensor of `state_dict`), and at it a new value (another type, a huge or negative number, NaN,
  a class path, a `..` path, a URL, a tensor of another shape, dtype or layout, a list nested 5,000
  deep), the key deleted, or a key added beside it.
- `open_with_reader`, `open_with_load` and `open_with_cli` run one door on a written variant and sort what happened into
  accepted, refused (one `CheckpointError` line; exit 2 with one `error:` line) or failed (any other
  exception, a traceback, another exit code, a marker file, a victim touched).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import shutil
import signal
import sys
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from hypothesis import strategies as st
from robust_helpers import error_line, main_in_process, run_dirs, tiny_config

import vit
from vit.checks import CheckpointError

TRAINED_EPOCHS = 1  # the reference run; `fit` doors resume it for one epoch more
LOAD_SECONDS = 60  # `vit.load` of a tiny checkpoint takes ~20 ms: a minute means it hangs
CLI_SECONDS = 180  # `train.py fit` of one tiny epoch takes ~3 s
# What `fit` alone compares with its run (`resume.check_resume`) before Lightning restores it.
TRAINER_SECTIONS = (
    "loops",
    "callbacks",
    "callbacks.ModelCheckpoint",
    "callbacks.RestoreRNGState",
    "optimizer_states",
    "optimizer_states.param_groups",
    "optimizer_states.state",
    "lr_schedulers",
    "TwoCirclesDataModule",
    "epoch",
    "global_step",
)
LONG_LIST = 8  # a list longer than this (Python's RNG state: 625 words) offers only its first two and last items


# --- The reference checkpoint and the folder a door is fuzzed in -------------------------------------------


@dataclass(frozen=True)
class Trained:
    """A tiny run's `last.ckpt` (`checkpoint`, as `torch.load` reads it) and the run folder it was written in."""

    run_dir: Path
    checkpoint: dict = field(repr=False)  # hypothesis shows the fixtures of a failing example: not all 400 values

    @property
    def checkpoint_files(self) -> list[Path]:
        return sorted((self.run_dir / "checkpoints").glob("*.ckpt"))

    def moved_to(self, site: Site) -> dict:
        """The checkpoint as if its run had been written in `site`'s run folder: `ModelCheckpoint`'s paths name the
        site's files, so `fit` continues that run there and checks each path (not only drops them)."""
        old, new = str(self.run_dir), str(site.run_dir)

        def move(value: Any) -> Any:
            if isinstance(value, str):
                return value.replace(old, new)
            if isinstance(value, dict):
                return type(value)((move(k), move(v)) for k, v in value.items())
            return value

        return {**self.checkpoint, "callbacks": move(self.checkpoint["callbacks"])}


def train_checkpoint(root: Path) -> Trained:
    """Train the tiny two-circles run for one epoch in this process (~2 s) and return its `last.ckpt`."""
    config = tiny_config(root, max_epochs=TRAINED_EPOCHS)
    with pytest.MonkeyPatch.context() as monkeypatch:
        main_in_process(["fit", "--config", str(config), "--test_after_fit", "false"], monkeypatch)
    [run_dir] = run_dirs(root)
    return Trained(run_dir, torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True))


@dataclass(frozen=True)
class Site:
    """The folder one door is fuzzed in (module doc). `reset` lays out a fresh run folder for each variant."""

    root: Path

    run = property(lambda self: self.root / "run")  # the door's working folder: all it may write is in here
    run_dir = property(lambda self: self.run / "runs" / "tiny" / "version_0")
    checkpoint = property(lambda self: self.run_dir / "checkpoints" / "last.ckpt")  # where each variant is written
    config = property(lambda self: self.run / "tiny.yaml")
    marker = property(lambda self: self.root / "code_ran")
    victim = property(lambda self: self.root / "victim")
    victim_dir = property(lambda self: self.root / "victim_dir")
    popen_yaml = property(lambda self: self.root / "popen.yaml")

    @classmethod
    def make(cls, root: Path) -> Site:
        """The site at `root`, with its victims and the YAML file written (the run folder comes with `reset`)."""
        site = cls(root)
        site.victim_dir.mkdir(parents=True, exist_ok=True)
        site.victim.write_text("victim\n")
        (site.victim_dir / "keep").write_text("keep\n")
        site.popen_yaml.write_text(f"class_path: subprocess.Popen\ninit_args:\n  args: [touch, {site.marker}]\n")
        return site

    def reset(self, trained: Trained) -> None:
        """A fresh copy of the trained run's checkpoint folder (the files its `ModelCheckpoint` paths name) and a
        config that trains one epoch more than the checkpoint holds."""
        if self.run.exists():
            shutil.rmtree(self.run)
        shutil.copytree(trained.run_dir, self.run_dir)  # its config.yaml, checkpoints and model folders
        tiny_config(self.run, max_epochs=TRAINED_EPOCHS + 1)

    def write(self, checkpoint: dict) -> Path:
        """Save `checkpoint` as the run's `last.ckpt` (what `--ckpt_path` and `vit.load` are given)."""
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))  # pickling a list nested 5,000 deep recurses once per level
        try:
            torch.save(checkpoint, self.checkpoint)
        finally:
            sys.setrecursionlimit(limit)
        return self.checkpoint

    def harm(self) -> list[str]:
        """What a door did outside its run folder: a marker file, a victim changed or gone, a new file beside."""
        found = []
        if self.marker.exists():
            found.append(f"the marker {self.marker} exists: code named by the checkpoint ran")
        if not self.victim.is_file() or self.victim.read_text() != "victim\n":
            found.append(f"the victim file {self.victim} was changed or removed")
        if not (self.victim_dir / "keep").is_file() or (self.victim_dir / "keep").read_text() != "keep\n":
            found.append(f"the victim folder {self.victim_dir} was changed or removed")
        extra = sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []
        extra = [name for name in extra if name not in ("run", "victim", "victim_dir", "popen.yaml", "code_ran")]
        if extra:
            found.append(f"new files beside the run folder: {extra}")
        return found

    def strings(self) -> list[str]:
        """Strings a hostile checkpoint would hold: class paths (also as YAML), paths out of the run folder, URLs."""
        folder = self.checkpoint.parent
        return [
            f"{{class_path: subprocess.Popen, init_args: {{args: [touch, {self.marker}]}}}}",
            f"!!python/object/apply:os.system ['touch {self.marker}']",
            f"__import__('os').system('touch {self.marker}')",
            str(self.popen_yaml),
            self.popen_yaml.as_uri(),
            "subprocess.Popen",
            "os.system",
            "builtins.eval",
            "vit.models.VisionTransformer",
            "vit.models.vision_transformer.VisionTransformer",
            "vit.data.ImageFolderDataModule",
            "lightning.pytorch.cli.instantiate_module",
            "../victim",
            "../../../../victim",
            str(self.victim),
            str(self.victim_dir),
            "~/victim",
            "/",
            ".",
            f"{folder}/../../../../../victim",
            f"{folder}/../../../../../victim_dir",
            f"{folder}/../../../../..",
            str(self.run_dir),
            str(folder),
            "http://127.0.0.1:9/x.ckpt",
            "https://127.0.0.1:9/x.ckpt",
            "file:///etc/passwd",
            self.victim.as_uri(),
            "s3://bucket/x.ckpt",
            "last",
            "",
            "\0",
            "x" * 5000,
            "\udcff",
            "${HOME}",
            "%(name)s",
            "{}",
            "null",
            "RestoreRNGState",
            "ModelCheckpoint{}",
            "EarlyStopping{}",
            "kwargs",
        ]


# --- Mutations ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lazy:
    """A value made when a mutation is applied: shown by its `label` (a tensor or a 5,000-deep list repr badly)."""

    label: str
    make: Callable[[], Any] = field(compare=False)

    def __repr__(self) -> str:
        return self.label


@dataclass(frozen=True)
class Mutation:
    """One change to a checkpoint at key path `path` (shown as `where`): `value` replaces the value there, the
    key is deleted, `key: value` is added to the mapping there, or `value` appended to the list there."""

    path: tuple
    where: str
    action: Literal["replace", "delete", "add key", "append"]
    value: Any = None
    key: Any = None

    def __repr__(self) -> str:
        value = _shown(self.value)
        if self.action == "delete":
            return f"del {self.where}"
        if self.action == "add key":
            return f"{self.where}[{_shown(self.key)}] = {value} (added)"
        if self.action == "append":
            return f"{self.where} += [{value}]"
        return f"{self.where} = {value}"

    def apply(self, checkpoint: dict) -> dict:
        """A copy of `checkpoint` with this change; only the containers on the path are copied."""
        value = self.value.make() if isinstance(self.value, Lazy) else self.value
        return _edit(checkpoint, self.path, self.action, value, self.key)


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _edit(node: Any, path: tuple, action: str, value: Any, key: Any) -> Any:
    if not path:
        if action == "replace":
            return value
        if action == "add key":
            new = copy.copy(node)
            new[key] = value
            return new
        return type(node)([*node, value])
    head, rest = path[0], path[1:]
    if isinstance(node, dict):
        new = copy.copy(node)
        if action == "delete" and not rest:
            del new[head]
        else:
            new[head] = _edit(node[head], rest, action, value, key)
        return new
    items = list(node)
    if action == "delete" and not rest:
        del items[head]
    else:
        items[head] = _edit(node[head], rest, action, value, key)
    return type(node)(items)


def section(path: tuple) -> str:
    """The part of the checkpoint a key path is in: what the strategy draws first, so each part is tried as often."""
    if not path or path[0] in (
        "pytorch-lightning_version",
        "hparams_name",
        "datamodule_hparams_name",
        "schema_version",
    ):
        return "top level"
    if path[0] == "optimizer_states" and len(path) >= 3:
        return f"optimizer_states.{path[2]}"  # param_groups or state
    if path[0] == "callbacks" and len(path) >= 2:
        return "callbacks.ModelCheckpoint" if str(path[1]).startswith("ModelCheckpoint") else f"callbacks.{path[1]}"
    return str(path[0])


def key_paths(checkpoint: dict) -> dict[str, list[tuple[tuple, str]]]:
    """`{section: [(key path, shown path), ...]}` of every value in `checkpoint`, containers included."""
    found: dict[str, list[tuple[tuple, str]]] = {}
    stack: list[tuple[tuple, str, Any]] = [((), "checkpoint", checkpoint)]
    while stack:
        path, where, value = stack.pop()
        found.setdefault(section(path), []).append((path, where))
        if isinstance(value, dict):
            stack.extend(((*path, k), f"{where}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            indices = range(len(value)) if len(value) <= LONG_LIST else (0, 1, len(value) - 1)
            stack.extend(((*path, i), f"{where}[{i}]", value[i]) for i in indices)
    return {name: sorted(paths, key=lambda p: p[1]) for name, paths in found.items()}


def value_at(checkpoint: dict, path: tuple) -> Any:
    value = checkpoint
    for key in path:
        value = value[key]
    return value


def nested(kind: str, depth: int) -> Lazy:
    """A list (or dict, or tuple) nested `depth` deep: `torch.load` reads it; recursion over it would overflow."""

    def make():
        value: Any = []
        for _ in range(depth):
            value = {"x": value} if kind == "dict" else (value,) if kind == "tuple" else [value]
        return value

    return Lazy(f"<{kind} nested {depth} deep>", make)


def tensor_variants(original: torch.Tensor | None = None) -> list[Lazy]:
    """Tensors a checkpoint should not hold where `original` is: other shapes, dtypes, layouts, devices, values."""
    base = original if isinstance(original, torch.Tensor) else torch.ones(2, 3)
    shape = tuple(base.shape)
    real = base.float()
    variants = [
        (f"a {dtype} copy", lambda d=dtype: base.to(d))
        for dtype in (
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int64,
            torch.int8,
            torch.uint8,
            torch.bool,
            torch.complex64,
            torch.float8_e4m3fn,
        )
    ]
    variants += [
        (f"zeros{(*shape, 1)}", lambda: torch.zeros(*shape, 1)),
        (f"zeros{shape[:-1]}", lambda: torch.zeros(shape[:-1])),
        (f"zeros{tuple(s + 1 for s in shape)}", lambda: torch.zeros(tuple(s + 1 for s in shape))),
        ("flattened", lambda: base.reshape(-1)),
        ("a scalar tensor", lambda: torch.tensor(1.0)),
        ("an empty tensor (0,)", lambda: torch.empty(0)),
        ("zeros(0, 10**9)", lambda: torch.zeros(0, 10**9)),
        ("filled with nan", lambda: torch.full(shape, math.nan)),
        ("filled with inf", lambda: torch.full(shape, math.inf)),
        ("filled with -1e38", lambda: torch.full(shape, -1e38)),
        ("negated", lambda: -real),
        ("a non-contiguous view", lambda: torch.zeros(*shape, 2)[..., 0]),
        ("sparse COO", lambda: real.to_sparse() if real.dim() else torch.eye(3).to_sparse()),
        ("sparse CSR", lambda: torch.eye(3).to_sparse_csr()),
        ("a nested tensor", lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])),
        ("a meta tensor", lambda: torch.zeros(shape, device="meta")),
        ("quantized qint8", lambda: torch.quantize_per_tensor(real, 0.1, 0, torch.qint8)),
        ("an nn.Parameter", lambda: torch.nn.Parameter(real.clone())),
    ]
    return [Lazy(f"<tensor{shape}: {label}>", make) for label, make in variants]


ODD_INTS = [-1, -(2**63), 2**31, 2**53, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30)]
ODD_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324]
# Values `torch.load(weights_only=True)` reads that are not plain data (a frozenset or a slice it refuses itself).
ODD_OBJECTS = [
    b"bytes",
    bytearray(b"bytes"),
    {1, 2},
    frozenset({1}),
    1 + 2j,
    OrderedDict(a=1),
    torch.Size([2, 3]),
    torch.float32,
    torch.device("cpu"),
    slice(1, 2),
]
ODD_KEYS = [
    "extra",
    "class_path",
    "init_args",
    "_instantiator",
    "_class_path",
    "__class__",
    "",
    "a.b",
    0,
    -1,
    2**40,
    None,
    1.5,
    (1, 2),
    b"key",
    True,
    "MixedPrecision",
    "schema_version",
    "EarlyStopping{'monitor': 'x'}",
    "RestoreRNGState",
    "ModelCheckpoint{'monitor': None}",
    "cuda",
]


def hostile_values(site: Site) -> st.SearchStrategy:
    """Any value a checkpoint could hold: every type, odd numbers, hostile strings, tensors, deep nesting."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(ODD_INTS),
        st.floats(),
        st.sampled_from(ODD_FLOATS),
        st.text(max_size=12),
        st.sampled_from(site.strings()),
        st.sampled_from(ODD_OBJECTS),
    )
    keys = st.one_of(st.text(max_size=8), st.integers(), st.sampled_from(ODD_KEYS))
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(site.marker)]}}
    return st.one_of(
        scalars,
        st.sampled_from(tensor_variants()),
        st.recursive(
            scalars,
            lambda inner: (
                st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(keys, inner, max_size=3)
            ),
            max_leaves=6,
        ),
        st.just(popen),
        st.builds(nested, st.sampled_from(["list", "dict", "tuple"]), st.sampled_from([25, 5000])),
    )


def near_values(value: Any, site: Site) -> list:
    """Values close to `value` (one more, the other sign, another type of the same content): the ones that pass a
    type check and probe the checks of meaning."""
    if isinstance(value, bool):
        return [not value, int(value), str(value).lower(), None, [value]]
    if isinstance(value, int):
        return [
            value + 1,
            value - 1,
            -value,
            0,
            -1,
            value * 2,
            value * 1000,
            *ODD_INTS,
            float(value),
            str(value),
            True,
            None,
            [value],
            [value, value],
        ]
    if isinstance(value, float):
        return [-value, 0.0, value * 1e6, *ODD_FLOATS, int(value), str(value), None, [value]]
    if isinstance(value, str):
        return [
            "",
            value + "x",
            value.upper(),
            value * 2,
            value + "\0",
            f"{value}/../../../../victim",
            0,
            None,
            [value],
            {"class_path": value},
            *site.strings(),
        ]
    if value is None:
        return [0, -1, "", "null", "None", [], {}, False, 0.0, math.nan]
    if isinstance(value, (list, tuple)):
        other = tuple if isinstance(value, list) else list
        return [
            type(value)(),
            type(value)(value[:-1]),
            type(value)([*value, value[-1] if value else 0]),
            type(value)(reversed(value)),
            other(value),
            [value],
            {"0": value[0]} if value else {},
            None,
            str(value)[:100],
        ]
    if isinstance(value, dict):
        return [{}, list(value.values())[:3], {**value, "extra": 1}, None, str(list(value))[:100]]
    if isinstance(value, torch.Tensor):
        return tensor_variants(value)
    return [None]


def mutations(checkpoint: dict, site: Site, *, weigh_trainer_state: bool = False) -> st.SearchStrategy[Mutation]:
    """One `Mutation` of `checkpoint` (module doc): a section, a key path in it, then what is done there.

    With `weigh_trainer_state` the sections `fit` alone compares with its run (`TRAINER_SECTIONS`) are drawn twice
    as often.
    """
    places = key_paths(checkpoint)
    names = sorted(places) + (sorted(set(places) & set(TRAINER_SECTIONS)) if weigh_trainer_state else [])
    hostile = hostile_values(site)
    keys = st.one_of(st.sampled_from(ODD_KEYS), st.text(max_size=8))

    def at(place: tuple[tuple, str]) -> st.SearchStrategy[Mutation]:
        path, where = place
        value = value_at(checkpoint, path)
        choices = [
            st.builds(Mutation, st.just(path), st.just(where), st.just("replace"), hostile),
            st.builds(
                Mutation, st.just(path), st.just(where), st.just("replace"), st.sampled_from(near_values(value, site))
            ),
        ]
        if path:
            choices.append(st.just(Mutation(path, where, "delete")))
        if isinstance(value, dict):
            choices.append(st.builds(Mutation, st.just(path), st.just(where), st.just("add key"), hostile, keys))
        elif isinstance(value, (list, tuple)):
            choices.append(st.builds(Mutation, st.just(path), st.just(where), st.just("append"), hostile))
        return st.one_of(choices)

    return st.sampled_from(names).flatmap(lambda name: st.sampled_from(places[name])).flatmap(at)


def notable_mutations(checkpoint: dict, site: Site) -> list[Mutation]:
    """The mutations an attacker would try first, tried on every run (a random draw may miss them)."""
    model_checkpoint = next(k for k in checkpoint["callbacks"] if k.startswith("ModelCheckpoint") and "val/acc" in k)
    mc = ("callbacks", model_checkpoint)
    mc_where = f"callbacks.{model_checkpoint}"
    escape = f"{site.checkpoint.parent}/../../../../../victim"
    popen = {"class_path": "subprocess.Popen", "init_args": {"args": ["touch", str(site.marker)]}}
    return [
        Mutation(("hyper_parameters", "backbone"), "hyper_parameters.backbone", "replace", popen),
        Mutation(
            ("hyper_parameters", "backbone", "class_path"),
            "hyper_parameters.backbone.class_path",
            "replace",
            f"{{class_path: subprocess.Popen, init_args: {{args: [touch, {site.marker}]}}}}",
        ),
        Mutation(
            ("hyper_parameters", "backbone", "class_path"),
            "hyper_parameters.backbone.class_path",
            "replace",
            str(site.popen_yaml),
        ),
        Mutation(
            ("hyper_parameters", "backbone", "class_path"),
            "hyper_parameters.backbone.class_path",
            "replace",
            "os.system",
        ),
        Mutation(("hyper_parameters", "_instantiator"), "hyper_parameters._instantiator", "replace", "os.system"),
        Mutation(
            ("datamodule_hyper_parameters", "_class_path"),
            "datamodule_hyper_parameters._class_path",
            "replace",
            "subprocess.Popen",
        ),
        Mutation(
            ("hyper_parameters", "backbone", "init_args", "num_heads"),
            "hyper_parameters.backbone.init_args.num_heads",
            "replace",
            0,
        ),
        Mutation(("inputs", "img_size"), "inputs.img_size", "replace", [2**53, 2**53]),
        Mutation(("class_names",), "class_names", "replace", nested("list", 5000)),
        *(
            Mutation(("state_dict", "backbone.head.weight"), "state_dict.backbone.head.weight", "replace", variant)
            for variant in tensor_variants(checkpoint["state_dict"]["backbone.head.weight"])
            if variant.label.endswith(("sparse COO>", "a nested tensor>", "a meta tensor>", "float8_e4m3fn copy>"))
        ),
        Mutation((*mc, "best_model_path"), f"{mc_where}.best_model_path", "replace", escape),
        Mutation((*mc, "kth_best_model_path"), f"{mc_where}.kth_best_model_path", "replace", str(site.victim)),
        Mutation((*mc, "best_k_models"), f"{mc_where}.best_k_models", "add key", torch.tensor(-1.0), escape),
        Mutation((*mc, "last_model_path"), f"{mc_where}.last_model_path", "replace", "../victim"),
        Mutation((*mc, "dirpath"), f"{mc_where}.dirpath", "replace", "http://127.0.0.1:9/x.ckpt"),
    ]


# --- The doors ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one door did with one variant: `accepted`, `refused` (`detail`: its one line) or `failed` (`detail`:
    the exception and the end of its traceback, the exit code and stderr, or the harm done)."""

    status: Literal["accepted", "refused", "failed"]
    detail: str = ""

    def with_harm(self, harm: list[str]) -> Outcome:
        return (
            Outcome("failed", "; ".join(harm) + (f" ({self.status}: {self.detail})" if self.detail else ""))
            if harm
            else self
        )


class Hung(Exception):
    """A door still running after its deadline."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise `Hung` in this (the main) thread after `seconds`: a door that never returns is a failure, not a stall."""

    def stop(signum, frame):
        raise Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _traceback_tail(lines: int = 6) -> str:
    """The last `lines` lines of the traceback being handled, on one line (the `^^^` markers left out)."""
    text = [line.strip() for line in traceback.format_exc().strip().splitlines() if line.strip(" ^~")]
    return " | ".join(text[-lines:])


def open_with_load(site: Site) -> Outcome:
    """`vit.load` of the site's variant, then one prediction of an accepted model: accepted, refused with a
    `CheckpointError`, or failed (another exception; harm outside the run folder)."""
    with contextlib.chdir(site.run):  # a relative path in the checkpoint resolves beside the victims
        try:
            with deadline(LOAD_SECONDS):
                predictor = vit.load(site.checkpoint)
                inputs = predictor.inputs
                probabilities = predictor.probabilities(torch.zeros(1, inputs["in_chans"], *inputs["img_size"]))
            outcome = Outcome("accepted", f"probabilities of shape {tuple(probabilities.shape)}")
        except CheckpointError as err:
            outcome = Outcome("refused", str(err))
        except Exception as err:  # noqa: BLE001  (the property: no other exception, whatever the file holds)
            outcome = Outcome("failed", f"{type(err).__name__}: {_shown(str(err), 300)} | {_traceback_tail()}")
    return outcome.with_harm(site.harm())


def open_with_reader(site: Site, trained: Trained) -> Outcome:
    """The reader behind Lightning (`AtomicCheckpointIO.load_checkpoint`) bound to the site's run, as `train.py`
    binds it (the run's `ModelCheckpoint`s: the trained checkpoint's, whatever the variant holds): accepted (with
    every `ModelCheckpoint` path a file of the run's checkpoint folder, or forgotten),
    refused with a `CheckpointError`, or failed (another exception, a path out of the run; harm outside the run)."""
    from vit.artifact.io import PATHS, AtomicCheckpointIO

    reader = AtomicCheckpointIO()
    folder = site.checkpoint.parent.resolve()
    keys = [key for key in trained.checkpoint["callbacks"] if key.startswith("ModelCheckpoint")]
    reader.folders = lambda: dict.fromkeys(keys, folder)
    with contextlib.chdir(site.run):
        try:
            with deadline(LOAD_SECONDS):
                loaded = reader.load_checkpoint(site.checkpoint)
            escaping = [
                path
                for key, state in (loaded.get("callbacks") or {}).items()
                if str(key).startswith("ModelCheckpoint")
                for path in [*(state.get(p) for p in PATHS), *state.get("best_k_models", {})]
                if path and folder not in Path(path).resolve().parents
            ]
            outcome = Outcome("failed", f"handed Lightning {escaping}") if escaping else Outcome("accepted")
        except CheckpointError as err:
            outcome = Outcome("refused", str(err))
        except Exception as err:  # noqa: BLE001  (the property: no other exception, whatever the file holds)
            outcome = Outcome("failed", f"{type(err).__name__}: {_shown(str(err), 300)} | {_traceback_tail()}")
    return outcome.with_harm(site.harm())


def open_with_cli(subcommand: Literal["validate", "fit"], site: Site) -> Outcome:
    """`train.py SUBCOMMAND --config <site config> --ckpt_path <the variant>` in this process (`fit` for the one
    epoch more the site's config allows): accepted (it ran; exit 0), refused (exit 2 and exactly one `error:`
    line, no traceback), or failed (an exception, another exit, a traceback printed; harm outside the run folder)."""
    args = [subcommand, "--config", str(site.config), "--ckpt_path", str(site.checkpoint)]
    if subcommand == "fit":
        args += ["--test_after_fit", "false"]
    stderr = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        contextlib.chdir(site.run),
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            with deadline(CLI_SECONDS):
                main_in_process(args, monkeypatch)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        except Exception as err:  # noqa: BLE001  (the property: no exception escapes the CLI)
            return Outcome("failed", f"{type(err).__name__}: {_shown(str(err), 300)} | {_traceback_tail()}").with_harm(
                site.harm()
            )
    return _exit_outcome(code, stderr.getvalue()).with_harm(site.harm())


def _exit_outcome(code: Any, stderr: str) -> Outcome:
    tail = " | ".join(stderr.strip().splitlines()[-8:])
    if "Traceback" in stderr:
        return Outcome("failed", f"exit {code} with a traceback: {tail}")
    if code in (0, None):  # SystemExit() is a success
        return Outcome("accepted")
    try:
        line = error_line(stderr)
    except (AssertionError, ValueError):
        return Outcome("failed", f"exit {code} without exactly one error: line: {tail}")
    if code == 1 and ("holds NaN or infinite values at training step" in line or " is nan at training step" in line):
        # A finite but corrupt optimizer state (exp_avg of -1e38) is no value to refuse on its own: the run diverges
        # and the guard stops it in one line before a checkpoint is overwritten. Refused, during the run.
        return Outcome("refused", f"during the run: {line}")
    if code != 2:
        return Outcome("failed", f"exit {code} (not 2): {line}")
    return Outcome("refused", line)
