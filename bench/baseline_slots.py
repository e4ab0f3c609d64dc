"""The per-layer slots baseline (`PerLayerSlots`): SGLang 0.5.23 paged experts' policy at equal VRAM
(`srt/layers/moe/paged_experts/`). S = R // L slots per layer, slots start holding experts 0..S-1, LRU per layer,
copy-then-compute (misses copied on the copy engine into the layer's LRU slots before the GEMM); a step with
more distinct experts than S runs in host-planned waves (resident experts first, then the rest, S at a time);
its decode graphs are capped at S // top_k requests. The other systems and the shared compute are in
`bench/baselines.py`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from bench.baselines import ExpertCompute, _BankSystem, _empty_like_bank, distinct_experts
from pooled_runner.bank import ExpertBank


@dataclass(frozen=True)
class Wave:
    experts: list[int]  # logical ids served by this wave
    slots: list[int]  # the slot of each, same order
    loads: list[tuple[int, int]]  # (expert, slot) pairs to copy in before the wave runs


class SlotLRU:
    """SGLang paged experts' `LRUPolicy` for one layer: expert -> slot, least recently used first; slots start
    holding experts 0..S-1."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: OrderedDict[int, int] = OrderedDict((e, e) for e in range(num_slots))

    def place(self, experts: list[int]) -> Wave:
        """Make `experts` (at most S) resident, evicting least recently used experts outside them."""
        if len(experts) > self.num_slots:
            raise ValueError(f"a wave of {len(experts)} experts exceeds {self.num_slots} slots")
        for e in experts:
            if e in self.resident:
                self.resident.move_to_end(e)
        loads = []
        for e in experts:
            if e not in self.resident:
                _, slot = self.resident.popitem(last=False)  # the wave's experts sit at the tail
                self.resident[e] = slot
                loads.append((e, slot))
        return Wave(list(experts), [self.resident[e] for e in experts], loads)


def plan_waves(policy: SlotLRU, distinct: list[int]) -> list[Wave]:
    """SGLang's `plan_waves`: resident experts first, then the rest, in groups of at most S, each placed in
    turn. A step with no routed expert gets one empty wave."""
    k = policy.num_slots
    ordered = [e for e in distinct if e in policy.resident] + [
        e for e in distinct if e not in policy.resident
    ]
    groups = [ordered[i : i + k] for i in range(0, len(ordered), k)] or [[]]
    return [policy.place(group) for group in groups]


def wave_ids(topk_ids: torch.Tensor, experts: list[int], num_experts: int) -> torch.Tensor:
    """`topk_ids [T, K]` with every id outside `experts` (and padding) set to -1."""
    member = torch.zeros(num_experts + 1, dtype=torch.bool)
    member[experts] = True  # index num_experts stays False: padding maps there
    member = member.to(topk_ids.device)
    idx = torch.where((topk_ids >= 0) & (topk_ids < num_experts), topk_ids, num_experts).long()
    return torch.where(member[idx], topk_ids, torch.full_like(topk_ids, -1))


class PerLayerSlots(_BankSystem):
    """SGLang paged experts at equal VRAM: `num_slots` device slots per layer, LRU per layer, copy-then-compute,
    host-planned waves. Slot s of layer l is row `l * S + s`; `l2p[l, e]` = its row, or -1 when not resident."""

    name = "per-layer slots"

    def __init__(
        self,
        bank: ExpertBank,
        weight_format: str,
        dtype: torch.dtype,
        H: int,
        I: int,
        device: str,
        num_slots: int,
        top_k: int,
        use_kernels: bool | None = None,
    ):
        super().__init__(bank)
        if not top_k <= num_slots <= min(self.num_experts_per_layer):
            raise ValueError(
                f"num_slots={num_slots} must be in [top_k={top_k}, min experts per layer "
                f"{min(self.num_experts_per_layer)}] (SGLang requires at least top_k resident experts)"
            )
        self.device = torch.device(device)
        self.num_slots, self.top_k = num_slots, top_k
        self.max_graph_bs = max(1, num_slots // top_k)  # SGLang caps decode graph batch sizes here
        L = bank.num_layers
        self.rows = _empty_like_bank(bank, L * num_slots, self.device)
        self.policies = [SlotLRU(num_slots) for _ in range(L)]
        self.l2p_host = torch.full((L, max(self.num_experts_per_layer)), -1, dtype=torch.int32)
        for layer in range(L):
            for e in range(num_slots):  # slots start holding experts 0..S-1 (installation, not traffic)
                self._copy_in(layer, e, e)
        self.l2p = self.l2p_host.to(self.device)
        self.compute = ExpertCompute(weight_format, dtype, H, I, self.rows, None, use_kernels)

    def _copy_in(self, layer: int, expert: int, slot: int) -> None:
        """Copy a bank row into a slot (pinned -> device on the copy engine, in stream order) and map it."""
        row = layer * self.num_slots + slot
        src = self.bank.row(layer, expert)
        non_blocking = self.device.type == "cuda"
        for name, dst in self.rows.items():
            dst[row].copy_(src[name], non_blocking=non_blocking)
        self.l2p_host[layer][self.l2p_host[layer] == row] = -1  # the evicted expert
        self.l2p_host[layer, expert] = row

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Plan waves on the host (one sync, as SGLang's eager executor), copy each wave's misses, compute."""
        E = self.num_experts_per_layer[layer]
        distinct = distinct_experts(topk_ids, E)
        waves = plan_waves(self.policies[layer], distinct)
        c = self.counters
        c.layer_steps += 1
        c.waves += len(waves)
        c.graph_eligible += hidden.shape[0] <= self.max_graph_bs
        loads = sum(len(w.loads) for w in waves)
        c.misses += loads
        c.hits += len(distinct) - loads
        c.pcie_bytes += loads * self.row_bytes
        out32: torch.Tensor | None = None
        for wave in waves:
            for expert, slot in wave.loads:
                self._copy_in(layer, expert, slot)
            if wave.loads:
                self.l2p[layer].copy_(self.l2p_host[layer])  # stream-ordered after the previous wave's GEMM
            if len(waves) == 1:  # only padding is outside the wave
                return self.compute(layer, hidden, topk_ids, topk_weights, self.l2p[layer], E)
            ids = wave_ids(topk_ids, wave.experts, E)
            part = self.compute(layer, hidden, ids, topk_weights, self.l2p[layer], E).float()
            out32 = part if out32 is None else out32.add_(part)
        assert out32 is not None
        return out32.to(hidden.dtype)

    def check_invariants(self) -> None:
        """AssertionError unless the tables match the policies and every slot holds its expert's bank row."""
        assert torch.equal(self.l2p.cpu(), self.l2p_host), "l2p differs from its host mirror"
        for layer, policy in enumerate(self.policies):
            assert len(policy.resident) == self.num_slots, f"layer {layer}: {len(policy.resident)} residents"
            assert sorted(policy.resident.values()) == list(range(self.num_slots)), (
                f"layer {layer}: slots reused"
            )
            expected = torch.full_like(self.l2p_host[layer], -1)
            for expert, slot in policy.resident.items():
                expected[expert] = layer * self.num_slots + slot
                src = self.bank.row(layer, expert)
                for name, t in self.rows.items():
                    row = t[layer * self.num_slots + slot].cpu()
                    assert torch.equal(row, src[name]), (
                        f"layer {layer} slot {slot}: {name} != expert {expert}"
                    )
            assert torch.equal(self.l2p_host[layer], expected), f"layer {layer}: table != policy"
