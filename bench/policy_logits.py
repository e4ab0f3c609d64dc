"""CPU experiment (issue #5): rank pool rows by chain-start counts, or order each layer by a router statistic.

The frequency rules of `pooled_runner/policies.py` rank experts by how often they were routed, and on skewed
traces their miss rate stops near 0.79x LRU's at 50% rows (docs/BENCHMARKS.md): with a few hundred steps the
counts of the borderline experts cannot tell them apart. The router scores every expert for every token, though,
not only the top-k. This bench asks whether a per-expert sum of router statistics orders a layer better than the
hits do, on synthetic traces that carry their logits (and on two departures from their model, in which the mean
logit stops saying how often an expert is picked: see `trace_with_logits`):

- `counts`: value = chain starts (a routing not preceded by one at the layer's previous step) + a recent bonus
  (the `freq` rule of the adaptive policy, without decay);
- `logits`: the same counts give each layer's curve (its counts, largest first), but the experts take their
  places on it in the order of their summed router statistic (so the split of rows between layers still
  follows the hit counts, and the order inside a layer follows the router): the logits themselves
  (`--order logits`; on the traces as generated, where every expert's noise is the same, that is the true
  popularity order, an upper bound) or a smoothed top-k membership (`--order membership`, `soft_membership`);
- `lru`: least recently used.

The cache is a simplified model of the planner, not `DevicePlanner`: per tick, hits; then each miss either fills a
free row or evicts the row of least value that this tick does not route, if its value is not above the miss's (LRU:
always). So the ratios here are for comparing the two rankings with each other, not with the shipped policies'
table. The traces are `bench.traces.synthetic_trace` (one token per step, no drift: the skewed families), whose
router logits are each expert's Zipf log-probability plus the token's Gumbel noise.

Usage: python -m bench.policy_logits [--steps 300] [--bases 100,200,300,400,500] [--fracs 0.25,0.5]
           [--order logits|membership] [--tau 0.5] [--noise-scale 0.5,2] [--hidden-bias 0.5] [--out results.md]
"""

from __future__ import annotations

import argparse
import datetime

import numpy as np
import torch

from bench.common import commit_id, write_progress

# (skew range, reuse) of bench/planner.py's skew-dominated families; seeds base + index, as there
FAMILIES = {
    "skew A (Zipf 0.8-1.4, reuse 0.3)": ((0.8, 1.4), 0.3),
    "skew B (Zipf 0.6-1.2, reuse 0.1)": ((0.6, 1.2), 0.1),
    "skew C (Zipf 1.0-1.6, reuse 0)": ((1.0, 1.6), 0.0),
}
MODES = ("lru", "counts", "logits")


def trace_with_logits(
    num_steps: int,
    num_layers: int = 24,
    num_experts: int = 128,
    top_k: int = 8,
    skew: tuple[float, float] = (0.8, 1.4),
    reuse: float = 0.3,
    seed: int = 0,
    noise_scale: tuple[float, float] | None = None,
    hidden_bias: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """`bench.traces.synthetic_trace` at one token per step without drift (the same generator calls, so the
    same ids), plus the router logits: `ids [S, L, K]` int64 and `logits [S, L, E]` fp64 (Zipf log-probability
    + Gumbel noise of each expert, before the reuse boost of the previous token's kept experts).

    Two departures from that model, drawn from a separate generator (so without them the ids stay
    `synthetic_trace`'s): `noise_scale (lo, hi)`, each expert's Gumbel noise scaled by a factor drawn from
    U[lo, hi] (experts whose logits spread differently, so the mean logit no longer orders by how often they
    are picked); `hidden_bias` > 0, a per-expert N(0, hidden_bias) added for the selection but not to the
    logits reported (as a load-balancing bias the router adds after its logits)."""
    g = torch.Generator().manual_seed(seed)
    side = np.random.default_rng(seed + 12345)
    scale = torch.ones(num_layers, num_experts, dtype=torch.float64)
    if noise_scale is not None:
        scale = torch.from_numpy(side.uniform(*noise_scale, (num_layers, num_experts)))
    bias = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    if hidden_bias > 0:
        bias = torch.from_numpy(side.normal(0.0, hidden_bias, (num_layers, num_experts)))
    L, E, K = num_layers, num_experts, top_k
    lo, hi = skew
    alpha = lo + (hi - lo) * torch.rand(L, 1, generator=g)  # [L, 1]
    base = -alpha * torch.log(torch.arange(1, E + 1, dtype=torch.float64))[None, :]  # [L, E] by rank
    logp = torch.gather(base, 1, torch.argsort(torch.rand(L, E, generator=g), dim=1))  # [L, E]
    prev = torch.full((L, 1, K), -1, dtype=torch.int64)
    ids = np.empty((num_steps, L, K), np.int64)
    logits = np.empty((num_steps, L, E))
    for s in range(num_steps):
        gumbel = -torch.log(-torch.log(torch.rand(L, 1, E, generator=g, dtype=torch.float64)))
        reported = (logp - bias)[:, None, :] + scale[:, None, :] * gumbel  # [L, 1, E]
        logits[s] = reported[:, 0].numpy()
        score = reported + bias[:, None, :]
        if s:
            keep = (torch.rand(L, 1, K, generator=g) < reuse).to(torch.float64) * 1e9  # [L, 1, K]
            score.scatter_add_(2, prev, keep)
        prev = torch.topk(score, K, dim=2).indices  # [L, 1, K]
        ids[s] = prev[:, 0].numpy()
    return ids, logits


def mapped_values(counts: np.ndarray, order_by: np.ndarray) -> np.ndarray:
    """`[L, E]`: each layer's counts sorted largest first, handed out in the order of `order_by` (largest
    first; ties by expert id). The multiset of values per layer is the layer's counts."""
    curve = -np.sort(-counts, axis=1)
    order = np.argsort(-order_by, axis=1, kind="stable")
    out = np.empty_like(counts)
    np.put_along_axis(out, order, curve, axis=1)
    return out


def soft_membership(logits: np.ndarray, top_k: int, tau: float = 0.5) -> np.ndarray:
    """`[S, L, E]`: per tick, sigmoid((logit - the tick's k-th largest logit) / tau), a smoothed "was it picked"
    (tau -> 0: the hits themselves; large tau: the logit's own scale again)."""
    if not 0 < top_k <= logits.shape[2] or tau <= 0:
        raise ValueError(f"top_k={top_k} must be in [1, {logits.shape[2]}] and tau={tau} > 0")
    kth = -np.sort(-logits, axis=2)[:, :, top_k - 1 : top_k]  # [S, L, 1]
    return 1.0 / (1.0 + np.exp(-(logits - kth) / tau))


def simulate(
    ids: np.ndarray, logits: np.ndarray, num_rows: int, mode: str, warmup: int = 80, bonus: float = 32.0
) -> float:
    """Miss rate over the steps from `warmup` on (distinct experts of a tick; see the module docstring).
    `logits [S, L, E]`: what the `logits` mode sums for its order (the router's logits, or any per-tick score
    such as `soft_membership`); read at a tick only up to that tick."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    S, L, _ = ids.shape
    E = logits.shape[2]
    if not 0 < num_rows <= L * E:
        raise ValueError(f"num_rows={num_rows} must be in [1, {L * E}]")
    resident = np.zeros((L, E), bool)
    counts = np.zeros((L, E))
    summed = np.zeros((L, E))
    last = np.full((L, E), -(10**9))
    used = hits = misses = 0
    tick = 0
    for s in range(S):
        for layer in range(L):
            tick += 1
            now = sorted(set(ids[s, layer].tolist()))
            missed = [e for e in now if not resident[layer, e]]
            if s >= warmup:
                hits += len(now) - len(missed)
                misses += len(missed)
            for e in now:
                if last[layer, e] != tick - L:  # a chain start
                    counts[layer, e] += 1
                last[layer, e] = tick
            summed[layer] += logits[s, layer]
            if mode == "lru":
                value = last.astype(np.float64)
            else:
                base = counts if mode == "counts" else mapped_values(counts, summed)
                value = base + bonus * (tick - last < L)
            for e in missed:
                if used < num_rows:
                    resident[layer, e] = True
                    used += 1
                    continue
                victims = np.where(resident, value, np.inf)
                victims[layer, now] = np.inf  # this tick's experts stay
                v_layer, v_expert = np.unravel_index(np.argmin(victims), victims.shape)
                if not np.isfinite(victims[v_layer, v_expert]):
                    break  # every row is routed by this tick
                if mode != "lru" and value[layer, e] < victims[v_layer, v_expert]:
                    continue  # read in place
                resident[v_layer, v_expert] = False
                resident[layer, e] = True
    total = hits + misses
    return misses / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=80)
    ap.add_argument("--bases", default="100,200,300,400,500", help="seed bases: seed = base + family index")
    ap.add_argument("--fracs", default="0.25,0.5", help="pool rows as fractions of all experts")
    ap.add_argument(
        "--order",
        choices=("logits", "membership"),
        default="logits",
        help="what orders a layer in the logits mode: the summed logits, or `soft_membership`",
    )
    ap.add_argument("--tau", type=float, default=0.5, help="--order membership: the sigmoid's scale")
    ap.add_argument("--noise-scale", default="", help="lo,hi: per-expert Gumbel scales (trace_with_logits)")
    ap.add_argument(
        "--hidden-bias", type=float, default=0.0, help="sd of a selection bias left out of the logits"
    )
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bases = [int(b) for b in args.bases.split(",")]
    scale = tuple(float(x) for x in args.noise_scale.split(",")) if args.noise_scale else None
    if scale is not None and len(scale) != 2:
        raise SystemExit(f"--noise-scale {args.noise_scale!r}: want lo,hi")
    lines = [
        f"date {datetime.date.today()}, CPU, commit {args.commit or commit_id()}; {args.steps} steps of one token, "
        f"first {args.warmup} not counted; 24 layers, 128 experts, top-8; miss rate / LRU's, seed bases "
        f"{', '.join(map(str, bases))}; order by {args.order}"
        + (f" (tau {args.tau})" if args.order == "membership" else "")
        + (f"; noise scales U{scale}" if scale else "")
        + (f"; hidden selection bias N(0, {args.hidden_bias})" if args.hidden_bias else ""),
        "",
        "| trace | rows | LRU miss (per base) | counts / LRU | logits / LRU |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines[:-1]), flush=True)
    write_progress(args.out, lines)
    for i, (name, (skew, reuse)) in enumerate(FAMILIES.items()):
        for frac in (float(f) for f in args.fracs.split(",")):
            cells: dict[str, list[float]] = {m: [] for m in MODES}
            for b in bases:
                ids, logits = trace_with_logits(
                    args.steps,
                    skew=skew,
                    reuse=reuse,
                    seed=b + i,
                    noise_scale=scale,
                    hidden_bias=args.hidden_bias,
                )
                if args.order == "membership":
                    logits = soft_membership(logits, ids.shape[2], args.tau)
                rows = int(frac * ids.shape[1] * logits.shape[2])
                for m in MODES:
                    cells[m].append(simulate(ids, logits, rows, m, args.warmup))
            ratio = {m: " / ".join(f"{x / y:.3f}" for x, y in zip(cells[m], cells["lru"])) for m in MODES}
            lru = " / ".join(f"{x:.3f}" for x in cells["lru"])
            lines.append(f"| {name} | {frac:.0%} | {lru} | {ratio['counts']} | {ratio['logits']} |")
            write_progress(args.out, lines)


if __name__ == "__main__":
    main()
