"""A runnable tour of the core API on random weights: `python -m pooled_runner.demo`.

Builds a small model-shaped stack of MoE layers, pools its experts in fewer rows than it has experts, runs
a few decode-like steps with skewed routing, checks the output against the same layers with every expert
resident, and prints the pool statistics.
"""

from __future__ import annotations

import argparse
import logging

import torch

from pooled_runner import PoolConfig, PooledMoE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=32)
    parser.add_argument("--moe-expert-pool-rows", type=int, default=24)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    g = torch.Generator().manual_seed(0)
    H, I, E, K = args.hidden, args.intermediate, args.experts, args.top_k
    weights = {
        (layer, e): {
            "w13": torch.randn(2 * I, H, generator=g) / H**0.5,
            "w2": torch.randn(H, I, generator=g) / I**0.5,
        }
        for layer in range(args.layers)
        for e in range(E)
    }

    def build(rows: int) -> PooledMoE:
        moe = PooledMoE(PoolConfig.resolve(pool_rows=rows), H, I, top_k=K, dtype=torch.float32)
        for _ in range(args.layers):
            moe.register_layer(E)
        moe.install(lambda layer, e: weights[(layer, e)])
        return moe

    pooled, resident = build(args.moe_expert_pool_rows), build(args.layers * E)
    skew = torch.arange(E, 0, -1, dtype=torch.float32) ** 2  # a few hot experts per layer
    for _ in range(args.steps):
        for layer in range(args.layers):
            x = torch.randn(2, H, generator=g)
            ids = torch.multinomial(skew.expand(2, E), K, generator=g)  # [T, K]
            topk_w = torch.softmax(torch.randn(2, K, generator=g), dim=-1)  # [T, K]
            dev = pooled.config.torch_device
            out = pooled.forward(layer, x.to(dev), ids.to(dev), topk_w.to(dev))
            ref = resident.forward(layer, x.to(dev), ids.to(dev), topk_w.to(dev))
            if not torch.equal(out.cpu(), ref.cpu()):
                print("MISMATCH between pooled and resident outputs")
                return 1
    s = pooled.stats()
    print(f"outputs equal the all-resident layers over {args.steps} steps x {args.layers} layers")
    print(
        f"pool rows {args.moe_expert_pool_rows} of {args.layers * E} experts: hit rate {s.hit_rate:.2f}, "
        f"{s.hits} hits, {s.misses} misses, {s.admissions} admissions, {s.evictions} evictions"
    )
    print(
        f"rows in use per layer {s.rows_in_use_per_layer}; {s.bytes_copied_to_rows} bytes copied to rows, "
        f"{s.bytes_read_host_view} read through the host view"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
