"""Host side of the planner: the plain-Python `HostTwin` (the device planner's test oracle and the planner for
uncaptured steps of tests), the flat residency of a pool, and the table consistency check both use.

Kept independent of `planner.py` on purpose: the twin re-implements the decision rule from its description, so
a bug in the device planner (torch ops or the fused kernel) shows up as a state mismatch.
"""

from __future__ import annotations

import torch

from pooled_runner.policies import Policy, check_policy_rows
from pooled_runner.pool import ExpertPool
from pooled_runner.routing import check_router_scores

INT64_MIN = torch.iinfo(torch.int64).min
FREE = -1


def residency_from_pool(pool: ExpertPool) -> tuple[list[int], list[int]]:
    """Flat owners and stamps (1..n in LRU order, -1 free) of the pool's rows."""
    EM = pool.max_experts
    owner = [FREE if o is None else o[0] * EM + o[1] for o in pool.row_owner]
    stamp = [FREE] * pool.num_rows
    for i, row in enumerate(pool.lru_rows()):
        stamp[row] = i + 1
    return owner, stamp


def table_problems(
    l2p: torch.Tensor, owner: list[int], stamp: list[int], num_experts_per_layer: list[int], R: int
) -> list[str]:
    """Inconsistencies between a location table `[L, E_max]`, flat row owners and stamps (empty if none)."""
    EM = l2p.shape[1]
    out = []
    seen: dict[int, int] = {}
    for row, o in enumerate(owner):
        if o < 0:
            if stamp[row] != FREE:
                out.append(f"free row {row} has stamp {stamp[row]}")
            continue
        if o in seen:
            out.append(f"expert {divmod(o, EM)} owns rows {seen[o]} and {row}")
        seen[o] = row
        layer, expert = divmod(o, EM)
        if layer >= len(num_experts_per_layer) or expert >= num_experts_per_layer[layer]:
            out.append(f"row {row} owner {(layer, expert)} is not an expert")
        elif int(l2p[layer, expert]) != row:
            out.append(f"row {row} owner {(layer, expert)} maps to {int(l2p[layer, expert])}")
    for layer, n in enumerate(num_experts_per_layer):
        for expert in range(EM):
            code = int(l2p[layer, expert])
            if expert >= n:
                if code != -1:
                    out.append(f"layer {layer} padding expert {expert} has code {code}")
            elif code < 0:
                out.append(f"layer {layer} expert {expert} has code {code}")
            elif code < R:
                if owner[code] != layer * EM + expert:
                    out.append(f"layer {layer} expert {expert} -> row {code} owned by {owner[code]}")
            elif code != R + expert:
                out.append(f"layer {layer} expert {expert}: host code {code} != {R + expert}")
    return out


class HostTwin:
    """Plain-Python twin of `DevicePlanner` (same decision rule, own state, no tensors in the loop).

    Tracks tables only (it copies no weights). Start it from the same pool state as the planner
    (`HostTwin(pool, policy)` reads the pool's residency), feed it the same `plan` calls, and `state()`
    equals the planner's.
    """

    def __init__(self, pool: ExpertPool, policy: Policy, block_m: int = 16, min_reads_to_admit: int = 1):
        self.num_rows, self.max_experts = pool.num_rows, pool.max_experts
        self.num_experts_per_layer = list(pool.num_experts_per_layer)
        self.block_m, self.min_reads_to_admit = block_m, min_reads_to_admit
        self.policy = policy
        check_policy_rows(policy, pool.num_rows)
        policy.host_reset(pool.num_layers, pool.max_experts)
        self.row_owner, self.row_stamp = residency_from_pool(pool)
        self.clock = max([*self.row_stamp, 0])
        self.l2p = pool.l2p_host.tolist()
        self.hits = self.misses = self.admissions = 0

    def plan(
        self,
        layer: int,
        topk_ids: list[list[int]] | torch.Tensor,
        router_scores: torch.Tensor | None = None,
    ) -> list[int]:
        """Plan one step; returns the codes of the routed experts in expert-id order. `router_scores [T, >= E]`
        as `DevicePlanner.plan`'s (read only by a policy with `host_observe_scores`)."""
        R, EM = self.num_rows, self.max_experts
        E = self.num_experts_per_layer[layer]
        rows_of_ids = topk_ids.tolist() if isinstance(topk_ids, torch.Tensor) else topk_ids
        if router_scores is not None and rows_of_ids:  # before any change, as the device planner
            check_router_scores(router_scores, len(rows_of_ids), E, router_scores.device)
        tokens: dict[int, int] = {}
        for token in rows_of_ids:
            for e in token:
                if 0 <= e < E:
                    tokens[e] = tokens.get(e, 0) + 1
        present = sorted(tokens)
        self.clock += 1
        now = self.clock
        observe_scores = getattr(self.policy, "host_observe_scores", None)
        if router_scores is not None and rows_of_ids and observe_scores is not None:
            valid = [any(0 <= e < E for e in token) for token in rows_of_ids]
            observe_scores(layer, router_scores[:, :E].double().tolist(), valid, len(rows_of_ids[0]))
        self.policy.host_observe(layer, present, now)
        codes = self.l2p[layer]
        for e in present:
            if codes[e] < R:
                self.row_stamp[codes[e]] = now
                self.hits += 1
            else:
                self.misses += 1
        cands = [
            e for e in present if codes[e] >= R and -(-tokens[e] // self.block_m) >= self.min_reads_to_admit
        ]
        cands.sort(key=lambda e: self.policy.host_candidate_key(layer, e))  # stable: ties by expert id
        victims = [r for r in range(R) if self.row_stamp[r] != now]
        victims.sort(key=self._victim_order)
        for e, r in zip(cands, victims):
            old = self.row_owner[r]
            if old >= 0 and not self.policy.host_accept(layer * EM + e, self._victim_order(r)[0]):
                continue
            if old >= 0:
                self.l2p[old // EM][old % EM] = R + old % EM
                self.policy.host_evicted(self._victim_order(r)[0])
            self.l2p[layer][e] = r
            self.row_owner[r] = layer * EM + e
            self.row_stamp[r] = now
            self.admissions += 1
        return [self.l2p[layer][e] for e in present]

    def _victim_order(self, row: int) -> tuple[int, int, int]:
        owner = self.row_owner[row]
        key = INT64_MIN if owner < 0 else self.policy.host_victim_key(owner, self.row_stamp[row], self.clock)
        return (key, self.row_stamp[row], row)

    def state(self) -> dict[str, torch.Tensor]:
        out = {
            "l2p": torch.tensor(self.l2p, dtype=torch.int32),
            "row_owner": torch.tensor(self.row_owner, dtype=torch.int64),
            "row_stamp": torch.tensor(self.row_stamp, dtype=torch.int64),
            "clock": torch.tensor([self.clock], dtype=torch.int64),
        }
        out.update({k: torch.tensor(v, dtype=torch.int64) for k, v in self.policy.host_state().items()})
        return out
