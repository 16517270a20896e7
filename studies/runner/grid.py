"""The study's grid: every run it plans with the settings it gets (its config: `grid_config`)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from studies.runner.grid_config import CALIBRATE, TASK_DATA, experiments, load_config
from vit.data import two_circles


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
        text = json.dumps(
            [self.overrides, self.base_digest] + ([self.shift_region] if self.shift_region else []), sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]


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


def calibration_plan(cfg: dict) -> list[Run]:
    """The learning-rate calibration runs: each family's model at each lr, scored on the validation split."""
    if "calibration" not in cfg:
        return []
    cal = cfg["calibration"]
    exp = {
        "name": CALIBRATE,
        "tasks": [cal["task"]],
        "models": list(cal["models"].values()),
        "num_train": [cal["num_train"]],
        "train_region": "all",
        "test_region": "all",
        "shift_region": None,
        "train_samples": cfg["train_samples"],
        "data": cal.get("data"),
    }  # data: e.g. the spans trained on
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
    """The runs of ``entries`` in the order they are run (see ``plan``), each key once."""
    base_digest = hashlib.sha256(Path(cfg["base_config"]).read_bytes()).hexdigest()[:12]
    runs, keys = [], set()
    for exp in entries:
        for seed in seeds:
            for task in exp["tasks"]:
                for num_train in exp["num_train"]:
                    for model in exp["models"]:
                        run = _run(cfg, exp, task, model, num_train, seed, lr_of(model), base_digest)
                        if run.key not in keys:
                            keys.add(run.key)
                            runs.append(run)
    return runs


def _run(
    cfg: dict, exp: dict, task: str, model: str, num_train: int, seed: int, lr: float | None, base_digest: str
) -> Run:
    """One grid point with its train.py overrides: schedule, model, data."""
    epochs, val_every, val_batches = schedule(
        num_train,
        train_samples=exp["train_samples"],
        num_val_checks=cfg["num_val_checks"],
        batch_size=cfg["batch_size"],
    )
    trainer = {"max_epochs": epochs, "check_val_every_n_epoch": val_every}
    if val_batches:  # only then: the other runs keep their settings fingerprint
        trainer["val_check_interval"] = val_batches
    data_class, _ = TASK_DATA[task]
    model_args = {
        "backbone": cfg["models"][model],
        "warmup_epochs": round(cfg["warmup_fraction"] * epochs, 4),
    }
    if lr is not None:
        model_args["lr"] = lr
    overrides = {
        "seed_everything": seed,
        "trainer": trainer,
        "model": model_args,
        "data": {"class_path": data_class, "init_args": _data_args(cfg, exp, task, num_train, seed)},
    }
    return Run(
        exp["name"],
        task,
        model,
        num_train,
        seed,
        exp["train_region"],
        exp["test_region"],
        epochs,
        overrides,
        base_digest,
        lr,
        exp["shift_region"],
    )


def _data_args(cfg: dict, exp: dict, task: str, num_train: int, seed: int) -> dict:
    """The data module's ``init_args`` of one run."""
    init_args = {
        "num_train": num_train,
        "num_val": cfg["num_val"],
        "num_test": cfg["num_test"],
        "batch_size": cfg["batch_size"],
        "seed": seed,
        "train_region": exp["train_region"],
        "test_region": exp["test_region"],
    }
    if task in two_circles.TASKS:
        init_args["task"] = task
    init_args.update(exp.get("data") or {})  # only when given: other runs keep their fingerprint
    return init_args


__all__ = [
    "CALIBRATE",
    "TASK_DATA",
    "Run",
    "calibration_plan",
    "choose_lr",
    "experiments",
    "load_config",
    "plan",
    "schedule",
]
