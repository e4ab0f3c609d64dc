"""Benchmark helpers shared by bench/*.py: seeding, CUDA-event and graph-replay timing, the three bandwidths the
bound uses (measured in the same run), the bound, commit id, markdown output."""

from __future__ import annotations

import functools
import math
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

GB = 1e9


def seed_all(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


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


def capture_graph(fn: Callable[[], object], warmup: int, per_replay: int) -> torch.cuda.CUDAGraph:
    """`fn` called `warmup` times eagerly on a side stream, then captured `per_replay` times in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_replay):
            fn()
    return graph


def time_graph(fn: Callable[[], object], warmup: int = 3, iters: int = 20, per_replay: int = 1) -> float:
    """Median milliseconds of one call of `fn`, captured in a CUDA graph `per_replay` times and replayed."""
    graph = capture_graph(fn, warmup, per_replay)
    return time_cuda(graph.replay, warmup=2, iters=iters) / per_replay


def time_graphs(
    fns: dict[str, Callable[[], object]], rounds: int = 5, per_replay: int = 4, iters: int = 10
) -> dict[str, float]:
    """Milliseconds of one call of each of `fns`, for differences of a few µs between them: each is captured
    `per_replay` times in one graph (the CPU's launch of a replay is then outside all but the first copy), the
    graphs are timed in turn for `rounds` rounds (clock and thermal drift hit them alike), each round the median
    of `iters` replays; the result is the median over rounds. Captured after 2 eager warm-up calls each."""
    graphs = {name: capture_graph(fn, 2, per_replay) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(time_cuda(graph.replay, warmup=1, iters=iters) / per_replay)
    return {name: statistics.median(t) for name, t in times.items()}


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second measured in this run."""

    hbm_read: float  # device memory, streaming read
    host_zero_copy: float  # a kernel reading pinned host memory through its device address
    host_to_device_copy: float  # copy engine, pinned host -> device

    def describe(self) -> str:
        return (
            f"HBM read {self.hbm_read / GB:.0f} GB/s, zero-copy host read {self.host_zero_copy / GB:.1f} GB/s, "
            f"H2D copy {self.host_to_device_copy / GB:.1f} GB/s"
        )


def measure_bandwidths(nbytes: int = 1 << 30) -> Bandwidths:
    """Measure the three bandwidths the bound uses, on the current GPU."""
    dev = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device="cuda")
    host = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32).pin_memory()
    hbm_ms = _time_reads(dev, warmup=2, iters=5)
    zc_ms = _time_reads(host, warmup=2, iters=5)
    return Bandwidths(nbytes / (hbm_ms / 1e3), nbytes / (zc_ms / 1e3), copy_bandwidth(nbytes) * GB)


def read_bandwidth(t: torch.Tensor, reps: int = 5) -> float:
    """GB/s of a Triton streaming read of `t` (device, or pinned host read in place) into the GPU."""
    x = t.view(torch.int32).reshape(-1)
    ms = _time_reads(x, warmup=1, iters=reps)
    return x.numel() * 4 / (ms * 1e-3) / GB


_READ_PROGRAMS, _READ_BLOCK = 132 * 8, 1024
READS_PER_TIMING = 4


def _time_reads(x: torch.Tensor, warmup: int, iters: int) -> float:
    """Median milliseconds of one streaming read of `x` (device, or pinned host read in place through UVA):
    READS_PER_TIMING reads back to back between the events, into one output allocated here. The host's launch
    latency before the first read is then paid once per READS_PER_TIMING reads; timing one launch each, the GPU
    sat idle for it inside the timed region, which made the probe slower and every "% of bound" look better."""
    out = torch.empty(_READ_PROGRAMS * _READ_BLOCK, dtype=torch.int32, device="cuda")
    kernel = _read_kernel()

    def reads() -> None:
        for _ in range(READS_PER_TIMING):
            kernel[(_READ_PROGRAMS,)](x, out, x.numel(), BLOCK=_READ_BLOCK)

    return time_cuda(reads, warmup=warmup, iters=iters) / READS_PER_TIMING


@functools.cache
def _read_kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start.to(tl.int64) + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
        tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

    return _read


def bound_ms(miss_bytes: float, hit_bytes: float, bw: Bandwidths, host_path: str = "zero_copy") -> float:
    """DESIGN.md's bound for one step: miss bytes over PCIe plus hit bytes over HBM."""
    pcie = bw.host_zero_copy if host_path == "zero_copy" else bw.host_to_device_copy
    return 1e3 * (miss_bytes / pcie + hit_bytes / bw.hbm_read)


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched by `tokens` tokens routing top-k of E uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def commit_id(given: str = "") -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parents[1],  # the repository, wherever the bench is started from
            capture_output=True,
            text=True,
            check=True,
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


def write_progress(path: str | None, lines: list[str]) -> None:
    """Print the last of `lines` (a table row as it comes) and write all of them to `path` (if given)."""
    print("\n".join(lines[-1:]), flush=True)
    write(path, lines)


def write(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
