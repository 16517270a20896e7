"""Hostile pretrained weight files are refused in one line, before they cost time or memory: the checkpoint's rules."""

import json
import os
import resource
import stat
import sys
import threading
import time
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

import vit.models.weights
from vit.models.pretrained import create_vit, resolve_shape
from vit.models.vision_transformer import VisionTransformer
from vit.models.weights import MAX_BYTES_VARIABLE, PretrainedError, load_state_dict, open_regular_file

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
LIMIT = f"(set {MAX_BYTES_VARIABLE} to allow more)"


def small_state(dtype=torch.float32) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.to(dtype) for k, v in VisionTransformer(**SMALL).state_dict().items()}


def save(state: dict[str, torch.Tensor], path) -> str:
    """`state` written as safetensors or with torch.save, as `path`'s suffix says."""
    if str(path).endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    return str(path)


def write_safetensors(path, header: dict, data: bytes = b"") -> str:
    """A safetensors file by hand: the header's length (8 bytes, little-endian), its JSON, then the tensors' bytes."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return str(path)


def refused(call, *args, **kwargs) -> str:
    """The one-line message of the `PretrainedError` that `call` raises."""
    with pytest.raises(PretrainedError) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def within(seconds: float, fifo, call, *args, **kwargs):
    """`call(...)`'s exception or result, failing the test if it blocks `seconds` (then released by a writer)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001  (handed to the test)
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        with open(fifo, "wb"):  # a writer ends the blocked open, so the thread finishes
            pass
        thread.join(5)
        pytest.fail(f"{call.__name__} blocked on the named pipe {fifo}")
    return outcome


# 1. Named pipes and other files that are not regular files


@pytest.mark.parametrize("name", ["w.safetensors", "w.pth", "folder/model.safetensors"])
@pytest.mark.parametrize("sizes", [SMALL, {}], ids=["sizes given", "sizes from the file"])
def test_a_named_pipe_is_refused_at_once_naming_its_kind(tmp_path, name, sizes):
    fifo = tmp_path / name
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    source = str(tmp_path / "folder") if name.startswith("folder/") else str(fifo)
    outcome = within(10, fifo, create_vit, pretrained=source, **sizes)
    assert isinstance(outcome.get("error"), PretrainedError), outcome
    assert str(outcome["error"]) == (
        f"pretrained={source!r} is a named pipe (FIFO), not a regular file: model "
        "files are read from regular files only"
    )


def test_a_file_swapped_for_a_pipe_after_its_check_is_refused_by_the_open_file(tmp_path, monkeypatch):
    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    real_stat = os.stat

    def stat_before_the_swap(path, *args, **kwargs):  # the path was a regular file when it was checked
        result = real_stat(path, *args, **kwargs)
        if str(path) != str(fifo):
            return result
        return os.stat_result((stat.S_IFREG | 0o644, *tuple(result)[1:]))

    monkeypatch.setattr(vit.models.weights.os, "stat", stat_before_the_swap)
    outcome = within(10, fifo, open_regular_file, fifo, "pretrained='w.safetensors'")
    assert str(outcome.get("error")) == (
        "pretrained='w.safetensors' is a named pipe (FIFO), not a regular file: "
        "model files are read from regular files only"
    )


def test_a_device_is_refused_naming_its_kind():
    assert refused(load_state_dict, "/dev/zero") == (
        "pretrained='/dev/zero' is a character device, not a regular file: model files are read from regular files only"
    )


def test_the_cli_refuses_a_named_pipe_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, os.path.dirname(__file__))
    from robust_helpers import main_in_process, tiny_config

    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    config = tiny_config(tmp_path / "run")
    args = ["fit", "--config", str(config), "--model.pretrained", str(fifo)]
    outcome = within(60, fifo, main_in_process, args, monkeypatch)
    assert isinstance(outcome.get("error"), SystemExit) and outcome["error"].code == 2, outcome
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error: ")] == [
        f"error: pretrained={str(fifo)!r} is a named pipe (FIFO), not a regular file: model files are read from "
        "regular files only"
    ]
    assert not (tmp_path / "run" / "runs").exists()


# 2. Sizes from a header: bounded, backed by the file's bytes, compared on the meta device


def header_only_vit(path, width=4096, depth=48) -> str:
    """The header of a ViT of `width` and `depth` (9.7 B parameters at the defaults) whose tensors hold no bytes."""
    empty = {"dtype": "F32", "data_offsets": [0, 0]}
    header = {"patch_embed.proj.weight": {**empty, "shape": [width, 3, 16, 0]}}
    for i in range(depth):
        for name in ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"):
            header[f"blocks.{i}.{name}"] = {**empty, "shape": [0, width]}
    return write_safetensors(path, header)


def peak_memory_growth(call, *args, **kwargs) -> tuple[int, float]:
    """The growth of this process's peak resident memory (bytes) and the seconds taken while `call` runs."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, in KiB on Linux
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, time.perf_counter()
    call(*args, **kwargs)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale - before, time.perf_counter() - start


def test_a_header_only_giant_is_refused_fast_before_any_memory_is_spent(tmp_path):
    path = header_only_vit(tmp_path / "w.safetensors")
    messages = []
    growth, seconds = peak_memory_growth(
        lambda: messages.append(refused(create_vit, pretrained=path, img_size=224, patch_size=16, num_heads=64))
    )
    assert messages == [
        f"pretrained={path!r}: blocks.0.attn.qkv.weight has shape (0, 4096), and the width "
        "embed_dim=4096 of patch_embed.proj.weight needs (12288, 4096): its shapes are not those of "
        "one ViT of depth 48"
    ]
    assert seconds < 5 and growth < 2**30
    # `train.py fit` sizes the backbone by `resolve_shape` before building it: the same refusal.
    assert refused(resolve_shape, path, embed_dim=None, depth=None, num_heads=64) == messages[0]


def test_given_sizes_are_compared_with_the_header_on_the_meta_device(tmp_path):
    path = header_only_vit(tmp_path / "w.safetensors")
    messages = []
    growth, seconds = peak_memory_growth(
        lambda: messages.append(
            refused(create_vit, pretrained=path, img_size=224, patch_size=16, embed_dim=4096, depth=48, num_heads=64)
        )
    )
    assert messages[0].startswith(
        f"pretrained={path!r} does not fit this config (193 tensors differ): "
        "blocks.0.attn.proj.weight: (0, 4096) in the weights, (4096, 4096) here; "
    )
    assert seconds < 10 and growth < 2**30


def test_a_width_beyond_the_models_bounds_is_refused_naming_the_bound(tmp_path):
    path = header_only_vit(tmp_path / "w.safetensors", width=100_000, depth=1)
    assert refused(resolve_shape, path, embed_dim=None, depth=None, num_heads=1) == (
        f"pretrained={path!r}: the size its weights give is not allowed: embed_dim=100000 is not allowed: expected "
        "an int in [1, 65536]"
    )


@pytest.mark.parametrize(
    "header, data, reason",
    [
        (
            {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 0]}},
            b"",
            "w: data_offsets [0, 0] hold 0 bytes, and a F32 tensor of shape [4, 4] has 64",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            },
            bytes(16),
            "b: data_offsets [0, 16] do not start where the previous tensor ends (16)",
        ),
        (
            {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            bytes(32),
            "its tensors cover 16 of the 32 bytes after the header",
        ),
        ({"w": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}}, bytes(16), "w: expected a dtype of ["),
        (
            {"w": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}},
            b"",
            "w: shape [0, 4611686018427387904, 4611686018427387904] is too large for a tensor",
        ),
    ],
)
def test_a_header_that_its_bytes_do_not_match_is_refused(tmp_path, header, data, reason):
    path = write_safetensors(tmp_path / "w.safetensors", header, data)
    message = refused(load_state_dict, path)
    assert message.startswith(f"pretrained={path!r} is not a safetensors file, or it is corrupted ({reason}"), message


def test_tensors_the_file_cannot_hold_are_a_truncated_file(tmp_path):
    path = write_safetensors(
        tmp_path / "w.safetensors",
        {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4_000_000]}},
        bytes(100),
    )
    size = os.path.getsize(path)
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} is truncated: it starts like a safetensors file but its end is missing ({size} bytes; "
        "was its download or copy interrupted?)"
    )


def test_a_file_above_the_byte_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = save(small_state(), tmp_path / "w.safetensors")
    monkeypatch.setenv(MAX_BYTES_VARIABLE, "1000")
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} is {os.path.getsize(path)} bytes, above the limit of 1000 bytes {LIMIT}"
    )


def test_the_reader_gives_the_tensors_safetensors_itself_reads(tmp_path):
    state = {
        "f32": torch.randn(3, 4),
        "bf16": torch.randn(5).bfloat16(),
        "f16": torch.randn(2, 2).half(),
        "f64": torch.randn(3).double(),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(7).byte(),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    path = save(state, tmp_path / "w.safetensors")
    ours, reference = load_state_dict(path), load_file(path)
    assert sorted(ours) == sorted(reference)
    for key, value in reference.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        assert torch.equal(ours[key], value), key


# 3. Zip archives: the unpacked size from the central directory, before anything is read


def recompressed(path, target) -> str:
    """The torch.save archive at `path` with every entry recompressed with DEFLATE, as `target`."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for entry in source.infolist():
            out.writestr(entry.filename, source.read(entry.filename))
    return str(target)


@pytest.fixture
def no_torch_load(monkeypatch):
    """torch.load made to fail the test: the refusals here come from the zip's directory alone."""

    def load(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", load)


def test_a_deflate_bomb_is_refused_by_its_unpacked_size_before_it_is_read(tmp_path, monkeypatch, no_torch_load):
    torch.save({"w": torch.zeros(2**22)}, tmp_path / "plain.pth")  # 16 MiB of zeros
    path = recompressed(tmp_path / "plain.pth", tmp_path / "bomb.pth")
    assert os.path.getsize(path) < 2**16
    unpacked = sum(e.file_size for e in zipfile.ZipFile(path).infolist())
    monkeypatch.setenv(MAX_BYTES_VARIABLE, str(2**20))
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} unpacks to {unpacked} bytes, above the limit of {2**20} bytes {LIMIT}"
    )


def test_a_compressed_entry_is_refused_as_the_checkpoint_refuses_it(tmp_path, no_torch_load):
    torch.save(small_state(), tmp_path / "plain.pth")
    path = recompressed(tmp_path / "plain.pth", tmp_path / "deflated.pth")
    first = zipfile.ZipFile(path).infolist()[0].filename
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} has a compressed entry ({first}); torch.save stores its entries uncompressed, so "
        "another program wrote this file; refused"
    )


def test_views_of_one_small_storage_count_at_their_full_size(tmp_path):
    path = tmp_path / "expanded.pth"
    torch.save({"w": torch.zeros(1).expand(2**31)}, path)  # 4 bytes on disk, 8 GiB once converted or compared
    assert os.path.getsize(path) < 2**12
    assert refused(create_vit, pretrained=str(path), **SMALL) == (
        f"pretrained={str(path)!r} holds tensors of {2**33} bytes, above the limit of {4 * 2**30} bytes {LIMIT}"
    )
    # Under the limit, a view is still refused: 10**6 elements of one 4-byte storage are no model's weights.
    torch.save({"w": torch.zeros(1).expand(10**6)}, path)
    assert refused(create_vit, pretrained=str(path), **SMALL) == (
        f"pretrained={str(path)!r}: w of shape (1000000,) is a view whose 1000000 elements share 4 bytes of storage "
        "(strides (0,)); weights are tensors with memory of their own"
    )


# 4. Finite in the model's dtype, not only in the file's


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_float64_values_beyond_float32_are_refused_and_others_load_converted(tmp_path, suffix):
    state = small_state(torch.float64)
    good = create_vit(pretrained=save(state, tmp_path / f"good{suffix}"), **SMALL)
    for key, value in good.state_dict().items():  # float32 parameters, equal to the float64 values rounded
        assert value.dtype == torch.float32 and torch.equal(value, state[key].float()), key
    state["blocks.0.mlp.fc1.weight"].view(-1)[3] = 1e300  # finite in float64, infinite in float32
    path, numel = save(state, tmp_path / f"huge{suffix}"), state["blocks.0.mlp.fc1.weight"].numel()
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} is unusable: blocks.0.mlp.fc1.weight holds 1 of {numel} values that are not finite "
        "as this model's float32 (the weights' float64 values are beyond its range)"
    )


# 5. The kind of each tensor: floats for float parameters


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize(
    "key, dtype, kind", [("pos_embed", torch.int64, "integers"), ("blocks.0.attn.qkv.weight", torch.bool, "booleans")]
)
def test_an_integer_or_boolean_tensor_for_a_float_parameter_is_refused_naming_it(tmp_path, suffix, key, dtype, kind):
    state = small_state()
    state[key] = torch.ones_like(state[key], dtype=dtype)
    path = save(state, tmp_path / f"w{suffix}")
    assert refused(create_vit, pretrained=path, **SMALL) == (
        f"pretrained={path!r} is unusable: {key} is a tensor of {kind} ({str(dtype).removeprefix('torch.')}) in the "
        "weights and of floating-point numbers (float32) in this model; it is refused, not converted"
    )


def test_a_zip_of_a_version_zipfile_does_not_read_is_refused_as_corrupted(tmp_path):
    # Found by the input fuzzer: one flipped byte makes the archive ask for zip version 6.4, which zipfile raises
    # NotImplementedError for.
    from vit.models.weights import PretrainedError, load_state_dict

    path = tmp_path / "w.pth"
    torch.save({"w": torch.zeros(3)}, path)
    data = bytearray(path.read_bytes())
    data[data.find(b"PK\x01\x02") + 6] = 64  # "version needed to extract" of the first central-directory entry
    path.write_bytes(bytes(data))
    with pytest.raises(
        PretrainedError,
        match=r"cannot be loaded: it is corrupted \(NotImplementedError: zip file "
        r"version 6.4\)",
    ):
        load_state_dict(path)
