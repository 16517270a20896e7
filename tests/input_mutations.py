"""Mutated weight files and images, for the fuzz test of the doors that read them and for its longer run.

- `reference_weights` is a tiny timm ViT's state dict (random weights, no download); `weight_variants` the
  hypothesis strategy over what is done to it: a tensor's dtype (float64 holding 1e300, float16, int, bool,
  complex), values (NaN, inf), shape (a dim 0, flattened, a dim more), tensors deleted, added or renamed; then to
  its file: the safetensors header's length field, JSON values and data_offsets (shapes of 2**40 without data
  among them), a torch.save archive's entries recompressed, dropped or their sizes lied about, objects that are
  not tensors or that run code, truncation, flipped bytes, another format under the name; or the file replaced by a
  FIFO, a folder or a link; and the `config.json` beside it, which `create_vit` reads for `num_heads`.
- `image_variants` draws an image Pillow writes from a small random array: a format (the readable ones, EPS, PDF,
  ICO and Pillow's other writers), a mode (1 to HSV), values (NaN, inf, 1e38 in a float TIFF; 16- and 32-bit
  extremes), a size (1x1, very wide, a hand-written 0x0 or 12000x12000 PNG), EXIF orientations, several frames,
  then bytes truncated, flipped or prepended, a file name with a newline in it, or a FIFO, folder or link.
- `open_weights` and `open_image` run one door on a written variant and sort what happened into accepted,
  refused (`PretrainedError` / `ValueError` / `UnreadableImageError`, one line) or failed (any other exception, a
  hang, memory allocated before a refusal, a non-finite result, a marker file, a new file beside the variant).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import resource
import shutil
import struct
import traceback
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from checkpoint_mutations import Outcome, deadline
from hypothesis import strategies as st
from PIL import Image

from vit.data.images import IMAGE_FORMATS, UnreadableImageError, decode_image

DOOR_SECONDS = 30  # one weight file or image of a few KB opens in ~10-50 ms: half a minute means it hangs
# A door may hold this much more memory than before it ran. Above it an allocation fails in this process (a
# RuntimeError or MemoryError: a failure) instead of the machine swapping: a door must refuse before it allocates.
MEMORY_HEADROOM = 2 * 2**30
MEMORY_GROWTH = 2**30  # what the resident peak may grow by over a whole fuzz run
MARKER = "code_ran"  # the file code run from a variant would create, beside the variant


# --- Variants ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One step of making a variant: `label` shows it, `group` sorts it in a summary, `apply` does it."""

    label: str
    group: str
    apply: Callable[..., Any] = field(compare=False, repr=False)

    def __repr__(self) -> str:
        return self.label


AS_WRITTEN = Change("as written", "as written", lambda value, *rest: value)  # a step that changes nothing


@dataclass(frozen=True)
class Variant:
    """A file for a door: written by `steps` in turn (the first makes the file in a folder, each next one changes
    it and returns its path), shown as the steps' labels."""

    steps: tuple[Change, ...]
    write_first: Callable[[Path], Path] = field(compare=False, repr=False)

    def __repr__(self) -> str:
        return "; ".join(repr(step) for step in self.steps if step.label != "as written") or "as written"

    @property
    def group(self) -> str:
        """The summary's group: the last step that changed something, else the first."""
        changed = [step for step in self.steps if step.label != "as written"]
        return (changed[-1] if changed else self.steps[0]).group

    def write(self, folder: Path) -> Path:
        """A fresh `folder` holding only this variant's file (and what it puts beside it); returns the file."""
        if folder.exists() or folder.is_symlink():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        return self.write_first(folder)


# --- Weight files -----------------------------------------------------------------------------------------------

# The tiny ViT the weights are made from, and what the doors are told of it: width and depth come from the file,
# the heads from the `config.json` beside it (as `vit.export` writes one).
TINY_VIT = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=3)
BUILD = dict(img_size=32, patch_size=8, num_classes=3)
CONFIG = {"architecture": "vit_tiny_patch16_224", "model_args": {"num_heads": 2}}
WEIGHT_SUFFIXES = (".safetensors", ".pth")


def reference_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """`TINY_VIT`'s state dict as timm makes it (random weights): 32 tensors, 32K numbers."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_VIT)
    return {key: value.contiguous() for key, value in model.state_dict().items()}


class WritesAMarker:
    """Unpickles as a call to `exec` that creates the marker: what a malicious .pth file does when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def save_weights(state: dict, path: Path) -> None:
    """`state` as `safetensors.torch.save_file` or `torch.save` writes it, by `path`'s suffix."""
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)


# What a tensor is replaced by: another dtype (float64 1e300 is finite there and infinite in float32), values the
# loader must find, shapes the model must not be built from.
DTYPES = (
    "float64 1e300",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "float8_e4m3fn",
)
VALUES = ("nan", "inf", "-inf")
SHAPES = ("dim 0 first", "dim 0 last", "flattened", "a dim more", "each dim +1", "scalar")
RENAMES = ("{}_x", "module.{}", "backbone.{}", "blocks.1000000.{}", "{}.weight", "", "\0{}", "..{}")
EXTRA_KEYS = (
    "extra",
    "blocks.2.norm1.weight",
    "blocks.99999999.norm1.weight",
    "reg_token",
    "head_drop.x",
    "norm_pre.weight",
)


def _with_dtype(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "float64 1e300":
        return torch.full_like(tensor, 1e300, dtype=torch.float64)
    return tensor.to(getattr(torch, kind))


def _with_values(tensor: torch.Tensor, kind: str, everywhere: bool) -> torch.Tensor:
    changed = tensor.clone()
    if everywhere:
        changed.fill_(float(kind))
    else:
        changed.view(-1)[changed.numel() // 2] = float(kind)
    return changed


def _with_shape(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    shape = tuple(tensor.shape)
    return {
        "dim 0 first": lambda: torch.zeros(0, *shape[1:]),
        "dim 0 last": lambda: torch.zeros(*shape[:-1], 0),
        "flattened": lambda: tensor.reshape(-1).clone(),
        "a dim more": lambda: tensor[None].clone(),
        "each dim +1": lambda: torch.zeros(tuple(s + 1 for s in shape)),
        "scalar": lambda: torch.tensor(1.0),
    }[kind]()


def renamed(key: str, pattern: str) -> Change:
    new = pattern.format(key)
    return Change(
        f"{key} renamed {new!r}", "renamed", lambda state: {(new if k == key else k): v for k, v in state.items()}
    )


def state_changes(keys: list[str]) -> st.SearchStrategy[Change]:
    """A change to the state dict: one tensor's dtype, values or shape, or a tensor deleted, renamed or added."""
    key = st.sampled_from(keys)

    def at(key: str, label: str, group: str, change: Callable[[torch.Tensor], torch.Tensor]) -> Change:
        return Change(f"{key}: {label}", group, lambda state: {**state, key: change(state[key])})

    return st.one_of(
        st.just(AS_WRITTEN),
        st.builds(lambda k, d: at(k, f"as {d}", "dtype", lambda t: _with_dtype(t, d)), key, st.sampled_from(DTYPES)),
        st.builds(
            lambda k, v, e: at(
                k, f"{v} {'everywhere' if e else 'in one place'}", "values", lambda t: _with_values(t, v, e)
            ),
            key,
            st.sampled_from(VALUES),
            st.booleans(),
        ),
        st.builds(lambda k, s: at(k, s, "shape", lambda t: _with_shape(t, s)), key, st.sampled_from(SHAPES)),
        st.builds(
            lambda k: Change(f"{k} deleted", "deleted", lambda state: {x: v for x, v in state.items() if x != k}), key
        ),
        st.builds(renamed, key, st.sampled_from(RENAMES)),
        st.builds(
            lambda k: Change(f"{k} added", "added", lambda state: {**state, k: torch.zeros(1, 32)}),
            st.sampled_from(EXTRA_KEYS),
        ),
    )


def _split_safetensors(data: bytes) -> tuple[dict, bytes]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join_safetensors(header: Any, rest: bytes, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + rest


def _edit_bytes(edit: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def apply(path: Path) -> Path:
        path.write_bytes(edit(path.read_bytes()))
        return path

    return apply


def _first_tensor(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _last_tensor(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def _header_edit(where: str, value: Any) -> Change:
    """The JSON header of a safetensors file with `where` (`dtype`, `shape`, `data_offsets` of its first or last
    tensor, the entry itself, or a key `+name` added) set to `value`, the data left as it was."""

    def edit(data: bytes) -> bytes:
        header, rest = _split_safetensors(data)
        part, _, tensor = where.partition(" of ")
        if part.startswith("+"):
            header[part[1:]] = value
        else:
            name = _first_tensor(header) if tensor == "first" else _last_tensor(header)
            if part == "entry":
                header[name] = value
            elif part == "deleted":
                del header[name]
            else:
                header[name] = {**header[name], part: value(header[name][part]) if callable(value) else value}
        return _join_safetensors(header, rest)

    shown = "(computed)" if callable(value) else json.dumps(value)[:80]
    return Change(f"header {where} = {shown}", "safetensors header", _edit_bytes(edit))


def _raw_header(label: str, make: Callable[[dict, bytes], bytes]) -> Change:
    """The header replaced by the bytes `make(header, data)` returns (not necessarily JSON), its length field true."""
    return Change(
        f"header {label}",
        "safetensors header",
        _edit_bytes(lambda data: _join_safetensors(None, _split_safetensors(data)[1], make(*_split_safetensors(data)))),
    )


def _length_field(value: Callable[[int, int], int], label: str) -> Change:
    """The 8-byte header length set to `value(length, file size)`."""

    def edit(data: bytes) -> bytes:
        return (value(int.from_bytes(data[:8], "little"), len(data)) % 2**64).to_bytes(8, "little") + data[8:]

    return Change(f"header length = {label}", "safetensors length", _edit_bytes(edit))


HUGE_SHAPE = [2**20, 2**20, 2**20]  # 2**60 floats: said by a header, never held by a file


def safetensors_changes() -> list[Change]:
    """Changes to a safetensors file's header (`data_offsets` are `[begin, end]` after the header)."""
    changes = [_length_field(lambda n, size, v=v: v, str(v)) for v in (0, 1, 7, 2**32, 2**63, 2**64 - 1, 100_000_001)]
    changes += [
        _length_field(lambda n, size: n - 1, "length - 1"),
        _length_field(lambda n, size: n + 1, "length + 1"),
        _length_field(lambda n, size: size - 8, "size - 8"),
        _length_field(lambda n, size: size, "size"),
    ]
    for tensor in ("first", "last"):
        changes += [
            _header_edit(f"dtype of {tensor}", v)
            for v in ("F32x", "f32", "I4", "", 5, None, "F64", "BOOL", "U8", "C64")
        ]
        changes += [
            _header_edit(f"shape of {tensor}", v)
            for v in ([], [0], [-1], [1.5], ["2"], [True], HUGE_SHAPE, [2**63], [2**64], [0, 2**62], [2**62, 0])
        ]
        changes += [
            _header_edit(f"shape of {tensor}", (lambda s: list(reversed(s)))),
            _header_edit(f"shape of {tensor}", (lambda s: [*s, 1])),
            _header_edit(f"data_offsets of {tensor}", (lambda o: list(reversed(o)))),
            _header_edit(f"data_offsets of {tensor}", (lambda o: [o[0] + 4, o[1] + 4])),
            _header_edit(f"data_offsets of {tensor}", (lambda o: [0, o[1] - o[0]])),
            _header_edit(f"data_offsets of {tensor}", (lambda o: [o[0], 10**30])),
            _header_edit(f"data_offsets of {tensor}", (lambda o: [*o, 1])),
        ]
        changes += [_header_edit(f"data_offsets of {tensor}", v) for v in ([0, 0], [-1, 4], [0, 2**64], [], None)]
        changes += [_header_edit(f"entry of {tensor}", v) for v in ("x", [], None, {}, {"dtype": "F32"})]
        changes.append(_header_edit(f"deleted of {tensor}", None))
    huge = {"dtype": "F32", "shape": HUGE_SHAPE, "data_offsets": [0, 4 * 2**60]}
    changes.append(_header_edit("+huge", huge))
    changes += [_header_edit("+__metadata__", v) for v in ({"a": 1}, "x", [1, 2], None, {"format": ["pt"]})]
    changes += [
        _raw_header("a list", lambda h, d: b"[]"),
        _raw_header("a string", lambda h, d: b'"x"'),
        _raw_header("null", lambda h, d: b"null"),
        _raw_header("nested 100,000 deep", lambda h, d: b"[" * 100_000 + b"]" * 100_000),
        _raw_header("not UTF-8", lambda h, d: json.dumps(h).encode()[:-1] + b'\xff"}'),
        _raw_header("with trailing garbage", lambda h, d: json.dumps(h).encode() + b"}}"),
        _raw_header("padded with spaces", lambda h, d: json.dumps(h).encode() + b" " * 7),
        _raw_header("with a NUL byte", lambda h, d: json.dumps(h).encode()[:-1] + b"\0}"),
        _raw_header(
            "with the first tensor twice",
            lambda h, d: (
                json.dumps(h).encode()[:-1]
                + b", "
                + json.dumps({_first_tensor(h): {**h[_first_tensor(h)], "shape": HUGE_SHAPE}}).encode()[1:]
            ),
        ),
    ]
    return changes


def _central_directory(data: bytes) -> list[int]:
    """The offsets of a zip file's central directory records."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        start, count = archive.start_dir, len(archive.infolist())
    offsets, at = [], start
    for _ in range(count):
        offsets.append(at)
        names, extra, comment = struct.unpack_from("<HHH", data, at + 28)
        at += 46 + names + extra + comment
    return offsets


def _sizes_lied(entry: str, value: int) -> Change:
    """The central directory's sizes of the entry whose name ends with `entry` set to `value`."""

    def edit(data: bytes) -> bytes:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [info.filename for info in archive.infolist()]
        out = bytearray(data)
        for name, at in zip(names, _central_directory(data), strict=True):
            if name.endswith(entry):
                struct.pack_into("<II", out, at + 20, value, value)
        return bytes(out)

    return Change(f"zip entry *{entry}: sizes said to be {value}", "zip", _edit_bytes(edit))


def _rezipped(label: str, keep: Callable[[zipfile.ZipInfo], tuple[str, int] | None]) -> Change:
    """The archive rewritten entry by entry: `keep(info)` gives each one's new name and compression, or None to
    drop it."""

    def edit(data: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w") as target:
            for info in source.infolist():
                kept = keep(info)
                if kept is not None:
                    target.writestr(zipfile.ZipInfo(kept[0], info.date_time), source.read(info), compress_type=kept[1])
        return out.getvalue()

    return Change(f"zip {label}", "zip", _edit_bytes(edit))


def _token(state: dict) -> torch.Tensor:
    """The state's CLS token, or one of its shape where an earlier change removed it (changes compose)."""
    return state.get("cls_token", torch.zeros(1, 1, 32))


def _pickled(label: str, make: Callable[[dict, Path], Any]) -> Change:
    """The .pth file replaced by `torch.save(make(state, folder))`: what the file holds is not a state dict."""

    def apply(path: Path, state: dict) -> Path:
        torch.save(make(state, path.parent), path)
        return path

    return Change(f"torch.save of {label}", "pickle", apply)


def torch_changes() -> list[Change]:
    """Changes to a torch.save file: its zip entries, its pickle's objects, its legacy format."""
    stored, deflated = zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED
    changes = [
        _rezipped("every entry ZIP_DEFLATED", lambda i: (i.filename, deflated)),
        _rezipped("data.pkl ZIP_DEFLATED", lambda i: (i.filename, deflated if i.filename.endswith(".pkl") else stored)),
        _rezipped(
            "data/0 ZIP_DEFLATED", lambda i: (i.filename, deflated if i.filename.endswith("/data/0") else stored)
        ),
        _rezipped("without data/0", lambda i: None if i.filename.endswith("/data/0") else (i.filename, stored)),
        _rezipped("without data.pkl", lambda i: None if i.filename.endswith("data.pkl") else (i.filename, stored)),
        _rezipped("without version", lambda i: None if i.filename.endswith("/version") else (i.filename, stored)),
        _rezipped("under another folder", lambda i: ("x/" + i.filename.split("/", 1)[1], stored)),
        *(_sizes_lied(entry, value) for entry in ("data.pkl", "/data/0") for value in (0, 1, 0xFFFFFFFF)),
    ]
    changes += [
        Change(
            "torch.save of the state dict in its legacy format (a bare pickle)",
            "pickle",
            lambda path, state: (torch.save(state, path, _use_new_zipfile_serialization=False), path)[1],
        ),
        _pickled("{'state_dict': state}", lambda s, f: {"state_dict": s}),
        _pickled("{'model': state, 'epoch': 3}", lambda s, f: {"model": s, "epoch": 3}),
        _pickled("[state]", lambda s, f: [s]),
        _pickled("a tensor", lambda s, f: torch.zeros(3)),
        _pickled("{name: 1}", lambda s, f: {**s, "cls_token": 1}),
        _pickled("{name: 'x'}", lambda s, f: {**s, "cls_token": "x"}),
        _pickled("{name: None}", lambda s, f: {**s, "cls_token": None}),
        _pickled("{name: [tensor]}", lambda s, f: {**s, "cls_token": [_token(s)]}),
        _pickled("{name: {'a': tensor}}", lambda s, f: {**s, "cls_token": {"a": _token(s)}}),
        _pickled("{1: tensor}", lambda s, f: {**s, 1: _token(s)}),
        _pickled("a sparse tensor", lambda s, f: {**s, "cls_token": _token(s).to_sparse()}),
        _pickled("a 10**9-element stride-0 view", lambda s, f: {**s, "extra": torch.zeros(1).expand(10**9)}),
        _pickled(
            "a quantized tensor",
            lambda s, f: {**s, "cls_token": torch.quantize_per_tensor(_token(s), 0.1, 0, torch.qint8)},
        ),
        _pickled("an object that runs code", lambda s, f: {**s, "payload": WritesAMarker(f / MARKER)}),
    ]
    return changes


def _truncated(fraction: float) -> Change:
    return Change(
        f"truncated to {fraction:.3f} of its bytes",
        "truncated",
        _edit_bytes(lambda data: data[: int(len(data) * fraction)]),
    )


def _flipped(places: list[tuple[float, int]]) -> Change:
    def edit(data: bytes) -> bytes:
        out = bytearray(data)
        for fraction, xor in places:
            out[min(int(len(out) * fraction), len(out) - 1)] ^= xor
        return bytes(out)

    shown = ", ".join(f"{f:.3f}^{x:#x}" for f, x in places)
    return Change(f"bytes flipped at {shown}", "flipped", _edit_bytes(edit))


def _flipped_at(index: int, xor: int) -> Change:
    return Change(
        f"byte {index} ^ {xor:#x}",
        "flipped",
        _edit_bytes(
            lambda data: data[:index] + bytes([data[index] ^ xor]) + data[index + 1 :] if index < len(data) else data
        ),
    )


def byte_changes() -> st.SearchStrategy[Change]:
    """A file cut short, or a few of its bytes flipped anywhere, or one in its first 64 (where formats say what
    follows) as often."""
    fraction = st.floats(0, 1, exclude_max=True)
    return st.one_of(
        st.builds(_truncated, fraction),
        st.builds(_flipped, st.lists(st.tuples(fraction, st.integers(1, 255)), min_size=1, max_size=4)),
        st.builds(_flipped_at, st.integers(0, 63), st.integers(1, 255)),
    )


def _special(label: str, make: Callable[[Path], None]) -> Change:
    """The file replaced by `make(path)`: a FIFO (opening it for reading blocks), a folder, a link."""

    def apply(path: Path) -> Path:
        path.unlink()
        make(path)
        return path

    return Change(label, "special file", apply)


def special_files() -> list[Change]:
    return [
        _special("a FIFO", lambda p: os.mkfifo(p)),
        _special("a folder", lambda p: p.mkdir()),
        _special("an empty file", lambda p: p.write_bytes(b"")),
        _special("a link to /dev/zero", lambda p: p.symlink_to("/dev/zero")),
        _special("a dangling link", lambda p: p.symlink_to(p.parent / "missing")),
        _special("a link to itself", lambda p: p.symlink_to(p)),
        Change("a link to the file", "special file", _linked),
    ]


def _linked(path: Path) -> Path:
    """The file moved beside itself and `path` made a link to it (a link to a good file is a good file)."""
    real = path.with_name("real" + path.suffix)
    path.rename(real)
    path.symlink_to(real)
    return path


def other_format(suffix: str) -> Change:
    """The file's bytes as the other format writes them, under this suffix."""
    other = ".pth" if suffix == ".safetensors" else ".safetensors"

    def apply(path: Path, state: dict) -> Path:
        save_weights(state, path.with_suffix(other))
        path.with_suffix(other).rename(path)
        return path

    return Change(f"{other[1:]} bytes under {suffix}", "other format", apply)


CONFIGS = (
    "not JSON",
    "[]",
    '{"model_args": []}',
    '{"model_args": {"num_heads": "2"}}',
    '{"model_args": {"num_heads": 0}}',
    '{"model_args": {"num_heads": -2}}',
    '{"model_args": {"num_heads": 3}}',
    '{"model_args": {"num_heads": 1e300}}',
    '{"model_args": {"num_heads": true}}',
    '{"model_args": {"num_heads": null}}',
    '{"model_args": {"num_heads": 1099511627776}}',
    '{"model_args": {"num_heads": 2.5}}',
    "a FIFO",
    "a folder",
    "missing",
)


def config_change(text: str) -> Change:
    """The `config.json` beside the weights (where `create_vit` reads `num_heads`) replaced."""

    def apply(path: Path) -> Path:
        config = path.parent / "config.json"
        config.unlink()
        if text == "a FIFO":
            os.mkfifo(config)
        elif text == "a folder":
            config.mkdir()
        elif text != "missing":
            config.write_text(text)
        return path

    return Change(f"config.json: {text}", "config.json", apply)


def weight_variants(reference: dict[str, torch.Tensor]) -> st.SearchStrategy[Variant]:
    """A weight file made from `reference` (module doc): a format, a change to the state dict, then one to the file
    (as often none, a header or archive change, a byte change, another file in its place, or its config.json)."""
    keys = sorted(reference)
    headers, archives, specials = safetensors_changes(), torch_changes(), special_files()

    def file_changes(suffix: str) -> st.SearchStrategy[Change]:
        own = headers if suffix == ".safetensors" else archives
        return st.one_of(
            st.just(AS_WRITTEN),
            st.sampled_from(own),
            byte_changes(),
            st.sampled_from(specials),
            st.just(other_format(suffix)),
            st.sampled_from(CONFIGS).map(config_change),
        )

    def for_suffix(suffix: str) -> st.SearchStrategy[Variant]:
        return st.builds(weight_variant, st.just(reference), st.just(suffix), state_changes(keys), file_changes(suffix))

    return st.sampled_from(WEIGHT_SUFFIXES).flatmap(for_suffix)


def weight_variant(
    reference: dict[str, torch.Tensor], suffix: str, state_change: Change, file_change: Change
) -> Variant:
    """`reference` changed by `state_change`, saved as `weights<suffix>` with the `config.json` that names its heads,
    then its file changed by `file_change`."""

    def write(folder: Path) -> Path:
        path = folder / f"weights{suffix}"
        state = state_change.apply(dict(reference))
        save_weights(state, path)
        (folder / "config.json").write_text(json.dumps(CONFIG))
        takes_state = file_change.group in ("pickle", "other format")
        return file_change.apply(path, state) if takes_state else file_change.apply(path)

    return Variant((Change(suffix, suffix, None), state_change, file_change), write)


def notable_weight_variants(reference: dict[str, torch.Tensor]) -> list[Variant]:
    """The weight files an attacker or a broken download gives first, tried on every run."""
    variants = []
    for suffix in WEIGHT_SUFFIXES:

        def made(change: Change, state_change: Change = AS_WRITTEN, suffix: str = suffix) -> Variant:
            return weight_variant(reference, suffix, state_change, change)

        variants += [
            made(AS_WRITTEN),
            made(special_files()[0]),
            made(config_change("a FIFO")),
            made(_truncated(0.5)),
            made(
                AS_WRITTEN,
                Change(
                    "cls_token: as float64 1e300",
                    "dtype",
                    lambda s: {**s, "cls_token": _with_dtype(_token(s), "float64 1e300")},
                ),
            ),
            made(
                AS_WRITTEN,
                Change(
                    "cls_token: as float8_e4m3fn",
                    "dtype",
                    lambda s: {**s, "cls_token": _with_dtype(_token(s), "float8_e4m3fn")},
                ),
            ),
            made(
                AS_WRITTEN,
                Change(
                    "patch_embed.proj.weight: dim 0 first",
                    "shape",
                    lambda s: {**s, "patch_embed.proj.weight": torch.zeros(0, 3, 8, 8)},
                ),
            ),
            made(AS_WRITTEN, renamed("pos_embed", "blocks.1000000.{}")),
        ]
        if suffix == ".safetensors":
            variants += [
                made(_header_edit("+huge", {"dtype": "F32", "shape": HUGE_SHAPE, "data_offsets": [0, 4 * 2**60]})),
                made(_header_edit("shape of first", [0, 2**62])),
                made(_length_field(lambda n, size: 2**63, str(2**63))),
            ]
        else:
            variants += [
                made(c)
                for c in torch_changes()
                if c.label
                in (
                    "zip every entry ZIP_DEFLATED",
                    "torch.save of an object that runs code",
                    "torch.save of a 10**9-element stride-0 view",
                )
            ]
    return variants


# --- Images -----------------------------------------------------------------------------------------------------

IMAGE_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F", "LAB", "YCbCr", "HSV")
# Formats Pillow writes that `decode_image` must not read (EPS would hand its program to Ghostscript), beside the
# ones it reads.
OTHER_FORMATS = (
    "EPS",
    "PDF",
    "ICO",
    "PCX",
    "SGI",
    "IM",
    "DDS",
    "SPIDER",
    "QOI",
    "JPEG2000",
    "XBM",
    "MSP",
    "PALM",
    "ICNS",
)
EXTENSIONS = {"JPEG": "jpg", "JPEG2000": "jp2", "TIFF": "tif", "SPIDER": "spi"}
VALUE_KINDS = {
    "F": ("random", "zeros", "nan", "inf", "-inf", "1e38", "-1e38", "constant 5", "tiny"),
    "I": ("random", "zeros", "negative", "2**31 - 1", "-2**31"),
    "I;16": ("random", "zeros", "65535"),
}
SIZES = ((1, 1), (2, 3), (31, 17), (64, 64), (1, 3000), (3000, 1))  # (width, height)


@functools.cache
def writable_formats(mode: str, size: tuple[int, int]) -> tuple[str, ...]:
    """The formats Pillow writes an image of `mode` and `size` in (each tried once; ICO, for one, stops at 256)."""
    found = []
    image = make_image(mode, size, "zeros", 0)
    for fmt in (*IMAGE_FORMATS, *OTHER_FORMATS):
        with contextlib.suppress(Exception):
            image.save(io.BytesIO(), format=fmt)
            found.append(fmt)
    return tuple(found)


def make_image(mode: str, size: tuple[int, int], values: str, seed: int) -> Image.Image:
    """An image of `mode` and `size` (width, height) from a random array, or of the extreme `values` named."""
    rng = np.random.default_rng(seed)
    width, height = size
    if mode == "F":
        pixels = rng.random((height, width), dtype=np.float32)
        special = {
            "zeros": 0.0,
            "nan": math.nan,
            "inf": math.inf,
            "-inf": -math.inf,
            "1e38": 1e38,
            "-1e38": -1e38,
            "constant 5": 5.0,
        }
        if values in special:
            pixels.flat[pixels.size // 2] = special[values]
            if values in ("zeros", "constant 5"):
                pixels[:] = special[values]
        elif values == "tiny":
            pixels *= 1e-38
        return Image.fromarray(pixels)
    if mode in ("I", "I;16"):
        dtype, top = (np.int32, 2**31 - 1) if mode == "I" else (np.uint16, 65535)
        pixels = rng.integers(0, min(top, 65535), (height, width)).astype(dtype)
        fill = {"zeros": 0, "negative": -5, "2**31 - 1": 2**31 - 1, "-2**31": -(2**31), "65535": 65535}
        if values in fill:
            pixels[:] = fill[values]
        image = Image.fromarray(pixels)
        return image if image.mode == mode else image.convert(mode)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    if mode == "LAB":  # Pillow converts RGB to LAB only through ImageCms: its bytes are made directly
        return Image.frombytes("LAB", size, rgb.tobytes())
    return image if mode == "RGB" else image.convert(mode)


def png_bytes(width: int, height: int, rows: bytes, color_type: int = 0, bit_depth: int = 8) -> bytes:
    """A PNG file written by hand (chunks with their CRCs): sizes Pillow will not write, such as 0x0."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _bmp_patched(label: str, offset: int, fmt: str, value: int) -> Callable[[Path], Path]:
    """A 4x4 BMP with the header field at `offset` set to `value` (18: width, 22: height, 28: bits per pixel)."""

    def write(folder: Path) -> Path:
        data = io.BytesIO()
        make_image("RGB", (4, 4), "random", 0).save(data, format="BMP")
        out = bytearray(data.getvalue())
        struct.pack_into(fmt, out, offset, value)
        path = folder / "image.bmp"
        path.write_bytes(bytes(out))
        return path

    return write


def _eps_that_writes(folder: Path) -> Path:
    """An EPS whose PostScript program would create the marker if an interpreter ran it."""
    path = folder / "image.eps"
    marker = str(folder / MARKER)
    path.write_text(f"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 4 4\n({marker}) (w) file closefile\nshowpage\n")
    return path


def hand_written_images() -> list[tuple[str, Callable[[Path], Path]]]:
    """Files Pillow would not write: sizes 0 and huge, BMP fields out of range, a hostile EPS."""

    def png(name: str, width: int, height: int, rows: bytes) -> Callable[[Path], Path]:
        def write(folder: Path) -> Path:
            (folder / name).write_bytes(png_bytes(width, height, rows))
            return folder / name

        return write

    return [
        ("a 0x0 PNG", png("image.png", 0, 0, b"")),
        ("a 0x5 PNG", png("image.png", 0, 5, b"\0" * 5)),
        ("a PNG claiming 12000x12000 with one row", png("image.png", 12000, 12000, b"\0" * 12001)),
        ("a PNG claiming 30000x30000 (a decompression bomb)", png("image.png", 30000, 30000, b"\0" * 30001)),
        ("a PNG claiming 2**31-1 x 1", png("image.png", 2**31 - 1, 1, b"\0" * 100)),
        ("a BMP of width 0", _bmp_patched("width 0", 18, "<i", 0)),
        ("a BMP of height -4 (top-down)", _bmp_patched("height -4", 22, "<i", -4)),
        ("a BMP of width 2**30", _bmp_patched("width 2**30", 18, "<i", 2**30)),
        ("a BMP of 7 bits per pixel", _bmp_patched("bpp 7", 28, "<H", 7)),
        ("an EPS whose program writes a file", _eps_that_writes),
    ]


def _image_writer(
    fmt: str,
    mode: str,
    size: tuple[int, int],
    values: str,
    seed: int,
    frames: int,
    orientation: int | None,
    name: str | None,
) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        image = make_image(mode, size, values, seed)
        options: dict[str, Any] = {}
        if frames > 1:
            options.update(
                save_all=True, append_images=[make_image(mode, size, values, seed + i) for i in range(1, frames)]
            )
        if orientation is not None:
            exif = Image.Exif()
            exif[0x0112] = orientation
            options["exif"] = exif
        path = folder / (name or f"image.{EXTENSIONS.get(fmt, fmt.lower())}")
        data = io.BytesIO()  # some writers put the file's name inside (IM), where a name that is not ASCII fails
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Pillow's IM writer, deprecated, still a writer
            image.save(data, format=fmt, **options)
        path.write_bytes(data.getvalue())
        return path

    return write


def image_files() -> st.SearchStrategy[Change]:
    """The first step of an image variant: a mode, a format that writes it, values, a size, frames, an EXIF
    orientation and a file name; or a hand-written file."""

    @st.composite
    def drawn(draw) -> Change:
        mode, size = draw(st.sampled_from(IMAGE_MODES)), draw(st.sampled_from(SIZES))
        fmt = draw(st.sampled_from(writable_formats(mode, size)))
        values = draw(st.sampled_from(VALUE_KINDS.get(mode, ("random", "zeros"))))
        seed = draw(st.integers(0, 2**16))
        frames = draw(st.sampled_from((1, 1, 1, 2))) if fmt in ("GIF", "TIFF", "WEBP", "PNG", "PDF") else 1
        orientation = (
            draw(st.sampled_from((None, None, 1, 3, 6, 8, 0, 9, 65535)))
            if fmt in ("JPEG", "PNG", "WEBP", "TIFF")
            else None
        )
        name = draw(st.sampled_from((None, None, None, "image.jpg", "a\nb.png", "noext", "ímage ✓.png")))
        label = (
            f"{fmt} {mode} {size[0]}x{size[1]} {values}"
            + (f", {frames} frames" if frames > 1 else "")
            + (f", EXIF orientation {orientation}" if orientation is not None else "")
            + (f", named {name!r}" if name else "")
        )
        group = f"{fmt} {mode}" if fmt in IMAGE_FORMATS else f"{fmt} (not read)"
        return Change(label, group, _image_writer(fmt, mode, size, values, seed, frames, orientation, name))

    hand = [Change(label, "hand-written", write) for label, write in hand_written_images()]
    return st.one_of(drawn(), st.sampled_from(hand))


def image_byte_changes() -> st.SearchStrategy[Change]:
    junk = b"%!PS-Adobe-3.0 EPSF-3.0\n"
    return st.one_of(
        byte_changes(),
        st.just(Change("first 16 bytes zeroed", "flipped", _edit_bytes(lambda d: b"\0" * 16 + d[16:]))),
        st.just(Change("junk appended", "flipped", _edit_bytes(lambda d: d + os.urandom(64)))),
        st.just(Change("an EPS header prepended", "flipped", _edit_bytes(lambda d: junk + d))),
    )


def image_variants() -> st.SearchStrategy[Variant]:
    """An image file (module doc): written, then as often left as it is, its bytes changed, or replaced."""

    def made(first: Change, then: Change) -> Variant:
        return Variant((first, then), lambda folder: then.apply(first.apply(folder)))

    def then(first: Change) -> st.SearchStrategy[Change]:
        if first.group == "hand-written":
            return st.just(AS_WRITTEN)
        return st.one_of(st.just(AS_WRITTEN), image_byte_changes(), st.sampled_from(special_files()))

    return image_files().flatmap(lambda first: then(first).map(lambda change: made(first, change)))


def notable_image_variants() -> list[tuple[Variant, str]]:
    """Images tried on every run, each with what a door must do with it (`accepted` or `refused`): each hand-written
    file, formats not read, NaN and extremes in a float TIFF, a FIFO and the other files in an image's place."""

    def made(first: Change, then: Change = AS_WRITTEN) -> Variant:
        return Variant((first, then), lambda folder: then.apply(first.apply(folder)))

    def image(fmt: str, mode: str, values: str = "random", size: tuple[int, int] = (31, 17)) -> Change:
        return Change(
            f"{fmt} {mode} {size[0]}x{size[1]} {values}",
            f"{fmt} {mode}",
            _image_writer(fmt, mode, size, values, 0, 1, None, None),
        )

    # Pillow reads a PNG whose rows stop early as far as they go, and a top-down BMP as any other.
    readable = ("a PNG claiming 12000x12000 with one row", "a BMP of height -4 (top-down)")
    variants = [
        (made(Change(label, "hand-written", write)), "accepted" if label in readable else "refused")
        for label, write in hand_written_images()
    ]
    variants += [(made(image(fmt, "RGB")), "refused") for fmt in ("EPS", "PDF", "ICO", "PCX", "SGI")]
    variants += [
        (made(image("TIFF", "F", v)), "refused" if v in ("nan", "inf") else "accepted")
        for v in ("nan", "inf", "1e38", "-1e38", "constant 5")
    ]
    variants += [
        (made(image("PNG", "RGB"), change), "accepted" if change.label == "a link to the file" else "refused")
        for change in special_files()
    ]
    variants += [
        (made(image("PNG", "RGB")), "accepted"),
        (made(image("TIFF", "I", "-2**31")), "accepted"),
        (made(image("PNG", "I;16", "65535")), "accepted"),
    ]
    return variants


# --- The doors --------------------------------------------------------------------------------------------------


def _vm_bytes() -> int:
    """This process's virtual memory size (what RLIMIT_AS bounds)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def resident_peak() -> int:
    """This process's peak resident memory in bytes (`ru_maxrss`, KB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def bounded_memory(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Allocations past `headroom` more virtual memory fail (an exception, a failed variant), not the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _failure(err: BaseException) -> Outcome:
    lines = [line.strip() for line in traceback.format_exc().strip().splitlines() if line.strip(" ^~")]
    text = str(err)
    return Outcome("failed", f"{type(err).__name__}: {text[:300]} | {' | '.join(lines[-6:])}")


def _one_line(err: Exception) -> Outcome:
    text = str(err)
    return (
        Outcome("refused", text)
        if text and "\n" not in text
        else Outcome("failed", f"{type(err).__name__} of {len(text.splitlines())} lines: {text[:300]!r}")
    )


def _harm(folder: Path, before: set[str]) -> list[str]:
    found = []
    if (folder / MARKER).exists():
        found.append(f"the marker {folder / MARKER} exists: code named by the file ran")
    extra = sorted(set(os.listdir(folder)) - before) if folder.is_dir() else []
    if extra:
        found.append(f"new files beside the variant: {extra}")
    return found


def opened(door: Callable[[Path], Outcome], variant: Variant, folder: Path) -> Outcome:
    """`door(path)` of `variant` written in `folder`, under a deadline and a memory bound; failed when it left a
    marker or a new file, or when the process's resident peak grew by more than `MEMORY_GROWTH`."""
    path = variant.write(folder)
    before, peak = set(os.listdir(folder)), resident_peak()
    try:
        with bounded_memory(), deadline(DOOR_SECONDS):
            outcome = door(path)
    except Exception as err:  # noqa: BLE001  (the property: nothing but a one-line refusal escapes a door)
        outcome = _failure(err)
    grown = resident_peak() - peak
    harm = _harm(folder, before)
    if grown > MEMORY_GROWTH:
        harm.append(f"the resident peak grew by {grown / 2**20:.0f} MB")
    return outcome.with_harm(harm)


def weights_door(kind: str) -> Callable[[Path], Outcome]:
    """`create_vit(path, **BUILD)` (width and depth from the file, heads from its config.json) or `load_pretrained`
    into `TINY_VIT`'s model, then one forward pass: accepted with finite logits of shape (1, 3), refused with one
    `ValueError` line (`PretrainedError` is one)."""
    from vit.models.pretrained import create_vit, load_pretrained
    from vit.models.vision_transformer import VisionTransformer

    def door(path: Path) -> Outcome:
        try:
            if kind == "create_vit":
                model = create_vit(str(path), **BUILD)
            else:
                model = VisionTransformer(**TINY_VIT)
                load_pretrained(model, str(path))
        except ValueError as err:
            return _one_line(err)
        with torch.no_grad():
            logits = model.eval()(torch.zeros(1, 3, 32, 32))
        floats = [p for p in model.state_dict().values() if p.is_floating_point()]
        weights_finite = all(bool(torch.isfinite(p).all()) for p in floats)
        if logits.shape != (1, 3) or not weights_finite:
            return Outcome("failed", f"accepted, and its logits are {logits.tolist()}")
        if not torch.isfinite(logits).all():  # finite weights too large for float32 arithmetic: no value is wrong
            # to load, and every door that runs the model refuses its NaN output, naming the image (NonFiniteModelError)
            return Outcome("accepted", "finite weights whose logits overflow float32")
        return Outcome("accepted", f"{sum(p.numel() for p in model.parameters())} parameters")

    return door


def decode_door(path: Path) -> Outcome:
    """`decode_image(path, (32, 32))`: an "L" or "RGB" image, or a finite `(1, H, W)` tensor in [0, 1]; refused
    with one `UnreadableImageError` line."""
    try:
        image = decode_image(path, (32, 32))
    except UnreadableImageError as err:
        return _one_line(err)
    if isinstance(image, torch.Tensor):
        ok = (
            image.ndim == 3
            and image.shape[0] == 1
            and bool(torch.isfinite(image).all())
            and bool(((image >= 0) & (image <= 1)).all())
        )
        shown = f"a tensor {tuple(image.shape)} of {image.dtype}"
    else:
        ok, shown = image.mode in ("L", "RGB") and image.width > 0 and image.height > 0, f"a {image.mode} image"
    return Outcome("accepted", shown) if ok else Outcome("failed", f"decoded as {shown}: out of the contract")


def predict_door(predictor) -> Callable[[Path], Outcome]:
    """`predictor.predict(path)`: one prediction of a finite probability in [0, 1], or one unreadable-file line."""

    def door(path: Path) -> Outcome:
        try:
            [[prediction]] = predictor.predict(path)
        except UnreadableImageError as err:
            return _one_line(err)
        if not 0 <= prediction.probability <= 1:  # NaN fails this too
            return Outcome("failed", f"predicted {prediction}")
        return Outcome("accepted", f"{prediction.class_name} {prediction.probability:.3f}")

    return door
