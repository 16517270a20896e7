"""Weight files as this project reads them: a regular file only (`open_regular_file`), its sizes read from its
header or zip directory and bounded (`max_bytes`, which every file this project reads shares) before its tensors are
read; a `.safetensors` file or a `torch.save` file (`weights_only=True`), checked whole: complete, finite tensors
(`read_file`). Also a model's `config.json`, strict and bounded (`read_json`)."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import BinaryIO

import torch

from vit.messages import file_kind

_FORMATS = ".safetensors, or a torch.save file (.pth, .pt, .bin, .ckpt, .tar)"

# One knob for every file read: weights, model folders, downloads and a run's checkpoints (`vit.artifact`).
MAX_BYTES_VARIABLE = "READABLE_VIT_DOWNLOAD_MAX_BYTES"

_DEFAULT_MAX_BYTES = 4 * 2**30

MAX_CONFIG_BYTES = 16 * 2**20  # 100,000 class names of 100 characters fit; a config.json is a few KB

MAX_PICKLE_BYTES = 256 * 2**20  # a state dict's data.pkl is a few KB: names, shapes, storage keys

_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header

# The safetensors format's dtype names (its specification), as torch names them.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


class PretrainedError(ValueError):
    """Pretrained weights that cannot be had or do not fit the config."""


def max_bytes() -> int:
    """The most bytes of tensors a weights file may hold (unpacked): `READABLE_VIT_DOWNLOAD_MAX_BYTES`, as for a
    checkpoint, default 4 GiB."""
    return whole_number(MAX_BYTES_VARIABLE, _DEFAULT_MAX_BYTES)


def whole_number(variable: str, default: int) -> int:
    """The whole number > 0 in the environment variable `variable` (a limit a user may raise), or `default`."""
    value = os.environ.get(variable, "").strip()
    if value and (not value.isdigit() or int(value) == 0):
        raise PretrainedError(f"{variable}={value!r} is not allowed: expected a whole number > 0 (default {default})")
    return int(value) if value else default


def read_json(path: Path, name: str) -> object:
    """The JSON value in the regular file `path` (a model's config.json): at most `MAX_CONFIG_BYTES`, strict (no
    NaN or Infinity, which JSON does not have); else `PretrainedError` naming `name`."""

    def no_constant(value: str) -> None:
        raise ValueError(f"{value} is not a JSON number")

    with open_regular_file(path, name) as f:
        text = f.read(MAX_CONFIG_BYTES + 1)
    if len(text) > MAX_CONFIG_BYTES:
        raise PretrainedError(f"{name} is larger than {MAX_CONFIG_BYTES // 2**20} MiB; a config.json is a few KB")
    try:
        return json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError) as err:
        raise PretrainedError(f"{name} is not valid JSON: {str(err).splitlines()[0][:200]}") from None


def open_regular_file(path: Path, name: str) -> BinaryIO:
    """`path` opened for reading, or `PretrainedError` unless it is a regular file: a named pipe would block the open
    until a writer came, and a device would never end. O_NONBLOCK and the `fstat` after opening keep a file swapped
    for a pipe after the first check from blocking either."""
    nonblocking = getattr(os, "O_NONBLOCK", 0)  # POSIX's flag (and O_BINARY, below, Windows'): 0 where absent
    try:
        kind = file_kind(os.stat(path).st_mode)
        if kind != "a file":
            raise _not_regular(name, kind)
        fd = os.open(path, os.O_RDONLY | nonblocking | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise PretrainedError(f"{name} cannot be read ({err.strerror})") from None
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind != "a file":
            raise _not_regular(name, kind)
        if nonblocking:
            os.set_blocking(fd, True)  # no effect on a regular file's reads: the usual flags again
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _not_regular(name: str, kind: str) -> PretrainedError:
    return PretrainedError(f"{name} is {kind}, not a regular file: model files are read from regular files only")


def read_file(path: Path, name: str, header_only: bool = False) -> dict[str, torch.Tensor]:
    """The state dict in a local file, or a `PretrainedError` saying what is wrong with the file; `header_only`: a
    .safetensors file's tensors on the meta device, its data not read."""
    if not path.exists():
        raise PretrainedError(f"{name}: there is no such file")
    if path.is_dir() and (path / "model.safetensors").exists():  # a Hub-layout folder, as `vit.export` writes
        path = path / "model.safetensors"
    elif path.is_dir():
        raise PretrainedError(
            f"{name} is a folder without a model.safetensors, not a weights file (.safetensors, .pth or .bin)"
        )
    with open_regular_file(path, name) as f:
        size = checked_size(f, name)
        if path.suffix.lower() == ".npz":
            raise _numpy_archive(name)
        if path.suffix == ".safetensors":
            return _read_safetensors(f, name, size, header_only)
        return _read_torch(f, name, size)


def checked_size(f: BinaryIO, name: str) -> int:
    """The size of the open file `f`, refused when empty or above `max_bytes()` (its tensors cannot be smaller)."""
    size, limit = os.fstat(f.fileno()).st_size, max_bytes()
    if size == 0:
        raise PretrainedError(f"{name} is empty (0 bytes)")
    if size > limit:
        raise _too_large(name, f"is {size} bytes", limit)
    return size


def _too_large(name: str, what: str, limit: int) -> PretrainedError:
    return PretrainedError(f"{name} {what}, above the limit of {limit} bytes (set {MAX_BYTES_VARIABLE} to allow more)")


def _numpy_archive(name: str) -> PretrainedError:
    return PretrainedError(
        f"{name} is a NumPy .npz archive (JAX / big_vision weights), a format not supported here: "
        f"expected {_FORMATS}. timm reads a big_vision ViT's .npz (timm.models.load_checkpoint("
        "model, path)); save that model's state_dict() with safetensors.torch.save_file and pass "
        "the .safetensors file"
    )


def _truncated(name: str, kind: str, size: int) -> PretrainedError:
    return PretrainedError(
        f"{name} is truncated: it starts like a {kind} file but its end is missing "
        f"({size} bytes; was its download or copy interrupted?)"
    )


def _safetensors_header(f: BinaryIO, name: str, size: int) -> tuple[dict[str, dict], int]:
    """The tensors' entries of a safetensors file (`{key: {"dtype", "shape", "data_offsets"}}`) and where their bytes
    start, each entry's byte count checked against its dtype and shape and all of them against the file's size."""

    def corrupted(reason: str) -> PretrainedError:
        return PretrainedError(f"{name} is not a safetensors file, or it is corrupted ({reason})")

    f.seek(0)
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else None
    if length is None or length > _MAX_HEADER_BYTES:
        raise corrupted("header too large" if length else "header too small")
    if 8 + length > size:  # a plausible header length that runs past the end: a file cut short
        raise _truncated(name, "safetensors", size)
    try:
        header = json.loads(f.read(length))
    except (ValueError, RecursionError) as err:
        raise corrupted(f"its header is not JSON: {error_summary(err)}") from None
    if not isinstance(header, dict):
        raise corrupted("its header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes, ends = size - 8 - length, []
    for key, entry in header.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if isinstance(entry, dict) else (None, None)
        if dtype not in _SAFETENSORS_DTYPES or not _whole_numbers(shape) or not _whole_numbers(offsets, 2):
            raise corrupted(
                f"{key}: expected a dtype of {sorted(_SAFETENSORS_DTYPES)}, a shape of whole numbers and "
                "data_offsets [begin, end]"
            )
        if math.prod(max(d, 1) for d in shape) >= 2**63:  # its strides would overflow torch's int64
            raise corrupted(f"{key}: shape {shape} is too large for a tensor")
        begin, end = offsets
        expected = math.prod(shape) * _SAFETENSORS_DTYPES[dtype].itemsize
        if end - begin != expected:
            raise corrupted(
                f"{key}: data_offsets {offsets} hold {end - begin} bytes, and a {dtype} tensor of shape "
                f"{shape} has {expected}"
            )
        ends.append((begin, end, key))
    ends.sort()
    if ends and ends[-1][1] > data_bytes:
        raise _truncated(name, "safetensors", size)
    # Back to back from 0 to the end: no tensor shares another's bytes, so the file's size bounds their memory.
    covered = 0
    for begin, end, key in ends:
        if begin != covered:
            raise corrupted(
                f"{key}: data_offsets [{begin}, {end}] do not start where the previous tensor ends ({covered})"
            )
        covered = end
    if covered != data_bytes:
        raise corrupted(f"its tensors cover {covered} of the {data_bytes} bytes after the header")
    return header, 8 + length


def _whole_numbers(value: object, count: int | None = None) -> bool:
    """Whether `value` is a list of ints >= 0 (not bools) that torch can hold (int64), of `count` items if given."""
    return (
        isinstance(value, list)
        and (count is None or len(value) == count)
        and all(type(v) is int and 0 <= v < 2**63 for v in value)
    )


def _read_safetensors(f: BinaryIO, name: str, size: int, header_only: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, read from the open file `f` after its header passed `_safetensors_header`
    (on the meta device when `header_only`)."""
    header, start = _safetensors_header(f, name, size)
    state = {}
    for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        dtype, shape, (begin, end) = _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if header_only or end == begin:
            state[key] = torch.empty(shape, dtype=dtype, device="meta" if header_only else "cpu")
            continue
        data = bytearray(end - begin)
        f.seek(start + begin)
        if f.readinto(data) != len(data):  # the file shrank since its size was read
            raise _truncated(name, "safetensors", size)
        state[key] = torch.frombuffer(data, dtype=dtype).reshape(shape)  # the format is little-endian, as torch here
    return state


def _read_torch(f: BinaryIO, name: str, size: int) -> dict[str, torch.Tensor]:
    # torch.save writes a zip archive (its table of contents at the end), or a bare pickle in its legacy format.
    f.seek(0)
    head = f.read(8)
    if head.startswith(b"PK\x03\x04"):
        try:
            entries = zipfile.ZipFile(f).infolist() if zipfile.is_zipfile(f) else None
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as err:  # a version zipfile lacks
            raise PretrainedError(f"{name} cannot be loaded: it is corrupted ({error_summary(err)})") from None
        if entries is None:
            raise _truncated(name, "torch.save", size)
        members = [e.filename for e in entries]
        if members and all(m.endswith(".npy") for m in members):  # an .npz under another name
            raise _numpy_archive(name)
        if not any(m.endswith("data.pkl") for m in members):  # torch.save writes <name>/data.pkl, <name>/data/0, ...
            raise PretrainedError(
                f"{name} is a zip archive, but not one torch.save writes (it has no data.pkl): expected {_FORMATS}"
            )
        check_zip_entries(entries, name)
    elif not head.startswith(b"\x80"):  # the pickle protocol opcode
        raise PretrainedError(
            f"{name} is not a PyTorch weights file (neither the zip archive torch.save writes "
            f"nor a pickle): expected {_FORMATS}"
        )
    try:
        f.seek(0)
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise PretrainedError(
                f"{name} holds Python objects, not only tensors (it asks for {found[1]}); loading it "
                "could run arbitrary code, so it is refused. Pass a state dict saved with "
                "torch.save(model.state_dict(), path), or a .safetensors file"
            ) from None
        raise PretrainedError(f"{name} is not a PyTorch weights file, or it is corrupted") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError or OSError for damaged archives)
        raise PretrainedError(f"{name} cannot be loaded: it is corrupted ({error_summary(err)})") from None
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise PretrainedError(f"{name} does not hold a state dict (a mapping of names to tensors)")
    _check_tensors(state, name)
    return {k.removeprefix("module.").removeprefix("backbone."): v for k, v in state.items()}


def check_zip_entries(entries: list[zipfile.ZipInfo], name: str) -> None:
    """The checkpoint's rules for a zip archive, from its central directory before anything is unpacked: at most
    `max_bytes()` unpacked (a zip bomb is small on disk), `MAX_PICKLE_BYTES` of pickle, no compressed entry."""
    limit, total = max_bytes(), sum(e.file_size for e in entries)
    if total > limit:
        raise _too_large(name, f"unpacks to {total} bytes", limit)
    pickled = sum(e.file_size for e in entries if e.filename.endswith(".pkl"))
    if pickled > MAX_PICKLE_BYTES:
        raise PretrainedError(
            f"{name} has {pickled} bytes of pickle beside its tensors (a state dict's names and "
            f"shapes take a few KB; limit {MAX_PICKLE_BYTES}); refused"
        )
    compressed = next((e for e in entries if e.compress_type != zipfile.ZIP_STORED), None)
    if compressed is not None:
        raise PretrainedError(
            f"{name} has a compressed entry ({compressed.filename}); torch.save stores its entries "
            "uncompressed, so another program wrote this file; refused"
        )


def _check_tensors(state: dict[str, torch.Tensor], name: str) -> None:
    """Dense tensors of at most `max_bytes()` in all: a pickle may make many tensors, or stride-0 ones, of one
    small storage, and each would take its full size once converted or compared."""
    odd = next((k for k, v in state.items() if v.layout != torch.strided or v.is_quantized), None)
    if odd is not None:
        raise PretrainedError(f"{name}: {odd} is a {state[odd].layout} tensor; weights are dense tensors")
    limit, total = max_bytes(), sum(v.numel() * v.element_size() for v in state.values())
    if total > limit:
        raise _too_large(name, f"holds tensors of {total} bytes", limit)
    for key, tensor in state.items():
        stored = tensor.untyped_storage().nbytes()
        if tensor.numel() * tensor.element_size() > stored:  # elements sharing memory: a stride-0 view
            raise PretrainedError(
                f"{name}: {key} of shape {tuple(tensor.shape)} is a view whose "
                f"{tensor.numel()} elements share {stored} bytes of storage (strides "
                f"{tensor.stride()}); weights are tensors with memory of their own"
            )


def error_summary(err: Exception) -> str:
    """`Type: first sentence` of an exception, short enough for a one-line message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0].split('. ')[0][:200]}" if text else type(err).__name__
