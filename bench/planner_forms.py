"""GPU rows of `bench/planner.py --forms`: the one-launch plan + copy's launch forms (`planner_overhead.PLANNERS`:
plain grid by ticket or cooperative grid, PDL or not, overlap or not) on miss-heavy decode steps of T tokens.

Why: on whole decode steps (`bench.decode`, 2026-12-02) the default form was 1.4-2.8% faster than the old one at
one token per step but 2.1-4.5% slower at 64, within about twice the run-to-run spread of those rows. Here every
form replays the same synthetic trace through one captured step per T, and the forms take turns round by round
(clock and thermal drift hit them alike; each round starts with the next form, so no form always runs first),
so that a difference of a percent or two is measurable, and which of the three launch choices it comes from.

Each form builds its own pooled stack (`planner_overhead.build`) and its own graphs. Round 0 fills the pools
and is not counted; every form sees the same routing in the same state (the planners decide alike: checked on
the hit counters of every counted round), so each later round replays identical work per form.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import write_progress as write
from bench.planner_overhead import PLANNERS, ROWS, E, H, K, L, build
from bench.traces import synthetic_trace
from pooled_runner.cycle_lru import CycleLRUPolicy

FORMS = ("one", "one-coop", "one-pdl", "one-nc", "one-coop-pdl")  # the default first: ratios are to it
TOKENS = (1, 4, 16, 64)


def launch_forms(lines: list[str], args: argparse.Namespace) -> None:
    """Append the launch-form table: ms per step of each form at each T, and its ratio to the first form."""
    forms, tokens = args.forms, args.form_tokens
    steps, rounds = (24, 4) if args.quick else (48, 6)
    lines += [
        "",
        f"### Launch forms of the one-launch plan + copy on miss-heavy steps ({L} layers, R={ROWS} of {L * E}, "
        f"{steps} trace steps per round, {rounds - 1} rounds counted)",
        "",
        "| T | form | hits / step | misses / step | ms / step (median of rounds) | / first form (median; "
        "min-max over rounds) |",
        "|---|---|---|---|---|---|",
    ]
    write(args.out, lines)
    traces = {
        T: synthetic_trace(steps, num_layers=L, num_experts=E, top_k=K, tokens_per_step=T, seed=40 + T).ids
        for T in tokens
    }
    stacks = {name: _Stack(name, traces, max(tokens)) for name in forms}
    times: dict[tuple[int, str], list[float]] = {(T, f): [] for T in tokens for f in forms}
    counts: dict[tuple[int, str], tuple[int, int]] = {}
    for r in range(rounds):
        for T in tokens:
            for name in forms[r % len(forms) :] + forms[: r % len(forms)]:  # each round led by the next form
                ms, hits, misses = stacks[name].replay(T)
                if r:
                    times[T, name].append(ms)
                    counts[T, name] = (hits, misses)
            if r:
                assert len({counts[T, name] for name in forms}) == 1, (r, T, {n: counts[T, n] for n in forms})
    for T in tokens:
        first = times[T, forms[0]]
        for name in forms:
            ratios = [t / f for t, f in zip(times[T, name], first)]
            hits, misses = counts[T, name]
            lines.append(
                f"| {T} | {PLANNERS[name][0]} | {hits / steps:.1f} | {misses / steps:.1f} | "
                f"{statistics.median(times[T, name]):.3f} | {statistics.median(ratios):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f}) |"
            )
    lines += [
        "",
        "Same routing, same decisions in every form (hit and miss counts checked equal); ratio < 1: faster than "
        "the first form. Trace: Zipf 0.8-1.4 per layer, reuse 0.3, T independent lanes per step.",
    ]
    write(args.out, lines)


class _Stack:
    """One form's pooled stack and one captured decode step per T (its static ids buffer filled per step)."""

    def __init__(self, name: str, traces: dict[int, torch.Tensor], max_tokens: int):
        self.moe, self.planner, _, kpath = build(
            CycleLRUPolicy(), max_routed=max_tokens * K, **PLANNERS[name][1]
        )
        self.traces_host = {T: ids.to(torch.int64).pin_memory() for T, ids in traces.items()}  # [S, L, T, K]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.ids: dict[int, torch.Tensor] = {}
        g = torch.Generator(device="cuda").manual_seed(3)
        for T, ids_host in self.traces_host.items():
            ids = ids_host[0].cuda()  # [L, T, K]
            x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
            w = torch.softmax(torch.randn(L, T, K, generator=g, device="cuda"), -1).bfloat16()

            def step(ids: torch.Tensor = ids, x: torch.Tensor = x, w: torch.Tensor = w) -> None:
                for layer in range(L):
                    kpath.planned_forward(self.planner, layer, x, ids[layer], w[layer])

            step()  # compile before capture (replays this trace's step 0 once more than the others)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.graphs[T], self.ids[T] = graph, ids

    def replay(self, T: int) -> tuple[float, int, int]:
        """Replay the trace of T tokens per step once: (ms per step, hits, misses)."""
        ids_host, ids, graph = self.traces_host[T], self.ids[T], self.graphs[T]
        torch.cuda.synchronize()
        before = self.planner.counter_values()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in range(ids_host.shape[0]):
            ids.copy_(ids_host[s], non_blocking=True)
            graph.replay()
        end.record()
        end.synchronize()
        after = self.planner.counter_values()
        ms = start.elapsed_time(end) / ids_host.shape[0]
        return ms, after["hits"] - before["hits"], after["misses"] - before["misses"]
