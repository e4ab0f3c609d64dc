"""The adaptive plan kernel alone (`kernels/plan_adaptive.py`) at several block sizes of its serial passes
(issue #5): the router's pairwise ranking (`RANK_BLOCK` experts per pass), the shadow ranks (`SHADOW_BLOCK` experts
of all layers per pass) and the present experts per pass (`PRESENT_BLOCK`). The plan is one program of dependent
passes, so fewer, wider passes may cut its latency, or spill registers.

Each variant first plans a few steps eagerly against `plan_adaptive_reference` from the same state (every table
and policy word equal, exactly: a variant that differs is reported and not timed), then one decode step (one
plan launch per layer) is captured and timed by graph replay (`common.time_graphs`). Setup as `bench/planner.py`:
6 layers of 128 experts, R = 384, top-8; M tokens of random distinct ids per layer; the router's state (member,
ranked; with the duel both orders' and the order duel's words) random.

Usage: python -m bench.plan_blocks [--variants "16,256,16;32,256,16;64,512,16;32,256,16,8"] [--policy ...]
       [--tokens 1,8] [--device cpu]  (cpu: the eager check only, under the Triton interpreter, tiny sizes)
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
from pooled_runner.kernels import plan_adaptive as plan_module
from pooled_runner.kernels.plan_adaptive import AdaptiveState, plan_adaptive
from pooled_runner.kernels.plan_adaptive_ref import plan_adaptive_reference
from pooled_runner.kernels.plan_lru import PLAN_WARPS

from bench.common import commit_id, seed_all
from pooled_runner.policies import make_policy

VARIANT_NAMES = ("RANK_BLOCK", "SHADOW_BLOCK", "PRESENT_BLOCK")


@contextlib.contextmanager
def blocks(variant: tuple[int, ...]) -> Iterator[None]:
    """The plan launcher's block sizes set to `variant` (rank, shadow, present[, warps]) while inside."""
    old = tuple(getattr(plan_module, n) for n in VARIANT_NAMES)
    for name, value in zip(VARIANT_NAMES, variant[:3]):
        setattr(plan_module, name, value)
    try:
        yield
    finally:
        for name, value in zip(VARIANT_NAMES, old):
            setattr(plan_module, name, value)


def warps(variant: tuple[int, ...]) -> int:
    """The variant's warps per program (its 4th number; 4, the launcher's, without)."""
    return variant[3] if len(variant) > 3 else 4


def random_setup(L: int, E: int, R: int, policy: str, device: str, g: torch.Generator) -> dict:
    """Tables of a pool whose rows each hold a distinct random expert, and the policy's state, randomized."""
    pol = make_policy(policy, num_rows=R)
    pol.bind(L, E, torch.device(device))
    state: AdaptiveState = pol.kernel_state()  # type: ignore[attr-defined]
    n = L * E
    flat = torch.randperm(n, generator=g)[:R]
    l2p = R + torch.arange(n) % E
    l2p[flat] = torch.arange(R)
    tables = {
        "l2p": l2p.to(torch.int32),
        "row_owner": torch.cat([flat, torch.tensor([-1])]),
        "row_stamp": torch.cat([torch.randint(1, 50, (R,), generator=g), torch.tensor([-1])]),
        "clock": torch.tensor([60]),
        "counters": torch.zeros(5, dtype=torch.int64),
    }
    words = {
        "count": torch.randint(0, 1 << 20, (n + 1,), generator=g),
        "last_use": torch.randint(1, 61, (n,), generator=g),
        "misses": torch.randint(0, 1 << 16, (2,), generator=g),
        "mode": torch.ones(1, dtype=torch.int64),
    }
    if state.member is not None:
        orders = state.member.shape[0] // n  # the duel: two, slow then fast
        words["member"] = torch.randint(0, 1 << 20, (orders * n,), generator=g)
        words["ranked"] = torch.randint(0, 1 << 20, (orders * (n + 1),), generator=g)
        words["ranked"][n :: n + 1] = 0  # each order's last slot is a dummy never read, zero as in use
    if state.order_misses is not None:
        words["order_misses"] = torch.randint(0, 1 << 16, (2,), generator=g)
        words["order_state"] = torch.tensor([int(torch.randint(0, 2, (1,), generator=g)), 0, 0])
    words["count"][n] = 0
    out = {k: v.to(device) for k, v in {**tables, **words}.items()}
    out["rule"] = pol.kernel_rule()  # type: ignore[attr-defined]
    return out


def plan_args(
    s: dict, ids: torch.Tensor, layer: int, E: int, R: int, outs: list, counts: torch.Tensor
) -> tuple:
    state = AdaptiveState(s["count"], s["last_use"], s["misses"], s["mode"], s.get("member"), s.get("ranked"),
                          torch.zeros(E, dtype=torch.int64, device=ids.device), s.get("order_misses"),
                          s.get("order_state"))  # fmt: skip
    return (ids, s["l2p"], s["row_owner"], s["row_stamp"], s["clock"], s["counters"], counts, *outs,
            layer, E, E, R, 16, 1, state, s["rule"])  # fmt: skip


def check_variant(variant, L, E, R, M, K, policy, device, seed) -> str | None:
    """Plan L steps with `variant` and with the reference from one random state: None when every word is equal,
    else the first difference."""
    g = torch.Generator().manual_seed(seed)
    base = random_setup(L, E, R, policy, device, g)
    runs = {name: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in base.items()} for name in "kr"}
    P = min(E, R, M * K)
    for layer in range(L):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).reshape(-1).to(device)
        for name in "kr":
            outs = [torch.zeros(P, dtype=torch.int32, device=device) for _ in range(3)]
            counts = torch.zeros(E, dtype=torch.int32, device=device)
            args = plan_args(runs[name], ids, layer, E, R, outs, counts)
            with blocks(variant):
                if name == "k":
                    plan_adaptive(*args, num_warps=warps(variant))
                else:
                    plan_adaptive_reference(*args)
            runs[name]["outs"] = outs
        for key, want in runs["r"].items():
            got = runs["k"][key]
            if key == "outs":
                for a, b in zip(got, want):
                    if not torch.equal(a, b):
                        return f"layer {layer}: pairs {a.tolist()} vs {b.tolist()}"
            elif torch.is_tensor(want) and not torch.equal(got, want):
                bad = (got != want).nonzero().flatten()[:5].tolist()
                return f"layer {layer}: {key} differs at {bad}"
    return None


def time_variants(variants, L, E, R, M, K, policy) -> dict:
    """µs of one decode step's plans (L launches), per variant, by graph replay."""
    from bench.common import time_graphs

    g = torch.Generator().manual_seed(7)
    base = random_setup(L, E, R, policy, "cuda", g)
    ids = torch.stack(
        [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).reshape(-1) for _ in range(L)]
    ).cuda()
    P = min(E, R, M * K)
    fns = {}
    for variant in variants:
        s = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in base.items()}
        outs = [torch.zeros(P, dtype=torch.int32, device="cuda") for _ in range(3)]
        counts = torch.zeros(E, dtype=torch.int32, device="cuda")

        def step(s=s, outs=outs, counts=counts, variant=variant) -> None:
            with blocks(variant):
                for layer in range(L):
                    plan_adaptive(
                        *plan_args(s, ids[layer], layer, E, R, outs, counts), num_warps=warps(variant)
                    )

        fns[variant] = step
    return {v: ms * 1000 for v, ms in time_graphs(fns, rounds=5, per_replay=4, iters=20).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="16,256,16;32,256,16;64,256,16;16,512,16;16,256,32")
    ap.add_argument(
        "--policy",
        default="adaptive-router",
        choices=["adaptive", "adaptive-router", "adaptive-router-duel"],
    )
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--commit", default="", help="the tree's commit (a device copy may carry a stale git HEAD)"
    )
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    args = ap.parse_args()
    variants = [tuple(int(x) for x in v.split(",")) for v in args.variants.split(";")]
    if any(
        len(v) not in (3, 4) or min(v) < 1 or any(x & (x - 1) for x in v) or warps(v) not in PLAN_WARPS
        for v in variants
    ):
        raise SystemExit(
            f"--variants {args.variants}: expected 'rank,shadow,present[,warps];...' powers of two (warps <= 32)"
        )
    seed_all(0)
    shipped = tuple(getattr(plan_module, n) for n in VARIANT_NAMES)  # the launcher's own block sizes
    if shipped not in variants:
        variants.insert(0, shipped)
    cuda = args.device == "cuda"
    L, E, R, K = (6, 128, 384, 8) if cuda else (2, 9, 5, 3)
    lines = [
        f"policy {args.policy}; L {L}, E {E}, R {R}, top-{K}; commit {commit_id(args.commit)}",
        "| variant (rank, shadow, present[, warps]) | M | check | plans µs per step | vs the shipped blocks |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for M in (int(t) for t in args.tokens.split(",")):
        checks = {v: check_variant(v, L, E, R, M, K, args.policy, args.device, 3 + M) for v in variants}
        good = [v for v in variants if checks[v] is None]
        times = time_variants(good, L, E, R, M, K, args.policy) if cuda and good else {}
        for v in variants:
            t = f"{times[v]:.1f}" if v in times else "-"
            base = times.get(shipped)
            ratio = f"{times[v] / base:.2f}x" if v in times and base else "-"
            lines.append(f"| {v} | {M} | {checks[v] or 'equal'} | {t} | {ratio} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
