"""The device planner: every residency decision of a decode step on the device, graph-safe, and its host twin.

State at stable addresses (allocated once, updated in place, so one captured decode step replays with any
routing): `row_owner [R + 1]` flat id `l * E_max + e` of the row's expert (-1 free), `row_stamp [R + 1]`
last-use clock value (-1 free), `clock [1]`, `counters [5]` (hits, misses, admissions, host-view reads, evictions), the
pool's `l2p_gpu [L, E_max]`, and the policy's state. Slot R of the row tensors is a dummy that masked writes go
to, so every update is a fixed-size `index_put_` with no compaction.

One planned step of layer l (`plan(l, topk_ids)`), see `policies.py` for the ordering rule:
  - ids outside [0, E_l) (padding -1, or out of range) are not routed;
  - clock += 1; hits get the new stamp (their rows cannot be evicted by this step);
  - a miss is a candidate for admission if the byte-cost rule says copying it is worth it: the kernel reads a
    host-view expert once per M-block, `reads = ceil(tokens / block_m)`; candidates need
    `reads >= min_reads_to_admit` (1: every miss is a candidate, since a copy costs the same PCIe bytes as one
    read and earns later hits; raise it when copies cannot overlap);
  - candidate i takes victim i (a row not used by this step) if the policy accepts; the rest (more distinct
    experts than free-able rows, rejected, or below the byte rule) are read through the host view (R + e);
  - the admitted rows are copied from the bank in the same launch (`kernels/plan_copy.py`; or by the row-gather
    kernel after it), before the GEMM reads them: by default on sm_90+ the GEMM's programs of resident experts
    run beside the plan + copy, and an admitted expert's row is published only once it is whole (`overlap`).
Deterministic: sort keys are total orders (ties by expert id / stamp / row), masked writes go to the dummy slot,
and integer counters only.

`HostTwin` (`planner_twin.py`) is an independent plain-Python implementation of the same rule, for tests.
"""

from __future__ import annotations

import torch

from pooled_runner import envs
from pooled_runner.cycle_lru import CycleLRUPolicy
from pooled_runner.kernels.admit_copy import ONE_LAUNCH_WARPS
from pooled_runner.kernels.pdl import pdl_available
from pooled_runner.kernels.plan_copy import COPY_PROGRAMS, MAX_FUSED_OPERANDS, SYNC_WORDS
from pooled_runner.kernels.plan_lru import PLAN_WARPS
from pooled_runner.kernels.row_gather import MULTI_CHUNK_PROGRAMS
from pooled_runner.planner_fused import plan_adaptive_fused, plan_lru_fused
from pooled_runner.planner_ops import plan_ops
from pooled_runner.planner_twin import FREE, residency_from_pool, table_problems
from pooled_runner.policies import LRUPolicy, Policy, check_policy_rows
from pooled_runner.policy_adaptive import AdaptivePolicy
from pooled_runner.policy_duel import MemoryDuelPolicy
from pooled_runner.policy_router import RouterAdaptivePolicy
from pooled_runner.pool import ExpertPool
from pooled_runner.routing import check_router_scores
from pooled_runner.telemetry import RouteTelemetry


def _copy_rows(t: torch.Tensor) -> torch.Tensor:
    """`[rows, n]` view of an operand for the row-copy kernels; 1-byte floats (fp8 weights, NVFP4 scales) as
    bytes: a copy needs no values, and Triton refuses fp8e4nv before sm_89."""
    if t.dtype.is_floating_point and t.element_size() == 1:
        t = t.view(torch.uint8)
    return t.view(t.shape[0], -1)


class DevicePlanner:
    """Plans decode steps of `pool` on its device (see module docstring).

    Args:
      pool: the expert pool (its `l2p_gpu` and rows are updated in place).
      policy: residency policy (default cycle-protected LRU, `cycle_lru.py`); bound to the pool device here.
      max_routed: the largest `T * K` of a planned step (the workspace bound; a larger step raises).
      block_m: M-block of the MoE kernel (for the byte-cost rule).
      min_reads_to_admit: byte-cost threshold (see module docstring).
      debug_checks: verify the tables after every step (host sync; default from POOLED_RUNNER_DEBUG_CHECKS).
      fused: plan with a single-program kernel: `kernels/plan_lru.py` for LRU and lru-cycle,
        `kernels/plan_adaptive.py` for the adaptive policies; the others have torch ops only. None = on CUDA
        with those unless POOLED_RUNNER_TORCH_PLANNER is set; True on the CPU runs it under the Triton
        interpreter (tests).
      gather_chunks: programs per admitted expert and operand in the admission copy (more stream the pinned
        bank at a higher PCIe rate; unused ones exit at once).
      one_launch: the fused plan and its admission copy in one launch (`kernels/plan_copy.py`, for the
        adaptive policies `kernels/plan_adaptive_copy.py`; `copy_programs` programs) instead of two (the plan,
        then `gather_rows_multi` per 4 operands). None = with `fused`, a bank and <= 8 operands, unless
        POOLED_RUNNER_PLAN_SPLIT_COPY is set. cooperative: launch it as a cooperative grid where Triton supports
        it, else a plain grid whose programs take their roles by ticket (None: POOLED_RUNNER_PLAN_COOPERATIVE,
        default off). pdl: as a programmatic dependent launch where PDL is available, cooperative or not (None:
        POOLED_RUNNER_PLAN_PDL, default on). plan_warps: the plan's warps per program, in either form (None: the
        adaptive policies' `plan_warps`, 8 for the duel; else 4). overlap: the one launch lets
        the MoE's first GEMM start beside it (`kernels/plan_copy.py`, `early_trigger`); read `self.overlap` to
        tell the kernels (`KernelPath.planned_forward` does). None:
        POOLED_RUNNER_PLAN_OVERLAP (default on) where the one launch runs and the device has PDL
        (`pdl.pdl_available`); True also elsewhere (the interpreter tests the deferred commit).
    """

    def __init__(
        self,
        pool: ExpertPool,
        policy: Policy | None = None,
        max_routed: int = 64,
        block_m: int = 16,
        min_reads_to_admit: int = 1,
        debug_checks: bool | None = None,
        fused: bool | None = None,
        gather_chunks: int = MULTI_CHUNK_PROGRAMS,
        one_launch: bool | None = None,
        copy_programs: int = COPY_PROGRAMS,
        cooperative: bool | None = None,
        pdl: bool | None = None,
        plan_warps: int | None = None,
        overlap: bool | None = None,
    ):
        if max_routed < 1 or block_m < 1 or min_reads_to_admit < 1:
            raise ValueError(
                f"max_routed={max_routed}, block_m={block_m}, min_reads_to_admit={min_reads_to_admit} "
                "must all be >= 1"
            )
        if (
            gather_chunks < 1
            or copy_programs < 1
            or (plan_warps is not None and plan_warps not in PLAN_WARPS)
        ):
            raise ValueError(
                f"gather_chunks={gather_chunks}, copy_programs={copy_programs} must be >= 1 and "
                f"plan_warps={plan_warps} a power of two <= 32"
            )
        self.pool = pool
        pool.device_planned = True  # its host bookkeeping is stale until store_to_pool()
        self.policy: Policy = policy if policy is not None else CycleLRUPolicy()
        self.max_routed = max_routed
        self.block_m = block_m
        self.min_reads_to_admit = min_reads_to_admit
        self.debug_checks = envs.debug_checks() if debug_checks is None else debug_checks
        self.gather_chunks = gather_chunks
        R, L, EM = pool.num_rows, pool.num_layers, pool.max_experts
        self.num_rows, self.num_layers, self.max_experts = R, L, EM
        dev = pool.device
        self.row_owner = torch.full((R + 1,), FREE, dtype=torch.int64, device=dev)
        self.row_stamp = torch.full((R + 1,), FREE, dtype=torch.int64, device=dev)
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        # hits, misses, admissions, host reads, evictions (admissions into a row that had an owner)
        self.counters = torch.zeros(5, dtype=torch.int64, device=dev)
        self._l2p_scratch = torch.empty(L * EM + 1, dtype=torch.int32, device=dev)
        self._counts = torch.zeros(EM + 1, dtype=torch.int64, device=dev)
        self._ones = torch.ones(max_routed, dtype=torch.int64, device=dev)
        self._arange = torch.arange(max(EM, R) + 1, dtype=torch.int64, device=dev)
        self._rows_flat = {name: _copy_rows(t) for name, t in pool.rows_gpu.items()}
        self._bank_flat = (
            {name: _copy_rows(t) for name, t in pool.bank.tensors_host.items()}
            if pool.bank is not None
            else None
        )
        if dev.type == "cuda" and self._bank_flat is not None:
            for name, t in self._bank_flat.items():
                if not t.is_pinned():
                    raise ValueError(
                        f"bank operand {name!r} is not page-locked: the row gather cannot read it; build the "
                        "bank with ExpertBank(..., pin=True)"
                    )
        check_policy_rows(self.policy, self.num_rows)
        self.policy.bind(L, EM, dev)
        is_lru = type(self.policy) in (LRUPolicy, CycleLRUPolicy)
        # exact types: a subclass that changes the rule must not be fused with the base rule
        exact = type(self.policy) in (AdaptivePolicy, RouterAdaptivePolicy, MemoryDuelPolicy)
        self._adaptive = self.policy if isinstance(self.policy, AdaptivePolicy) and exact else None
        can_fuse = is_lru or self._adaptive is not None
        if fused and not can_fuse:
            raise ValueError(
                "the fused planner implements lru, lru-cycle, adaptive, adaptive-router and "
                f"adaptive-router-duel, not policy "
                f"{self.policy.name!r}"
            )
        self.fused = (
            (dev.type == "cuda" and can_fuse and not envs.torch_planner()) if fused is None else fused
        )
        # Fused-plan workspace: token counts per expert and the admitted pairs for the row gather.
        max_pairs = max(1, min(EM, R, max_routed))
        self._counts32 = torch.zeros(EM, dtype=torch.int32, device=dev)
        self._victims32 = torch.zeros(max_pairs, dtype=torch.int32, device=dev)
        self._codes32 = torch.zeros(max_pairs, dtype=torch.int32, device=dev)
        self._valid32 = torch.zeros(max_pairs, dtype=torch.int32, device=dev)
        can_one = (
            self.fused
            and can_fuse
            and self._bank_flat is not None
            and len(self._rows_flat) <= MAX_FUSED_OPERANDS
        )
        if one_launch and not can_one:
            raise ValueError(
                f"one_launch needs the fused planner (fused={self.fused}, policy {self.policy.name!r}), a "
                f"bank and <= {MAX_FUSED_OPERANDS} operands ({len(self._rows_flat)})"
            )
        self.one_launch = can_one and (not envs.plan_split_copy() if one_launch is None else one_launch)
        if plan_warps is None:
            plan_warps = self._adaptive.plan_warps if self._adaptive is not None else 4
        if self.one_launch and plan_warps not in ONE_LAUNCH_WARPS:
            raise ValueError(
                f"plan_warps={plan_warps}: the one-launch plan + copy takes {ONE_LAUNCH_WARPS} warps per program"
            )
        self.copy_programs = copy_programs
        # the one launch's operands, in the planner's operand order: pool rows, bank rows (built once)
        self._copy_operands = (
            (list(self._rows_flat.values()), [self._bank_flat[n] for n in self._rows_flat])
            if self._bank_flat is not None
            else ([], [])
        )
        self._cooperative = envs.plan_cooperative() if cooperative is None else cooperative
        self._pdl = envs.plan_pdl() if pdl is None else pdl
        self._plan_warps = plan_warps
        # the plan + copy lets the next kernel launch at its start (only the one launch has the deferred commit)
        if overlap and not self.one_launch:
            raise ValueError(
                "overlap=True needs the one-launch plan + copy (the fused planner, a bank, "
                f"<= {MAX_FUSED_OPERANDS} operands, POOLED_RUNNER_PLAN_SPLIT_COPY unset): only it defers the "
                "admitted codes to after their copy"
            )
        # by default only where PDL is: elsewhere nothing can run beside the plan, and the deferred commit costs
        self.overlap = self.one_launch and (
            envs.plan_overlap() and pdl_available(self.clock) if overlap is None else overlap
        )
        # the adaptive plans are long (14-20 µs per layer at 4-8 tokens on the H200, against 3-4 for LRU): the
        # MoE after them should start beside them (`pooled_fused_moe(long_plan=...)`)
        self.long_plan = self.overlap and self.fused and self._adaptive is not None
        self._sync32 = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=dev)  # zero between launches
        self.load_from_pool()

    # ----------------------------------------------------------------------------------------------
    # Boundaries (outside capture): exchange state with the pool's host bookkeeping.
    def load_from_pool(self) -> None:
        """Device state from the pool's host bookkeeping (the truth at a boundary): owners, stamps 1..n in the
        pool's LRU order, clock n, and `l2p_gpu` = `l2p_host`. A planner that changed the tables must
        `store_to_pool()` first."""
        owner, stamp = residency_from_pool(self.pool)
        old_clock = int(self.clock.item())  # a boundary: syncing is allowed
        self.pool.l2p_gpu.copy_(self.pool.l2p_host)
        self.row_owner[: self.num_rows].copy_(torch.tensor(owner, dtype=torch.int64))
        self.row_stamp[: self.num_rows].copy_(torch.tensor(stamp, dtype=torch.int64))
        new_clock = max([*stamp, 0])
        self.clock.fill_(new_clock)
        self.policy.clock_reset(new_clock - old_clock)  # stamps were renumbered: shift clock-valued state

    def store_to_pool(self) -> None:
        """Push the device tables into the pool's host bookkeeping (syncs); LRU order = (stamp, row)."""
        owner = self.row_owner[: self.num_rows].tolist()
        stamp = self.row_stamp[: self.num_rows].tolist()
        EM = self.max_experts
        owners = [None if o < 0 else (o // EM, o % EM) for o in owner]
        lru = sorted((r for r in range(self.num_rows) if owner[r] >= 0), key=lambda r: (stamp[r], r))
        self.pool.load_residency(owners, lru)

    def state(self) -> dict[str, torch.Tensor]:
        """CPU copies of the planner state (for comparison with `HostTwin.state()`)."""
        out = {
            "l2p": self.pool.l2p_gpu.cpu(),
            "row_owner": self.row_owner[: self.num_rows].cpu(),
            "row_stamp": self.row_stamp[: self.num_rows].cpu(),
            "clock": self.clock.cpu(),
        }
        out.update({k: v.cpu() for k, v in self.policy.state_tensors().items()})
        return out

    def counter_values(self) -> dict[str, int]:
        hits, misses, admissions, host_reads, evictions = self.counters.tolist()
        return {
            "hits": hits,
            "misses": misses,
            "admissions": admissions,
            "host_reads": host_reads,
            "evictions": evictions,
        }

    # ----------------------------------------------------------------------------------------------
    def plan(
        self,
        layer: int,
        topk_ids: torch.Tensor,
        telemetry: RouteTelemetry | None = None,
        router_scores: torch.Tensor | None = None,
    ) -> bool:
        """Plan one step of `layer` from `topk_ids [T, K]` (any integer dtype, on the pool device).

        Graph-safe: no host sync, fixed shapes for a given (layer, T, K). After it, `pool.l2p_gpu[layer]`
        holds a row or host code for every routed expert, and admitted rows hold their weights (copies
        enqueued on the current stream). Raises ValueError (at capture time, before any change) when
        `T * K > max_routed`. `telemetry` (enabled) also records the step's routes: inside the fused plan
        kernel when it runs (no launch of its own), else by `telemetry.record`. `router_scores [T, >= E]`
        (floating, the scores the top-k was taken on; columns past the layer's E experts are ignored) feed a
        policy that reads them (`observe_scores`, e.g. `RouterAdaptivePolicy`); other policies ignore them.

        Returns whether the plan may still be running when the next kernel starts (`overlap`, and the plan
        read `topk_ids` in place: no temporary whose memory a later allocation could take while the plan reads
        it, no debug check launched after it): pass it as `after_plan` to the MoE launched next, with nothing
        launched in between (the first GEMM must be the plan's programmatic dependent).
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids has shape {tuple(topk_ids.shape)}, expected [T, K]")
        num_routed = topk_ids.numel()
        if num_routed > self.max_routed:
            raise ValueError(
                f"topk_ids {tuple(topk_ids.shape)} routes {num_routed} > max_routed={self.max_routed}: "
                "build the planner with a larger max_routed (decode lanes x top_k)"
            )
        if topk_ids.device != self.clock.device:
            raise ValueError(f"topk_ids is on {topk_ids.device}, expected {self.clock.device}")
        R = self.num_rows
        E = self.pool.num_experts_per_layer[layer]
        num_pairs = min(E, R, max(num_routed, 1))
        if telemetry is not None and not telemetry.enabled:
            telemetry = None
        if telemetry is not None and telemetry.max_experts != self.max_experts:
            raise ValueError(
                f"telemetry counts {telemetry.max_experts} experts per layer, the pool {self.max_experts}"
            )
        if router_scores is not None and topk_ids.shape[0] == 0:
            router_scores = None  # nothing to vote; SGLang's empty top-k output has scores of shape [0, K]
        if router_scores is not None:
            check_router_scores(router_scores, topk_ids.shape[0], E, topk_ids.device)
            if getattr(self.policy, "observe_scores", None) is None:
                router_scores = None
        in_place = False
        if self.fused and self._adaptive is not None:
            in_place = plan_adaptive_fused(self, layer, topk_ids, E, num_pairs, router_scores, telemetry)
        elif self.fused:
            in_place = plan_lru_fused(self, layer, topk_ids, E, num_pairs, telemetry)
        else:
            if telemetry is not None:
                telemetry.record(layer, topk_ids)
            plan_ops(self, layer, topk_ids, E, num_pairs, router_scores)
        if self.debug_checks and not _capturing():  # the check syncs; under capture it waits for replay
            self.check_invariants()
            return False
        return self.overlap and in_place

    # ----------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """RuntimeError naming the first inconsistency between l2p, owners and stamps (host sync)."""
        problems = table_problems(
            self.pool.l2p_gpu.cpu(),
            self.row_owner[: self.num_rows].tolist(),
            self.row_stamp[: self.num_rows].tolist(),
            self.pool.num_experts_per_layer,
            self.num_rows,
        )
        if problems:
            raise RuntimeError("planner tables inconsistent (a policy bug?): " + "; ".join(problems[:5]))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
