"""Speculative decoding with the pool (issue 7 item 5): decode tokens/s per request for num_spec in {0, 1, 3},
pool at 25% / 50% of the experts, on a model-shaped stack of pooled MoE layers (GPU; not run on the CPU).

Per step, every one of `--requests` requests puts `1 + num_spec` tokens into each layer (a verify step); the
routing is drawn from a skewed per-layer popularity (so the pool has hot experts to hold). Acceptance is
synthetic: with per-draft acceptance rate a (chain, topk 1), a verify step yields `1 + a + a^2 + ... + a^n`
tokens per request in expectation, so tokens/s per request = that / step time. Reported per configuration:
step time (CUDA events around the whole stack; the pooled forward still plans on the host, so no graph
replay yet), tokens/s per request, the ratio to the all-resident stack (the same steps with every expert in
rows) and to the bound (`common.bound_ms` with this run's bandwidths), the pool's host bytes per step next to
the distinct experts per layer (the union over the step's lanes) and lanes x top_k, and the step widths per
path, which must all be decode-path widths (`PooledMoE.step_widths`; the run fails otherwise).

Usage: python bench/spec.py [--layers 8] [--requests 1] [--steps 40] [--accept 0.7] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess

import torch

from bench.common import GB, bound_ms, distinct_experts, measure_bandwidths, print_table, seed_all, time_cuda
from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.lanes import decode_lanes
from pooled_runner.spec_acceptance import expected_chain_tokens

# Qwen3-30B-A3B-like MoE layer shape: hidden, intermediate per expert, experts, top-k.
SHAPE = {"H": 2048, "I": 768, "E": 128, "K": 8}
NUM_SPECS = (0, 1, 3)
POOL_FRACTIONS = (0.25, 0.5)


def expected_tokens_per_step(num_spec: int, accept: float) -> float:
    """Tokens a verify step yields per request with a chain of `num_spec` drafts, each accepted w.p. `accept`."""
    return expected_chain_tokens(num_spec, accept)


def build_stack(layers: int, rows: int, g: torch.Generator) -> PooledMoE:
    H, I, E, K = SHAPE["H"], SHAPE["I"], SHAPE["E"], SHAPE["K"]
    config = PoolConfig.resolve(pool_rows=rows, prefill_staging=False)
    moe = PooledMoE(config, H, I, top_k=K, dtype=torch.bfloat16)
    for _ in range(layers):
        moe.register_layer(E)
    w13 = (torch.randn(2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(H, I, generator=g) / I**0.5).to(torch.bfloat16)
    # Every expert gets the same weights (speed does not depend on values); installation stays fast.
    moe.install(lambda layer, e: {"w13": w13, "w2": w2})
    return moe


def make_routing(layers: int, steps: int, tokens: int, g: torch.Generator) -> list[list[torch.Tensor]]:
    """Per step, per layer, `[tokens, K]` distinct expert ids from a skewed popularity (Zipf-like, 1.1)."""
    E, K = SHAPE["E"], SHAPE["K"]
    out = []
    popularity = [torch.randperm(E, generator=g) for _ in range(layers)]
    weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.1
    for _ in range(steps):
        per_layer = []
        for layer in range(layers):
            ranks = torch.stack([torch.multinomial(weights, K, generator=g) for _ in range(tokens)])
            per_layer.append(popularity[layer][ranks].cuda())  # [T, K]
        out.append(per_layer)
    return out


def run_steps(moe: PooledMoE, routing: list[list[torch.Tensor]], hidden: torch.Tensor) -> float:
    """Median ms of one step (every layer once), over the given routings (cycled)."""
    K = SHAPE["K"]
    weights = torch.full((hidden.shape[0], K), 1.0 / K, device="cuda")
    state = {"i": 0}

    def step() -> None:
        ids = routing[state["i"] % len(routing)]
        state["i"] += 1
        for layer, layer_ids in enumerate(ids):
            moe.forward(layer, hidden, layer_ids, weights)

    return time_cuda(step, warmup=3, iters=len(routing))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accept", type=float, default=0.7, help="synthetic per-draft acceptance rate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/spec.py needs a CUDA GPU")
    g = seed_all(0)
    bw = measure_bandwidths()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    header_lines = [
        f"date {datetime.date.today()}, GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"commit {commit.strip() or 'n/a'}; {args.layers} layers of {SHAPE}, {args.requests} requests, "
        f"acceptance {args.accept}",
        f"measured: {bw.describe()}",
    ]
    print("\n".join(header_lines), flush=True)
    E, K, L = SHAPE["E"], SHAPE["K"], args.layers
    rows_table = []
    for num_spec in NUM_SPECS:
        tokens = args.requests * (1 + num_spec)
        lanes = decode_lanes(args.requests, num_spec)
        routing = make_routing(L, args.steps, tokens, g)
        hidden = torch.randn(tokens, SHAPE["H"], generator=g).to(torch.bfloat16).cuda()
        resident = build_stack(L, L * E, g)
        resident.set_decode_lanes(lanes)
        resident_ms = run_steps(resident, routing, hidden)
        row_bytes = resident.pool.row_bytes if resident.pool is not None else 0
        del resident
        per_request = expected_tokens_per_step(num_spec, args.accept)
        for fraction in POOL_FRACTIONS:
            moe = build_stack(L, int(fraction * L * E), g)
            moe.set_decode_lanes(lanes)
            run_steps(moe, routing[:3], hidden)  # warm the pool, then count from here
            moe.reset_stats()  # the device planner's counters too (the warm-up's cold fill is not counted)
            for widths in moe.step_widths.values():
                widths.clear()
            ms = run_steps(moe, routing, hidden)
            stats = moe.stats()
            num_steps = max(1, sum(moe.step_widths["decode"].values()))
            if moe.step_widths["prefill"]:
                raise SystemExit(
                    f"steps left the decode path: {dict(moe.step_widths['prefill'])} (lanes {lanes})"
                )
            host_bytes = (stats.bytes_copied_to_rows + stats.bytes_read_host_view) / num_steps
            distinct = sum(len(torch.unique(ids)) for step in routing for ids in step) / (len(routing) * L)
            hit_bytes = distinct * L * row_bytes - host_bytes
            bound = bound_ms(host_bytes, max(hit_bytes, 0.0), bw)
            rows_table.append(
                [
                    num_spec, f"{int(fraction * 100)}%", lanes, ms, 1e3 * per_request / ms,
                    resident_ms / ms, bound / ms, host_bytes / GB * 1e3, distinct, lanes * K,
                    distinct_experts(E, K, tokens), stats.hit_rate,
                ]
            )  # fmt: skip
            del moe
    table = print_table(
        "Speculative decoding with the pool (synthetic acceptance)",
        [
            "num_spec", "pool", "lanes", "step ms", "tok/s/req", "vs all-resident", "vs bound",
            "host MB/step", "distinct experts/layer", "lanes x top_k", "uniform E(distinct)", "hit rate",
        ],
        rows_table,
    )  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(header_lines) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
