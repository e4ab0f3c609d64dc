"""Cost models of verify steps for the speculative-depth governors' tests (`tests/test_spec_governor*.py`,
`test_spec_family.py`, `test_spec_state.py`, the engine's governor test): step times per depth, sampled chain
acceptance, and a loop that drives a governor through them; the best fixed depth's rate computed from the model
alone, independently of any governor."""

from __future__ import annotations

import random

# per-draft acceptance (chain, 0.6 as the decode bench), expected and sampled accepted drafts: the CPU models' own
from bench.spec_governor_model import ACCEPT as ACCEPT
from bench.spec_governor_model import sample_accepted as sample_accepted
from bench.spec_governor_model import tokens_at as tokens_at
from pooled_runner.spec_governor import SpecGovernor


def run(
    governor: SpecGovernor,
    seconds_at,
    num_steps: int,
    rng: random.Random,
    noise: float = 0.05,
    batch_size: int = 1,
    accept: float = ACCEPT,
):  # type: ignore[no-untyped-def]
    """Drive `governor` for `num_steps` steps of the cost model (acceptance sampled per request); returns
    (tokens per request, seconds, depths run)."""
    total_tokens = total_seconds = 0.0
    depths = []
    for step in range(num_steps):
        depth = governor.choose()
        seconds = seconds_at(depth, step) * (1.0 + noise * rng.uniform(-1.0, 1.0))
        accepted = [sample_accepted(depth, rng, accept) for _ in range(batch_size)]
        governor.observe(depth, accepted, seconds)
        total_tokens += 1.0 + sum(accepted) / batch_size
        total_seconds += seconds
        depths.append(depth)
    return total_tokens, total_seconds, depths


def best_rate(costs: dict[int, float]) -> tuple[int, float]:
    depth = max(costs, key=lambda d: tokens_at(d) / costs[d])
    return depth, tokens_at(depth) / costs[depth]


# step milliseconds per depth: drafting loses (a small pool at bs 1), wins, and one where depth 1 is best
COST_MODELS = {
    "drafting-loses": {0: 1.13, 1: 2.31, 3: 4.27},
    "depth3-wins": {0: 3.1, 1: 3.9, 3: 4.8},
    "depth1-wins": {0: 1.7, 1: 2.05, 3: 3.6},
}
