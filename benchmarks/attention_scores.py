"""Forward+backward time and peak memory of each attention score function, relative to scaled_dot.

    python benchmarks/attention_scores.py            # N=65 tokens, width 192, 3 heads, batch 128, CPU

Time: one attention layer, forward + backward, each score timed in turn, round after round in the
same process (so machine noise hits all of them alike); the median per score is divided by the
median of `scaled_dot` on its fused (SDPA) path. Memory: in a fresh subprocess per score, the
growth of the peak resident set size over one forward+backward (after the layer and input exist);
this includes the allocator's and the CPU kernels' own scratch, so read small numbers loosely. On
CUDA, the growth of `torch.cuda.max_memory_allocated` over a second step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from vit.commands import EitherSpelling
from vit.models.attention import Attention
from vit.models.scores import SCORES


def make(score: str, args) -> tuple[Attention, torch.Tensor]:
    torch.manual_seed(0)
    attn = Attention(args.width, num_heads=args.heads, attn_score=score, score_dim=args.score_dim).to(args.device)
    x = torch.randn(args.batch, args.tokens, args.width, device=args.device, requires_grad=True)
    return attn, x


def step(attn: Attention, x: torch.Tensor) -> None:
    attn(x).sum().backward()
    if x.is_cuda:
        torch.cuda.synchronize()


def hwm_kib() -> int:
    """This process's peak resident set size (KiB). Unlike `ru_maxrss`, it is not inherited from
    the parent process across fork + exec, so a subprocess measures only itself."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])


def peak_memory_mb(score: str, args) -> float:
    """Peak memory (MiB) of one forward+backward, measured in a fresh process."""
    code = f"""
import sys, json, torch
from benchmarks.attention_scores import make, step, parse, hwm_kib
args = parse({_cli(args)!r})
attn, x = make({score!r}, args)
if args.device == "cuda":
    step(attn, x)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(attn, x)
    print(json.dumps((torch.cuda.max_memory_allocated() - before) / 2**20))
else:
    before = hwm_kib()
    step(attn, x)
    print(json.dumps((hwm_kib() - before) / 1024))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli(args) -> list[str]:
    return [f"--{k}={v}" for k, v in vars(args).items() if k not in ("rounds", "no_memory")]


def parse(argv=None):
    p = EitherSpelling(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--score_dim", type=int, default=16, help="d_a of the additive forms")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no_memory", action="store_true")
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    models = {s: make(s, args) for s in SCORES}
    for s in SCORES:  # warm-up
        step(*models[s])
    times: dict[str, list[float]] = {s: [] for s in SCORES}
    for _ in range(args.rounds):
        for s in SCORES:
            t0 = time.perf_counter()
            step(*models[s])
            times[s].append(time.perf_counter() - t0)
    base = statistics.median(times["scaled_dot"])
    memory = {s: None for s in SCORES} if args.no_memory else {s: peak_memory_mb(s, args) for s in SCORES}

    print(
        f"one attention layer, forward+backward: B={args.batch} N={args.tokens} D={args.width} "
        f"H={args.heads} d_a={args.score_dim} on {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} rounds"
    )
    print(f"{'score':<11} {'path':<9} {'ms':>8} {'min-max ms':>15} {'x time':>7} {'peak MiB':>9} {'x mem':>6}")
    for s in SCORES:
        ms = [1e3 * t for t in times[s]]
        path = "fused" if s in ("scaled_dot", "dot", "general") else "explicit"
        mem = memory[s]
        mem_s = f"{mem:9.0f} {mem / memory['scaled_dot']:6.1f}" if mem is not None else f"{'-':>9} {'-':>6}"
        print(
            f"{s:<11} {path:<9} {statistics.median(ms):8.1f} {min(ms):7.1f}-{max(ms):<7.1f} "
            f"{statistics.median(times[s]) / base:7.2f} {mem_s}"
        )


if __name__ == "__main__":
    main()
