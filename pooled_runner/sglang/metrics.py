"""Pool gauges on SGLang's `/metrics` (with `--enable-metrics`).

SGLang serves `/metrics` from the launcher process and collects the children's samples through
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set by SGLang before it spawns them), so
the gauges are created in the scheduler process with `multiprocess_mode="mostrecent"`, as SGLang's own are.
"""

from __future__ import annotations

from pooled_runner.pool import PoolStats

PREFIX = "pooled_runner_pool_"


class PoolMetrics:
    """Gauges of one process's pool, updated at the stats boundaries."""

    def __init__(self, layer_names: list[str]):
        from prometheus_client import Gauge  # imported late: after SGLang set PROMETHEUS_MULTIPROC_DIR

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, labelnames=labels, multiprocess_mode="mostrecent")

        self.layer_names = layer_names
        self.hit_rate = gauge("hit_rate", "Fraction of distinct (step, layer, expert) found in a pool row.")
        self.hits = gauge("hits", "Distinct (step, layer, expert) found in a pool row, since start.")
        self.misses = gauge("misses", "Distinct (step, layer, expert) not in a pool row, since start.")
        self.admissions = gauge("admissions", "Host rows copied into pool rows, since start.")
        self.evictions = gauge("evictions", "Pool rows given up for another expert, since start.")
        self.bytes_per_token = gauge(
            "host_bytes_per_token",
            "Expert bytes moved from the host (copied to rows, read through the host view, or staged for "
            "prefill) per token.",
        )
        self.staged_rows = gauge(
            "staged_rows", "Rows copied into prefill staging buffers, since start (0: staging off)."
        )
        self.rows = gauge("rows_in_use", "Pool rows held by each pooled layer.", ("layer",))
        self.steps = gauge("steps", "Forward steps seen by the pool, since start.")

    def update(self, stats: PoolStats, num_steps: int, num_tokens: int) -> None:
        self.hit_rate.set(stats.hit_rate)
        self.hits.set(stats.hits)
        self.misses.set(stats.misses)
        self.admissions.set(stats.admissions)
        self.evictions.set(stats.evictions)
        moved = stats.bytes_copied_to_rows + stats.bytes_read_host_view + stats.bytes_staged
        self.bytes_per_token.set(moved / num_tokens if num_tokens else 0.0)
        self.staged_rows.set(stats.rows_staged)
        self.steps.set(num_steps)
        for name, rows in zip(self.layer_names, stats.rows_in_use_per_layer):
            self.rows.labels(layer=name).set(rows)
