"""The cost-aware adaptive speculation inside SGLang's own `AdaptiveController` (no server, no model).

SGLang's controller switches a worker between pre-built runtime states, one per depth; here the worker records
the depth each verify step ran at and a cost model (step time per depth, acceptance 0.6 per draft, sampled)
advances a fake clock. The reference: SGLang's own `AdaptiveSpeculativeParams` under the same model, and the
best fixed depth of the model, computed directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tests.spec_cost_models import sample_accepted

ACCEPT = 0.6


@dataclass
class FakeWorker:
    """The `AdaptiveSpecWorker` protocol: runtime states per depth, the active depth, nothing else."""

    speculative_num_steps: int
    ran: list[int] = field(default_factory=list)

    def build_adaptive_runtime_state(
        self, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None
    ):  # type: ignore[no-untyped-def]
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        assert speculative_num_draft_tokens == speculative_num_steps + 1
        return SpecRuntimeState(
            speculative_num_steps=speculative_num_steps,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            draft_attn_backend=None,
            cuda_graph_runner=None,
            target_attn_backend=None,
            target_graph_runner=None,
            draft_extend_attn_backend=None,
            cuda_graph_runner_for_draft_extend=None,
        )

    def apply_runtime_state(self, state) -> None:  # type: ignore[no-untyped-def]
        self.speculative_num_steps = state.speculative_num_steps


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def serve(
    params, clock: FakeClock | None, step_ms: dict[int, float], num_steps: int, batch_size: int, seed: int
):  # type: ignore[no-untyped-def]
    """Run `num_steps` decode batches through SGLang's controller; returns (tokens per request, seconds, worker)."""
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    worker = FakeWorker(speculative_num_steps=3)
    controller = AdaptiveController(worker, params)
    controller.init_states()
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(num_steps):
        controller.activate_step_by_batch(batch_size)
        depth = worker.speculative_num_steps
        worker.ran.append(depth)
        accepted = [sample_accepted(depth, rng, ACCEPT) for _ in range(batch_size)]
        step_s = step_ms.get(depth, max(step_ms.values())) * 1e-3 * (1.0 + 0.04 * rng.uniform(-1.0, 1.0))
        if clock is not None:
            clock.now += step_s
        controller.on_verify_complete(accepted, batch_size=batch_size)
        tokens += 1.0 + sum(accepted) / batch_size
        seconds += step_s
    return tokens, seconds, worker


def expected_rate(step_ms: dict[int, float], depth: int) -> float:
    return sum(ACCEPT**i for i in range(depth + 1)) / (step_ms[depth] * 1e-3)


# a small pool at bs 1: every draft depth costs more than it yields; SGLang's default slot (1, 3, 5, 7) has no 0
DRAFTING_LOSES = {0: 1.1, 1: 2.2, 3: 4.1, 5: 5.6, 7: 7.0}
DRAFTING_WINS = {0: 3.0, 1: 3.3, 3: 3.9, 5: 4.9, 7: 6.0}


@pytest.mark.parametrize(("name", "step_ms"), [("loses", DRAFTING_LOSES), ("wins", DRAFTING_WINS)])
def test_cost_aware_params_reach_the_best_depth_where_sglangs_rule_does_not(name: str, step_ms: dict) -> None:
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    ours = CostAwareSpecParams(initial_steps=3, clock=clock)
    assert ours.governor(1).candidates == (0, 1, 3, 5, 7)  # depth 0 added to SGLang's bs-1 slot
    num_steps = 1500
    tokens, seconds, worker = serve(ours, clock, step_ms, num_steps, batch_size=1, seed=7)
    best = max(step_ms, key=lambda d: expected_rate(step_ms, d))
    assert ours.governor(1).current == best, ours.governor(1).rates()
    assert sum(d == best for d in worker.ran[-500:]) >= 480, worker.ran[-500:]
    achieved = (tokens / seconds) / expected_rate(step_ms, best)
    assert achieved >= 0.93, achieved  # probes and sampled acceptance included

    upstream_tokens, upstream_seconds, upstream_worker = serve(
        AdaptiveSpeculativeParams(initial_steps=3), None, step_ms, num_steps, batch_size=1, seed=7
    )
    assert 0 not in upstream_worker.ran  # SGLang's rule cannot turn drafting off at bs 1
    if name == "loses":
        assert tokens / seconds > 1.5 * upstream_tokens / upstream_seconds


def test_steps_of_each_batch_size_are_learned_apart() -> None:
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    serve(params, clock, DRAFTING_LOSES, 300, batch_size=1, seed=1)
    serve(params, clock, DRAFTING_LOSES, 50, batch_size=3, seed=2)  # the same slot (1-7), another batch size
    governors = params.governors()
    assert sorted(governors) == [1, 3]
    assert governors[1].num_steps == 300 and governors[3].num_steps == 50
    assert params._slots[1].governors.keys() == {1, 3}  # both in SGLang's bs-1 slot


def test_batch_sizes_of_every_slot_share_acceptance_and_a_newcomer_starts_from_its_neighbour() -> None:
    """One `GovernorFamily` across SGLang's slots: bs 3 (slot 1-7) and bs 9 (slot 8+) read the acceptance bs 1
    taught; bs 2, new after bs 1 settled on depth 0 with its depth-1 probes lost, waits half bs 1's interval
    before probing depth 1 (alone it would probe at once)."""
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    serve(params, clock, DRAFTING_LOSES, 400, batch_size=1, seed=5)
    first = params.governor(1)
    assert first.current == 0 and first.acceptance is not None
    assert params.governor(3).acceptance == first.acceptance == params.governor(9).acceptance
    assert params._slots[1] is not params._route(9)  # another slot, the same family
    lost = first._arms[1].interval
    assert lost > 2 * first.min_probe_interval, lost
    _, _, worker = serve(params, clock, DRAFTING_LOSES, lost // 2 + 4, batch_size=2, seed=6)
    assert worker.ran.index(1) == lost // 2, worker.ran


def test_each_move_of_the_running_depth_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang logs every switch, probes included; the slot logs the moves alone, so a server log tells the depth
    that runs (what the server test of the random head reads)."""
    import itertools
    import logging
    import re

    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    with caplog.at_level(logging.INFO, logger="pooled_runner"):
        serve(params, clock, DRAFTING_WINS, 400, batch_size=1, seed=3)
    moves = [
        (int(a), int(b))
        for b, a in re.findall(r"batch size 1 now runs depth (\d+) \(was (\d+)\)", caplog.text)
    ]
    governor = params.governor(1)
    assert len(moves) == governor.num_switches >= 1, (moves, governor.num_switches)
    assert moves[0][0] == 0 and moves[-1][1] == governor.current, (moves, governor.current)
    assert all(a != b for a, b in moves) and all(b == c for (_, b), (c, _) in itertools.pairwise(moves)), (
        moves
    )


def test_patch_replaces_the_workers_class_and_checks_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang
    import sglang.srt.speculative.eagle_worker_v2 as worker_module
    from pooled_runner.patches import spec_cost_governor
    from pooled_runner.patches._check import PatchError

    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    monkeypatch.setattr(worker_module, "AdaptiveSpeculativeParams", worker_module.AdaptiveSpeculativeParams)
    spec_cost_governor.apply()
    assert worker_module.AdaptiveSpeculativeParams is CostAwareSpecParams
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(PatchError, match="written for sglang 0.5.23, found 0.5.24"):
        spec_cost_governor.apply()


def test_scheduler_process_applies_the_patch_for_cost_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.srt.speculative.eagle_worker_v2 as worker_module
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    import pooled_runner.sglang.layer as layer
    import pooled_runner.sglang.spec as spec
    from pooled_runner.config import PoolConfig
    from pooled_runner.sglang.children import prepare_process
    from pooled_runner.sglang.serve_config import ServeConfig
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    monkeypatch.setattr(worker_module, "AdaptiveSpeculativeParams", AdaptiveSpeculativeParams)
    monkeypatch.setattr(layer, "install_layer_hook", lambda: None)  # the model-building hooks: not under test
    monkeypatch.setattr(spec, "install_lanes_hook", lambda: None)
    for governor, expected in (("off", AdaptiveSpeculativeParams), ("cost", CostAwareSpecParams)):
        pool = PoolConfig(
            pool_rows=8,
            device="cpu",
            prefill_staging=False,
            spec_governor=governor,
            spec_governor_state="off",
        )
        monkeypatch.setenv(
            "POOLED_RUNNER_SERVE_CONFIG", ServeConfig(pool=pool, cpu=False, speculative=True).to_json()
        )
        prepare_process("detokenizer")
        assert worker_module.AdaptiveSpeculativeParams is AdaptiveSpeculativeParams
        prepare_process("scheduler")
        assert worker_module.AdaptiveSpeculativeParams is expected, governor


def test_a_step_is_timed_from_its_launch_or_the_previous_completion() -> None:
    """Without overlap a gap before the launch (a prefill, idle time) is not the step's; with overlap (the next
    step launched before this one's result) the time between completions is."""
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    governor = params.governor(1)
    seen: list[tuple[float, bool]] = []
    observe = governor.observe
    governor.observe = lambda depth, accepted, seconds, timed=True: (  # type: ignore[method-assign]
        seen.append((round(seconds, 6), timed)),
        observe(depth, accepted, seconds, timed=timed),
    )
    depth = params.get_steps_for_batch(1)  # plain: launch, 4 ms, complete
    clock.now += 0.004
    params.on_verify_complete([0], 1)
    clock.now += 0.250  # a prefill batch between two decode steps
    params.get_steps_for_batch(1)
    clock.now += 0.005
    params.on_verify_complete([0], 1)
    assert seen == [(0.004, False), (0.005, True)], seen  # the first completion has no slot before it
    params.get_steps_for_batch(1)  # overlapped: launch A, 3 ms later launch B, A completes, B completes
    clock.now += 0.003
    params.get_steps_for_batch(1)
    clock.now += 0.003
    params.on_verify_complete([0], 1)
    clock.now += 0.006
    params.on_verify_complete([0], 1)
    assert seen[2:] == [(0.006, True), (0.006, True)], seen
    assert depth == 0 and governor.steps_at[0] == 4  # every slot starts without drafting


def test_a_step_after_another_batch_size_is_not_timed() -> None:
    """The first step after a step of another batch size (same slot, bs 1 and 3, or another, bs 8) runs on
    another working set: not timed."""
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    marks: list[tuple[int, bool]] = []
    for bs in (1, 1, 3, 3, 1, 8, 1, 1):
        governor = params.governor(bs)
        observe = governor.observe
        governor.observe = lambda d, a, s, timed=True, bs=bs, observe=observe: (  # type: ignore[method-assign]
            marks.append((bs, timed)),
            observe(d, a, s, timed=timed),
        )
        params.get_steps_for_batch(bs)
        clock.now += 0.002
        params.on_verify_complete([0] * bs, bs)
        governor.observe = observe  # type: ignore[method-assign]
    expected = [(1, False), (1, True), (3, False), (3, True), (1, False), (8, False), (1, False), (1, True)]
    assert marks == expected, marks


def test_an_outcome_out_of_step_with_the_launches_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """More accepted drafts than the launched depth, or another batch size than launched: the scheduler must
    not crash; the sample and the slot's in-flight queue go, and the slot goes on."""
    from pooled_runner.sglang.spec_governor import CostAwareSpecParams

    clock = FakeClock()
    params = CostAwareSpecParams(initial_steps=3, clock=clock)
    slot = params._slots[1]
    assert params.get_steps_for_batch(1) == 0
    params.get_steps_for_batch(1)
    clock.now += 0.002
    with caplog.at_level("WARNING", logger="pooled_runner"):
        params.on_verify_complete([2], 1)  # 2 accepted drafts for a depth-0 launch
    governor = params.governor(1)
    assert slot.num_dropped == 1 and not slot._in_flight and governor.num_steps == 0
    assert "out of step" in caplog.text
    params.on_verify_complete([0], 1)  # the second launch's outcome: its queue entry is gone, not timed
    assert governor.num_steps == 0
    params.get_steps_for_batch(1)
    clock.now += 0.002
    params.on_verify_complete([0], 1)
    assert governor.num_steps == 1
    params.get_steps_for_batch(1)
    params.on_verify_complete([0, 0], 2)  # 2 requests' outcome for a 1-request launch (both route to slot 1)
    assert slot.num_dropped == 2 and governor.num_steps == 1
