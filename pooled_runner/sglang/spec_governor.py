"""SGLang's adaptive speculation with a cost-aware rule: `CostAwareSpecParams`.

SGLang 0.5.23 (`--speculative-adaptive`, EAGLE/NEXTN v2 worker) switches the number of draft steps among
candidate depths, one pre-built runtime state per depth, from the acceptance length alone
(`speculative/adaptive_spec_params.py`). With a pool the cost of a verify step grows with the distinct experts
its draft lanes route (often read from the host), so a depth that SGLang's rule keeps can yield fewer tokens
per second than no drafting. `CostAwareSpecParams` keeps SGLang's per-batch-size slots and candidates, adds
depth 0 to every slot (drafting off must always be possible), and decides the depth of each batch size with
its own `pooled_runner.spec_governor.SpecGovernor` (among its slot's candidates) fed with tokens per request
and the wall time between two verify completions. The governors form one `spec_family.GovernorFamily`: one
acceptance estimate for all, and a batch size seen for the first time starts from the nearest batch size's
running depth and verdicts. The first starts without drafting (SGLang's `--speculative-num-steps` is only the
worker's starting state): drafting must prove that it pays. Installed by
`pooled_runner.patches.spec_cost_governor` (`--moe-expert-pool-spec-governor cost`).

Timing: a verify step's time runs from the later of its launch (`get_steps_for_batch`) and the previous verify
completion, to its own completion (`on_verify_complete`). Without the overlap scheduler that is the step itself
(a prefill or an idle gap before the launch is not counted); with it, a step is launched before the previous
one's result is processed, and the time is the interval between completions, the steady step time. A step
that completes after a step of another batch size is not timed (the working set changed with the batch).
What still inflates a sample (a prefill overlapped with a decode step) the governor drops as an outlier when it
is large and otherwise averages out.

Calibration across restarts (`--moe-expert-pool-spec-governor-state`, by default a directory under
POOLED_RUNNER_CACHE_DIR holding a file per serving configuration, `pooled_runner.spec_state`): the
family is loaded from its file at construction when the file's fingerprint (`serving_fingerprint`: model, pool,
GPU, TP size, graphs, draft settings, candidate depths, SGLang's and this package's versions, this package's code digest) is this server's, else it starts fresh; it is saved every
`SAVE_EVERY` verify completions (and at 64, 128, ... before that, `save_due`) and at exit (atexit; SGLang's
shutdown SIGKILLs its schedulers, whose last periodic save is then what the next start finds). Only one process
writes (`writes_state`: TP rank 0 of data-parallel replica 0); every one reads.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams, adaptive_unsupported_reason

from pooled_runner.sglang.serve_config import ServeConfig
from pooled_runner.spec_family import GovernorFamily
from pooled_runner.spec_governor import SpecGovernor
from pooled_runner.spec_state import load_family, save_family
from pooled_runner.spec_state_paths import code_digest, mark_used, prune_states, state_file

logger = logging.getLogger("pooled_runner")

MAX_IN_FLIGHT = 4  # verify steps chosen but not yet completed that a slot remembers (overlap scheduling: 1-2)
# verify completions between two saves of the governors' state. A save (JSON of every batch size's governor,
# an unsynced rename) took 1.0 ms for 32 batch sizes on a 2-core Xeon VM (27 KB; 3.0 ms with every carried
# probe list full), so every 1024 steps of 2 ms (bs 1 on the H200) it costs 0.05% of the steps' time (0.15%),
# against the several percent a cold start's probes cost over its first 150 steps (bench/spec_governor_model.py
# --restore); a crash loses at most 1024 steps of learning, one longest probe interval (max_probe_interval)
SAVE_EVERY = 1024
# before SAVE_EVERY, saves at FIRST_SAVE completions and each doubling (64, 128, 256, 512): SGLang's shutdown
# SIGKILLs its schedulers (`kill_process_tree`: no atexit), so a short run keeps its first verdicts, which are
# what a cold start pays for, only through them
FIRST_SAVE = 64
# SGLang's server args that make step times comparable between two runs (`serving_fingerprint`)
SERVER_FACTS = (
    "model_path",
    "revision",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "tp_size",
    "pp_size",
    "dp_size",
    "attention_backend",
    "disable_cuda_graph",
    "cuda_graph_backend_decode",  # the launcher's switch for decode graphs
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def adaptive_refusal(server_args: Any) -> str | None:
    """Why `--moe-expert-pool-spec-governor cost` cannot run with these resolved server args, or None.

    SGLang turns `--speculative-adaptive` off by itself where its adaptive worker cannot run (topk != 1,
    attention DP, two-batch overlap, pdmux, a platform worker; `adaptive_unsupported_reason`), with a warning
    only; the governor would then do nothing, so the launcher refuses instead, with SGLang's reason.
    """
    reason = adaptive_unsupported_reason(server_args)
    if reason is None:
        return None
    return (
        f"--moe-expert-pool-spec-governor cost decides SGLang's adaptive speculation, which SGLang turns off "
        f"here: {reason}. Change that setting, or drop the governor (--moe-expert-pool-spec-governor off)"
    )


def with_depth_zero(candidate_steps: Iterable[int]) -> list[int]:
    """A slot's candidate depths as the governors see them: SGLang's plus 0 (drafting off), sorted."""
    return sorted(set(candidate_steps) | {0})


class GovernedStepSlot:
    """One batch-size slot (the interface `AdaptiveSpeculativeParams` reads of `AdaptiveStepSlot`:
    `candidate_steps`, `current_steps`), deciding with one `SpecGovernor` per batch size (created at its first
    step): a slot spans several batch sizes (1-7 in SGLang's default config) and a step's time grows with them,
    so their times must not be averaged together. The governors come from `family`, shared by every slot: one
    acceptance estimate, and a new batch size starts from its nearest neighbour's verdicts (the first one at
    depth 0); None: a family of this slot's own."""

    def __init__(self, candidate_steps: list[int], family: GovernorFamily | None = None) -> None:
        self.candidate_steps = with_depth_zero(candidate_steps)
        self.family = GovernorFamily() if family is None else family
        self.governors: dict[int, SpecGovernor] = {}
        self._in_flight: deque[tuple[int, int, float]] = deque(maxlen=MAX_IN_FLIGHT)  # (bs, depth, launch)
        self._last_batch_size: int | None = None
        self.num_dropped = 0  # outcomes that matched no launched step (see `complete`)

    def governor(self, batch_size: int) -> SpecGovernor:
        """The governor of `batch_size` (created on first use)."""
        if batch_size not in self.governors:
            self.governors[batch_size] = self.family.governor(batch_size, self.candidate_steps)
        return self.governors[batch_size]

    @property
    def current_steps(self) -> int:
        """The depth the last launched batch size runs outside probes (what SGLang's logs read)."""
        if self._last_batch_size is None:
            return 0
        return self.governor(self._last_batch_size).current

    def launch(self, batch_size: int, now: float) -> int:
        """The depth of the verify step of `batch_size` requests launched at `now`; remembered until its outcome
        arrives."""
        depth = self.governor(batch_size).choose()
        self._in_flight.append((batch_size, depth, now))
        self._last_batch_size = batch_size
        return depth

    def complete(
        self,
        num_correct_drafts_per_req: list[int],
        now: float,
        last_complete: float | None,
        timed: bool = True,
    ) -> None:
        """The outcome of the oldest launched step, completed at `now`: accepted drafts per request; timed from
        the later of its launch and `last_complete` (the previous verify completion of any slot), unless
        `timed` is False. An outcome that cannot be the oldest launch's (another batch size, or more accepted
        drafts than its depth: the launches and completions went out of step) is dropped with the queue, never
        raised in the scheduler: the governor loses a sample, the server nothing."""
        if not self._in_flight:  # an outcome without a launch (the slot was routed differently): not timed
            return
        batch_size, depth, launched = self._in_flight.popleft()
        if not num_correct_drafts_per_req:
            return
        out_of_step = len(num_correct_drafts_per_req) != batch_size
        if out_of_step or max(num_correct_drafts_per_req) > depth or min(num_correct_drafts_per_req) < 0:
            self.num_dropped += 1
            self._in_flight.clear()
            if self.num_dropped == 1:
                logger.warning(
                    "cost-aware speculation: an outcome of %s accepted drafts for a step of %d requests launched "
                    "at depth %d; dropped (launches and completions out of step), this slot's in-flight steps "
                    "forgotten",
                    num_correct_drafts_per_req,
                    batch_size,
                    depth,
                )
            return
        start = launched if last_complete is None else max(launched, last_complete)
        if now > start:
            governor = self.governor(batch_size)
            running = governor.current
            governor.observe(depth, num_correct_drafts_per_req, now - start, timed=timed)
            if (
                governor.current != running
            ):  # a probe won: SGLang's switch log cannot tell a move from a probe
                logger.info(
                    "cost-aware speculation: batch size %d now runs depth %d (was %d); steps by depth %s",
                    batch_size,
                    governor.current,
                    running,
                    governor.steps_at,
                )


class CostAwareSpecParams(AdaptiveSpeculativeParams):
    """`AdaptiveSpeculativeParams` whose slots choose the depth by measured tokens per request per second.

    Same constructor as SGLang's (plus `clock`, for tests); the candidates of each slot are the adaptive
    config's plus 0, and each batch size has its own governor (one `GovernorFamily`, `family`). `initial_steps`
    is the worker's starting state; the first governor starts at depth 0 (the first decode batch switches to it),
    later ones at their nearest neighbour's depth. `get_steps_for_batch` is called once per decode batch before
    its verify step (SGLang's `activate_step_by_batch`) and `on_verify_complete` once per verify result; the latter returns
    None: the next batch's `get_steps_for_batch` applies the governor's choice.
    `state_path`: the governors' state file, or a directory holding one per serving configuration (module
    docstring); None: the launcher's `--moe-expert-pool-spec-governor-state` (`ServeConfig.from_env`), "" : none. `fingerprint`: what the file
    must have been saved with (None: `serving_fingerprint`).
    """

    def __init__(
        self,
        initial_steps: int,
        cfg_path: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        *,
        state_path: str | None = None,
        fingerprint: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(initial_steps=initial_steps, cfg_path=cfg_path)
        upstream: dict[int, Any] = self._slots  # type: ignore[has-type]
        candidates = {bs: with_depth_zero(slot.candidate_steps) for bs, slot in upstream.items()}
        path = configured_state_path() if state_path is None else state_path
        self.fingerprint: dict[str, Any] = {}
        if path:
            self.fingerprint = serving_fingerprint(candidates) if fingerprint is None else dict(fingerprint)
        # a directory (the default one) holds a file per serving configuration
        self.state_path = state_file(path, self.fingerprint) if path else ""
        self.saves_state = bool(self.state_path) and writes_state()
        if self.saves_state and self.state_path != path:
            # the directory was there at launch: made again if removed since (best-effort: a failed save is
            # logged once, `save_state`)
            with contextlib.suppress(OSError):
                os.makedirs(path, exist_ok=True)
            prune_states(path, keep=self.state_path)  # configurations not served for a month
        restored = load_family(self.state_path, self.fingerprint) if self.state_path else None
        if restored is not None and self.saves_state:
            mark_used(self.state_path)  # its time is its last use for other servers' pruning
        # one acceptance estimate; new batch sizes learn from their neighbours
        self.family = GovernorFamily() if restored is None else restored
        governed = {bs: GovernedStepSlot(steps, self.family) for bs, steps in candidates.items()}
        self._slots = governed
        self._clock = clock
        self._last_complete: float | None = None
        self._last_batch_size: int | None = None  # of the last completion
        self.num_completions = 0
        self._saved_at: int | None = None  # num_completions at the last save
        self._save_failed = False
        if self.saves_state:
            atexit.register(self.save_state)
        logger.info(
            "cost-aware speculation: depth per batch size chosen by measured tokens/s; candidates by slot %s%s",
            {bs: slot.candidate_steps for bs, slot in governed.items()},
            f"; state {'kept' if self.saves_state else 'read'} at {self.state_path}"
            if self.state_path
            else "",
        )

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self._governed(batch_size).launch(batch_size, self._clock())

    def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> int | None:
        now = self._clock()
        timed = batch_size == self._last_batch_size  # another batch: another working set, not timed
        self._governed(batch_size).complete(num_correct_drafts_per_req, now, self._last_complete, timed)
        self._last_complete, self._last_batch_size = now, batch_size
        self.num_completions += 1
        if self.saves_state and save_due(self.num_completions):
            self.save_state()
        return None

    def save_state(self) -> bool:
        """Save the family to `state_path` if this process writes it and something was learned since the last
        save; True if written. A failure (a full disk, the directory gone) is logged, once, and never raised:
        the scheduler goes on, and later saves try again."""
        if not self.saves_state or self._saved_at == self.num_completions:
            return False
        try:
            save_family(self.family, self.state_path, self.fingerprint)
        except (OSError, TypeError, ValueError) as exc:
            if not self._save_failed:
                logger.warning(
                    "cost-aware speculation: cannot save the state to %s: %s", self.state_path, exc
                )
            self._save_failed = True
            return False
        self._saved_at = self.num_completions
        return True

    def close(self) -> None:
        """Save the state (`save_state`) and drop the save at exit (a scheduler's params live until it exits;
        for tests and embedders)."""
        self.save_state()
        atexit.unregister(self.save_state)

    def governor(self, batch_size: int) -> SpecGovernor:
        """The governor of `batch_size` (created on first use; for logs and tests)."""
        return self._governed(batch_size).governor(batch_size)

    def governors(self) -> dict[int, SpecGovernor]:
        """Every batch size's governor so far."""
        return dict(self.family.governors)

    def _governed(self, batch_size: int) -> GovernedStepSlot:
        slot = self._route(batch_size)
        assert isinstance(slot, GovernedStepSlot), type(slot)
        return slot


def save_due(num_completions: int) -> bool:
    """Whether the state is saved after this many verify completions: at FIRST_SAVE and each doubling below
    SAVE_EVERY, then at every multiple of SAVE_EVERY."""
    n = num_completions
    return n > 0 and (n % SAVE_EVERY == 0 or (FIRST_SAVE <= n < SAVE_EVERY and n & (n - 1) == 0))


def configured_state_path() -> str:
    """The launcher's resolved `--moe-expert-pool-spec-governor-state` (an absolute path of a file or a
    directory), or "" (off, or no launcher)."""
    serve = ServeConfig.from_env()
    return serve.pool.spec_governor_state if serve is not None and serve.pool is not None else ""


def serving_fingerprint(candidates: dict[int, list[int]]) -> dict[str, Any]:
    """What makes this server's verify step times comparable with a saved state's: SGLang's version, this
    package's version and code digest, the GPU, the pool (rows, weight format, planner policy), SGLang's
    `SERVER_FACTS` (None where unknown: outside a server) and the candidate depths of each slot. All read
    cheaply at construction (the digest reads this package's sources: about 2 ms)."""
    import sglang
    import torch

    import pooled_runner
    import pooled_runner.kernels

    serve = ServeConfig.from_env()
    pool = serve.pool if serve is not None else None
    facts: dict[str, Any] = {
        "sglang": getattr(sglang, "__version__", None),
        "pooled_runner": pooled_runner.__version__,  # its kernels' speed changes between releases
        # and within one version in a checkout being worked on: its code's digest (a release's is fixed)
        "pooled_runner_code": code_digest([pooled_runner.__file__, pooled_runner.kernels.__file__]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "pool_rows": None if pool is None else pool.pool_rows,
        "weight_format": None if pool is None else pool.weight_format,
        "planner_policy": None if pool is None else pool.planner_policy,
        "candidates": {str(bs): steps for bs, steps in sorted(candidates.items())},
    }
    try:
        from sglang.srt.runtime_context import get_server_args

        args: Any = get_server_args()
    except Exception:  # not set outside a server (tests): those facts are None on both sides
        args = None
    for name in SERVER_FACTS:
        value = getattr(args, name, None)
        facts[name] = value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
    return facts


def writes_state() -> bool:
    """Whether this process writes the state file: TP rank 0 of data-parallel replica 0. Every scheduler that
    runs the draft has its own `CostAwareSpecParams` (one per TP rank and DP replica; PP: the last stage's),
    and they would write the same file. Outside a server (no published ranks): True."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        tp_rank = int(parallel.tp_rank)
    except Exception:  # not published: a test, or an embedder with one process
        tp_rank = 0
    try:
        dp_rank = parallel.dp_rank
    except Exception:
        dp_rank = None
    return tp_rank == 0 and dp_rank in (None, 0)
