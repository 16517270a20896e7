"""`benchmarks/gpu_check.py`, run tiny on a CPU: the plumbing of the GPU check (the recipes through the CLI, the
table)."""

import re

import pytest

from benchmarks import gpu_check

pytestmark = pytest.mark.slow  # starts two training runs (in this process)

NUMBER = r"\d+\.\d+"


def test_tiny_cpu_run_prints_every_row_with_numbers(tmp_path, capsys):
    out = tmp_path / "gpu_check.md"
    status = gpu_check.main([
        "--device", "cpu", "--steps", "3", "--batch_size", "8", "--num_train", "64", "--num_workers", "0",
        "--skip_compile", "--repeats", "2", "--bench_steps", "1", "--warmup", "1", "--out", str(out),
    ])  # fmt: skip
    printed = capsys.readouterr().out
    report = out.read_text()
    # The file holds the printed table, under a title and the command.
    assert printed.endswith(report.split("\n\n", 2)[2])

    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    for name in ("ViT, eager", "ResNet, eager"):
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        _, params, start, end, fell, steps_per_s, _, peak = cells
        assert all(re.fullmatch(NUMBER, v) for v in (params, start, end, steps_per_s)), rows[name]
        assert fell == ("yes" if float(end) < float(start) else "**NO**")
        assert peak == "n/a (CPU)"
    assert "skipped (--skip_compile)" in rows["ViT, compiled"]
    assert re.search(rf"\| ours \| \d+ \[\d+-\d+\] \| {NUMBER} \[{NUMBER}-{NUMBER}\] \|", report)
    assert rows["timm"].startswith("| timm |")
    assert re.search(r"torch \S+, timm \S+, lightning \S+", report)
    assert "precision 32-true" in report
    # The exit status says whether every loss fell.
    all_fell = all("| yes |" in rows[name] for name in ("ViT, eager", "ResNet, eager"))
    assert status == (0 if all_fell else 1)


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cuda"])
    assert exit_info.value.code == 2
