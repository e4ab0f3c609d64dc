"""`PoolStats`: the pool's hit, miss, admission, eviction and byte counters (`ExpertPool.stats`, `PooledMoE.stats`,
the SGLang metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolStats:
    """Counters since the pool was built (or since `reset_stats`)."""

    hits: int = 0  # distinct (step, layer, expert) found in a row
    misses: int = 0  # distinct (step, layer, expert) not in a row
    admissions: int = 0  # host row copied into a pool row
    evictions: int = 0  # row given up by one (layer, expert) for another
    bytes_copied_to_rows: int = 0  # host -> pool row copies
    bytes_read_host_view: int = 0  # expert rows read in place from the bank, once per step
    rows_in_use_per_layer: list[int] = field(default_factory=list)
    rows_staged: int = 0  # rows copied into prefill staging buffers (filled in by PooledMoE.stats)
    bytes_staged: int = 0  # their bytes (host -> staging buffers)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0
