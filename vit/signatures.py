"""A constructor's signature as the registry reads it: whether plain YAML/JSON data fits an annotation (`matches`),
the annotation in words for an error (`describe`), and the constructor's own refusal out of jsonargparse's report
(`constructor_message`). A class, a callable or a module never fits: a saved model names only plain values."""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal, Union


def constructor_message(text: str) -> str:
    """The constructor's own message, out of jsonargparse's report for an optional class (`None | DataModule`):
    each union member's failure but "Expected a <class 'NoneType'>" (which only says the value was not None)."""
    if not text.startswith("Does not validate against any of the Union subtypes") or "\nErrors:\n" not in text:
        return text
    block = text.split("\nErrors:\n", 1)[1].split("\nGiven value type:", 1)[0]
    items = [" ".join(item.split()) for item in re.split(r"\n\s*- ", "\n" + block) if item.strip()]
    items = [item for item in items if not item.startswith("Expected a <class 'NoneType'>")]
    return "; ".join(items) or text


PLAIN = (bool, int, float, str, type(None))  # what YAML and JSON give


def matches(value: Any, annotation: Any) -> bool:
    """Whether `value`, plain data as YAML or JSON gives it, is of the type `annotation` says: bool, int, float (an int
    too), str, None, `Literal[...]`, unions, and lists or tuples of those. A class or a callable matches nothing."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return isinstance(value, PLAIN)
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool or annotation is str:
        return isinstance(value, annotation)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin in (tuple, list) or annotation in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        inner = args[0] if args else Any
        return all(matches(v, inner) for v in value)
    return False  # a class, a callable, a module: nothing a checkpoint may hand a constructor


def describe(annotation: Any) -> str:
    """`annotation` in words, for an error message: "one of ['cls', 'mean']", "an int or null"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return f"one of {list(args)}"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if annotation is type(None):
        return "null"
    if annotation is bool:
        return "true or false"
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} ({', '.join(describe(a) for a in args)})"
    if origin in (tuple, list):
        return f"a list of {describe(args[0]) if args else 'values'}"
    name = getattr(annotation, "__name__", str(annotation))  # a class has a name; a typing construct only a repr
    return f"a{'n' if name[:1] in 'aeiou' else ''} {name}"
