"""Per-draft acceptance of chain speculation, estimated from verify outcomes: `AcceptanceEstimate`.

A verify step at depth d yields each request 1 + its accepted drafts (0..d); with one acceptance probability p
per draft while the chain lasts, that is 1 + p + ... + p^d tokens on average (`expected_chain_tokens`). The
estimate counts accepted drafts and rejections (a chain that stopped before its depth), both decayed per
observed step, and gives p = accepted / (accepted + rejected): a chain's accepted drafts are the successes of
its Bernoulli trials and a stop is its one failure, whatever the depth, so steps of every depth teach one p.

The draft model and the text decide p, not the batch size, so one estimate may serve the governors of every
batch size (`pooled_runner.spec_family.GovernorFamily`): a batch size seen for the first time then starts from
what the others learned instead of from nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_chain_tokens(depth: int, accept: float) -> float:
    """Expected tokens per request of a verify step with `depth` chain drafts, each accepted w.p. `accept`
    while the chain lasts: 1 + accept + ... + accept^depth."""
    return sum(accept**i for i in range(depth + 1))


def chain_tokens_slope(depth: int, accept: float) -> float:
    """d expected_chain_tokens / d accept."""
    return sum(i * accept ** (i - 1) for i in range(1, depth + 1))


class AcceptanceEstimate:
    """Decayed counts of accepted drafts and of rejections; `decay` (0, 1] per observed drafted step.

    Contract: `observe(depth, accepted)` with each request's accepted drafts (0..depth, checked by the caller);
    a step at depth 0 teaches nothing. `value` is None before any drafted step.
    """

    def __init__(self, decay: float = 0.995) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"acceptance_decay={decay} must be in (0, 1]")
        self.decay = decay
        self.accepted = 0.0
        self.rejected = 0.0

    def observe(self, depth: int, accepted: Sequence[int]) -> None:
        """One verify step's accepted drafts per request at `depth`."""
        if depth <= 0:
            return
        self.accepted = self.decay * self.accepted + sum(int(n) for n in accepted)
        self.rejected = self.decay * self.rejected + sum(int(n) < depth for n in accepted)

    @property
    def value(self) -> float | None:
        """Estimated per-draft acceptance, or None before any drafted step."""
        total = self.accepted + self.rejected
        return None if total == 0.0 else self.accepted / total

    def log_tokens_ratio_variance(self, depth: int, other: int) -> float:
        """Variance of log(tokens(depth) / tokens(other)) from the estimate's own uncertainty (binomial, on
        the decayed trials; smoothed so that a young all-accepted estimate is not certain)."""
        trials = self.accepted + self.rejected
        p = (self.accepted + 1.0) / (trials + 2.0)
        slope = chain_tokens_slope(depth, p) / expected_chain_tokens(depth, p)
        slope -= chain_tokens_slope(other, p) / expected_chain_tokens(other, p)
        return slope * slope * p * (1.0 - p) / (trials + 2.0)
