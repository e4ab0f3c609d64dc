"""Tensor parallelism: each rank's shard of every expert, its own bank and pool, and the same plan everywhere.

Under TP = N every rank holds 1/N of every expert's intermediate dimension (the sharding of SGLang's
`FusedMoE`: rank r gets gate and up rows `[r*I/N, (r+1)*I/N)` and the same columns of the down projection),
so every rank keeps its own bank of shards and its own pool of `R` rows (`--moe-expert-pool-rows` is per
rank). The decisions (which expert sits in which row) must be the same on every rank, or ranks compute
different experts and the all-reduce mixes them. They are, without communication: the planner's inputs
(routed ids from replicated hidden states, the step sequence) are identical on every rank and the plan is a
deterministic function of them (`ExpertPool.plan_step`). `POOLED_RUNNER_DEBUG_CHECKS=1` verifies it at coarse
boundaries: every rank hashes its location tables (`table_digests` of its `PooledMoE`, whose device planner's
state is synced to the host first), the digests are all-gathered, and a mismatch raises `TablesDisagree`
naming the layer and the step.

Nothing here imports SGLang; `torch.distributed` is used only by `all_gather_digests`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pooled_runner.formats import make_format
from pooled_runner.pool import ExpertPool, PoolStats

if TYPE_CHECKING:
    from pooled_runner.moe import PooledMoE

GiB = 1 << 30


class TablesDisagree(RuntimeError):
    """Ranks of one TP group hold different location tables (or telemetry): their outputs would be garbage."""


# ------------------------------------------------------------------------------------------------------
# Shards and per-rank sizes
def shard_size(intermediate_size: int, tp_size: int) -> int:
    """I / N, the intermediate size each rank holds; ValueError when it does not split evenly."""
    if tp_size <= 0:
        raise ValueError(f"tp_size={tp_size} must be positive")
    if intermediate_size <= 0 or intermediate_size % tp_size:
        raise ValueError(
            f"expert intermediate size {intermediate_size} cannot be split evenly over {tp_size} TP ranks "
            f"({intermediate_size} % {tp_size} = {intermediate_size % tp_size}); use a TP size dividing it"
        )
    return intermediate_size // tp_size


def shard_expert(
    w13: torch.Tensor, w2: torch.Tensor, tp_rank: int, tp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `tp_rank`'s shard of one expert, as SGLang's `FusedMoE` loader lays it out.

    `w13 [2I, H]` (gate rows, then up rows), `w2 [H, I]` -> `w13 [2I/N, H]` (the rank's gate rows, then its
    up rows) and `w2 [H, I/N]` (the same columns), both contiguous. The sum over ranks of each shard's
    expert MLP output is the full expert's output.
    """
    if w13.dim() != 2 or w2.dim() != 2 or w13.shape[0] != 2 * w2.shape[1] or w13.shape[1] != w2.shape[0]:
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [2I, H] and [H, I] of one expert"
        )
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} out of range [0, {tp_size})")
    intermediate = w2.shape[1]
    size = shard_size(intermediate, tp_size)
    lo, hi = tp_rank * size, (tp_rank + 1) * size
    w13_shard = torch.cat([w13[lo:hi], w13[intermediate + lo : intermediate + hi]])
    return w13_shard.contiguous(), w2[:, lo:hi].contiguous()


# SGLang 0.5.23 on the CPU (`configs/update_config.py:adjust_config_with_unaligned_cpu_tp`, called by
# `ModelRunner` when device == "cpu") pads the expert intermediate size up to a multiple of tp_size * 32
# (`DEFAULT_MOE_PADDING_SIZE`, unquantized) and zero-fills the padding: with TP = 2 a 32-wide expert is 64
# wide, rank 0 holds all 32 real rows and rank 1 only zeros. The bank mirrors whatever the loader writes.
CPU_MOE_PADDING = 32


def rank_intermediate(intermediate_size: int, tp_size: int, cpu: bool) -> int:
    """The intermediate size one rank holds: I / N on CUDA (ValueError unless it divides), SGLang's padded
    `round_up(I, N * 32) / N` on the CPU."""
    if not cpu:
        return shard_size(intermediate_size, tp_size)
    if tp_size <= 0 or intermediate_size <= 0:
        raise ValueError(f"intermediate_size={intermediate_size}, tp_size={tp_size} must be positive")
    step = tp_size * CPU_MOE_PADDING
    return -(-intermediate_size // step) * step // tp_size


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds: its shard of every expert in the bank, `pool_rows` rows of shards on the device."""

    tp_size: int
    intermediate_per_rank: int
    row_bytes: int  # one expert's shard, all operands
    pool_rows: int  # rows actually allocated (min(R, experts): an all-resident pool needs no more)
    bank_bytes: int  # 0 when every expert is resident (no bank)

    @property
    def pool_bytes(self) -> int:
        return self.pool_rows * self.row_bytes

    def describe(self) -> str:
        bank = f"bank {self.bank_bytes / GiB:.3f} GiB host" if self.bank_bytes else "no bank (all resident)"
        return (
            f"per rank (TP={self.tp_size}, I/rank={self.intermediate_per_rank}): {self.pool_rows} rows x "
            f"{self.row_bytes / 1024:.1f} KiB = {self.pool_bytes / GiB:.3f} GiB device, {bank}"
        )


def rank_memory(
    weight_format: str,
    dtype: torch.dtype,
    hidden_size: int,
    intermediate_size: int,
    tp_size: int,
    pool_rows: int,
    num_total_experts: int,
    cpu: bool = False,
) -> RankMemory:
    """Per-rank bytes of a pooled model under TP (full `intermediate_size`; ValueError if it cannot split)."""
    per_rank = rank_intermediate(intermediate_size, tp_size, cpu)
    operands = make_format(weight_format, dtype).operands(hidden_size, per_rank)
    row_bytes = sum(spec.row_bytes for spec in operands)
    resident = pool_rows >= num_total_experts
    return RankMemory(
        tp_size=tp_size,
        intermediate_per_rank=per_rank,
        row_bytes=row_bytes,
        pool_rows=min(pool_rows, num_total_experts),
        bank_bytes=0 if resident else num_total_experts * row_bytes,
    )


def tp_problems(
    pool_rows: int, top_k: int, intermediate_size: int, tp_size: int, cpu: bool = False
) -> list[str]:
    """Every reason a TP configuration cannot run, with per-rank numbers (empty when it can).

    `pool_rows` is per rank: each of the `tp_size` ranks holds that many rows of its own shards, and one
    token's top-k experts must fit in one rank's rows. On CUDA the intermediate size must divide by the TP
    size (SGLang's `FusedMoE` asserts it); on the CPU SGLang pads it instead.
    """
    out: list[str] = []
    if tp_size <= 0:
        return [f"--tp-size {tp_size}: must be positive"]
    if not cpu and intermediate_size > 0 and intermediate_size % tp_size:
        out.append(
            f"--tp-size {tp_size}: the expert intermediate size {intermediate_size} does not split evenly "
            f"({intermediate_size} / {tp_size} = {intermediate_size / tp_size:g} per rank); use a TP size "
            f"dividing {intermediate_size}"
        )
    if 0 < pool_rows < top_k:
        out.append(
            f"--moe-expert-pool-rows {pool_rows} is per rank: each of the {tp_size} ranks would hold "
            f"{pool_rows} rows, below top-k {top_k}; use >= {top_k}"
        )
    return out


# ------------------------------------------------------------------------------------------------------
# Agreement across ranks
_MASK63 = (1 << 63) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK63


def _synced(source: PooledMoE | ExpertPool) -> tuple[ExpertPool, PoolStats]:
    """The pool with current host bookkeeping and its full counters (device-planned steps included)."""
    if isinstance(source, ExpertPool):
        if source.device_planned:
            raise ValueError(
                "this pool is planned on the device: its host tables are stale between boundaries; pass the "
                "PooledMoE (its stats() syncs the device planner's state first)"
            )
        return source, source.stats()
    stats = source.stats()  # syncs the device planner's tables into the pool, adds the device counters
    pool = source.pool
    assert pool is not None
    return pool, stats


def _policy_state(source: PooledMoE | ExpertPool) -> dict[str, torch.Tensor]:
    """The device planner policy's state tensors of a `PooledMoE` on the GPU path (empty otherwise)."""
    planner = getattr(getattr(source, "_gpu_path", None), "planner", None)
    return dict(planner.policy.state_tensors()) if planner is not None else {}


def table_digests(
    source: PooledMoE | ExpertPool,
    layer_names: list[str] | None = None,
    telemetry: dict[str, torch.Tensor] | None = None,
) -> tuple[list[str], torch.Tensor]:
    """Names and int64 hashes `[N]` of everything ranks must agree on: each layer's location table, the LRU
    order (it decides future evictions), the plan counters, the device planner policy's state and each
    telemetry tensor.

    `source` is the rank's `PooledMoE` (on CUDA its device planner's state is synced to the host first, a
    boundary operation, and the counters include the device-planned steps), or a bare host-planned
    `ExpertPool` (ValueError for one bound to a device planner: its host tables are stale).
    Byte counters are left out: they count each rank's own shard bytes, which differ by design.
    """
    pool, s = _synced(source)
    if layer_names is not None and len(layer_names) != pool.num_layers:
        raise ValueError(f"{len(layer_names)} layer names for {pool.num_layers} pooled layers")
    entries: list[tuple[str, bytes]] = [
        (
            f"location table of {layer_names[i]} (pooled layer {i})"
            if layer_names
            else f"location table of pooled layer {i}",
            pool.l2p_host[i].numpy().tobytes(),
        )
        for i in range(pool.num_layers)
    ]
    entries.append(
        ("LRU order of the pool rows", repr([(r, pool.row_owner[r]) for r in pool.lru_rows()]).encode())
    )
    entries.append(("plan counters", repr((s.hits, s.misses, s.admissions, s.evictions)).encode()))
    for key, t in sorted(_policy_state(source).items()):  # e.g. lru-cycle's cycle starts decide evictions
        entries.append((f"planner policy state {key}", t.detach().cpu().contiguous().numpy().tobytes()))
    for key, t in sorted((telemetry or {}).items()):
        entries.append((f"telemetry {key}", t.detach().cpu().contiguous().numpy().tobytes()))
    return [n for n, _ in entries], torch.tensor([_digest(b) for _, b in entries], dtype=torch.int64)


def check_agreement(gathered: torch.Tensor, names: list[str], step: int) -> None:
    """Raise `TablesDisagree` unless every rank's digests (rows of `gathered [W, N]`) are equal.

    The message names the first disagreeing entry (layer), the step, and each rank's value.
    """
    if gathered.dim() != 2 or gathered.shape[1] != len(names):
        raise ValueError(f"gathered digests have shape {tuple(gathered.shape)}, expected [W, {len(names)}]")
    differs = (gathered != gathered[0:1]).any(dim=0)  # [N]
    if not bool(differs.any()):
        return
    bad = [i for i in range(len(names)) if bool(differs[i])]
    first = bad[0]
    values = ", ".join(f"rank {r}: {int(gathered[r, first]):#018x}" for r in range(gathered.shape[0]))
    also = (
        f"; {len(bad) - 1} more entries differ: {', '.join(names[i] for i in bad[1:4])}"
        if len(bad) > 1
        else ""
    )
    raise TablesDisagree(
        f"TP ranks disagree at step {step}: {names[first]} ({values}){also}. The ranks planned differently, "
        "so the all-reduce would mix different experts; stopping. Planner inputs (routed ids, step order) "
        "must be identical on every rank and the planner deterministic (docs/tp.md)."
    )


def all_gather_digests(digests: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """`[N]` int64 on this rank -> `[W, N]` of every rank in `group` (gloo on the CPU, NCCL on CUDA tensors)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)  # type: ignore[arg-type]
    out = [torch.empty_like(digests) for _ in range(world)]
    dist.all_gather(out, digests, group=group)  # type: ignore[arg-type]
    return torch.stack(out).cpu()


def verify_tables_agree(
    source: PooledMoE | ExpertPool,
    step: int,
    group: object | None = None,
    layer_names: list[str] | None = None,
    telemetry: dict[str, torch.Tensor] | None = None,
    device: torch.device | None = None,
) -> int:
    """Hash this rank's tables (`table_digests`: pass the `PooledMoE`), all-gather over `group`, raise
    `TablesDisagree` on a mismatch.

    A collective and a boundary operation: every rank of `group` must call it at the same step, outside any
    capture. `device` is where the gathered tensor lives (a CUDA device for NCCL). Returns the combined digest
    (the same on every rank).
    """
    names, digests = table_digests(source, layer_names, telemetry)
    gathered = all_gather_digests(digests.to(device or torch.device("cpu")), group)
    check_agreement(gathered, names, step)
    return _digest(gathered[0].numpy().tobytes())
