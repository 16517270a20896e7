"""Pretrained weights as a state dict, from a local file, a Hugging Face Hub id or a timm model name: `load_state_dict`.
A `.safetensors` file, or a `torch.save` file read with `weights_only=True`, checked whole: complete, finite tensors.
A regular file only, its sizes read from its header or zip directory and bounded (`max_bytes`, which every file this
project reads shares) before its tensors are read."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from vit.checks import file_kind

_HUB_PREFIXES = ("hf-hub:", "hf_hub:")  # timm's source prefix, in both spellings timm reads
_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".bin", ".pt", ".ckpt", ".tar", ".npz")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?")  # org/name[@revision]
_FORMATS = ".safetensors, or a torch.save file (.pth, .pt, .bin, .ckpt, .tar)"
UNKNOWN_NAME = "pretrained={!r} is neither a file nor a timm model name (see timm.list_models(pretrained=True))"
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


def load_state_dict(source: str | os.PathLike, name: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict named by `source` (`source_kind`; timm downloads names and hub ids), checked to be finite;
    `name`: how messages name a local file (default `pretrained='<source>'`)."""
    kind = source_kind(source)
    state = _local(source, _read_file, name) if kind == "file" else _download(str(source), kind)
    for key, tensor in state.items():
        # A NaN or infinity in the weights would only show up later as a NaN loss, blamed on the learning rate.
        if not tensor.is_floating_point():
            continue
        if tensor.element_size() == 1:  # float8: torch.isfinite has no kernel for it, every value is exact in float32
            tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise PretrainedError(
                f"{name or f'pretrained={str(source)!r}'} is unusable: {key} holds NaN or "
                f"infinite values ({bad} of {tensor.numel()})"
            )
    return state


def weight_shapes(source: str | os.PathLike, name: str | None = None) -> dict[str, torch.Tensor]:
    """The weights at `source` as tensors on the meta device (names, shapes, dtypes), read from a .safetensors file's
    header without its data; other sources are loaded (`load_state_dict`)."""
    if source_kind(source) == "file":
        return _local(source, lambda path, shown: _read_file(path, shown, header_only=True), name)
    return load_state_dict(source, name)


def _local(source: str | os.PathLike, read, name: str | None = None) -> dict[str, torch.Tensor]:
    """`read(path, name)` of the local file `source` (a model folder: its `model.safetensors`, the weights of another
    run's model), its errors told that an `org/name` could be a Hub id."""
    path = Path(source).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file():
        path = path / "model.safetensors"
    try:
        return read(path, name or f"pretrained={str(source)!r}")
    except PretrainedError as err:
        if isinstance(source, str) and _REPO_ID.fullmatch(source) and not source.lower().endswith(_WEIGHT_SUFFIXES):
            # `org/name` is a Hub id unless a file or folder of that name exists; here one did.
            raise PretrainedError(
                f"{err}; it was read as a local path because {source} exists here: a Hugging "
                f"Face Hub id is written hf-hub:{source}"
            ) from None
        raise


def source_kind(source: str | os.PathLike) -> Literal["file", "hub", "name"]:
    """How `source` is read: `"file"` (a path that exists, or looks like one), `"hub"` (`hf-hub:org/name` or
    `org/name`), or `"name"` (a timm model name with an optional tag, `vit_small_patch16_224.augreg_in21k`)."""
    text = str(source)
    if not isinstance(source, str) or _exists(text):
        return "file"
    if text.lower().startswith(_HUB_PREFIXES):
        return "hub"
    if text.lower().endswith(_WEIGHT_SUFFIXES):
        return "file"
    if _REPO_ID.fullmatch(text):  # one slash, no leading `.` or `/`: `org/name`, as the Hub spells its ids
        return "hub"
    if any(c in text for c in "/\\:~"):
        return "file"
    return "name"


def _exists(text: str) -> bool:
    try:
        return Path(text).expanduser().exists()
    except (OSError, ValueError):  # a name over 255 bytes (ENAMETOOLONG) or with a NUL byte names no file
        return False


def max_bytes() -> int:
    """The most bytes of tensors a weights file may hold (unpacked): `READABLE_VIT_DOWNLOAD_MAX_BYTES`, as for a
    checkpoint, default 4 GiB."""
    value = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not value:
        return _DEFAULT_MAX_BYTES
    if not value.isdigit() or int(value) <= 0:
        raise PretrainedError(
            f"{MAX_BYTES_VARIABLE}={value!r} is not allowed: expected a whole number of bytes > 0 "
            f"(default {_DEFAULT_MAX_BYTES})"
        )
    return int(value)


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
    nonblocking = getattr(os, "O_NONBLOCK", 0)
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


def _read_file(path: Path, name: str, header_only: bool = False) -> dict[str, torch.Tensor]:
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
        size = _checked_size(f, name)
        if path.suffix.lower() == ".npz":
            raise _numpy_archive(name)
        if path.suffix == ".safetensors":
            return _read_safetensors(f, name, size, header_only)
        return _read_torch(f, name, size)


def _checked_size(f: BinaryIO, name: str) -> int:
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
        raise corrupted(f"its header is not JSON: {_first_line(err)}") from None
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
            raise PretrainedError(f"{name} cannot be loaded: it is corrupted ({_first_line(err)})") from None
        if entries is None:
            raise _truncated(name, "torch.save", size)
        members = [e.filename for e in entries]
        if members and all(m.endswith(".npy") for m in members):  # an .npz under another name
            raise _numpy_archive(name)
        if not any(m.endswith("data.pkl") for m in members):  # torch.save writes <name>/data.pkl, <name>/data/0, ...
            raise PretrainedError(
                f"{name} is a zip archive, but not one torch.save writes (it has no data.pkl): expected {_FORMATS}"
            )
        _check_entries(entries, name)
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
        raise PretrainedError(f"{name} cannot be loaded: it is corrupted ({_first_line(err)})") from None
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


def _check_entries(entries: list[zipfile.ZipInfo], name: str) -> None:
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


def _first_line(err: Exception) -> str:
    """`Type: first sentence` of an exception, short enough for a one-line message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0].split('. ')[0][:200]}" if text else type(err).__name__


def _download(source: str, kind: Literal["hub", "name"]) -> dict[str, torch.Tensor]:
    """The weights of a timm model name or hub id, as `timm.create_model(..., pretrained=True)` fetches them."""
    import timm

    # timm reads `hf-hub:org/name` (the repo's config.json names the architecture) and refuses a bare `org/name`.
    timm_name = "hf-hub:" + source.split(":", 1)[-1] if kind == "hub" else source
    try:
        return timm.create_model(timm_name, pretrained=True).state_dict()
    except RuntimeError as err:
        if kind == "name" and str(err).startswith("Unknown model"):
            raise PretrainedError(UNKNOWN_NAME.format(source)) from None
        if kind == "name" and str(err).startswith("Invalid pretrained tag"):
            model = source.split(".", 1)[0]
            tags = [t.split(".", 1)[1] for t in timm.list_pretrained(f"{model}.*")]
            raise PretrainedError(
                f"pretrained={source!r}: timm has no pretrained tag {source.split('.', 1)[1]!r} "
                f"for {model}; it has {tags}"
            ) from None
        raise _download_error(source, kind, err) from None
    except Exception as err:  # noqa: BLE001  (huggingface_hub and urllib raise many kinds when offline)
        raise _download_error(source, kind, err) from None


def _download_error(source: str, kind: Literal["hub", "name"], err: Exception) -> PretrainedError:
    repo = "<org>/<name>"
    if kind == "hub":
        repo = source.split(":", 1)[-1].split("@", 1)[0]
    else:
        with contextlib.suppress(Exception):  # the hint is a courtesy; the error below is what matters
            import timm

            repo = timm.models.get_pretrained_cfg(source).hf_hub_id or repo
    taken = " (taken for a Hugging Face Hub id: there is no file of that name)" if _REPO_ID.fullmatch(source) else ""
    return PretrainedError(
        f"the weights of {source!r}{taken} could not be downloaded ({_first_line(err)}). Without "
        f"network, download the file on a machine that has it (`hf download {repo} "
        "model.safetensors --local-dir weights`) and pass the file instead: "
        "pretrained=weights/model.safetensors"
    )
