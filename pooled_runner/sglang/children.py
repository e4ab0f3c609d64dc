"""Entry functions of SGLang's spawned children, wrapped so our set-up runs before anything is built.

SGLang starts the scheduler and the detokenizer with multiprocessing `spawn`; the child imports the module of
its target function first, so passing these functions to `launch_server(run_scheduler_process_func=...,
run_detokenizer_process_func=...)` applies the CPU patches and installs `PooledFusedMoE` in the child before
SGLang imports or builds the model (this also works under pytest, where re-running `__main__` would not).
The configuration comes from the environment (`ServeConfig.from_env`).
"""

from __future__ import annotations

import logging
from typing import Any

from pooled_runner import envs
from pooled_runner.sglang.serve_config import ServeConfig

logger = logging.getLogger("pooled_runner")


def prepare_process(role: str) -> ServeConfig | None:
    """Apply what this process needs: CPU patches without CUDA; in the scheduler, the layer and lanes hooks and
    (`--moe-expert-pool-spec-governor cost`) the cost-aware adaptive speculation."""
    serve = ServeConfig.from_env()
    if serve is None:
        return None
    logging.getLogger("pooled_runner").setLevel(envs.log_level())
    if serve.cpu:
        from pooled_runner.patches import apply_cpu_patches, apply_cpu_speculative_patches

        apply_cpu_patches()
        if serve.speculative and role == "scheduler":
            apply_cpu_speculative_patches()
    if serve.pool is not None and role == "scheduler":
        from pooled_runner.sglang.layer import install_layer_hook
        from pooled_runner.sglang.spec import install_lanes_hook

        install_layer_hook()
        install_lanes_hook()
        if serve.pool.spec_governor == "cost":
            from pooled_runner.patches import spec_cost_governor

            spec_cost_governor.apply()
            logger.info("applied %s (cost-aware speculative depth)", spec_cost_governor.__name__)
    return serve


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's `run_scheduler_process`, after `prepare_process("scheduler")`."""
    prepare_process("scheduler")
    from sglang.srt.managers.scheduler import run_scheduler_process as original

    return original(*args, **kwargs)


def run_detokenizer_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's `run_detokenizer_process`, after `prepare_process("detokenizer")`."""
    prepare_process("detokenizer")
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as original

    return original(*args, **kwargs)
