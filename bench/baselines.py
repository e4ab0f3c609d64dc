"""Decode baselines as real components over the project's own pieces (bank, rows, kernels, torch path).

Every system serves `forward(layer, hidden [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]` (ids -1 are
padding) and reports its traffic with `traffic()` (a `Traffic`, cumulative):
  AllResident    every expert in device memory (the upper bound; needs VRAM for all of them).
  AllHostView    every expert read in place from the pinned bank by the kernel (vLLM's UVA CPU offload).
  PerLayerSlots  SGLang 0.5.23 paged experts' policy at equal VRAM, in `bench/baseline_slots.py`.
  Ours           `PooledMoE` (a global pool of R rows, the device planner for decode steps).
The compute is `pooled_runner.kernels.fused_moe.pooled_fused_moe` on CUDA and the batch-invariant torch path
(`pooled_runner.torch_path`) elsewhere; both read weights by location code (row < N, host row N + e, -1 not
here), so every system computes exactly what the pooled runtime computes, only its residency differs.
Used by bench/decode.py (all four) and bench/prefill.py (PerLayerSlots as 'page-in waves').
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pooled_runner.bank import ExpertBank
from pooled_runner.formats import make_format
from pooled_runner.moe import PooledMoE
from pooled_runner.torch_path import combine, expert_mlp


@dataclass
class Traffic:
    """Cumulative counters of one system. A hit/miss is a distinct (layer step, expert)."""

    hits: int = 0  # read from device memory
    misses: int = 0  # crossed PCIe (copied into a slot/row, or read in place from the bank)
    pcie_bytes: int = 0  # bytes over PCIe: copies + in-place host reads (one read per expert per layer step)
    layer_steps: int = 0  # forward calls counted
    waves: int = 0  # PerLayerSlots: waves run (one per layer step when the experts fit the slots)
    graph_eligible: int = 0  # PerLayerSlots: layer steps with T <= S // top_k (SGLang would capture them)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def distinct_experts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    """Sorted distinct ids in [0, num_experts) of `topk_ids [T, K]` (a host sync on the GPU)."""
    ids = topk_ids.reshape(-1)
    return torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()


class ExpertCompute:
    """Routed-experts output of one layer from device rows `rows[op] [N, ...]` and the bank's host view, by
    location codes `l2p [E]` int32 (row < N, N + e = host row e of the layer, -1 = not computed).

    `use_kernels`: the Triton kernels (default on CUDA); False: the batch-invariant torch path.
    """

    def __init__(
        self,
        weight_format: str,
        dtype: torch.dtype,
        hidden_size: int,
        intermediate_size: int,
        rows: dict[str, torch.Tensor],
        bank: ExpertBank | None,
        use_kernels: bool | None = None,
    ):
        self.format = make_format(weight_format, dtype)
        self.dtype = dtype
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.rows = rows
        self.bank = bank
        self.num_rows = int(next(iter(rows.values())).shape[0])
        device = next(iter(rows.values())).device
        self.use_kernels = device.type == "cuda" if use_kernels is None else use_kernels
        self._projections: dict[int, tuple[object, object]] = {}

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        l2p: torch.Tensor,
        num_experts: int,
    ) -> torch.Tensor:
        if self.use_kernels:
            return self._kernels(layer, hidden, topk_ids, topk_weights, l2p, num_experts)
        return self._torch(layer, hidden, topk_ids, topk_weights, l2p, num_experts)

    def _kernels(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        l2p: torch.Tensor,
        num_experts: int,
    ) -> torch.Tensor:
        from pooled_runner.kernels.fused_moe import make_projections, pooled_fused_moe
        from pooled_runner.kernels.operands import kernel_format

        kfmt = kernel_format(self.format)
        if layer not in self._projections:
            host_view = self.bank.layer(layer) if self.bank is not None else None
            self._projections[layer] = make_projections(
                kfmt, self.rows, host_view, self.hidden_size, self.intermediate_size
            )
        w13, w2 = self._projections[layer]
        return pooled_fused_moe(hidden, topk_ids, topk_weights, l2p, num_experts, w13, w2, kfmt)  # type: ignore[arg-type]

    def _torch(
        self,
        layer: int,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        l2p: torch.Tensor,
        num_experts: int,
    ) -> torch.Tensor:
        T, K = topk_ids.shape
        ids = topk_ids.long()  # [T, K]
        codes = l2p.long().cpu()
        valid = (ids >= 0) & (ids < num_experts)
        routed = torch.where(valid, codes.to(ids.device)[ids.clamp(0, max(num_experts - 1, 0))], -1) >= 0
        ids = torch.where(routed, ids, -1)  # entries whose code is -1 add nothing, as in the kernels' combine
        expert_out = torch.zeros(
            (T, K, self.hidden_size), dtype=self.dtype, device=hidden.device
        )  # [T, K, H]
        for expert in distinct_experts(ids, num_experts):
            code = int(codes[expert])
            if code < self.num_rows:
                src = {name: t[code] for name, t in self.rows.items()}
            else:
                assert self.bank is not None, (
                    f"layer {layer} expert {expert}: host code {code} without a bank"
                )
                src = self.bank.row(layer, code - self.num_rows)
            w13, w2 = self.format.expert_weights(src)
            token_idx, slot_idx = (ids == expert).nonzero(as_tuple=True)
            x = hidden[token_idx]
            expert_out[token_idx, slot_idx] = expert_mlp(x, w13.to(x.device), w2.to(x.device))
        return combine(expert_out, ids, topk_weights)


def _empty_like_bank(bank: ExpertBank, num_rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        name: torch.empty((num_rows, *t.shape[1:]), dtype=t.dtype, device=device)
        for name, t in bank.tensors_host.items()
    }


class _BankSystem:
    """Shared parts: the bank's layout, row bytes, the traffic counters."""

    name = "?"
    capturable = False  # forward has no host sync: a decode step can be captured in a CUDA graph

    def __init__(self, bank: ExpertBank):
        self.bank = bank
        self.num_experts_per_layer = list(bank.num_experts_per_layer)
        self.row_bytes = bank.row_bytes()
        self.counters = Traffic()

    def traffic(self) -> Traffic:
        return Traffic(*(getattr(self.counters, f.name) for f in fields(Traffic)))


class _StaticTableSystem(_BankSystem):
    """A system whose location table never changes: expert e of layer l always at code `first[l] + e`."""

    capturable = True

    def _set_table(self, first_code: list[int], device: torch.device) -> None:
        E_max = max(self.num_experts_per_layer)
        l2p = torch.full((len(first_code), E_max), -1, dtype=torch.int32)
        for layer, num_experts in enumerate(self.num_experts_per_layer):
            l2p[layer, :num_experts] = first_code[layer] + torch.arange(num_experts)
        self.l2p = l2p.to(device)

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(
            layer, hidden, topk_ids, topk_weights, self.l2p[layer], self.num_experts_per_layer[layer]
        )


class AllResident(_StaticTableSystem):
    """Every expert in device memory: rows `[total experts]` layer-major, codes `offset(layer) + e`."""

    name = "all resident"

    def __init__(
        self,
        bank: ExpertBank,
        weight_format: str,
        dtype: torch.dtype,
        H: int,
        I: int,
        device: str,
        use_kernels: bool | None = None,
    ):
        super().__init__(bank)
        dev = torch.device(device)
        rows = _empty_like_bank(bank, bank.num_total_experts, dev)
        for name, t in rows.items():
            t.copy_(bank.tensors_host[name])
        self._set_table(bank.layer_offsets[:-1], dev)
        self.compute = ExpertCompute(weight_format, dtype, H, I, rows, None, use_kernels)

    def account(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one layer step's traffic (outside timing: forward itself never syncs)."""
        self.counters.hits += len(distinct_experts(topk_ids, self.num_experts_per_layer[layer]))
        self.counters.layer_steps += 1


class AllHostView(_StaticTableSystem):
    """Every expert read in place from the pinned bank (codes `1 + e`; one unused device row)."""

    name = "all host view"

    def __init__(
        self,
        bank: ExpertBank,
        weight_format: str,
        dtype: torch.dtype,
        H: int,
        I: int,
        device: str,
        use_kernels: bool | None = None,
    ):
        super().__init__(bank)
        dev = torch.device(device)
        rows = {name: t.zero_() for name, t in _empty_like_bank(bank, 1, dev).items()}  # never read
        self._set_table([1] * bank.num_layers, dev)
        self.compute = ExpertCompute(weight_format, dtype, H, I, rows, bank, use_kernels)

    def account(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one layer step's traffic (outside timing): every distinct expert read once over PCIe."""
        n = len(distinct_experts(topk_ids, self.num_experts_per_layer[layer]))
        self.counters.misses += n
        self.counters.pcie_bytes += n * self.row_bytes
        self.counters.layer_steps += 1


class Ours(_BankSystem):
    """`PooledMoE` as built by the caller (global pool, device planner on CUDA). Traffic from its stats
    (a boundary read: syncs)."""

    name = "pooled (ours)"
    capturable = True

    def __init__(self, moe: PooledMoE):
        assert moe.pool is not None and moe.bank is not None, "Ours needs an installed PooledMoE with a bank"
        super().__init__(moe.bank)
        self.moe = moe

    def forward(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.moe.forward(layer, hidden, topk_ids, topk_weights)

    def traffic(self) -> Traffic:
        s = self.moe.stats()
        return Traffic(s.hits, s.misses, s.bytes_copied_to_rows + s.bytes_read_host_view)
