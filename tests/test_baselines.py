"""The decode baselines (bench/baselines.py, bench/baseline_slots.py) against an independent dense reference at awkward sizes, their
slot/LRU bookkeeping, and the wave logic (every routed (token, k) computed exactly once)."""

from __future__ import annotations

import pytest
import torch

from bench.baseline_slots import PerLayerSlots, SlotLRU, plan_waves, wave_ids
from bench.baselines import AllHostView, AllResident, Ours, distinct_experts
from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.bank import ExpertBank
from pooled_runner.formats import make_format
from tests.kernel_helpers import assert_close
from tests.reference import dense_reference, random_routing

EXPERTS = [13, 9, 11]  # odd, unequal per layer
K = 3  # top-3: divides none of them


def _bank(H: int, I: int, seed: int) -> ExpertBank:
    fmt = make_format("bf16", torch.bfloat16)
    bank = ExpertBank(fmt.operands(H, I), EXPERTS, pin=False)
    g = torch.Generator().manual_seed(seed)
    for layer, num_experts in enumerate(EXPERTS):
        for e in range(num_experts):
            w13 = (torch.randn(2 * I, H, generator=g) / H**0.5).bfloat16()
            w2 = (torch.randn(H, I, generator=g) / I**0.5).bfloat16()
            bank.write_expert(layer, e, {"w13": w13, "w2": w2})
    return bank


def _reference(bank: ExpertBank, layer, hidden, ids, w) -> torch.Tensor:
    weights = {e: {k: v.clone() for k, v in bank.row(layer, e).items()} for e in range(EXPERTS[layer])}
    return dense_reference(hidden, ids, w, weights)


def _ours(bank: ExpertBank, H: int, I: int, rows: int) -> Ours:
    moe = PooledMoE(PoolConfig(pool_rows=rows, device="cpu", prefill_staging=False), H, I, top_k=K)
    for n in EXPERTS:
        moe.register_layer(n)
    moe.install(lambda layer, e: {k: v.clone() for k, v in bank.row(layer, e).items()})
    return Ours(moe)


def _systems(bank: ExpertBank, H: int, I: int, use_kernels: bool = False):
    args = (bank, "bf16", torch.bfloat16, H, I, "cpu")
    return [
        AllResident(*args, use_kernels=use_kernels),
        AllHostView(*args, use_kernels=use_kernels),
        PerLayerSlots(*args, num_slots=4, top_k=K, use_kernels=use_kernels),  # waves from 2 tokens on
        PerLayerSlots(*args, num_slots=K, top_k=K, use_kernels=use_kernels),  # the smallest SGLang allows
    ]


def _route(T: int, E: int, g: torch.Generator):
    ids, w = random_routing(T, K, E, g)
    return ids, w.bfloat16()


@pytest.mark.parametrize("T", [0, 1, 2, 5, 17])
def test_every_system_equals_the_dense_reference(T):
    H, I = 24, 10
    bank = _bank(H, I, seed=T)
    systems = [*_systems(bank, H, I), _ours(bank, H, I, rows=7)]
    g = torch.Generator().manual_seed(100 + T)
    for _step in range(3):
        for layer, E in enumerate(EXPERTS):
            hidden = torch.randn(T, H, generator=g).bfloat16()
            ids, w = _route(T, E, g)
            ref = _reference(bank, layer, hidden, ids, w)
            for system in systems:
                before = system.traffic()
                out = system.forward(layer, hidden, ids, w)
                waves = (system.traffic() - before).waves
                assert out.shape == (T, H) and out.dtype == torch.bfloat16
                if waves > 1:  # waves add bf16 partial sums in fp32: a rounding apart from one combine
                    assert_close(out, ref, f"{system.name} T={T} layer={layer} waves={waves}")
                else:  # one combine over the batch-invariant torch path: bit for bit
                    assert torch.equal(out, ref), f"{system.name} T={T} layer={layer}"
    for system in systems:
        if isinstance(system, PerLayerSlots):
            system.check_invariants()


def test_steps_needing_waves_happen_and_traffic_adds_up():
    H, I = 16, 8
    bank = _bank(H, I, seed=5)
    slots = PerLayerSlots(bank, "bf16", torch.bfloat16, H, I, "cpu", num_slots=4, top_k=K)
    resident = AllResident(bank, "bf16", torch.bfloat16, H, I, "cpu")
    host = AllHostView(bank, "bf16", torch.bfloat16, H, I, "cpu")
    g = torch.Generator().manual_seed(9)
    total_distinct = layer_steps = multi_wave = 0
    for T in (1, 1, 2, 6, 6, 1, 9):
        for layer, E in enumerate(EXPERTS):
            hidden = torch.randn(T, H, generator=g).bfloat16()
            ids, w = _route(T, E, g)
            n = len(distinct_experts(ids, E))
            before = slots.traffic()
            slots.forward(layer, hidden, ids, w)
            d = slots.traffic() - before
            assert d.hits + d.misses == n
            assert d.waves == max(1, -(-n // 4)), f"{n} distinct experts in {d.waves} waves of 4 slots"
            assert d.graph_eligible == int(T <= 4 // K)
            multi_wave += d.waves > 1
            resident.account(layer, ids)
            host.account(layer, ids)
            total_distinct += n
            layer_steps += 1
            slots.check_invariants()
    assert multi_wave > 0, "no step needed waves: the test does not cover them"
    s = slots.traffic()
    assert s.pcie_bytes == s.misses * bank.row_bytes() and s.layer_steps == layer_steps
    assert 0 < s.hits and 0 < s.misses
    r, h = resident.traffic(), host.traffic()
    assert (r.hits, r.misses, r.pcie_bytes) == (total_distinct, 0, 0)
    assert (h.hits, h.misses, h.pcie_bytes) == (0, total_distinct, total_distinct * bank.row_bytes())


@pytest.mark.parametrize("seed", range(6))
def test_waves_cover_every_routed_entry_exactly_once(seed):
    g = torch.Generator().manual_seed(seed)
    E, S = 17, 5
    policy = SlotLRU(S)
    for T in (1, 3, 8, 0, 11):
        ids, _ = random_routing(T, 4, E, g, pad_prob=0.2)
        distinct = distinct_experts(ids, E)
        resident_before = set(policy.resident)
        waves = plan_waves(policy, distinct)
        served = [e for wave in waves for e in wave.experts]
        assert sorted(served) == distinct, "waves do not partition the step's experts"
        hits_first = [e for e in served if e in resident_before]
        assert served[: len(hits_first)] == hits_first, "resident experts are not served first"
        covered = torch.zeros(ids.shape, dtype=torch.int64)
        for wave in waves:
            assert len(wave.experts) <= S
            assert len(set(wave.slots)) == len(wave.slots), f"two experts in one slot: {wave}"
            masked = wave_ids(ids, wave.experts, E)
            inside = masked >= 0
            assert torch.equal(masked[inside], ids[inside])
            assert set(masked[inside].tolist()) <= set(wave.experts)
            covered += inside.long()
        assert torch.equal(covered, (ids >= 0).long()), f"coverage {covered.tolist()} for ids {ids.tolist()}"
        assert sorted(policy.resident.values()) == list(range(S))


def test_wave_planning_equals_sglang_paged_experts():
    residency = pytest.importorskip("sglang.srt.layers.moe.paged_experts.residency")
    g = torch.Generator().manual_seed(3)
    ours, theirs = SlotLRU(6), residency.LRUPolicy(6)
    for T in (1, 2, 1, 5, 3, 9, 1, 1, 4):
        ids, _ = random_routing(T, 4, 19, g)
        distinct = distinct_experts(ids, 19)
        a, b = plan_waves(ours, distinct), residency.plan_waves(policy=theirs, distinct=distinct)
        assert [(w.experts, w.slots, w.loads) for w in a] == [
            (w.experts, w.slots, [tuple(x) for x in w.loads]) for w in b
        ]
        assert list(ours.resident.items()) == list(theirs.resident.items())


def test_slot_counts_are_checked():
    bank = _bank(8, 4, seed=1)
    with pytest.raises(ValueError, match="num_slots"):
        PerLayerSlots(bank, "bf16", torch.bfloat16, 8, 4, "cpu", num_slots=K - 1, top_k=K)
    with pytest.raises(ValueError, match="num_slots"):
        PerLayerSlots(bank, "bf16", torch.bfloat16, 8, 4, "cpu", num_slots=10, top_k=K)  # layer 1 has 9
    with pytest.raises(ValueError, match="exceeds"):
        SlotLRU(2).place([0, 1, 2])


def test_kernel_path_under_the_interpreter():
    """The CUDA code path (pooled_fused_moe with location codes, masked waves) on Triton's interpreter."""
    from pooled_runner.kernels.moe_gemm import interpreting

    if not interpreting():
        pytest.skip("CPU interpreter test; the GPU runs bench/decode.py")
    H, I = 40, 24
    bank = _bank(H, I, seed=11)
    g = torch.Generator().manual_seed(12)
    systems = _systems(bank, H, I, use_kernels=True)
    for T in (1, 5):
        layer, E = 0, EXPERTS[0]
        hidden = torch.randn(T, H, generator=g).bfloat16()
        ids, w = _route(T, E, g)
        ref = _reference(bank, layer, hidden, ids, w)
        for system in systems:
            assert_close(system.forward(layer, hidden, ids, w), ref, f"{system.name} kernels T={T}")
    for system in systems[2:]:
        assert system.traffic().waves > system.traffic().layer_steps  # T=5 needed waves
        system.check_invariants()
