"""The decode bench's routing traces (bench/decode.py): three families, plain decode steps and MTP verify steps.

Families:
  same skew (Zipf 1.0)             `synthetic_trace`, every layer the same Zipf exponent, reuse 0.3
  per-layer skew (Zipf 0.4-1.6)    `synthetic_trace`, each layer its own exponent, reuse 0.3
  recorded from transformers ...   `hf_trace.record_trace`: a random-init Qwen3-MoE of the bench's E, top-k and
                                   layer count (recorded layer l = bench layer l), sampled; near-uniform routing
A family's trace is a sequence of consecutive tokens per request (lane). A plain decode step takes one token per
request; an MTP verify step with `num_spec` drafts takes `1 + num_spec` consecutive tokens per request (request-
major, as SGLang lays out a verify batch), so drafted tokens overlap their neighbours' experts exactly as
adjacent tokens of the trace do (the generator's reuse, or the recorded model's own). The plain steps are the
first `steps` tokens of the same sequences (a synthetic trace's prefix does not depend on its length).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.hf_trace import RecordedModel, record_trace, trace_stats
from bench.traces import synthetic_trace

SAME, PER_LAYER = "same skew (Zipf 1.0)", "per-layer skew (Zipf 0.4-1.6)"
RECORDED = "recorded from transformers Qwen3-MoE (random init)"
SYNTHETIC: dict[str, dict[str, object]] = {  # name: synthetic_trace arguments
    SAME: dict(skew=(1.0, 1.0), reuse=0.3),
    PER_LAYER: dict(skew=(0.4, 1.6), reuse=0.3),
}
FAMILIES = (SAME, PER_LAYER, RECORDED)


@dataclass(frozen=True)
class TraceKey:
    """One trace of the bench: family, requests per step, drafts per request (0: plain decode)."""

    family: str
    bs: int
    num_spec: int = 0

    @property
    def tokens(self) -> int:
        """Tokens per step: bs x (1 + num_spec)."""
        return self.bs * (1 + self.num_spec)


def verify_steps(ids: torch.Tensor, num_spec: int) -> torch.Tensor:
    """Consecutive tokens `ids [S * (1 + n), L, B, K]` -> verify steps `[S, L, B * (1 + n), K]`: step s holds
    tokens s(1+n) .. s(1+n)+n of every request, request-major (request b's tokens at b(1+n) .. b(1+n)+n)."""
    n = 1 + num_spec
    total, L, B, K = ids.shape
    if total % n:
        raise ValueError(f"{total} tokens per lane do not split into verify steps of {n}")
    return ids.reshape(total // n, n, L, B, K).permute(0, 2, 3, 1, 4).reshape(total // n, L, B * n, K)


def tokens_per_lane(steps: int, num_spec: int) -> int:
    return steps * (1 + num_spec)


def build_traces(
    L: int,
    E: int,
    K: int,
    steps: int,
    batches: tuple[int, ...],
    families: tuple[str, ...],
    num_spec: int,
    mtp_families: tuple[str, ...],
) -> tuple[dict[TraceKey, torch.Tensor], list[str]]:
    """Every trace the bench runs (int64 on the CPU, `[steps, L, tokens, K]`), and header lines describing them:
    each family's distinct experts per layer step and adjacent-token overlap at the largest batch, and how
    long the recording took. MTP traces for the families in `mtp_families` (none when `num_spec` is 0)."""
    out: dict[TraceKey, torch.Tensor] = {}
    lines = []
    for family in families:
        n = num_spec if family in mtp_families else 0
        tokens = tokens_per_lane(steps, n)
        if family == RECORDED:
            t0 = time.perf_counter()
            lanes = max(batches)
            recorded = record_trace(RecordedModel(L, E, K), tokens, lanes, seed=29).ids.long()
            seconds = time.perf_counter() - t0
            per_bs = {bs: recorded[:, :, :bs].contiguous() for bs in batches}
            how = (
                f"recorded in {seconds:.1f} s on the CPU ({lanes} sequences x {tokens} tokens; model layer l = "
                "bench layer l)"
            )
        else:
            spec = SYNTHETIC[family]
            per_bs = {
                bs: synthetic_trace(tokens, L, E, K, bs, seed=17 + bs, **spec).ids.long()  # type: ignore[arg-type]
                for bs in batches
            }
            how = f"synthetic, {spec}"
        for bs, ids in per_bs.items():
            out[TraceKey(family, bs)] = ids[:steps].contiguous()
            if n:
                out[TraceKey(family, bs, n)] = verify_steps(ids, n)
        distinct, overlap = trace_stats(per_bs[max(batches)][:steps])
        lines.append(
            f"trace '{family}': {how}; at bs {max(batches)}: {distinct:.1f} distinct experts per layer step "
            f"(of {E}), adjacent-token overlap {overlap:.2f}"
        )
    return out, lines
