"""Benchmark helpers shared by bench/*.py (the kernel bench's read_bandwidth / random_rows / time_graph live in
bench/kernels.py): event timing, the H2D copy bandwidth, the bound, commit id, markdown output."""

from __future__ import annotations

import math
import statistics
import subprocess
from collections.abc import Callable

import torch


def time_cuda(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of `fn` timed with CUDA events (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a pinned host -> device copy on the copy engine (the staging path)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ms = time_cuda(lambda: dev.copy_(host, non_blocking=True))
    return nbytes / (ms * 1e-3) / 1e9


def bound_ms(miss_bytes: float, hit_bytes: float, pcie_gbs: float, hbm_gbs: float) -> float:
    """DESIGN.md's bound for one step: miss bytes over PCIe plus hit bytes over HBM."""
    return 1e3 * (miss_bytes / (pcie_gbs * 1e9) + hit_bytes / (hbm_gbs * 1e9))


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched by `tokens` tokens routing top-k of E uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def commit_id(given: str = "") -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_table(title: str, header: list[str], rows: list[list[object]]) -> str:
    """Print and return a markdown table."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if math.isfinite(v) else "-"
        return str(v)

    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
