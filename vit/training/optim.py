"""What trains and how fast: `freeze` (the parameters fine-tuning leaves trainable) and the learning-rate schedule,
timm's schedulers by name (`timm.scheduler.create_scheduler_v2`), stepped per optimizer update after a linear
warmup.

timm's schedulers, unlike torch's, give each parameter group `value * lr_scale`, so layer-wise decay scales the
warmup, the peak and the floor of every group alike. They are a function of the update count (`step_update(t)`),
which is what makes a resumed run take exactly the rates an uninterrupted one takes; the state a checkpoint holds
is their settings, checked against this version's before a resumed run takes its first step."""

from __future__ import annotations

import logging
import math
from numbers import Real

import torch
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler
from torch import nn

from vit.checks import check_int

# timm's names that need no validation metric; "step" and "constant" read `decay_epochs` / `decay_rate`.
SCHEDULES = ("cosine", "tanh", "step", "constant")


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    sched: str = "cosine",
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    decay_steps: int = 1,
    decay_rate: float = 0.1,
) -> Scheduler:
    """The rate at update t (from 0), as a multiple of each group's `lr * lr_scale`: `(t + 1) / warmup_steps` for
    the warmup, then `sched` from 1 at update `warmup_steps - 1`: "cosine" and "tanh" down to `min_lr_ratio` at
    `total_steps`, "step" times `decay_rate` every `decay_steps` updates, "constant" 1."""
    lr = optimizer.defaults["lr"]
    ramp = max(0, warmup_steps - 1)  # timm's warmup starts at `warmup_lr_init` and reaches the peak after `ramp`
    logger = logging.getLogger("timm.scheduler.cosine_lr")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its note on a one-update cosine: the warmup then takes the whole run
    try:
        schedule, _ = create_scheduler_v2(
            optimizer,
            sched=sched,
            num_epochs=max(1, total_steps - ramp),  # "epochs" are updates here (updates_per_epoch=1)
            warmup_epochs=ramp,
            warmup_lr=lr / warmup_steps if warmup_steps else 0.0,
            warmup_prefix=True,
            min_lr=lr * min_lr_ratio,
            decay_epochs=max(1, decay_steps),
            decay_rate=decay_rate,
            step_on_epochs=False,
            updates_per_epoch=1,
        )
    finally:
        logger.setLevel(level)
    return schedule


def group_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """This update's learning rates: `train/lr`, the head's (the highest); with layer decay also `train/lr/group_i`,
    each parameter group's, as Lightning's `LearningRateMonitor` logs them."""
    rates = [group["lr"] for group in optimizer.param_groups]
    if len(set(rates)) == 1:
        return {"train/lr": rates[0]}
    return {"train/lr": max(rates), **{f"train/lr/group_{i}": rate for i, rate in enumerate(rates)}}


def check_restored(schedule: Scheduler, state: dict, first: int, last: int) -> None:
    """Raise `ValueError` unless `state`, a checkpoint's, holds the settings `schedule` has (this run's, built
    fresh over a stand-in optimizer, which it then steps), each of the same kind (a number, a list as long, ...),
    and gives finite rates at updates `first` to `last`: timm's `load_state_dict` takes any dict, and a rate list
    shorter than the groups would leave the groups beyond it at a stale rate without a word."""
    fresh = schedule.state_dict()
    if set(state) != set(fresh):
        extra, missing = (_some(sorted(a - b)) for a, b in ((set(state), set(fresh)), (set(fresh), set(state))))
        raise ValueError(
            f"the schedule's state is not a {type(schedule).__name__}'s (saved by another version or schedule): "
            f"it has {extra} and lacks {missing}"
        )
    for key, value in state.items():
        if not _same_kind(value, fresh[key]):
            raise ValueError(f"the schedule's {key}={value!r} is not of the kind this run's has ({fresh[key]!r})")
    schedule.load_state_dict(state)
    for t in range(first, last + 1):
        try:
            schedule.step_update(t)
        except ArithmeticError as err:  # a cycle of no updates, say
            raise ValueError(f"the schedule's state cannot give the rate of update {t}: {err}") from None
        rates = [group["lr"] for group in schedule.optimizer.param_groups]
        if not all(math.isfinite(rate) and rate >= 0 for rate in rates):
            raise ValueError(f"the schedule's state gives the rates {rates} at update {t}")


def _some(names: list[str]) -> str:
    return "nothing" if not names else ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _same_kind(saved, fresh) -> bool:
    """A finite number where `fresh` has a number, a list as long of the same kinds, else the same value (a name
    such as the group field it schedules, a flag, None)."""
    if isinstance(fresh, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(fresh) and all(map(_same_kind, saved, fresh))
    if isinstance(fresh, Real) and not isinstance(fresh, bool):
        return isinstance(saved, Real) and not isinstance(saved, bool) and math.isfinite(saved)
    return type(saved) is type(fresh) and saved == fresh


def freeze(backbone: nn.Module, trainable: str | int) -> None:
    """Leave trainable only what `trainable` names (see `ImageClassifier`); the rest gets `requires_grad=False`."""
    if trainable == "all":
        return
    if isinstance(trainable, bool) or not (trainable == "head" or isinstance(trainable, int)):
        raise ValueError(f"trainable={trainable!r} is not allowed: expected 'all', 'head' or a number of last blocks")
    # timm's names for the children (torch keeps them in `named_children`, where no typing Protocol can declare them)
    children = dict(backbone.named_children())
    if "head" not in children:
        raise ValueError(f"trainable={trainable!r} needs a backbone with a `head`; {type(backbone).__name__} has none")
    keep = [children["head"]]
    if isinstance(trainable, int):
        blocks = children.get("blocks")
        if blocks is None:
            raise ValueError(
                f"trainable={trainable} counts Transformer blocks; {type(backbone).__name__} has no `blocks`"
            )
        check_int("trainable", trainable, 0, len(blocks))
        final = ("norm", "fc_norm", "attn_pool")
        keep += list(blocks[len(blocks) - trainable :]) + [children[name] for name in final if name in children]
    backbone.requires_grad_(False)
    for module in keep:
        module.requires_grad_(True)
