"""Prefill benchmark (GPU): a model-shaped stack of pooled MoE layers, one prefill step, five ways.

Modes per (shape, format, pool fraction, step tokens):
  resident   every expert in VRAM (the compute floor of the step)
  host_view  non-resident experts read in place from the pinned bank by the kernel (once per M-block)
  page_in    SGLang paged experts' per-layer slots (`bench/baseline_slots.py` `PerLayerSlots`): copy-then-compute in
             host-planned waves of at most S experts per layer (resident experts first), LRU per layer, at equal
             VRAM: S = (R + the stager's ring of chunk buffers, in experts) // L slots per layer, at most E
             (table column 'slots/layer'; the same bank as host_view). `--layers-model N` sizes S for a model of
             N layers instead (R = pool fraction * E * N): the equal-VRAM split of a real model's depth.
  stage_sync prefill staging, each chunk copied on the compute stream when needed (no prefetch)
  stage      prefill staging: routed non-resident experts streamed through the ring of chunk buffers, copies on a
             side stream ahead of the compute, the next layer's first chunks prefetched (the default)
Bound = max(resident time, non-resident bytes / measured H2D copy bandwidth), both measured in this run.
Pool rows are spread evenly over the layers (expert-major fill), routing is softmax top-k of random logits,
the step is timed with CUDA events around all layers (host-side plans included), median of a few runs.
`tests/test_prefill_bench.py` runs every mode on the CPU at a tiny shape (outputs against the resident stack).

Usage: python -m bench.prefill [--quick] [--shapes qwen3] [--formats bf16,int4-g128] [--chunk-experts 16]
       [--layers-model 48] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import time
from collections.abc import Callable

import torch

from bench.baseline_slots import PerLayerSlots
from bench.common import commit_id, copy_bandwidth, print_table, read_bandwidth, write
from bench.decode_steps import StepTimer, empty_cache, sync
from bench.kernels import random_rows
from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.staging import LayerStager

Dims = tuple[int, int, int, int, int]  # H, I, E, top_k, layers
SHAPES: dict[str, Dims] = {  # DeepSeek-like dims with fewer experts to keep the bank small
    "qwen3": (2048, 768, 128, 8, 8),
    "deepseek": (7168, 2048, 64, 8, 3),
}
MODES = ("resident", "host_view", "page_in", "stage_sync", "stage")
# layer, hidden [T, H], topk_ids [T, K], topk_weights [T, K] -> [T, H]
Forward = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Routes = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per layer: hidden, ids, weights


def pool_rows(dims: Dims, rows_frac: float) -> int:
    E, K, L = dims[2], dims[3], dims[4]
    return max(K, int(rows_frac * E * L))


DEFAULT_CHUNK = PoolConfig(pool_rows=1, device="cpu").staging_chunk_experts  # the flag's default


def ring_experts(dims: Dims, chunk_experts: int = DEFAULT_CHUNK) -> int:
    """Expert rows of VRAM in `stage`'s ring: NUM_BUFFERS chunks of C (cut to E, as PooledMoE does)."""
    return LayerStager.NUM_BUFFERS * min(chunk_experts, dims[2])


def page_in_slots(
    dims: Dims, rows_frac: float, chunk_experts: int = DEFAULT_CHUNK, layers_model: int | None = None
) -> int:
    """Slots per layer of the page-in baseline at the VRAM of `stage`: pool rows + the ring of chunk buffers.

    `layers_model`: split that VRAM over a model of that many layers (its pool: `rows_frac` of its experts).
    """
    E, K, L = dims[2], dims[3], dims[4]
    depth = layers_model or L
    rows = pool_rows((*dims[:4], depth), rows_frac)
    return max(K, min(E, (rows + ring_experts(dims, chunk_experts)) // depth))


def build(
    dims: Dims,
    fmt: str,
    rows_frac: float,
    mode: str,
    g: torch.Generator,
    device: str = "cuda",
    staging_min_tokens: int = 256,
    chunk_experts: int = DEFAULT_CHUNK,
) -> PooledMoE:
    """The pooled stack for `mode` (not page_in: see `build_page_in`), random rows made on `device`."""
    H, I, E, K, L = dims
    rows = E * L if mode == "resident" else pool_rows(dims, rows_frac)
    staging = mode in ("stage", "stage_sync")
    cfg = PoolConfig(
        pool_rows=rows,
        weight_format=fmt,
        device=device,
        prefill_staging=staging,
        staging_min_tokens=staging_min_tokens,
        staging_chunk_experts=chunk_experts,
    )
    moe = PooledMoE(cfg, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(L):
        moe.register_layer(E)
    moe.allocate()
    assert moe._storage is not None
    for layer in range(L):  # random rows made on the device, copied into the bank (or rows) layer by layer
        layer_rows = random_rows(fmt, H, I, E, device, g)
        for name, t in layer_rows.items():
            moe._storage[name][layer * E : (layer + 1) * E].copy_(t)
    moe.finalize(priority=[(layer, e) for e in range(E) for layer in range(L)])
    if mode == "stage_sync":
        assert moe.stager is not None and moe.bank is not None and moe.pool is not None
        moe.stager = LayerStager(
            moe.operands,
            moe.bank,
            moe.pool.num_rows,
            torch.device(device),
            staging_min_tokens,
            moe.stager.chunk_experts,
            prefetch=False,
        )
    return moe


def build_page_in(host_view: PooledMoE, fmt: str, num_slots: int) -> PerLayerSlots:
    """The page-in baseline over the bank of a host_view stack (so both read the same experts)."""
    assert host_view.bank is not None, "the host_view stack has no bank (every expert resident)"
    device = host_view.config.torch_device.type
    H, I, K = host_view.hidden_size, host_view.intermediate_size, host_view.top_k
    return PerLayerSlots(host_view.bank, fmt, torch.bfloat16, H, I, device, num_slots=num_slots, top_k=K)


def pooled_forward(moe: PooledMoE) -> Forward:
    """A prefill step's layer call: misses read in place or from the staging buffer, never admitted."""
    return lambda layer, x, ids, w: moe.forward(layer, x, ids, w, admit_misses=False)


def make_routes(dims: Dims, T: int, g: torch.Generator, device: str) -> Routes:
    """Per layer: hidden [T, H] bf16, softmax top-k ids and weights [T, K] of random logits."""
    H, _, E, K, L = dims
    routes = []
    for _ in range(L):
        x = torch.randn(T, H, generator=g, device=device).bfloat16()
        logits = torch.randn(T, E, generator=g, device=device)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        routes.append((x, ids, w))
    return routes


def run_stack(forward: Forward, routes: Routes) -> list[torch.Tensor]:
    """One prefill step through every layer; each layer's output."""
    return [forward(layer, x, ids, w) for layer, (x, ids, w) in enumerate(routes)]


def step_ms(forward: Forward, routes: Routes, device: torch.device, repeats: int = 3) -> float:
    """Median ms of one step over `repeats` runs, after one untimed run (compiles, warms up)."""
    run_stack(forward, routes)
    times = []
    timer = StepTimer(device)
    for _ in range(repeats):
        sync(device)
        timer.start()
        run_stack(forward, routes)
        times.append(timer.stop())
    return statistics.median(times)


def nonresident_bytes(moe: PooledMoE) -> int:
    assert moe.pool is not None
    host = int((moe.pool.l2p_host >= moe.pool.num_rows).sum())
    return host * moe.pool.row_bytes


def measure_case(
    dims: Dims,
    fmt: str,
    frac: float,
    tokens: list[int],
    g: torch.Generator,
    device: str = "cuda",
    staging_min_tokens: int = 256,
    chunk_experts: int = DEFAULT_CHUNK,
    num_slots: int | None = None,
    pcie_gb: dict[str, float] | None = None,
) -> tuple[dict[str, dict[int, float]], float, float]:
    """Every mode's step ms per token count, the non-resident GB, and the page-in waves per layer step.

    One system at a time (each holds its own bank), except page_in, which runs over host_view's bank (with
    `num_slots` per layer; default `page_in_slots`). `pcie_gb` (if given) receives the GB copied over PCIe per
    step, averaged over the timed steps, for "stage" (rows staged) and "page_in" (slot copies).
    """
    if num_slots is None:
        num_slots = page_in_slots(dims, frac, chunk_experts)
    dev = torch.device(device)
    t: dict[str, dict[int, float]] = {}
    miss_gb, waves = 0.0, float("nan")
    # one set of routes per prompt length for every mode: the ratios between modes compare the same step
    routes = {T: make_routes(dims, T, g, device) for T in tokens}
    for mode in MODES:
        if mode == "page_in":
            continue  # measured right after host_view, over its bank
        moe = build(dims, fmt, frac, mode, g, device, staging_min_tokens, chunk_experts)
        if mode == "stage":
            miss_gb = nonresident_bytes(moe) / 1e9
        t0 = time.perf_counter()
        t[mode] = {T: step_ms(pooled_forward(moe), routes[T], dev) for T in tokens}
        print(f"  {fmt} {frac:.0%} {mode}: {t[mode]} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if mode == "stage" and pcie_gb is not None and moe.stager is not None:
            st = moe.stager.stats
            pcie_gb["stage"] = st.bytes_staged / max(1, st.steps_staged) / 1e9
        if mode == "host_view":
            slots = build_page_in(moe, fmt, num_slots)
            del moe  # its rows; the bank lives on in `slots`
            empty_cache(dev)
            before = slots.traffic()
            t0 = time.perf_counter()
            t["page_in"] = {T: step_ms(slots.forward, routes[T], dev) for T in tokens}
            print(
                f"  {fmt} {frac:.0%} page_in: {t['page_in']} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
            d = slots.traffic() - before
            waves = d.waves / max(1, d.layer_steps)
            if pcie_gb is not None:
                pcie_gb["page_in"] = d.pcie_bytes / max(1, d.layer_steps) * dims[4] / 1e9
            del slots
        else:
            del moe
        gc.collect()  # a stack on CUDA holds a reference cycle (its GPU path): free its rows before the next
        empty_cache(dev)
    return t, miss_gb, waves


HEADER = [
    "shape", "format", "pool", "tokens", "non-res GB", "ring experts", "slots/layer", "resident", "host view",
    "page-in waves", "stage sync", "stage", "stage vs host", "stage vs page-in waves", "stage / bound",
    "prefetch gain", "waves/layer", "PCIe GB/step stage", "PCIe GB/step page-in",
]  # fmt: skip


def table_rows(
    case: tuple[str, str, float],
    num_slots: int,
    t: dict[str, dict[int, float]],
    miss_gb: float,
    waves: float,
    copy_bw: float,
    ring: int = 0,
    pcie_gb: dict[str, float] | None = None,
) -> list[list[object]]:
    """One table row per token count of `case` (shape, format, pool fraction); ratios > 1: stage is faster.
    `ring`: expert rows in stage's chunk buffers (its staging VRAM beside the pool rows)."""
    shape, fmt, frac = case
    rows: list[list[object]] = []
    for T in sorted(t["stage"]):
        r = {m: t[m][T] for m in MODES}
        bound = max(r["resident"], miss_gb / copy_bw * 1e3)
        rows.append(
            [
                shape, fmt, f"{frac:.0%}", T, f"{miss_gb:.2f}", ring, num_slots, f"{r['resident']:.1f}",
                f"{r['host_view']:.1f}", f"{r['page_in']:.1f}", f"{r['stage_sync']:.1f}", f"{r['stage']:.1f}",
                f"{r['host_view'] / r['stage']:.2f}x", f"{r['page_in'] / r['stage']:.2f}x",
                f"{r['stage'] / bound:.2f}x", f"{r['stage_sync'] / r['stage']:.2f}x", f"{waves:.2f}",
                *(f"{(pcie_gb or {}).get(m, float('nan')):.2f}" for m in ("stage", "page_in")),
            ]
        )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="")
    ap.add_argument("--shapes", default="", help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument(
        "--formats",
        default="",
        help="comma-separated weight formats (default: bf16 with --quick, else +int4-g128)",
    )
    ap.add_argument("--chunk-experts", type=int, default=DEFAULT_CHUNK, help="stage's chunk buffer size C")
    ap.add_argument(
        "--layers-model",
        type=int,
        default=None,
        help="size the page-in baseline's slots for a model of this many layers at equal VRAM (e.g. 48)",
    )
    ap.add_argument("--fracs", default="0.25,0.5", help="pool fractions")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    hbm = read_bandwidth(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    header = (
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, commit {commit_id(args.commit)}"
    )
    print(header)
    print(f"measured: H2D copy {copy_bw:.1f} GB/s, HBM read {hbm:.0f} GB/s")
    tokens = [512, 4096, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    formats = args.formats.split(",") if args.formats else ["bf16"] if args.quick else ["bf16", "int4-g128"]
    cases = [(shape, fmt) for shape in ("qwen3", "deepseek") for fmt in formats]
    rows_out: list[list[object]] = []
    depth = f"a {args.layers_model}-layer model's" if args.layers_model else "the stack's"
    note = (
        f"page-in waves: SGLang paged experts' per-layer slots at stage's VRAM (pool rows + stage's ring of "
        f"chunk buffers, 'ring experts'), split evenly over {depth} layers, at most E per layer; stage streams "
        f"chunks of {args.chunk_experts} experts; ratios > 1: stage is that many times faster."
    )
    for shape, fmt in cases:
        if args.shapes and shape not in args.shapes.split(","):
            continue
        dims = SHAPES[shape]
        for frac in (float(f) for f in args.fracs.split(",")):
            slots = page_in_slots(dims, frac, args.chunk_experts, args.layers_model)
            pcie: dict[str, float] = {}
            try:
                t, miss_gb, waves = measure_case(
                    dims,
                    fmt,
                    frac,
                    tokens,
                    g,
                    chunk_experts=args.chunk_experts,
                    num_slots=slots,
                    pcie_gb=pcie,
                )
            except Exception as exc:  # report and keep going
                rows_out.append([shape, fmt, f"{frac:.0%}", "-", f"error: {type(exc).__name__}: {exc}"[:120]])
                continue
            ring = ring_experts(dims, args.chunk_experts)
            rows_out += table_rows((shape, fmt, frac), slots, t, miss_gb, waves, copy_bw, ring, pcie)
            # the table so far, after every case: a run cut short by its time cap keeps what it measured
            table = print_table("Prefill step, whole stack (ms)", HEADER, rows_out)
            write(
                args.out,
                [
                    header,
                    f"measured: H2D copy {copy_bw:.1f} GB/s, HBM read {hbm:.0f} GB/s",
                    "",
                    table,
                    "",
                    note,
                ],
            )


if __name__ == "__main__":
    main()
