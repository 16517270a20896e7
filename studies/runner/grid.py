"""The study's grid: its config file read and checked, and every run it plans with the settings it gets."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import yaml

from studies.runner import arrangement
from vit.checks import check_choice
from vit.data import same_different, two_circles
from vit.training.run_dir import printable

# Every task the study can run: its data module and the placement regions it knows.
TASK_DATA = {
    **{task: ("vit.data.TwoCirclesDataModule", two_circles.REGIONS) for task in two_circles.TASKS},
    "same_different": ("vit.data.SameDifferentDataModule", get_args(same_different.Region)),
    "arrangement": ("studies.runner.arrangement.ArrangementDataModule", get_args(arrangement.Region)),
}
# The value of a data option (an experiment's ``data``): a plain scalar, checked by the data module itself.
PLAIN = (int, float, str, bool, type(None))
# A model or experiment name: part of each run's key, which names its folder under log_dir and its file names.
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


CALIBRATE = "calibrate"  # the experiment name of the learning-rate calibration runs


@dataclass(frozen=True)
class Run:
    """One grid point and the settings that make it (what the fingerprint hashes)."""

    experiment: str
    task: str
    model: str
    num_train: int
    seed: int
    train_region: str
    test_region: str
    epochs: int
    overrides: dict
    base_digest: str  # of the base config's text: editing it changes every run
    lr: float | None = None  # None: the base config's learning rate
    shift_region: str | None = None  # a second test placement, scored after the test (the translation test)

    @property
    def key(self) -> str:
        lr = f"-lr{self.lr:g}" if self.experiment == CALIBRATE else ""
        return f"{self.experiment}-{self.task}-{self.model}{lr}-n{self.num_train}-s{self.seed}"

    @property
    def fingerprint(self) -> str:
        text = json.dumps([self.overrides, self.base_digest] + ([self.shift_region] if self.shift_region else []),
                          sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


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
        raise ValueError(f"{where}: {key}={value!r} is not allowed: expected a plain name of {allowed}, "
                         "not starting with '.'")


def schedule(num_train: int, *, train_samples: int, num_val_checks: int, batch_size: int) -> tuple[int, int, int]:
    """``(epochs, val_every, val_batches)``: about ``train_samples`` samples seen, at least one epoch.

    Every run gets the same compute (about ``train_samples / batch_size`` optimisation steps), so a
    small training set is seen for many epochs and a large one for few; a set larger than
    ``train_samples`` is seen once (one epoch, more steps). Validation runs about
    ``num_val_checks`` times and always after the last step: every ``val_every`` epochs or, with
    fewer epochs than checks, every ``val_batches`` batches within an epoch (0: at the end of the
    epoch only). The checks per epoch are the divisor of the number of batches nearest to the
    wanted number, so that the epoch's last batch is always a check.
    """
    epochs = max(1, round(train_samples / num_train))
    val_every = max(1, epochs // num_val_checks)
    num_batches = math.ceil(num_train / batch_size)
    wanted = max(1, round(num_val_checks / epochs))
    divisors = [d for d in range(1, num_batches + 1) if num_batches % d == 0]
    checks_per_epoch = min(divisors, key=lambda d: (abs(d - wanted), -d))
    val_batches = num_batches // checks_per_epoch if checks_per_epoch > 1 else 0
    return math.ceil(epochs / val_every) * val_every, val_every, val_batches


def load_config(path: str | Path) -> dict:
    """Read and check a study config; errors name the key, the value and what is allowed."""
    path = Path(path)
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
    allowed = {"base_config", "out_dir", "log_dir", "seeds", "batch_size", "train_samples", "num_val_checks",
               "num_val", "num_test", "threads", "warmup_fraction", "models", "experiments", "families",
               "calibration", "lrs", "shortcuts", "comparisons"}
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
    models = _require(cfg, "models", dict, where)
    for name, model in models.items():
        _check_name(where, "models", name)
        if not isinstance(model, dict) or "class_path" not in model:
            raise ValueError(f"{where}: models.{name} must be a backbone mapping with a class_path "
                             f"(and init_args), as under model.backbone in a train.py config")
    experiments = _require(cfg, "experiments", list, where)
    if not experiments:
        raise ValueError(f"{where}: experiments=[] is not allowed: expected a non-empty list of experiments "
                         "(each a mapping with name, tasks, models, num_train)")
    seen: dict[str, tuple] = {}
    for i, exp in enumerate(experiments):
        w = f"{where}: experiments[{i}]"
        if not isinstance(exp, dict):
            raise ValueError(f"{w}: expected a mapping")
        extra = set(exp) - {"name", "tasks", "models", "num_train", "train_region", "test_region", "shift_region",
                            "train_samples", "data"}
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
        for region in ("train_region", "test_region"):
            for task in tasks:
                check_choice(f"{w}.{region} (task {task})", exp.setdefault(region, "all"), TASK_DATA[task][1])
        if exp.setdefault("shift_region", None) is not None:
            for task in tasks:
                check_choice(f"{w}.shift_region (task {task})", exp["shift_region"], TASK_DATA[task][1])
        data = exp.setdefault("data", {})
        reserved = {"num_train", "num_val", "num_test", "batch_size", "seed", "train_region", "test_region", "task"}
        if not isinstance(data, dict) or set(data) & reserved or any(not isinstance(v, PLAIN) for v in data.values()):
            raise ValueError(f"{w}: data={data!r} is not allowed: expected a mapping of the data module's other "
                             f"options (e.g. train_max_span) to plain values; the grid sets {sorted(reserved)}")
        samples = exp.setdefault("train_samples", cfg.get("train_samples"))
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"{w}: train_samples={samples!r} is not allowed: expected an int >= 1")
        # Entries may share a name (e.g. all models at one size, a few models at more sizes): they
        # fill one table, so they must agree on the placements and the budget.
        settings = (exp["train_region"], exp["test_region"], exp["shift_region"], exp["train_samples"],
                    sorted(exp["data"].items()))
        if seen.setdefault(name, settings) != settings:
            raise ValueError(f"{w}: experiment {name!r} is listed with (train_region, test_region, shift_region, "
                             f"train_samples, data) {seen[name]} and {settings}; entries that share a name must "
                             "share them")
        if name == CALIBRATE:
            raise ValueError(f"{w}: name={name!r} is reserved for the learning-rate calibration")
    _check_calibration(cfg, where)
    _check_comparisons(cfg, where)
    if "shortcuts" in cfg:
        sc = _require(cfg, "shortcuts", dict, where)
        extra = set(sc) - {"num_train", "num_test"}
        if extra:
            raise ValueError(f"{where}: shortcuts: unknown keys {sorted(extra)}; allowed: ['num_test', 'num_train']")
        for name in ("num_train", "num_test"):
            if _require(sc, name, int, f"{where}: shortcuts") < 100:
                raise ValueError(f"{where}: shortcuts.{name}={sc[name]!r} is not allowed: expected an int >= 100")
    return cfg


def _check_calibration(cfg: dict, where: str) -> None:
    """``families`` (family -> models) come with either ``calibration`` (task, num_train, seed or seeds,
    lrs, one model per family), or ``lrs`` (family -> a fixed rate, e.g. one an earlier calibration
    chose); every model of the study must then be in exactly one family."""
    given = [k for k in ("calibration", "lrs") if k in cfg]
    if ("families" in cfg) != bool(given) or len(given) > 1:
        raise ValueError(f"{where}: 'families' goes with either 'calibration' or fixed 'lrs' (one of them), "
                         f"got {['families'] * ('families' in cfg) + given}")
    if "families" not in cfg:
        return
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
        raise ValueError(f"{where}: models {sorted(used - set(owner))} are in no family, so no learning rate "
                         f"would be calibrated for them; add them to 'families'")
    if "lrs" in cfg:
        fixed = _require(cfg, "lrs", dict, where)
        if set(fixed) != set(families) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                              or not 0 < v < 1 for v in fixed.values()):
            raise ValueError(f"{where}: lrs={fixed!r} is not allowed: expected one rate in (0, 1) for each "
                             f"family {sorted(families)}")
        return
    cal = _require(cfg, "calibration", dict, where)
    w = f"{where}: calibration"
    extra = set(cal) - {"task", "num_train", "seed", "seeds", "lrs", "models", "data"}
    if extra:
        raise ValueError(f"{w}: unknown keys {sorted(extra)}")
    check_choice(f"{w}.task", _require(cal, "task", str, w), tuple(TASK_DATA))
    if ("seed" in cal) == ("seeds" in cal):
        raise ValueError(f"{w}: give either seed (one) or seeds (a list), got " +
                         (f"both ({cal['seed']!r} and {cal['seeds']!r})" if "seed" in cal else "neither"))
    seeds = cal.setdefault("seeds", [cal.get("seed")])  # one seed is a list of one
    if _require(cal, "num_train", int, w) < 1 or not isinstance(seeds, list) or not seeds or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"{w}: num_train must be an int >= 1 and seed(s) ints >= 0, got num_train="
                         f"{cal['num_train']!r}, seeds={seeds!r}")
    for seed in seeds:
        if seed in cfg["seeds"]:
            raise ValueError(f"{w}: seed={seed} is one of the study's seeds {cfg['seeds']}; calibrate on "
                             f"other data than the study is scored on")
    data = cal.get("data", {})
    if not isinstance(data, dict) or any(not isinstance(v, PLAIN) for v in data.values()):
        raise ValueError(f"{w}: data={data!r} is not allowed: expected a mapping of the data module's options to "
                         "plain values (e.g. train_max_span), as an experiment's data")
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
            raise ValueError(f"{where}: comparisons.{name}={families!r} is not allowed: expected a mapping of "
                             "family names to lists of [first, second] model pairs")
        for family, pairs in families.items():
            w = f"{where}: comparisons.{name}.{family}"
            if not isinstance(pairs, list) or not pairs or any(
                    not isinstance(p, list) or len(p) != 2 or p[0] == p[1] for p in pairs):
                raise ValueError(f"{w}={pairs!r} is not allowed: expected a non-empty list of [first, second] pairs "
                                 "of two different models")
            for model in (m for pair in pairs for m in pair):
                check_choice(w, model, tuple(models[name]))


def family_of(cfg: dict, model: str) -> str | None:
    """The family a model's learning rate is calibrated with (None without calibration)."""
    return next((f for f, members in cfg.get("families", {}).items() if model in members), None)


def calibration_key(cfg: dict, model: str, lr: float, seed: int) -> str:
    """The run key of one calibration run."""
    cal = cfg["calibration"]
    return Run(CALIBRATE, cal["task"], model, cal["num_train"], seed, "all", "all", 0, {}, "", lr).key


def calibration_scores(cfg: dict, rows: list[dict], model: str, lr: float) -> list[float | None]:
    """The validation accuracy of ``model`` at ``lr`` on each calibration seed (None: not finished)."""
    done = {r["key"]: float(r["val_acc"]) for r in rows}
    return [done.get(calibration_key(cfg, model, lr, seed)) for seed in cfg["calibration"]["seeds"]]


def choose_lr(cfg: dict, rows: list[dict]) -> dict[str, float]:
    """``{family: lr}``: the rate with the best mean ``val_acc`` over the calibration seeds, per family (ties: the
    smaller lr). A mean, not a best seed: in a bimodal regime one seed that escapes would decide alone.

    Raises if a calibration run is missing from ``rows``.
    """
    cal = cfg["calibration"]
    chosen = {}
    for family, model in cal["models"].items():
        scores = {}
        for lr in cal["lrs"]:
            accs = calibration_scores(cfg, rows, model, lr)
            if None in accs:
                key = calibration_key(cfg, model, lr, cal["seeds"][accs.index(None)])
                raise ValueError(f"calibration run {key} has not finished")
            scores[lr] = sum(accs) / len(accs)
        chosen[family] = max(sorted(scores), key=lambda lr: scores[lr])  # max keeps the first (smallest) on ties
    return chosen


def experiments(cfg: dict) -> list[dict]:
    """The experiments by name, entries that share a name merged (tasks, models, sizes in first-seen order)."""
    merged: dict[str, dict] = {}
    for exp in cfg["experiments"]:
        m = merged.setdefault(exp["name"], {"name": exp["name"], "tasks": [], "models": [], "num_train": [],
                                            **{k: exp.get(k) for k in ("train_region", "test_region", "shift_region",
                                                                       "train_samples", "data")}})
        for key in ("tasks", "models", "num_train"):
            m[key] += [v for v in exp[key] if v not in m[key]]
    for m in merged.values():
        m["num_train"].sort()
    return list(merged.values())


def calibration_plan(cfg: dict) -> list[Run]:
    """The learning-rate calibration runs: each family's model at each lr, scored on the validation split."""
    if "calibration" not in cfg:
        return []
    cal = cfg["calibration"]
    exp = {"name": CALIBRATE, "tasks": [cal["task"]], "models": list(cal["models"].values()),
           "num_train": [cal["num_train"]], "train_region": "all", "test_region": "all", "shift_region": None,
           "train_samples": cfg["train_samples"], "data": cal.get("data")}  # data: e.g. the spans trained on
    return [run for lr in cal["lrs"] for run in _runs(cfg, [exp], cal["seeds"], lambda model, lr=lr: lr)]


def plan(cfg: dict, lrs: dict[str, float] | None = None) -> list[Run]:
    """Every run of the study, in the order they are run: entry by entry as listed, and within an
    entry seed by seed (every cell of the entry with the first seed, then with the next).

    So a study stopped early holds the entries listed first, each cell with the same number of
    seeds (give or take one): list the most important entries first. With a calibration, ``lrs``
    (``{family: lr}``, from ``choose_lr``) sets every model's learning rate; a config's fixed ``lrs``
    do without one.
    """
    if "calibration" in cfg and lrs is None:
        raise ValueError("this study calibrates its learning rates: pass lrs (choose_lr) to plan it")
    lrs = cfg.get("lrs", lrs)
    return _runs(cfg, cfg["experiments"], cfg["seeds"], lambda model: lrs[family_of(cfg, model)] if lrs else None)


def _runs(cfg: dict, entries: list[dict], seeds: list[int], lr_of) -> list[Run]:
    base_digest = hashlib.sha256(Path(cfg["base_config"]).read_bytes()).hexdigest()[:12]
    runs, keys = [], set()
    for exp in entries:
        for seed in seeds:
            for task in exp["tasks"]:
                for num_train in exp["num_train"]:
                    for model in exp["models"]:
                        epochs, val_every, val_batches = schedule(
                            num_train, train_samples=exp["train_samples"], num_val_checks=cfg["num_val_checks"],
                            batch_size=cfg["batch_size"])
                        trainer = {"max_epochs": epochs, "check_val_every_n_epoch": val_every}
                        if val_batches:  # only then: the other runs keep their settings fingerprint
                            trainer["val_check_interval"] = val_batches
                        data_class, _ = TASK_DATA[task]
                        init_args = {"num_train": num_train, "num_val": cfg["num_val"], "num_test": cfg["num_test"],
                                     "batch_size": cfg["batch_size"], "seed": seed,
                                     "train_region": exp["train_region"], "test_region": exp["test_region"]}
                        if task in two_circles.TASKS:
                            init_args["task"] = task
                        init_args.update(exp.get("data") or {})  # only when given: other runs keep their fingerprint
                        lr = lr_of(model)
                        model_args = {"backbone": cfg["models"][model],
                                      "warmup_epochs": round(cfg["warmup_fraction"] * epochs, 4)}
                        if lr is not None:
                            model_args["lr"] = lr
                        overrides = {
                            "seed_everything": seed,
                            "trainer": trainer,
                            "model": model_args,
                            "data": {"class_path": data_class, "init_args": init_args},
                        }
                        run = Run(exp["name"], task, model, num_train, seed, exp["train_region"],
                                  exp["test_region"], epochs, overrides, base_digest, lr, exp["shift_region"])
                        if run.key not in keys:
                            keys.add(run.key)
                            runs.append(run)
    return runs
