"""Benchmark helpers: seeded inputs, CUDA-event / graph-replay timing, bandwidth probes, the bound, a table."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

GB = 1e9


def seed_all(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def time_cuda(fn: Callable[[], object], warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of `fn` timed with CUDA events (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(fn: Callable[[], object], warmup: int = 3, iters: int = 20, per_replay: int = 1) -> float:
    """Median milliseconds of one call of `fn`, captured in a CUDA graph `per_replay` times and replayed."""
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
    return time_cuda(graph.replay, warmup=2, iters=iters) / per_replay


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second measured in this run."""

    hbm_read: float  # device memory, streaming read (sum reduction over a large tensor)
    host_zero_copy: float  # a kernel reading pinned host memory through its device address
    host_to_device_copy: float  # copy engine, pinned host -> device

    def describe(self) -> str:
        return (
            f"HBM read {self.hbm_read / GB:.0f} GB/s, zero-copy host read {self.host_zero_copy / GB:.1f} GB/s, "
            f"H2D copy {self.host_to_device_copy / GB:.1f} GB/s"
        )


def measure_bandwidths(nbytes: int = 1 << 30) -> Bandwidths:
    """Measure the three bandwidths the bound uses, on the current GPU."""
    numel = nbytes // 2
    dev = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    host = torch.randn(numel, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty_like(dev)
    hbm_ms = time_cuda(lambda: dev.sum(dtype=torch.float32))
    copy_ms = time_cuda(lambda: dst.copy_(host, non_blocking=True))
    zc_ms = time_cuda(lambda: _zero_copy_read(host), iters=5)
    return Bandwidths(nbytes / (hbm_ms / 1e3), nbytes / (zc_ms / 1e3), nbytes / (copy_ms / 1e3))


def _zero_copy_read(host: torch.Tensor) -> torch.Tensor:
    """Sum a pinned host tensor with a Triton kernel that reads it in place (UVA)."""
    import triton

    out = torch.zeros(1, device="cuda", dtype=torch.float32)
    block = 8192
    _read_kernel()[(triton.cdiv(host.numel(), block),)](host, out, host.numel(), BLOCK=block)
    return out


@functools.cache
def _read_kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def _read(src, out, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n, other=0.0)
        tl.atomic_add(out, tl.sum(x.to(tl.float32), axis=0))

    return _read


def bound_ms(miss_bytes: float, hit_bytes: float, bw: Bandwidths, host_path: str = "zero_copy") -> float:
    """DESIGN.md bound for one step: miss bytes over PCIe plus hit bytes over HBM."""
    pcie = bw.host_zero_copy if host_path == "zero_copy" else bw.host_to_device_copy
    return 1e3 * (miss_bytes / pcie + hit_bytes / bw.hbm_read)


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched by `tokens` tokens routing top-k of E uniformly."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


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
