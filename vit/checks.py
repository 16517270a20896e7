"""One way to check an argument: every error names the argument, the value given and what is allowed (an option,
a number, an image size, a constructor's keyword arguments within their bounds, a class, `topk`).

Pool = Literal["cls", "mean", "map"]   # allowed options, declared once
check_choice("pool", pool, Pool)   # pool='avg' is not allowed: expected one of ['cls', 'mean', 'map']
"""

from __future__ import annotations

import inspect
import math
import numbers
import typing
from typing import Any, get_args

from vit.messages import file_kind, first_line  # noqa: F401  (re-exported until every importer names vit.messages)
from vit.signatures import constructor_message, describe, matches  # noqa: F401  (likewise: vit.signatures)


class CheckpointError(ValueError):
    """A checkpoint or model folder that cannot be used; its message is one line naming the file (or URL, redacted)
    and the key."""


def check_choice(name: str, value: object, allowed: Any) -> None:
    """Raise `ValueError` unless `value` is one of `allowed` (a `Literal` type or a sequence)."""
    options = get_args(allowed) or tuple(allowed)
    if value not in options:
        raise ValueError(f"{name}={value!r} is not allowed: expected one of {list(options)}")


def check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
    """Raise `ValueError` unless `value` is an int (not a bool) in `[minimum, maximum]`."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not ok or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = (
            f"in [{minimum}, {maximum}]"
            if minimum is not None and maximum is not None
            else f">= {minimum}"
            if minimum is not None
            else f"<= {maximum}"
            if maximum is not None
            else ""
        )
        raise ValueError(f"{name}={value!r} is not allowed: expected an int {bounds}".rstrip())


def check_float(
    name: str,
    value: object,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise `ValueError` unless `value` is a finite real number from `low` to `high`, each end excluded when
    `low_open` / `high_open`: `check_float("p", p, 0, 1, high_open=True)` is `[0, 1)`."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not (
        ok
        and (low is None or (value > low if low_open else value >= low))
        and (high is None or (value < high if high_open else value <= high))
    ):
        lo, hi = "-inf" if low is None else f"{low:g}", "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name}={value!r} is not allowed: expected a finite number in {interval}")


def check_size(name: str, value: object, minimum: int = 1) -> tuple[int, int]:
    """`(H, W)` of an image size (one int: a square, or `[H, W]`); `ValueError` unless each is an int >= `minimum`."""
    square = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    sides = (value, value) if square else tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(sides) != 2 or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= minimum for s in sides
    ):
        raise ValueError(
            f"{name}={value!r} is not allowed: expected an int >= {minimum} (a square) or a pair [H, W] of them"
        )
    return int(sides[0]), int(sides[1])


def check_arguments(cls: type, arguments: dict[str, Any], bounds: dict[str, tuple]) -> None:
    """Raise `ValueError` naming the first of `cls`'s constructor arguments not of its annotated type or outside its
    `bounds`: `{name: (low, high)}` for an int, `{name: (low, high, low_open, high_open)}` for a float."""
    hints = typing.get_type_hints(cls.__init__)
    for name, value in ((n, arguments[n]) for n in inspect.signature(cls).parameters if n in arguments):
        if name in hints and not matches(value, hints[name]):
            raise ValueError(f"{name}={value!r} is not allowed: expected {describe(hints[name])}")
        if name in bounds and value is not None:
            low, high, *open_ends = bounds[name]
            if open_ends:
                check_float(name, value, low, high, low_open=open_ends[0], high_open=open_ends[1])
            else:
                check_int(name, value, low, high)


def class_index(target: str | int, class_names: list[str], option: str = "target=") -> int:
    """The index of a class given by name, or by index (an int, or digits when no class has that name);
    `ValueError` naming `{option}{target!r}` and listing the names otherwise."""
    if isinstance(target, str) and target in class_names:
        return class_names.index(target)
    index = int(target) if isinstance(target, str) and target.isdigit() else target
    if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(class_names):
        return index
    raise ValueError(
        f"{option}{target!r} is not a class of this model: expected one of {class_names} "
        f"or an index in [0, {len(class_names) - 1}]"
    )


def check_topk(topk: int, num_classes: int, option: str = "--topk ") -> None:
    """Raise `ValueError` unless `topk` is an int in [1, num_classes]; the message names it `{option}{topk}`."""
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_classes:
        raise ValueError(
            f"{option}{topk} is not allowed: expected an int in [1, {num_classes}] "
            f"(the model has {num_classes} classes)"
        )
