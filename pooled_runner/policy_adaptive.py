"""Adaptive residency policy: set dueling between LRU and a frequency policy, scored by shadow caches.

Rule (all integer arithmetic; device and host forms agree exactly):
  - Statistics per (layer, expert) flat id: `count` (fixed point, ONE per *chain start*: a routing of an expert
    not routed at its layer's previous step, so a run of consecutive routings counts once; every step, at the
    layer-0 tick, `count -= count >> decay_shift`) and `last_use` (tick of the last routing).
  - Frequency value of an expert: `count + recent_bonus * ONE * [routed at its layer's latest tick]`.
  - Shadow scoring, at every tick before the update, for each expert routed now: would an idealized LRU cache of
    `num_rows` rows hold it (fewer than `num_rows` experts used more recently), and would an idealized frequency
    cache hold it (fewer than `num_rows` experts of higher (value, last use), values as of the previous tick)?
    The misses where the two disagree are summed into `misses = [lru only, freq only]` (x256, decayed by
    `>> duel_shift` every step). Misses both shadows share (cold misses, the long tail) are left out: summed in,
    they made the relative margin an absolute hurdle that grew with the miss rate, and at 50% rows of a skewed
    trace the frequency mode came tens of steps late (docs/BENCHMARKS.md, sixteenth session).
  - Mode: frequency while `freq_only + (freq_only >> margin_shift) + floor_misses * 256 < lru_only`, else LRU
    (ties and near-ties go to LRU). The absolute floor makes the frequency shadow prove itself by a few misses
    (decayed) before the pool leaves LRU: without it, short mistaken switches on drifting traces cost up to 0.2%
    more misses than LRU; with 8, none of 30 recency-dominated quality cells (five seed bases) is above LRU at
    three decimals (four by at most 0.05%), for a later switch on skewed ones (docs/BENCHMARKS.md, seventeenth
    session).
  - LRU mode decides exactly as `LRUPolicy` (victim key 0, candidates by expert id, always admit). Frequency
    mode: victims of lowest value first (ties: least recently used, then row index), candidates of highest count
    first, and a candidate displaces its victim only if `count + recent_bonus * ONE >= victim value`.

The shadow caches need the pool's row count (`num_rows`; the planner and the twin refuse another size). After
the planner renumbers its clock (a host-planned step) the last-use ticks are shifted exactly, but the recent bonus
of `victim_key` reads the rows' renumbered stamps 1..n: until the rows are used again, the L most recently used
rows get the bonus rather than the rows used in the last L ticks.
"""

from __future__ import annotations

import torch

from pooled_runner.kernels.plan_adaptive import AdaptiveRule, AdaptiveState
from pooled_runner.policy_base import NEVER, shift_ticks

ONE = 1 << 16  # fixed-point unit of one chain start
SCORE = 256  # fixed-point unit of one shadow miss


class AdaptivePolicy:
    """LRU or chain-start frequency, whichever an idealized shadow cache of the pool's size misses less on
    (see module docstring)."""

    name = "adaptive"
    plan_warps = 4  # warps per program of the fused plan (`DevicePlanner(plan_warps=None)`)

    def __init__(
        self,
        num_rows: int,
        decay_shift: int = 9,
        recent_bonus: int = 32,
        duel_shift: int = 5,
        margin_shift: int = 2,
        floor_misses: int = 8,
    ):
        if num_rows < 1 or recent_bonus < 0 or floor_misses < 0:
            raise ValueError(
                f"num_rows={num_rows} must be >= 1, recent_bonus={recent_bonus} and floor_misses={floor_misses} >= 0"
            )
        if not (1 <= decay_shift <= 30 and 1 <= duel_shift <= 30 and 1 <= margin_shift <= 30):
            raise ValueError(
                f"decay_shift={decay_shift}, duel_shift={duel_shift}, margin_shift={margin_shift} "
                "must be in [1, 30]"
            )
        self.num_rows, self.decay_shift, self.recent_bonus = num_rows, decay_shift, recent_bonus
        self.duel_shift, self.margin_shift = duel_shift, margin_shift
        self._floor = floor_misses * SCORE
        self._bonus = recent_bonus * ONE
        self.count: torch.Tensor | None = None  # [L * E_max + 1] int64; last slot is a dummy
        self.last_use: torch.Tensor | None = None  # [L * E_max] int64
        self.misses: torch.Tensor | None = None  # [2] int64: LRU-shadow-only, freq-shadow-only misses
        self.mode: torch.Tensor | None = None  # [1] int64: 1 = frequency
        self._kernel_state: AdaptiveState | None = None  # the fused plan's view of the state (set by bind)
        self._kernel_rule: AdaptiveRule | None = None
        self._layers, self._max_experts = 0, 0
        self._h_count: list[int] = []
        self._h_last: list[int] = []
        self._h_misses = [0, 0]
        self._h_mode = 0

    def clock_reset(self, shift: int) -> None:
        """The planner renumbered its clock (tick t is now t + shift): move the last-use ticks with it, so that
        ages, the shadow LRU order and chain starts survive a host-planned step."""
        shift_ticks(self.last_use, shift)

    def bind(self, num_layers: int, max_experts: int, device: torch.device) -> None:
        self._layers, self._max_experts = num_layers, max_experts
        size = num_layers * max_experts
        self.count = torch.zeros(size + 1, dtype=torch.int64, device=device)
        self.last_use = torch.full((size,), NEVER, dtype=torch.int64, device=device)
        self.misses = torch.zeros(2, dtype=torch.int64, device=device)
        self.mode = torch.zeros(1, dtype=torch.int64, device=device)
        scratch = torch.zeros(max_experts, dtype=torch.int64, device=device)  # the fused plan's workspace
        self._kernel_state = AdaptiveState(
            self.count, self.last_use, self.misses, self.mode, None, None, scratch
        )
        self._kernel_rule = AdaptiveRule(
            num_layers,
            self.decay_shift,
            self.duel_shift,
            self.margin_shift,
            self._floor,
            self._bonus,
            SCORE,
            ONE,
            self.decay_shift,  # the router's membership decay: unread without it (RouterAdaptivePolicy.bind)
        )

    def _state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.count is None or self.last_use is None or self.misses is None or self.mode is None:
            raise RuntimeError("AdaptivePolicy used before bind()")
        return self.count, self.last_use, self.misses, self.mode

    def observe(self, layer: int, present: torch.Tensor, now: torch.Tensor) -> None:
        count, last_use, misses, mode = self._state()
        L, E = self._layers, present.shape[0]
        lo = layer * self._max_experts
        last = last_use[lo : lo + E]  # [E] view
        seen = last != NEVER
        # Shadow caches, as of the previous tick.
        lru_rank = (last_use[None, :] > last[:, None]).sum(1)  # [E]
        lru_miss = present & ~(seen & (lru_rank < self.num_rows))
        freq_miss = self.frequency_shadow_miss(self._value_counts(), layer, present, now)
        if layer == 0:  # once per step
            misses -= misses >> self.duel_shift
            count -= count >> self.decay_shift
        disagree = lru_miss != freq_miss  # [E]
        misses += torch.stack([(lru_miss & disagree).sum(), (freq_miss & disagree).sum()]) * SCORE
        freq = misses[1:2]
        mode.copy_((freq + (freq >> self.margin_shift) + self._floor < misses[0:1]).to(torch.int64))
        start = present & (last != now - L)  # not routed at this layer's previous step
        count[lo : lo + E] += start.to(torch.int64) * ONE
        last.copy_(torch.where(present, now, last))

    def frequency_shadow_miss(
        self, value_counts: torch.Tensor, layer: int, present: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor:
        """`[E]` bool: routed now (`present`) and outside an idealized frequency cache of `num_rows` rows that
        ranks every expert by (`value_counts [L * E_max + 1]` + recent bonus, last use), as of the previous tick
        (call before `observe` updates the last uses)."""
        last_use = self._state()[1]
        L, E, lo = self._layers, present.shape[0], layer * self._max_experts
        last = last_use[lo : lo + E]  # [E]
        value = value_counts[:-1] + self._bonus * ((now - 1 - last_use) < L).to(torch.int64)  # [N]
        mine = value[lo : lo + E, None]
        above = (value[None, :] > mine) | ((value[None, :] == mine) & (last_use[None, :] > last[:, None]))
        return present & ~((last != NEVER) & (above.sum(1) < self.num_rows))

    def candidate_key(self, layer: int, num_experts: int) -> torch.Tensor | None:
        mode = self._state()[3]
        lo = layer * self._max_experts
        return -self._value_counts()[lo : lo + num_experts] * mode

    def victim_key(
        self, row_owner: torch.Tensor, row_stamp: torch.Tensor, now: torch.Tensor
    ) -> torch.Tensor | None:
        mode, count = self._state()[3], self._value_counts()
        value = count[torch.where(row_owner >= 0, row_owner, count.shape[0] - 1)]
        value = value + self._bonus * ((now - row_stamp) < self._layers).to(torch.int64)
        return value * mode

    def accept(self, cand_flat: torch.Tensor, victim_key: torch.Tensor) -> torch.Tensor | None:
        mode = self._state()[3]
        return (mode == 0) | (self._value_counts()[cand_flat] + self._bonus >= victim_key)

    def evicted(self, victim_key: torch.Tensor, evicted: torch.Tensor) -> None:
        pass

    def kernel_state(self) -> AdaptiveState:
        """The device state for the fused plan (`kernels/plan_adaptive.py`), with its scratch (built by bind)."""
        if self._kernel_state is None:
            raise RuntimeError(f"{type(self).__name__} used before bind()")
        return self._kernel_state

    def kernel_rule(self) -> AdaptiveRule:
        """The constants of the fused plan (built by bind)."""
        if self._kernel_rule is None:
            raise RuntimeError(f"{type(self).__name__} used before bind()")
        return self._kernel_rule

    def _value_counts(self) -> torch.Tensor:
        """`[L * E_max + 1]` the counts the frequency mode ranks by (a subclass may reorder them per layer)."""
        return self._state()[0]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        count, last_use, misses, mode = self._state()
        return {"count": count[:-1], "last_use": last_use, "misses": misses, "mode": mode}

    # Host form (the twin's).
    def host_reset(self, num_layers: int, max_experts: int) -> None:
        self._layers, self._max_experts = num_layers, max_experts
        size = num_layers * max_experts
        self._h_count, self._h_last = [0] * size, [NEVER] * size
        self._h_misses, self._h_mode = [0, 0], 0

    def host_frequency_out(
        self, value_counts: list[int], layer: int, present: list[int], now: int
    ) -> list[bool]:
        """Host form of `frequency_shadow_miss`: per expert of `present`, outside the idealized frequency cache
        ranked by `value_counts [L * E_max]` (+ recent bonus, last use), as of the previous tick."""
        L, R, lo, last_all = self._layers, self.num_rows, layer * self._max_experts, self._h_last
        value = [c + self._bonus * (now - 1 - t < L) for c, t in zip(value_counts, last_all)]
        out = []
        for e in present:
            t, v = last_all[lo + e], value[lo + e]
            out.append(t == NEVER or sum(w > v or (w == v and x > t) for w, x in zip(value, last_all)) >= R)
        return out

    def host_observe(self, layer: int, present: list[int], now: int) -> None:
        L, R, lo = self._layers, self.num_rows, layer * self._max_experts
        last_all, count = self._h_last, self._h_count
        freq_outs = self.host_frequency_out(self._h_value_counts(), layer, present, now)
        lru_miss = freq_miss = 0  # misses of one shadow where the other hits
        for e, freq_out in zip(present, freq_outs):
            t = last_all[lo + e]
            lru_out = t == NEVER or sum(x > t for x in last_all) >= R
            lru_miss += int(lru_out and not freq_out)
            freq_miss += int(freq_out and not lru_out)
        if layer == 0:
            self._h_misses = [m - (m >> self.duel_shift) for m in self._h_misses]
            self._h_count = count = [c - (c >> self.decay_shift) for c in count]
        self._h_misses[0] += lru_miss * SCORE
        self._h_misses[1] += freq_miss * SCORE
        freq = self._h_misses[1]
        self._h_mode = int(freq + (freq >> self.margin_shift) + self._floor < self._h_misses[0])
        for e in present:
            if last_all[lo + e] != now - L:
                count[lo + e] += ONE
            last_all[lo + e] = now

    def _h_value_counts(self) -> list[int]:
        return self._h_count

    def host_candidate_key(self, layer: int, expert: int) -> int:
        return -self._h_value_counts()[layer * self._max_experts + expert] * self._h_mode

    def host_victim_key(self, owner_flat: int, stamp: int, now: int) -> int:
        value = self._h_value_counts()[owner_flat] + self._bonus * (now - stamp < self._layers)
        return value * self._h_mode

    def host_accept(self, cand_flat: int, victim_key: int) -> bool:
        return self._h_mode == 0 or self._h_value_counts()[cand_flat] + self._bonus >= victim_key

    def host_evicted(self, victim_key: int) -> None:
        pass

    def host_state(self) -> dict[str, list[int]]:
        return {
            "count": list(self._h_count),
            "last_use": list(self._h_last),
            "misses": list(self._h_misses),
            "mode": [self._h_mode],
        }
