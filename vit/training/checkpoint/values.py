"""Checks of single values read from a checkpoint (plain data of bounded size); each failure a `CheckpointError`."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vit.checks import PLAIN, CheckpointError, constructor_message, first_line

SCHEMA_VERSION = 2  # of the checkpoints ImageClassifier writes and `schema.validate` reads
MAX_DEPTH = 24  # a Lightning checkpoint nests 8 deep; an optimizer state of nested groups a few more
MAX_STRING = 4096  # PATH_MAX: the longest value a checkpoint has reason to hold is a path
MAX_ITEMS = 10_000_000  # values in the whole checkpoint: a ViT-H optimizer state holds ~2,000
MAX_INT = 2**53  # counters and sizes: beyond this a float cannot hold the number, and nothing here needs more
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool)  # what a model, an optimizer and a random generator save


def shown(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a message quotes a value, never a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def not_allowed(key: str, value: Any, expected: str, limit: int = 60) -> CheckpointError:
    """The error for `key=value`: "<key>=<value> is not allowed: expected <expected>"."""
    return CheckpointError(f"{key}={shown(value, limit)} is not allowed: expected {expected}")


def is_int(value: Any, low: int = 0, high: int = MAX_INT) -> bool:
    """Whether `value` is an int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any, low: float = -math.inf, *, above: bool = False) -> bool:
    """Whether `value` is a finite int or float (not a bool) >= `low` (> `low` with `above`)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > low if above else value >= low))


def walk(value: Any, key: str, *, tensors: bool) -> Iterator[tuple[str, Any]]:
    """Every `(key path, value)` under `value`, depth first without recursion, checked to be `check_plain`'s values,
    lists, tuples and mappings of those with str (or int: an optimizer's) keys, and with `tensors`, tensors."""
    stack, count = [(key, value, 0)], 0
    while stack:
        path, item, depth = stack.pop()
        count += 1
        if count > MAX_ITEMS:
            raise CheckpointError(f"{key or 'it'} holds more than {MAX_ITEMS} values; refused")
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path} is nested more than {MAX_DEPTH} levels deep; refused")
        yield path, item
        if isinstance(item, Mapping):
            for k, v in item.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise CheckpointError(f"{path} has a key {shown(k)} that is not a string; refused")
                stack.append((f"{path}.{k}" if path else str(k), v, depth + 1))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", v, depth + 1) for i, v in enumerate(item))
        elif isinstance(item, torch.Tensor):
            if not tensors:
                raise CheckpointError(f"{path} is a tensor where a plain value belongs; refused")
            check_tensor(item, path)
        else:
            check_plain(item, path)


def check_plain(value: Any, key: str) -> None:
    """Raise `CheckpointError` unless `value` is a bool, an int <= 2**53, a finite float, a short str, or None."""
    if not isinstance(value, PLAIN):
        raise CheckpointError(f"{key} holds a {type(value).__name__}, not plain data (numbers, strings, booleans, "
                              "lists and mappings of those); refused")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise not_allowed(key, value, "a number of at most 2**53")
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{key}={value!r} is not allowed: expected a finite number")
    if isinstance(value, str) and (len(value) > MAX_STRING or "\0" in value):
        raise CheckpointError(f"{key} is a string of {len(value)} characters"
                              + (" with a NUL character" if "\0" in value else "") + "; refused")


def check_tensor(value: torch.Tensor, key: str) -> None:
    """Raise `CheckpointError` unless `value` is an ordinary (dense, CPU) tensor of one of `DTYPES`."""
    if value.is_nested or value.layout is not torch.strided:
        kind = "nested" if value.is_nested else str(value.layout)
        raise CheckpointError(f"{key} is a {kind} tensor; a checkpoint holds dense tensors only; refused")
    if value.device.type != "cpu":
        raise CheckpointError(f"{key} is a tensor on {value.device.type}; refused")
    if value.dtype not in DTYPES:
        raise CheckpointError(f"{key} is a {value.dtype} tensor; refused")


def same_structure(value: Any, reference: Any, key: str) -> None:
    """`value` has `reference`'s keys, lengths, types (ints in [0, 2**53], floats >= 0), strings, tensor shapes."""
    if isinstance(reference, Mapping):
        if not isinstance(value, Mapping) or set(value) != set(reference):
            extra = sorted(set(value) - set(reference), key=str) if isinstance(value, Mapping) else []
            missing = sorted(set(reference) - set(value), key=str) if isinstance(value, Mapping) else []
            raise CheckpointError(f"{key} does not hold what this run's state holds"
                                  + (f" (unexpected {shown(extra[0])})" if extra else "")
                                  + (f" (missing {shown(missing[0])})" if missing else ""))
        for k in reference:
            same_structure(value[k], reference[k], f"{key}.{k}")
    elif isinstance(reference, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(reference):
            raise not_allowed(key, value, f"a list of {len(reference)}")
        for i, (v, r) in enumerate(zip(value, reference)):
            same_structure(v, r, f"{key}[{i}]")
    elif isinstance(reference, bool):
        if not isinstance(value, bool):
            raise not_allowed(key, value, "true or false")
    elif isinstance(reference, int):  # -1 where the reference has it: a schedule not yet stepped (`last_epoch`)
        if not is_int(value, min(reference, 0)):
            raise not_allowed(key, value, f"an int >= {min(reference, 0)}")
    elif isinstance(reference, float):
        if not is_number(value, 0):
            raise not_allowed(key, value, "a finite number >= 0")
    elif reference is None:
        if value is not None:
            raise not_allowed(key, value, "null")
    elif isinstance(reference, str):
        if value != reference:
            raise not_allowed(key, value, repr(reference))
    elif isinstance(reference, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != reference.shape or value.dtype != reference.dtype:
            what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                    else shown(value))
            raise CheckpointError(f"{key} is {what}: expected a {reference.dtype} tensor of shape "
                                  f"{tuple(reference.shape)}")


def construct(cls: type, kwargs: Mapping, failure: str) -> Any:
    """`cls(**kwargs)`, a constructor's refusal (`ValueError`, `TypeError`) raised as "<failure>: <its message>"."""
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{failure}: {first_line(ValueError(constructor_message(str(err))))}") from None
