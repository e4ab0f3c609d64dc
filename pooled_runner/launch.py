"""`python -m pooled_runner.launch`: an SGLang 0.5.23 server whose MoE layers run out of the expert pool.

Our flags (`--moe-expert-pool-*`, from `PoolConfig`) are parsed first with `parse_known_args`; everything else
goes unchanged to SGLang's `prepare_server_args`, so every SGLang flag and endpoint stays as it is. With no
`--model` the embedded tiny Qwen3-MoE is generated (once, offline) and served. Without CUDA the CPU defaults
are added unless given (`--device cpu`, `--max-total-tokens 4096`) and the CPU patches are applied in this
process and in the spawned children. The resolved configuration reaches the children through the
environment (`POOLED_RUNNER_SERVE_CONFIG`).

Tensor parallelism (`--tp-size N`): every rank holds its shard (I/N) of every expert and its own pool of
`--moe-expert-pool-rows` rows (the flag is per rank); a size that does not split or leaves a rank below top-k
is refused here with per-rank numbers, and the per-rank memory is logged. Without CUDA each rank's OpenMP
threads get their own cores (`SGLANG_CPU_OMP_THREADS_BIND`, unless set).

Everything up to `LaunchPlan` runs without importing SGLang, so bad flags are refused in a second (the checks:
`launch_checks.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from pooled_runner import envs
from pooled_runner.config import PoolConfig, add_cli_arguments, cli_fields, flag_name
from pooled_runner.launch_checks import (
    GRAPH_FLAGS,
    GRAPHS_OFF,
    MODEL_FLAGS,
    POOL_MOE_FLAGS,
    PROG,
    argv_problems,
    device_problems,
    find_model_facts,
    flag_value,
    format_problems,
    graph_phases_maybe_on,
    has_flag,
    pool_problems,
    spec_governor_problems,
    tp_size_of,
    weight_dtype,
)
from pooled_runner.sglang.model_facts import ModelFacts
from pooled_runner.sglang.serve_config import ServeConfig
from pooled_runner.tp import RankMemory, rank_memory

logger = logging.getLogger("pooled_runner")

CPU_MAX_TOTAL_TOKENS = 4096
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def build_parser() -> argparse.ArgumentParser:
    """Our flags only (SGLang's are parsed by SGLang); `--help` prints these, then SGLang's."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        add_help=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # never swallow an SGLang flag as an abbreviation of ours
        description="SGLang server with pooled MoE experts. Flags not listed here are SGLang's (below).",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show our flags, then SGLang's, and exit")
    add_cli_arguments(parser)
    group = parser.add_argument_group("pooled_runner (launcher)")
    group.add_argument(
        "--no-moe-expert-pool",
        dest="no_pool",
        action="store_true",
        help="serve with SGLang's own MoE layers (the unpooled baseline); CPU support still applies",
    )
    group.add_argument(
        "--moe-expert-pool-stats-interval",
        dest="stats_interval",
        type=int,
        default=64,
        help="log pool statistics (and update the /metrics gauges) every N forward steps",
    )
    return parser


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher will do: the serving config for every process and SGLang's argv."""

    serve: ServeConfig
    sglang_argv: list[str]
    embedded: bool
    tp_size: int = 1
    rank_memory: RankMemory | None = None  # per-rank bytes, when config.json gives the expert shape
    facts: ModelFacts | None = None


def cpu_threads_bind(tp_size: int, cores: list[int]) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `tp_size` ranks: the cores split into contiguous groups, one per
    rank ("0|1" for two ranks on two cores); with fewer cores than ranks, ranks share cores round-robin."""
    if not cores:
        raise ValueError("no CPU cores to bind")
    cores = sorted(cores)
    if len(cores) < tp_size:
        return "|".join(str(cores[r % len(cores)]) for r in range(tp_size))
    per_rank = len(cores) // tp_size
    groups = [cores[r * per_rank : (r + 1) * per_rank] for r in range(tp_size)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def _refusal(problems: list[str]) -> ValueError:
    return ValueError("cannot launch:\n  - " + "\n  - ".join(problems))


def resolve_launch(ours: argparse.Namespace, rest: list[str], cuda_available: bool) -> LaunchPlan:
    """Turn our parsed flags and SGLang's argv into a LaunchPlan; ValueError lists every problem at once."""
    argv = list(rest)
    our_flags = sorted(s for a in build_parser()._actions for s in a.option_strings if s.startswith("--"))
    problems: list[str] = argv_problems(argv, pooled=not ours.no_pool, our_flags=our_flags)
    embedded = not has_flag(argv, *MODEL_FLAGS)
    rows = ours.pool_rows
    try:
        tp_size = tp_size_of(argv)
    except ValueError as exc:
        problems.append(str(exc))
        tp_size = 1
    if not ours.no_pool:
        problems += device_problems(argv, ours, cuda_available, tp_size)
    memory: RankMemory | None = None
    if embedded and problems:  # say them before generating the embedded model (its checks come after)
        raise _refusal(problems)
    if embedded:
        from pooled_runner.sglang.embedded import DEFAULT_POOL_ROWS, ensure_embedded_model

        argv = ["--model-path", str(ensure_embedded_model()), *argv]
        if rows is None:
            rows = DEFAULT_POOL_ROWS
    pool: PoolConfig | None = None
    facts: ModelFacts | None = None
    if ours.no_pool:
        defaults = build_parser().parse_args([])
        ignored = [
            flag_name(f.name) for f in cli_fields() if getattr(ours, f.name) != getattr(defaults, f.name)
        ]
        if ignored:
            logger.warning("pooled_runner: %s have no effect with --no-moe-expert-pool", ", ".join(ignored))
    else:
        if has_flag(argv, "--enable-paged-experts"):
            problems.append(
                "--enable-paged-experts is SGLang's own per-layer expert paging; it cannot wrap the pooled "
                "layers. Use one of them (drop --enable-paged-experts, or pass --no-moe-expert-pool)"
            )
        model_path = flag_value(argv, *MODEL_FLAGS)
        revision, download_dir = flag_value(argv, "--revision"), flag_value(argv, "--download-dir")
        facts = find_model_facts(model_path, revision, download_dir) if model_path else None
        problems += pool_problems(
            rows, facts, tp_size, cpu=not cuda_available, weight_format=ours.weight_format
        )
        problems += spec_governor_problems(ours.spec_governor, argv, tp_size)
        if ours.stats_interval <= 0:
            problems.append(f"--moe-expert-pool-stats-interval {ours.stats_interval}: must be positive")
        if facts is not None:
            problems += format_problems(
                ours.weight_format, weight_dtype(argv, facts), facts, tp_size, cpu=not cuda_available
            )
        values = {f.name: getattr(ours, f.name) for f in cli_fields()}
        # a bad row count is reported above, with the model's numbers: check the other fields with a valid one
        values["pool_rows"] = rows if rows is not None and rows > 0 else 1
        try:
            pool = PoolConfig.resolve(**values)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            pool = None
        if not problems and pool is not None and facts is not None and facts.hidden_size > 0:
            memory = rank_memory(
                pool.weight_format,
                weight_dtype(argv, facts),
                facts.hidden_size,
                facts.moe_intermediate_size,
                tp_size,
                pool.pool_rows,
                facts.num_total_experts,
                cpu=not cuda_available,
            )
    if problems:
        raise _refusal(problems)
    cpu = not cuda_available
    if pool is not None and not cpu and not has_flag(argv, *GRAPH_FLAGS):
        # PooledMoE's decode steps are capturable (device planner; tested with torch CUDA graphs on an H200),
        # but SGLang's graph runner over pooled layers has not run on a GPU yet. Said in the log by main().
        # The per-phase backends, not the deprecated --disable-cuda-graph, which any other graph flag overrides.
        argv += list(GRAPHS_OFF)
    if pool is not None and not cpu:
        for flags in POOL_MOE_FLAGS:
            if not has_flag(argv, flags[0]):
                argv += list(flags)
    if cpu:
        if not has_flag(argv, "--device"):
            argv += ["--device", "cpu"]
        if not has_flag(argv, "--max-total-tokens"):
            argv += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
    serve = ServeConfig(
        pool=pool,
        cpu=cpu,
        metrics=has_flag(argv, "--enable-metrics"),
        stats_interval=ours.stats_interval,
        speculative=has_flag(argv, "--speculative-algorithm"),
        router_scores=router_scores_usable(pool, facts),
    )
    return LaunchPlan(
        serve=serve, sglang_argv=argv, embedded=embedded, tp_size=tp_size, rank_memory=memory, facts=facts
    )


def router_scores_usable(pool: PoolConfig | None, facts: ModelFacts | None) -> bool:
    """Whether the pooled layers hand their router logits to the device planner: only for a policy that reads
    them, on a model whose top-k selects on its logits (else the policy ranks by hit counts alone; logged)."""
    if pool is None or not pool.planner_policy.startswith("adaptive-router"):
        return False
    why = "config.json was not found" if facts is None else facts.router_logits_differ
    if why:
        logger.warning(
            "pooled_runner: %s %s: the router's logits may not be what its top-k selects on (%s); the planner "
            "orders experts by hit counts alone (as adaptive)",
            flag_name("planner_policy"),
            pool.planner_policy,
            why,
        )
        return False
    return True


def cuda_graph_warning(plan: LaunchPlan, user_argv: list[str]) -> str | None:
    """What the log must say of CUDA graphs over the pooled layers (not yet verified under SGLang's graph
    runner on a GPU): that the launcher turned them off, or that the user's graph flags leave some phase on;
    None when the pool is off, on the CPU, or the user turned every phase off."""
    if plan.serve.pool is None or plan.serve.cpu:
        return None
    off = " ".join(GRAPHS_OFF)
    if not has_flag(user_argv, *GRAPH_FLAGS):
        return (
            "CUDA graphs disabled: SGLang's graph runner over pooled layers is not yet verified on a GPU "
            f"(pass {off} yourself to silence this)"
        )
    phases = graph_phases_maybe_on(user_argv)
    if not phases:
        return None
    return (
        f"your CUDA-graph flags leave the {' and '.join(phases)} graphs on (or to SGLang's defaults): SGLang's "
        f"graph runner over pooled layers is not yet verified on a GPU; {off} turns them off"
    )


def print_help(parser: argparse.ArgumentParser) -> None:
    parser.print_help()
    print("\n==== SGLang's flags (all accepted unchanged) ====\n", flush=True)
    from sglang.srt.server_args import prepare_server_args

    prepare_server_args(["--help"])  # prints SGLang's help and exits


def prepare_sglang(plan: LaunchPlan) -> Any:
    """Export our config, apply the CPU patches, resolve SGLang's server args and check them against the pool.

    Returns the resolved `ServerArgs`; raises ValueError (with numbers) to refuse a speculative configuration
    the pool cannot serve (`spec.check_launch`), or the cost-aware governor where SGLang turns its adaptive
    speculation off (`spec_governor.adaptive_refusal`).
    """
    plan.serve.export()
    if plan.serve.cpu and plan.tp_size > 1 and not os.environ.get(CPU_BIND_ENV):
        os.environ[CPU_BIND_ENV] = cpu_threads_bind(plan.tp_size, sorted(os.sched_getaffinity(0)))
        logger.info("no CUDA, TP=%d: %s=%s", plan.tp_size, CPU_BIND_ENV, os.environ[CPU_BIND_ENV])
    if plan.serve.cpu:
        if plan.serve.speculative and "TRITON_INTERPRET" not in os.environ:
            # SGLang's speculative tree kernels and the draft's attention have no torch fallback on the CPU: they
            # run under Triton's interpreter, which must be chosen before anything imports Triton (children
            # inherit the environment).
            os.environ["TRITON_INTERPRET"] = "1"
            logger.info("no CUDA and speculative decoding: TRITON_INTERPRET=1 for this server")
        from pooled_runner.patches import apply_cpu_patches

        logger.info("no CUDA: applied %s", ", ".join(apply_cpu_patches()))
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(plan.sglang_argv)
    server_args.resolve_once()
    pool = plan.serve.pool
    if pool is not None and pool.spec_governor == "cost":
        from pooled_runner.sglang.spec_governor import adaptive_refusal

        refusal = adaptive_refusal(server_args)
        if refusal:
            raise _refusal([refusal])
    if pool is not None and plan.facts is not None and plan.facts.top_k:
        from pooled_runner.sglang.spec import check_launch

        staging = pool.staging_min_tokens if pool.prefill_staging else None
        for warning in check_launch(server_args, pool.pool_rows, plan.facts.top_k, staging):
            logger.warning("pooled_runner: %s", warning)
    return server_args


def serve(server_args: Any) -> None:
    """Start SGLang's HTTP server with our wrapped child entry functions; returns when it stops."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.utils import kill_process_tree

    from pooled_runner.sglang import children

    try:
        launch_server(
            server_args,
            run_scheduler_process_func=children.run_scheduler_process,
            run_detokenizer_process_func=children.run_detokenizer_process,
        )
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def main(argv: list[str] | None = None) -> int:
    env_problems = envs.check_all()  # every knob now, not when a child first reads it
    if env_problems:
        print(f"{PROG}: {_refusal(env_problems)}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=envs.log_level(), format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"
    )
    parser = build_parser()
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if ours.help:
        print_help(parser)
        return 0
    try:
        plan = resolve_launch(ours, rest, torch.cuda.is_available())
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    pool = plan.serve.pool
    logger.info(
        "pooled_runner: %s; %s; SGLang args: %s",
        "embedded model (random weights)" if plan.embedded else "user model",
        f"pool {pool}" if pool is not None else "pooling off (--no-moe-expert-pool)",
        " ".join(plan.sglang_argv),
    )
    if plan.rank_memory is not None:
        logger.info("pooled_runner: expert memory %s", plan.rank_memory.describe())
    graph_warning = cuda_graph_warning(plan, rest)
    if graph_warning:
        logger.warning("pooled_runner: %s", graph_warning)
    try:
        server_args = prepare_sglang(plan)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    serve(server_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
