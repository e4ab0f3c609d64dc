"""The expert pool: R device rows per operand, shared by every pooled layer, and the location tables.

Location table `l2p_gpu` `[L, E_max]` int32, on the pool device at a stable address (only its contents
change): for layer l and logical expert e, `0..R-1` = the pool row holding it, `R + e` = host row e of the
layer's bank (the host view), `-1` = not an expert of this layer (padding up to E_max). A host mirror
(`l2p_host`) is kept in step for the host-side bookkeeping; `check_invariants()` compares them.

Which (layer, expert) sits in which row is decided globally, least recently used row first, so a hot layer
can hold more rows than a cold one. This module keeps the LRU order on the host (the torch path and
uncaptured steps); the device planner mirrors the same policy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch

from pooled_runner.bank import ExpertBank, check_expert_counts, check_expert_weights
from pooled_runner.formats.base import OperandSpec
from pooled_runner.pool_stats import PoolStats as PoolStats  # re-exported

logger = logging.getLogger("pooled_runner")

NOT_ROUTED = -1


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    """`t` is on `device`; a device without an index ("cuda") means the current one of its type."""
    if t.device.type != device.type:
        return False
    if device.index is None:
        return device.type != "cuda" or t.device.index == torch.cuda.current_device()
    return t.device.index == device.index


class ExpertPool:
    """R device rows per operand plus the per-layer location table and a global LRU over rows.

    Args:
      operands: operand specs of one expert row.
      num_experts_per_layer: E of each pooled layer.
      num_rows: R, the number of pool rows.
      device: where rows and `l2p_gpu` live.
      bank: the host bank, or None when every expert is resident (then R must cover all of them).
    """

    def __init__(
        self,
        operands: tuple[OperandSpec, ...],
        num_experts_per_layer: list[int],
        num_rows: int,
        device: torch.device,
        bank: ExpertBank | None,
        allocate_rows: bool = True,
    ):
        check_expert_counts(list(num_experts_per_layer))
        num_total = sum(num_experts_per_layer)
        if num_rows <= 0:
            raise ValueError(f"num_rows={num_rows} must be positive")
        if bank is None and num_rows < num_total:
            raise ValueError(f"no bank: num_rows={num_rows} must hold all {num_total} experts")
        self.operands = operands
        self.num_experts_per_layer = list(num_experts_per_layer)
        self.num_rows = num_rows
        self.device = device
        self.bank = bank
        self.max_experts = max(num_experts_per_layer)
        # Rows on the pool device (the GPU; the CPU in CPU runs).
        self.rows_gpu: dict[str, torch.Tensor] = {}
        for spec in operands if allocate_rows else ():
            self.rows_gpu[spec.name] = torch.empty(
                (num_rows, *spec.row_shape), dtype=spec.dtype, device=device
            )
        self.l2p_host = self._host_view_codes()
        self.l2p_gpu = self.l2p_host.to(device, copy=True)
        self.row_owner: list[tuple[int, int] | None] = [None] * num_rows  # row -> (layer, expert)
        self._lru: OrderedDict[int, None] = OrderedDict()  # rows in use, least recently used first
        self._free_rows: list[int] = list(range(num_rows - 1, -1, -1))  # pop() yields the lowest row
        self.stats_counters = PoolStats()
        # Set by a DevicePlanner bound to this pool: the host bookkeeping (tables, owners, LRU order, counters)
        # is then stale between boundaries; read it through `PooledMoE.sync_tables()` / `PooledMoE.stats()`.
        self.device_planned = False

    @classmethod
    def all_resident(
        cls,
        operands: tuple[OperandSpec, ...],
        num_experts_per_layer: list[int],
        device: torch.device,
        rows_gpu: dict[str, torch.Tensor],
    ) -> ExpertPool:
        """A pool adopting `rows_gpu` (`[total experts, *row]`, layer-major) as its rows: every expert resident."""
        total = sum(num_experts_per_layer)
        pool = cls(operands, num_experts_per_layer, total, device, bank=None, allocate_rows=False)
        for spec in operands:
            t = rows_gpu[spec.name]
            if (
                tuple(t.shape) != (total, *spec.row_shape)
                or t.dtype != spec.dtype
                or not _same_device(t, device)
            ):
                raise ValueError(
                    f"rows {spec.name}: {tuple(t.shape)} {t.dtype} on {t.device}, expected "
                    f"{(total, *spec.row_shape)} {spec.dtype} on {device}"
                )
        pool.rows_gpu = dict(rows_gpu)
        row = 0
        for layer, num_experts in enumerate(num_experts_per_layer):
            for expert in range(num_experts):
                pool._assign(layer, expert, row)
                row += 1
        return pool

    # ----------------------------------------------------------------------------------------------
    # Queries
    @property
    def num_layers(self) -> int:
        return len(self.num_experts_per_layer)

    @property
    def row_bytes(self) -> int:
        return sum(spec.row_bytes for spec in self.operands)

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def _host_view_codes(self) -> torch.Tensor:
        """`[L, E_max]` int32 codes with every expert on its host row (R + e) and padding -1."""
        l2p = torch.full((self.num_layers, self.max_experts), NOT_ROUTED, dtype=torch.int32)
        for layer, num_experts in enumerate(self.num_experts_per_layer):
            l2p[layer, :num_experts] = self.num_rows + torch.arange(num_experts, dtype=torch.int32)
        return l2p

    def _check_expert(self, layer: int, expert: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if not 0 <= expert < self.num_experts_per_layer[layer]:
            raise ValueError(
                f"expert {expert} out of range [0, {self.num_experts_per_layer[layer]}) for layer {layer}"
            )

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} out of range [0, {self.num_rows})")

    def lookup(self, layer: int, expert: int) -> int:
        """The location code of (layer, expert): a row in [0, R) or R + expert for its host row."""
        self._check_expert(layer, expert)
        return int(self.l2p_host[layer, expert])

    def is_resident(self, layer: int, expert: int) -> bool:
        return self.lookup(layer, expert) < self.num_rows

    def lru_rows(self) -> list[int]:
        """Rows in use, least recently used first."""
        return list(self._lru)

    def rows_in_use_per_layer(self) -> list[int]:
        counts = [0] * self.num_layers
        for owner in self.row_owner:
            if owner is not None:
                counts[owner[0]] += 1
        return counts

    def stats(self) -> PoolStats:
        """A copy of the counters, with the current rows in use per layer."""
        return dataclasses.replace(self.stats_counters, rows_in_use_per_layer=self.rows_in_use_per_layer())

    def reset_stats(self) -> None:
        self.stats_counters = PoolStats()

    def weights_at(self, layer: int, code: int) -> dict[str, torch.Tensor]:
        """Operand views of the expert at location `code` of `layer` (a pool row or a host row)."""
        if 0 <= code < self.num_rows:
            return {name: t[code] for name, t in self.rows_gpu.items()}
        if self.bank is None or code < self.num_rows:
            raise ValueError(
                f"layer {layer}: code {code} is neither a row in [0, {self.num_rows}) nor a host row"
            )
        return self.bank.row(layer, code - self.num_rows)

    # ----------------------------------------------------------------------------------------------
    # Changes
    def _set_code(self, layer: int, expert: int, code: int) -> None:
        self.l2p_host[layer, expert] = code
        self.l2p_gpu[layer, expert] = code

    def touch(self, row: int) -> None:
        """Mark a row as most recently used."""
        self._check_row(row)
        if row not in self._lru:
            raise ValueError(f"row {row} is free; only rows in use can be touched")
        self._lru.move_to_end(row)

    def write_row(self, row: int, weights: dict[str, torch.Tensor]) -> None:
        """Copy operand tensors into a pool row (asynchronously from pinned memory on CUDA)."""
        self._check_row(row)
        check_expert_weights(self.operands, weights, f"row {row}")
        non_blocking = self.device.type == "cuda"
        for name, dst in self.rows_gpu.items():
            dst[row].copy_(weights[name], non_blocking=non_blocking)

    def place(
        self, layer: int, expert: int, row: int, weights: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Put (layer, expert) into a free row, copying `weights` (default: its bank row) there."""
        self._check_expert(layer, expert)
        self._check_row(row)
        if self.row_owner[row] is not None:
            raise ValueError(f"row {row} is held by (layer, expert) {self.row_owner[row]}; evict it first")
        if self.is_resident(layer, expert):
            raise ValueError(
                f"(layer {layer}, expert {expert}) is already in row {self.lookup(layer, expert)}"
            )
        if weights is None:
            if self.bank is None:
                raise ValueError("place() without weights needs a bank")
            weights = self.bank.row(layer, expert)
            self.stats_counters.bytes_copied_to_rows += self.row_bytes
        self.write_row(row, weights)
        self._assign(layer, expert, row)

    def _assign(self, layer: int, expert: int, row: int) -> None:
        """Record that `row` (free) now holds (layer, expert); its weights are already there."""
        if self._free_rows and self._free_rows[-1] == row:  # the usual case (lowest free row): O(1)
            self._free_rows.pop()
        else:
            self._free_rows.remove(row)
        self.row_owner[row] = (layer, expert)
        self._lru[row] = None
        self._set_code(layer, expert, row)

    def evict(self, row: int) -> tuple[int, int]:
        """Give a row back: its expert is read from its host row again. Returns the evicted (layer, expert)."""
        self._check_row(row)
        owner = self.row_owner[row]
        if owner is None:
            raise ValueError(f"row {row} is free; nothing to evict")
        if self.bank is None:
            raise ValueError("cannot evict without a bank: every expert must stay resident")
        layer, expert = owner
        self._set_code(layer, expert, self.num_rows + expert)
        self.row_owner[row] = None
        del self._lru[row]
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)
        self.stats_counters.evictions += 1
        return owner

    def _victim_row(self, protected: set[int]) -> int | None:
        """A free row, else the least recently used row not in `protected`, else None."""
        if self._free_rows:
            return self._free_rows[-1]
        for row in self._lru:  # least recently used first
            if row not in protected:
                return row
            if len(protected) >= len(self._lru):
                # every row is protected; quick for plan_step, which touches its protected rows (so a protected
                # head means all are): its steps wider than the pool would otherwise scan all rows per miss
                return None
        return None

    def admit(self, layer: int, expert: int, protected: set[int] | None = None) -> int | None:
        """Make (layer, expert) resident, evicting the LRU row outside `protected` if the pool is full.

        Returns the row, or None when every row is protected (the caller reads the host view instead).
        A resident expert is only touched.
        """
        code = self.lookup(layer, expert)
        if code < self.num_rows:
            self.touch(code)
            return code
        row = self._victim_row(protected or set())
        if row is None:
            return None
        if self.row_owner[row] is not None:
            self.evict(row)
        self.place(layer, expert, row)
        self.stats_counters.admissions += 1
        return row

    def plan_step(
        self, layer: int, experts: list[int], admit_misses: bool = True, staged: bool = False
    ) -> list[int]:
        """Host-side LRU plan for one step of one layer: location codes for the distinct `experts`.

        Hits are touched; misses are admitted (copy-then-compute) while a row outside this step's rows can
        be evicted, and otherwise read through the host view (code R + e). `admit_misses=False` reads every
        miss through the host view. `staged=True` (a prefill-staged step) admits nothing and counts no
        host-view bytes: code R + e is then read from the staging buffer. Returns codes aligned with
        `experts`; ValueError if an expert repeats.

        Deterministic (tensor parallelism relies on it: every rank plans alone and must reach the same
        tables): the codes and the new state (tables, LRU order, counters) depend only on the state before
        the call and the *set* `experts`, never on its order. Misses are taken in ascending expert id; each
        takes the lowest free row, else the least recently used row outside this step; at the end this
        step's rows become the most recently used in ascending row order. The LRU order is therefore the
        order of (last plan call that used the row, row index): ties broken by row index. A device planner
        must reproduce exactly this (docs/tp.md).
        """
        if len(set(experts)) != len(experts):
            raise ValueError(f"layer {layer}: experts {experts} repeat an id; pass each routed expert once")
        admit_misses = admit_misses and not staged
        codes: list[int] = [self.lookup(layer, e) for e in experts]
        step_rows = {c for c in codes if c < self.num_rows}
        for c in sorted(step_rows):
            self.touch(c)
        num_hits = len(step_rows)
        self.stats_counters.hits += num_hits
        self.stats_counters.misses += len(codes) - num_hits
        for i in sorted(range(len(experts)), key=experts.__getitem__):  # misses in ascending expert id
            if codes[i] < self.num_rows:
                continue
            row = self.admit(layer, experts[i], protected=step_rows) if admit_misses else None
            if row is None:
                if not staged:
                    self.stats_counters.bytes_read_host_view += self.row_bytes
            else:
                codes[i] = row
                step_rows.add(row)
        for row in sorted(step_rows):  # this step's rows: most recent, ties broken by row index
            self._lru.move_to_end(row)
        return codes

    def fill(self, priority: list[tuple[int, int]] | None = None) -> int:
        """Admit (layer, expert) pairs in `priority` order (default: layer-major) until the rows are full.

        Returns the number of rows filled. The last admitted pair is the most recently used.
        """
        if priority is None:
            priority = [(l_, e) for l_, n in enumerate(self.num_experts_per_layer) for e in range(n)]
        filled = 0
        traffic = self.stats_counters.bytes_copied_to_rows  # installation copies are not traffic
        for layer, expert in priority:
            if not self._free_rows:
                break
            if self.is_resident(layer, expert):
                continue
            self.place(layer, expert, self._free_rows[-1])
            filled += 1
        self.stats_counters.bytes_copied_to_rows = traffic
        return filled

    def load_residency(self, row_owner: list[tuple[int, int] | None], lru_rows: list[int]) -> None:
        """Replace the residency bookkeeping (owners, LRU order, both tables) without copying weights.

        For the device planner, whose tables are the truth after captured steps: the rows already hold the
        owners' weights. `lru_rows` lists every row in use, least recently used first.
        """
        if len(row_owner) != self.num_rows:
            raise ValueError(f"row_owner has {len(row_owner)} entries, expected {self.num_rows}")
        used = [r for r, o in enumerate(row_owner) if o is not None]
        if sorted(lru_rows) != used:
            raise ValueError(f"lru_rows {sorted(lru_rows)} != rows in use {used}")
        l2p = self._host_view_codes()
        for row in used:
            layer, expert = row_owner[row]  # type: ignore[misc]
            self._check_expert(layer, expert)
            if l2p[layer, expert] < self.num_rows:
                raise ValueError(
                    f"(layer {layer}, expert {expert}) owns rows {int(l2p[layer, expert])} and {row}"
                )
            l2p[layer, expert] = row
        self.row_owner = list(row_owner)
        self._lru = OrderedDict((r, None) for r in lru_rows)
        self._free_rows = [r for r in range(self.num_rows - 1, -1, -1) if row_owner[r] is None]
        self.l2p_host.copy_(l2p)
        self.l2p_gpu.copy_(l2p)

    # ----------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """AssertionError naming the first inconsistency between rows, owners, LRU and both tables."""
        R = self.num_rows
        assert torch.equal(self.l2p_host, self.l2p_gpu.cpu()), "l2p_gpu differs from its host mirror"
        used = {r for r, o in enumerate(self.row_owner) if o is not None}
        assert used == set(self._lru), f"LRU rows {sorted(self._lru)} != rows in use {sorted(used)}"
        assert used.isdisjoint(self._free_rows), f"rows both free and used: {used & set(self._free_rows)}"
        assert len(used) + len(self._free_rows) == R, f"{len(used)} used + {len(self._free_rows)} free != {R}"
        for row in used:
            layer, expert = self.row_owner[row]  # type: ignore[misc]
            assert self.l2p_host[layer, expert] == row, f"row {row} owner {(layer, expert)} maps elsewhere"
        for layer, num_experts in enumerate(self.num_experts_per_layer):
            codes = self.l2p_host[layer]
            assert (codes[num_experts:] == NOT_ROUTED).all(), f"layer {layer}: padding codes not -1"
            for expert in range(num_experts):
                code = int(codes[expert])
                if code < R:
                    assert self.row_owner[code] == (layer, expert), (
                        f"layer {layer} expert {expert} -> row {code}"
                    )
                else:
                    assert code == R + expert, (
                        f"layer {layer} expert {expert}: host code {code} != {R + expert}"
                    )
