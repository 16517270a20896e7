"""The study's config file read and checked (`load_config`): every error names the key, the value and what is
allowed; the tasks it can name (`TASK_DATA`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import yaml

from studies.runner import arrangement
from vit.checks import check_choice
from vit.data import same_different, two_circles
from vit.signatures import PLAIN
from vit.training.run_lock import printable

# Every task the study can run: its data module and the placement regions it knows.
TASK_DATA = {
    **{task: ("vit.data.TwoCirclesDataModule", two_circles.REGIONS) for task in two_circles.TASKS},
    "same_different": ("vit.data.SameDifferentDataModule", get_args(same_different.Region)),
    "arrangement": ("studies.runner.arrangement.ArrangementDataModule", get_args(arrangement.Region)),
}
# The value of a data option (an experiment's ``data``): a plain scalar, checked by the data module itself.
# A model or experiment name: part of each run's key, which names its folder under log_dir and its file names.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


CALIBRATE = "calibrate"  # the experiment name of the learning-rate calibration runs


def _require(cfg: dict, name: str, kind: type, where: str):
    if name not in cfg:
        raise ValueError(f"{where}: missing required key {name!r}")
    value = cfg[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{where}: {name}={value!r} is not allowed: expected {names}")
    return value


def _check_name(where: str, key: str, value: object, *, dash: bool = True) -> None:
    """Raise unless ``value`` is a plain name (`NAME`; with a ``-`` only if ``dash``): no ``/``, ``..`` or hidden
    name, so that ``<log_dir>/<run key>`` stays inside ``log_dir``."""
    if not isinstance(value, str) or not NAME.fullmatch(value) or (not dash and "-" in value):
        allowed = "letters, digits, '_', '.'" + (", '-'" if dash else "")
        raise ValueError(
            f"{where}: {key}={value!r} is not allowed: expected a plain name of {allowed}, not starting with '.'"
        )


def load_config(path: str | Path) -> dict:
    """Read and check a study config; errors name the key, the value and what is allowed."""
    cfg, where = _read_config(Path(path))
    _check_settings(cfg, where)
    models = _check_models(cfg, where)
    _check_experiments(cfg, models, where)
    _check_calibration(cfg, where)
    _check_comparisons(cfg, where)
    _check_shortcuts(cfg, where)
    return cfg


def _read_config(path: Path) -> tuple[dict, str]:
    """The config file's top-level mapping and the file's name as messages show it."""
    if path.is_dir():
        raise ValueError(f"study config {str(path)!r} is a folder, not a YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"study config {str(path)!r} does not exist")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"study config {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
    where = printable(path)  # a name's escape sequences would reach the terminal
    if not isinstance(cfg, dict):
        got = "an empty file" if cfg is None else type(cfg).__name__
        raise ValueError(f"{where}: expected a mapping at the top level, got {got}")
    return cfg, where


def _check_settings(cfg: dict, where: str) -> None:
    """Check the top-level keys, the paths, the seeds and the scalar settings."""
    allowed = {
        "base_config",
        "out_dir",
        "log_dir",
        "seeds",
        "batch_size",
        "train_samples",
        "num_val_checks",
        "num_val",
        "num_test",
        "threads",
        "warmup_fraction",
        "models",
        "experiments",
        "families",
        "calibration",
        "lrs",
        "shortcuts",
        "comparisons",
    }
    unknown = set(cfg) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    base = Path(_require(cfg, "base_config", str, where))
    if not base.is_file():
        raise FileNotFoundError(f"{where}: base_config {str(base)!r} does not exist")
    _require(cfg, "out_dir", str, where)
    _require(cfg, "log_dir", str, where)
    seeds = _require(cfg, "seeds", list, where)
    if not seeds or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in seeds):
        raise ValueError(f"{where}: seeds={seeds!r} is not allowed: expected a non-empty list of ints >= 0")
    for name in ("batch_size", "train_samples", "num_val_checks", "num_val", "num_test", "threads"):
        if _require(cfg, name, int, where) < 1:
            raise ValueError(f"{where}: {name}={cfg[name]!r} is not allowed: expected an int >= 1")
    warmup = _require(cfg, "warmup_fraction", (int, float), where)
    if not 0 <= warmup <= 1:
        raise ValueError(f"{where}: warmup_fraction={warmup!r} is not allowed: expected a float in [0, 1]")


def _check_models(cfg: dict, where: str) -> dict:
    """Check ``models`` (name -> backbone mapping) and return it."""
    models = _require(cfg, "models", dict, where)
    for name, model in models.items():
        _check_name(where, "models", name)
        if not isinstance(model, dict) or "class_path" not in model:
            raise ValueError(
                f"{where}: models.{name} must be a backbone mapping with a class_path "
                f"(and init_args), as under model.backbone in a train.py config"
            )
    return models


def _check_experiments(cfg: dict, models: dict, where: str) -> None:
    """Check ``experiments``: a non-empty list of entries, each checked on its own and against its namesakes."""
    entries = _require(cfg, "experiments", list, where)
    if not entries:
        raise ValueError(
            f"{where}: experiments=[] is not allowed: expected a non-empty list of experiments "
            "(each a mapping with name, tasks, models, num_train)"
        )
    seen: dict[str, tuple] = {}
    for i, exp in enumerate(entries):
        _check_experiment(f"{where}: experiments[{i}]", exp, cfg, models, seen)


def _check_experiment(w: str, exp: object, cfg: dict, models: dict, seen: dict[str, tuple]) -> None:
    """Check one experiment entry, filling in its defaults (regions, ``data``, ``train_samples``)."""
    if not isinstance(exp, dict):
        raise ValueError(f"{w}: expected a mapping")
    extra = set(exp) - {
        "name",
        "tasks",
        "models",
        "num_train",
        "train_region",
        "test_region",
        "shift_region",
        "train_samples",
        "data",
    }
    if extra:
        raise ValueError(f"{w}: unknown keys {sorted(extra)}")
    name = _require(exp, "name", str, w)
    _check_name(w, "name", name, dash=False)  # '-' separates the parts of a run key
    tasks = _require(exp, "tasks", list, w)
    for task in tasks:
        check_choice(f"{w}.tasks", task, tuple(TASK_DATA))
    for model in _require(exp, "models", list, w):
        check_choice(f"{w}.models", model, tuple(models))
    sizes = _require(exp, "num_train", list, w)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"{w}: num_train={sizes!r} is not allowed: expected a list of ints >= 1")
    _check_regions(w, exp, tasks)
    _check_data_and_budget(w, exp, cfg)
    _check_shared_name(w, name, exp, seen)
    if name == CALIBRATE:
        raise ValueError(f"{w}: name={name!r} is reserved for the learning-rate calibration")


def _check_regions(w: str, exp: dict, tasks: list) -> None:
    """Check an entry's placements (``all`` by default, no shift region) against every task it names."""
    for region in ("train_region", "test_region"):
        for task in tasks:
            check_choice(f"{w}.{region} (task {task})", exp.setdefault(region, "all"), TASK_DATA[task][1])
    if exp.setdefault("shift_region", None) is not None:
        for task in tasks:
            check_choice(f"{w}.shift_region (task {task})", exp["shift_region"], TASK_DATA[task][1])


def _check_data_and_budget(w: str, exp: dict, cfg: dict) -> None:
    """Check an entry's data options (``{}`` by default) and ``train_samples`` (the study's by default)."""
    data = exp.setdefault("data", {})
    reserved = {"num_train", "num_val", "num_test", "batch_size", "seed", "train_region", "test_region", "task"}
    if not isinstance(data, dict) or set(data) & reserved or any(not isinstance(v, PLAIN) for v in data.values()):
        raise ValueError(
            f"{w}: data={data!r} is not allowed: expected a mapping of the data module's other "
            f"options (e.g. train_max_span) to plain values; the grid sets {sorted(reserved)}"
        )
    samples = exp.setdefault("train_samples", cfg.get("train_samples"))
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{w}: train_samples={samples!r} is not allowed: expected an int >= 1")


def _check_shared_name(w: str, name: str, exp: dict, seen: dict[str, tuple]) -> None:
    """Raise unless the entry agrees with the earlier entries of its name (``seen``: name -> their settings)."""
    # Entries may share a name (e.g. all models at one size, a few models at more sizes): they
    # fill one table, so they must agree on the placements and the budget.
    settings = (
        exp["train_region"],
        exp["test_region"],
        exp["shift_region"],
        exp["train_samples"],
        sorted(exp["data"].items()),
    )
    if seen.setdefault(name, settings) != settings:
        raise ValueError(
            f"{w}: experiment {name!r} is listed with (train_region, test_region, shift_region, "
            f"train_samples, data) {seen[name]} and {settings}; entries that share a name must "
            "share them"
        )


def _check_shortcuts(cfg: dict, where: str) -> None:
    """Check ``shortcuts`` (optional): the sizes of the shortcut audit's training and test sets."""
    if "shortcuts" in cfg:
        sc = _require(cfg, "shortcuts", dict, where)
        extra = set(sc) - {"num_train", "num_test"}
        if extra:
            raise ValueError(f"{where}: shortcuts: unknown keys {sorted(extra)}; allowed: ['num_test', 'num_train']")
        for name in ("num_train", "num_test"):
            if _require(sc, name, int, f"{where}: shortcuts") < 100:
                raise ValueError(f"{where}: shortcuts.{name}={sc[name]!r} is not allowed: expected an int >= 100")


def _check_calibration(cfg: dict, where: str) -> None:
    """``families`` (family -> models) come with either ``calibration`` (task, num_train, seed or seeds,
    lrs, one model per family), or ``lrs`` (family -> a fixed rate, e.g. one an earlier calibration
    chose); every model of the study must then be in exactly one family."""
    given = [k for k in ("calibration", "lrs") if k in cfg]
    if ("families" in cfg) != bool(given) or len(given) > 1:
        raise ValueError(
            f"{where}: 'families' goes with either 'calibration' or fixed 'lrs' (one of them), "
            f"got {['families'] * ('families' in cfg) + given}"
        )
    if "families" not in cfg:
        return
    families = _check_families(cfg, where)
    if "lrs" in cfg:
        _check_fixed_lrs(cfg, families, where)
        return
    cal = _require(cfg, "calibration", dict, where)
    w = f"{where}: calibration"
    extra = set(cal) - {"task", "num_train", "seed", "seeds", "lrs", "models", "data"}
    if extra:
        raise ValueError(f"{w}: unknown keys {sorted(extra)}")
    _check_calibration_runs(w, cal, cfg)
    _check_calibration_grid(w, cal, families)


def _check_families(cfg: dict, where: str) -> dict:
    """Check ``families`` (each model in at most one, every model of the experiments in one) and return it."""
    families = _require(cfg, "families", dict, where)
    owner: dict[str, str] = {}
    for family, members in families.items():
        if not isinstance(members, list) or not members:
            raise ValueError(f"{where}: families.{family}={members!r} is not allowed: expected a list of model names")
        for model in members:
            check_choice(f"{where}: families.{family}", model, tuple(cfg["models"]))
            if owner.setdefault(model, family) != family:
                raise ValueError(f"{where}: model {model!r} is in families {owner[model]!r} and {family!r}")
    used = {m for exp in cfg["experiments"] for m in exp["models"]}
    if used - set(owner):
        raise ValueError(
            f"{where}: models {sorted(used - set(owner))} are in no family, so no learning rate "
            f"would be calibrated for them; add them to 'families'"
        )
    return families


def _check_fixed_lrs(cfg: dict, families: dict, where: str) -> None:
    """Check the fixed ``lrs``: one rate in (0, 1) for each family."""
    fixed = _require(cfg, "lrs", dict, where)
    if set(fixed) != set(families) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in fixed.values()
    ):
        raise ValueError(
            f"{where}: lrs={fixed!r} is not allowed: expected one rate in (0, 1) for each family {sorted(families)}"
        )


def _check_calibration_runs(w: str, cal: dict, cfg: dict) -> None:
    """Check what the calibration runs on: its task, training-set size and seeds (a ``seed`` becomes a list of one)."""
    check_choice(f"{w}.task", _require(cal, "task", str, w), tuple(TASK_DATA))
    if ("seed" in cal) == ("seeds" in cal):
        raise ValueError(
            f"{w}: give either seed (one) or seeds (a list), got "
            + (f"both ({cal['seed']!r} and {cal['seeds']!r})" if "seed" in cal else "neither")
        )
    seeds = cal.setdefault("seeds", [cal.get("seed")])  # one seed is a list of one
    if (
        _require(cal, "num_train", int, w) < 1
        or not isinstance(seeds, list)
        or not seeds
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
    ):
        raise ValueError(
            f"{w}: num_train must be an int >= 1 and seed(s) ints >= 0, got num_train="
            f"{cal['num_train']!r}, seeds={seeds!r}"
        )
    for seed in seeds:
        if seed in cfg["seeds"]:
            raise ValueError(
                f"{w}: seed={seed} is one of the study's seeds {cfg['seeds']}; calibrate on "
                f"other data than the study is scored on"
            )


def _check_calibration_grid(w: str, cal: dict, families: dict) -> None:
    """Check what the calibration tries: its data options, its rates and one model for each family."""
    data = cal.get("data", {})
    if not isinstance(data, dict) or any(not isinstance(v, PLAIN) for v in data.values()):
        raise ValueError(
            f"{w}: data={data!r} is not allowed: expected a mapping of the data module's options to "
            "plain values (e.g. train_max_span), as an experiment's data"
        )
    lrs = _require(cal, "lrs", list, w)
    if not lrs or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in lrs):
        raise ValueError(f"{w}: lrs={lrs!r} is not allowed: expected a non-empty list of floats in (0, 1)")
    models = _require(cal, "models", dict, w)
    if set(models) != set(families):
        raise ValueError(f"{w}.models names {sorted(models)}, expected one model for each family {sorted(families)}")
    for family, model in models.items():
        if model not in families[family]:
            raise ValueError(f"{w}.models.{family}={model!r} is not allowed: expected one of {families[family]}")


def _check_comparisons(cfg: dict, where: str) -> None:
    """``comparisons`` (optional): experiment -> family of tests -> pairs ``[first, second]`` of its models,
    named before the runs; the report corrects each family for multiple comparisons on its own."""
    if "comparisons" not in cfg:
        return
    comparisons = _require(cfg, "comparisons", dict, where)
    models = {exp["name"]: exp["models"] for exp in experiments(cfg)}
    for name, families in comparisons.items():
        check_choice(f"{where}: comparisons", name, tuple(models))
        if not isinstance(families, dict) or not families:
            raise ValueError(
                f"{where}: comparisons.{name}={families!r} is not allowed: expected a mapping of "
                "family names to lists of [first, second] model pairs"
            )
        for family, pairs in families.items():
            w = f"{where}: comparisons.{name}.{family}"
            if (
                not isinstance(pairs, list)
                or not pairs
                or any(not isinstance(p, list) or len(p) != 2 or p[0] == p[1] for p in pairs)
            ):
                raise ValueError(
                    f"{w}={pairs!r} is not allowed: expected a non-empty list of [first, second] pairs "
                    "of two different models"
                )
            for model in (m for pair in pairs for m in pair):
                check_choice(w, model, tuple(models[name]))


def experiments(cfg: dict) -> list[dict]:
    """The experiments by name, entries that share a name merged (tasks, models, sizes in first-seen order)."""
    merged: dict[str, dict] = {}
    for exp in cfg["experiments"]:
        m = merged.setdefault(
            exp["name"],
            {
                "name": exp["name"],
                "tasks": [],
                "models": [],
                "num_train": [],
                **{k: exp.get(k) for k in ("train_region", "test_region", "shift_region", "train_samples", "data")},
            },
        )
        for key in ("tasks", "models", "num_train"):
            m[key] += [v for v in exp[key] if v not in m[key]]
    for m in merged.values():
        m["num_train"].sort()
    return list(merged.values())
