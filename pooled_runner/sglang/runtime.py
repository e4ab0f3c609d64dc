"""The pool of one SGLang process: the `PooledMoE` shared by every pooled layer, and its bookkeeping.

Lifecycle inside the scheduler process (the one that builds the model):
  1. model construction: each pooled `FusedMoE` registers its layer (`register_layer`); layers the pool does
     not handle are noted (`note_not_pooled`), with ONE warning for the whole model;
  2. weight loading: the first expert weight allocates the bank (every layer is registered by then) and each
     expert shard is written through `DenseLoader`: into its bank row in place (bf16; an fp8 checkpoint's
     weights and scales into fp8-b{block} or fp8, per-tensor scales widened to its rows), or into a dense buffer that is quantized into the row when the
     expert's last shard is in (int4, fp8, NVFP4 from an unquantized checkpoint);
  3. after loading: when every pooled layer has finished loading, the pool is filled (`finalize`) and the
     startup summary is logged (bank size, pinned or not, rows, layers pooled and not pooled);
  4. serving: every forward of the first pooled layer counts one step; every `stats_interval` steps (a
     coarse boundary, outside any graph) the statistics are logged and exported as metrics; with
     `POOLED_RUNNER_DEBUG_CHECKS=1` the location tables are also compared across the TP group there.

Under tensor parallelism this is one rank's pool: SGLang's loader gives each rank its shard of every expert
(intermediate size I/N), so the bank and the rows hold shards and `pool_rows` is per rank (pooled_runner.tp).

Nothing here imports SGLang at module level.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from pooled_runner import envs
from pooled_runner.config import PoolConfig
from pooled_runner.dense_load import DenseLoader
from pooled_runner.guard import POOLED_TRITON, TORCH, KernelBackend
from pooled_runner.moe import PooledMoE
from pooled_runner.sglang.serve_config import ServeConfig
from pooled_runner.telemetry import capturing

if TYPE_CHECKING:
    from pooled_runner.sglang.metrics import PoolMetrics

logger = logging.getLogger("pooled_runner")


def select_kernel_backend(device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend the pooled forward will run on this device and dtype (what the bank-size guard checks)."""
    from pooled_runner.kernel_path import kernels_supported

    if kernels_supported(device, dtype) and not envs.force_torch_path():
        return POOLED_TRITON
    return TORCH


class PoolRuntime:
    """One process's pool: layer registry, staged loading, stats boundaries.

    `kernel_backend` overrides the backend the bank-size guard checks (default: `select_kernel_backend`).
    """

    def __init__(self, serve: ServeConfig, kernel_backend: KernelBackend | None = None):
        if serve.pool is None:
            raise ValueError("PoolRuntime needs a pool config (ServeConfig.pool is None)")
        self.serve = serve
        self.config = serve.pool
        self.moe: PooledMoE | None = None
        self.loader: DenseLoader | None = None  # between the first expert weight and finalize
        self._loader_lock = threading.Lock()  # the first weights may arrive on several loader threads
        self.layer_names: list[str] = []
        self.not_pooled: dict[str, list[str]] = {}  # reason -> layer names
        self._loaded: set[int] = set()
        self._load_start: float | None = None
        self.num_steps = 0
        self.num_tokens = 0
        self._metrics: PoolMetrics | None = None
        self.tp_rank, self.tp_size = 0, 1  # read from SGLang when the first layer registers
        self.num_debug_checks = 0
        self.kernel_backend_override = kernel_backend
        self.decode_lanes: int | None = None

    # ---------------------------------------------------------------------------------------------
    # Construction
    def register_layer(
        self,
        name: str,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        dtype: torch.dtype,
    ) -> int:
        """Register one pooled MoE layer; returns its pooled-layer index. All layers must share H, I, K, dtype."""
        if self.moe is None:
            self.tp_rank, self.tp_size = _moe_tp_rank_and_size()
            self.config = _with_device_index(self.config)
            self.moe = PooledMoE(self.config, hidden_size, intermediate_size, top_k, dtype)
            backend = self.kernel_backend_override or select_kernel_backend(self.config.torch_device, dtype)
            # Checked against every pooled weight tensor when the storage is allocated (first expert loaded).
            self.moe.kernel_backend = backend
            logger.info(
                "pooled_runner: kernel backend %s (largest weight tensor: %s)",
                backend.name,
                "unbounded" if backend.max_tensor_bytes is None else f"{backend.max_tensor_bytes} B",
            )
            if self.decode_lanes is not None:
                self.moe.set_decode_lanes(self.decode_lanes)
        moe = self.moe
        shape = (hidden_size, intermediate_size, top_k, dtype)
        expected = (moe.hidden_size, moe.intermediate_size, moe.top_k, moe.dtype)
        if shape != expected:
            raise ValueError(
                f"MoE layer {name}: (hidden, intermediate, top_k, dtype) = {shape}, but the pool was built "
                f"for {expected}; every pooled layer must have the same expert shape (a model whose MoE layers "
                "differ cannot share one pool: serve it with --no-moe-expert-pool)"
            )
        self.layer_names.append(name)
        return moe.register_layer(num_experts)

    def note_not_pooled(self, name: str, reason: str) -> None:
        """A MoE layer keeps its experts on the device; one warning per model, a summary after loading."""
        if not self.not_pooled:
            logger.warning(
                "MoE layer %s is not pooled (%s): its experts stay on the device. Further layers that are "
                "not pooled are listed in the summary after the pooled layers have loaded.",
                name,
                reason,
            )
        self.not_pooled.setdefault(reason, []).append(name)

    # ---------------------------------------------------------------------------------------------
    # Loading
    def require_moe(self) -> PooledMoE:
        if self.moe is None:
            raise RuntimeError("no pooled layer registered")
        return self.moe

    def ensure_loader(self) -> DenseLoader:
        """The loader of the experts' shards; the first call allocates the bank (every layer is registered by
        then)."""
        moe = self.require_moe()
        if moe.pool is not None:
            raise RuntimeError(
                "an expert weight arrived after every pooled layer had loaded and the pool was built: the "
                "experts cannot change any more (online weight updates are not supported for pooled layers)"
            )
        with self._loader_lock:  # one allocation of the bank, whichever thread's weight comes first
            if self.loader is None:
                self._load_start = time.perf_counter()
                moe.allocate()
                self.loader = DenseLoader(moe)
            return self.loader

    def layer_loaded(self, index: int) -> None:
        """Layer `index` has all its experts; the last one finalizes the pool and logs the summary."""
        self._loaded.add(index)
        moe = self.require_moe()
        if len(self._loaded) < len(moe.num_experts_per_layer):
            return
        loader = self.loader
        # every layer reported its missing shards before this: no expert can still be waiting for one
        if loader is None:
            raise RuntimeError("every pooled layer reported loaded, but no expert weight was ever loaded")
        if loader.num_pending:
            raise RuntimeError(
                f"every pooled layer loaded, but {loader.num_pending} experts still wait for a shard"
            )
        moe.finalize()
        self.log_summary()
        self.loader = None  # the experts are the bank's and the pool's now

    def log_summary(self) -> None:
        moe = self.require_moe()
        pool = moe.pool
        assert pool is not None
        bank = moe.bank
        elapsed = time.perf_counter() - self._load_start if self._load_start is not None else 0.0
        logger.info(
            "pooled_runner: %s%d MoE layers pooled (%d experts, %s), %d not pooled; bank %s; pool %d rows of "
            "%.1f KiB = %.3f GiB on %s; loaded in %.1f s",
            self.rank_prefix,
            len(moe.num_experts_per_layer),
            moe.num_total_experts,
            moe.format.name,
            sum(len(v) for v in self.not_pooled.values()),
            (
                f"{bank.nbytes / (1 << 30):.3f} GiB {'pinned' if bank.pinned else 'pageable (not pinned)'}"
                if bank is not None
                else "none (every expert resident)"
            ),
            pool.num_rows,
            pool.row_bytes / 1024,
            pool.nbytes / (1 << 30),
            pool.device,
            elapsed,
        )
        if self.tp_size > 1:
            logger.info(
                "pooled_runner: %sholds its shard of every expert (intermediate %d per rank, %d over the ranks): "
                "%d rows x %.1f KiB "
                "= %.3f GiB device, bank %.3f GiB host; --moe-expert-pool-rows is per rank",
                self.rank_prefix,
                moe.intermediate_size,
                moe.intermediate_size * self.tp_size,
                pool.num_rows,
                pool.row_bytes / 1024,
                pool.nbytes / (1 << 30),
                bank.nbytes / (1 << 30) if bank is not None else 0.0,
            )
        if self.loader is not None and self.loader.num_quantized:
            logger.info(
                "pooled_runner: %sexperts quantized to %s while loading (%d experts; at most %d held dense at once)",
                self.rank_prefix,
                moe.format.name,
                self.loader.num_quantized,
                self.loader.peak_pending,
            )
        for reason, names in self.not_pooled.items():
            logger.warning("not pooled (%s): %d layers: %s", reason, len(names), ", ".join(names))

    @property
    def rank_prefix(self) -> str:
        """ "TP rank r/N: " under tensor parallelism, "" otherwise (log lines of each rank tell themselves apart)."""
        return f"TP rank {self.tp_rank}/{self.tp_size}: " if self.tp_size > 1 else ""

    def set_decode_lanes(self, lanes: int, why: str) -> None:
        """Steps of at most `lanes` tokens take the decode path (never staged); logged once with `why`."""
        self.decode_lanes = lanes
        if self.moe is not None:
            self.moe.set_decode_lanes(lanes)
        logger.info(
            "pooled_runner: decode lanes %d (%s); wider steps take the partition/staging path", lanes, why
        )

    # ---------------------------------------------------------------------------------------------
    # Serving
    def after_forward(self, index: int, num_tokens: int) -> None:
        """Called after each pooled forward; the first layer's calls count steps and mark the boundaries.

        Not while a CUDA graph is captured: a capture's forwards are no steps, and the boundary (`report`)
        syncs tables, which capture refuses. Replayed steps run no Python, so with SGLang's graphs on (the
        launcher turns them off) decode steps are not counted here."""
        if index != 0 or capturing():
            return
        self.num_steps += 1
        self.num_tokens += num_tokens
        if self.num_steps % self.serve.stats_interval == 0:
            self.report()

    def report(self) -> None:
        """Log the pool statistics and export them as metrics (at a coarse boundary)."""
        moe = self.require_moe()
        stats = moe.stats()
        logger.info(
            "%sexpert pool after %d steps: hit rate %.3f (%d hits, %d misses), %d admissions, %d evictions, "
            "%.2f MiB copied to rows, %.2f MiB read through the host view, %.2f MiB staged, rows per layer %s",
            self.rank_prefix,
            self.num_steps,
            stats.hit_rate,
            stats.hits,
            stats.misses,
            stats.admissions,
            stats.evictions,
            stats.bytes_copied_to_rows / (1 << 20),
            stats.bytes_read_host_view / (1 << 20),
            stats.bytes_staged / (1 << 20),
            stats.rows_in_use_per_layer,
        )
        logger.info(
            "expert pool steps by path (width: count): decode %s, prefill %s (decode lanes %s)",
            dict(sorted(moe.step_widths["decode"].items())),
            dict(sorted(moe.step_widths["prefill"].items())),
            moe.decode_lanes,
        )
        if moe.telemetry is not None and not (moe.stager is not None and moe.stager.active):
            # The route telemetry window closes here: its hottest experts are pinned (all or nothing). Not in the
            # middle of a staged step, whose runs were read from the tables at its first layer.
            copied = moe.telemetry_boundary()
            logger.info(
                "%sroute telemetry window closed: %s",
                self.rank_prefix,
                "discarded or nothing to pin"
                if copied is None
                else f"hottest experts pinned, {copied} rows copied",
            )
        if envs.debug_checks():
            self.check_tables_agree()
        if self.serve.metrics:
            if self._metrics is None:
                from pooled_runner.sglang.metrics import PoolMetrics

                self._metrics = PoolMetrics(self.layer_names)
            self._metrics.update(stats, self.num_steps, self.num_tokens)

    def check_tables_agree(self) -> None:
        """Debug check (a collective over the MoE TP group): every rank's tables equal, else TablesDisagree."""
        if self.tp_size == 1:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # never a collective inside a graph capture; the next boundary checks
        from sglang.srt.distributed.parallel_state import get_moe_tp_group

        from pooled_runner.tp import verify_tables_agree

        # The PooledMoE, not its pool: on CUDA the device planner's state is synced to the host first.
        digest = verify_tables_agree(
            self.require_moe(), self.num_steps, get_moe_tp_group().cpu_group, layer_names=self.layer_names
        )
        self.num_debug_checks += 1
        logger.info(
            "%sdebug check %d: location tables agree across %d TP ranks at step %d (digest %#018x)",
            self.rank_prefix,
            self.num_debug_checks,
            self.tp_size,
            self.num_steps,
            digest,
        )


def _with_device_index(config: PoolConfig) -> PoolConfig:
    """ "cuda" -> "cuda:N" of this process's current device (SGLang sets one GPU per TP rank before building
    the model), so every tensor and comparison names the rank's GPU: `torch.device("cuda")` does not compare
    equal to a tensor's `cuda:1`."""
    device = config.torch_device
    if device.type == "cuda" and device.index is None:
        return config.replace(device=f"cuda:{torch.cuda.current_device()}")
    return config


def _moe_tp_rank_and_size() -> tuple[int, int]:
    """This process's MoE TP rank and size from SGLang's runtime context; (0, 1) outside one."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(parallel.moe_tp_rank), int(parallel.moe_tp_size)
    except Exception:  # no SGLang, or no parallel context (a bare PooledMoE in a unit test)
        return 0, 1


_RUNTIME: PoolRuntime | None = None


def get_runtime() -> PoolRuntime | None:
    """This process's runtime, created from the launcher's exported config on first use (None: no pool)."""
    global _RUNTIME
    if _RUNTIME is None:
        serve = ServeConfig.from_env()
        if serve is None or serve.pool is None:
            return None
        _RUNTIME = PoolRuntime(serve)
    return _RUNTIME


def set_runtime(runtime: PoolRuntime | None) -> None:
    """Install (or clear) the process's runtime explicitly (tests, in-process engines)."""
    global _RUNTIME
    _RUNTIME = runtime
