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

Everything up to `LaunchPlan` runs without importing SGLang, so bad flags are refused in a second.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pooled_runner import envs
from pooled_runner.config import PoolConfig, add_cli_arguments, cli_fields, flag_name
from pooled_runner.sglang.model_facts import ModelFacts, read_model_facts
from pooled_runner.sglang.serve_config import ServeConfig
from pooled_runner.tp import RankMemory, rank_memory, tp_problems

logger = logging.getLogger("pooled_runner")

PROG = "python -m pooled_runner.launch"
CPU_MAX_TOTAL_TOKENS = 4096
_MODEL_FLAGS = ("--model-path", "--model")
_TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16}
_DTYPES |= {"float16": torch.float16, "half": torch.float16}
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
# SGLang flags the launcher reads from argv itself (so an abbreviation of one, which SGLang would take, is refused)
_READ_FLAGS = frozenset(
    {*_MODEL_FLAGS, *_TP_FLAGS, "--device", "--dtype", "--enable-metrics", "--speculative-algorithm"}
    | {"--speculative-adaptive", "--disable-cuda-graph", "--max-total-tokens", "--quantization", "--config"}
    | {"--enable-paged-experts", "--revision", "--download-dir"}
)


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


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _flag_value(argv: list[str], *names: str) -> str | None:
    """The value of the last of `names` in argv (SGLang's argparse keeps the last one too); None if absent."""
    value = None
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(n + "="):
                value = a.split("=", 1)[1]
    return value


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher will do: the serving config for every process and SGLang's argv."""

    serve: ServeConfig
    sglang_argv: list[str]
    embedded: bool
    tp_size: int = 1
    rank_memory: RankMemory | None = None  # per-rank bytes, when config.json gives the expert shape
    facts: ModelFacts | None = None


def tp_size_of(argv: list[str]) -> int:
    """SGLang's `--tp-size` (or its aliases) from argv; 1 when absent. ValueError when not an integer."""
    raw = _flag_value(argv, *_TP_FLAGS)
    if raw is None:
        return 1
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"--tp-size {raw!r} is not an integer") from None


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


def _weight_dtype(argv: list[str], facts: ModelFacts) -> torch.dtype:
    requested = _flag_value(argv, "--dtype")
    if requested in _DTYPES:
        return _DTYPES[requested]
    return _DTYPES.get(facts.dtype, torch.bfloat16)


def pool_problems(
    rows: int | None, facts: ModelFacts | None, tp_size: int = 1, cpu: bool = False
) -> list[str]:
    """Every problem with `--moe-expert-pool-rows` (per rank) and `--tp-size` against the model, with fixes."""
    flag = flag_name("pool_rows")
    out: list[str] = []
    if rows is None:
        out.append(f"{flag} N is required (N = device rows of the expert pool, shared by all MoE layers)")
    elif rows <= 0:
        out.append(f"{flag} {rows}: must be a positive number of rows")
    if facts is None:
        return out
    if facts.num_moe_layers == 0:
        out.append(
            "the model has no MoE layer (no routed experts in config.json): serve it with SGLang directly"
        )
        return out
    if facts.quantization is not None:
        out.append(
            f"quantization {facts.quantization!r}: the pool handles unquantized (bf16/fp16/fp32) experts only; "
            "use an unquantized checkpoint or pass --no-moe-expert-pool"
        )
    if tp_size != 1:
        out += tp_problems(rows or 0, facts.top_k, facts.moe_intermediate_size, tp_size, cpu)
    if rows is not None and rows > 0:
        if facts.top_k and rows < facts.top_k and tp_size == 1:
            out.append(
                f"{flag} {rows} is below top-k {facts.top_k}: one token's experts must fit; use >= {facts.top_k}"
            )
        if rows > facts.num_total_experts:
            out.append(
                f"{flag} {rows} is above the {facts.num_total_experts} routed experts of the model "
                f"({facts.num_moe_layers} MoE layers x {facts.num_experts}); use <= {facts.num_total_experts}"
            )
    return out


def spec_governor_problems(governor: str, argv: list[str], tp_size: int = 1) -> list[str]:
    """`--moe-expert-pool-spec-governor cost` decides SGLang's adaptive speculation: it needs it on, and one
    scheduler (each TP rank times its own steps: ranks could choose different depths and stall the collectives)."""
    if governor != "cost":
        return []
    flag = flag_name("spec_governor")
    if not _has_flag(argv, "--speculative-algorithm"):
        return [f"{flag} cost chooses the speculative depth: add --speculative-algorithm (EAGLE or NEXTN)"]
    if not _has_flag(argv, "--speculative-adaptive"):
        return [f"{flag} cost decides SGLang's adaptive speculation: add --speculative-adaptive"]
    if tp_size > 1:
        return [
            f"{flag} cost times each rank's steps on its own clock, so tensor-parallel ranks could choose "
            f"different depths: it runs with --tp-size 1 only (got {tp_size}); use {flag} off with TP"
        ]
    return []


def argv_problems(argv: list[str], pooled: bool) -> list[str]:
    """Problems with SGLang's argv that the launcher cannot serve or cannot see through, each with the fix."""
    out: list[str] = []
    if _has_flag(argv, "--config"):
        # SGLang merges the file under the command line; the launcher reads the command line only, so it would
        # check (and prepend the embedded model for) a command line that is not the one SGLang serves
        out.append(
            "--config FILE is not read by this launcher (its model, --tp-size and speculative settings would "
            "escape the pool's checks): pass those options on the command line instead"
        )
    our_flags = sorted(s for a in build_parser()._actions for s in a.option_strings if s.startswith("--"))
    for arg in argv:
        name = arg.split("=", 1)[0]
        # our flags never reach argv: one that looks like ours is misspelt (or a --no- form no flag has)
        if name.startswith(("--moe-expert-pool", "--no-moe-expert-pool")):
            close = difflib.get_close_matches(name, our_flags, n=1, cutoff=0.6)
            out.append(
                f"unknown flag {name}" + (f": did you mean {close[0]}?" if close else f" (see {PROG} --help)")
            )
        # SGLang's parser takes abbreviations; the launcher's scan of argv would miss this one
        full = sorted(f for f in _READ_FLAGS if f.startswith(name) and f != name)
        if len(name) > 2 and name.startswith("--") and full and name not in _READ_FLAGS:
            out.append(
                f"{name} abbreviates {' or '.join(full)}: write it in full (the launcher reads it too)"
            )
    if pooled and _flag_value(argv, "--quantization") not in (None, "unquant"):
        out.append(
            "--quantization: the pool handles unquantized (bf16/fp16/fp32) experts only; drop --quantization "
            "or pass --no-moe-expert-pool"
        )
    return out


def _device_problems(
    argv: list[str], ours: argparse.Namespace, cuda_available: bool, tp_size: int
) -> list[str]:
    """SGLang's `--device` against this machine and the pool's device."""
    out: list[str] = []
    sglang_device = _flag_value(argv, "--device")
    if sglang_device is not None and sglang_device != "cpu" and not sglang_device.startswith("cuda"):
        out.append(
            f"--device {sglang_device}: the pooled server runs on CUDA or the CPU (--device cuda or cpu)"
        )
    elif sglang_device is not None and sglang_device.startswith("cuda") and not cuda_available:
        out.append(f"--device {sglang_device} but CUDA is not available on this machine: use --device cpu")
    elif sglang_device == "cpu" and cuda_available:
        # SGLang 0.5.23 picks its ops' code by platform, not by --device, and the CPU patches refuse a CUDA
        # machine: hiding the GPUs is what makes it a CPU machine for both
        out.append(
            "--device cpu on a machine with CUDA: to serve on the CPU, hide the GPUs (CUDA_VISIBLE_DEVICES= "
            "python -m pooled_runner.launch ...); to serve on the GPU, drop --device cpu"
        )
    pool_device = str(getattr(ours, "device", "auto"))  # (a CUDA pool without CUDA: PoolConfig says it)
    if pool_device == "cpu" and cuda_available and sglang_device != "cpu":
        out.append(
            f"{flag_name('device')} cpu while the model runs on CUDA: the pool must be where the model runs; "
            f"drop {flag_name('device')} (auto follows the machine)"
        )
    if tp_size > 1 and pool_device.startswith("cuda:"):
        out.append(
            f"{flag_name('device')} {pool_device} with --tp-size {tp_size}: each rank's pool belongs on that "
            f"rank's GPU; use {flag_name('device')} cuda (or auto)"
        )
    return out


def _model_facts(
    model_path: str, revision: str | None = None, cache_dir: str | None = None
) -> ModelFacts | None:
    """`read_model_facts` of a local folder, or of a hub id's config.json at SGLang's `--revision` when it is
    already in the local Hugging Face cache (SGLang's `--download-dir`, else the default; no download here);
    None, with a warning, when neither is there."""
    facts = read_model_facts(model_path)
    if facts is not None or Path(model_path).expanduser().exists():
        return facts
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # not a hub id, or no huggingface_hub: nothing to read
        cached = None
    if isinstance(cached, str):
        return read_model_facts(str(Path(cached).parent))
    logger.warning(
        "pooled_runner: no config.json of %s on this machine (not a local folder, not in the Hugging Face cache): "
        "the checks of %s, quantization and --tp-size against the model are skipped. Download it first "
        "(huggingface-cli download %s) or pass a local path to have them",
        model_path,
        flag_name("pool_rows"),
        model_path,
    )
    return None


def _refusal(problems: list[str]) -> ValueError:
    return ValueError("cannot launch:\n  - " + "\n  - ".join(problems))


def resolve_launch(ours: argparse.Namespace, rest: list[str], cuda_available: bool) -> LaunchPlan:
    """Turn our parsed flags and SGLang's argv into a LaunchPlan; ValueError lists every problem at once."""
    argv = list(rest)
    problems: list[str] = argv_problems(argv, pooled=not ours.no_pool)
    embedded = not _has_flag(argv, *_MODEL_FLAGS)
    rows = ours.pool_rows
    try:
        tp_size = tp_size_of(argv)
    except ValueError as exc:
        problems.append(str(exc))
        tp_size = 1
    if not ours.no_pool:
        problems += _device_problems(argv, ours, cuda_available, tp_size)
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
        if _has_flag(argv, "--enable-paged-experts"):
            problems.append(
                "--enable-paged-experts is SGLang's own per-layer expert paging; it cannot wrap the pooled "
                "layers. Use one of them (drop --enable-paged-experts, or pass --no-moe-expert-pool)"
            )
        model_path = _flag_value(argv, *_MODEL_FLAGS)
        revision, download_dir = _flag_value(argv, "--revision"), _flag_value(argv, "--download-dir")
        facts = _model_facts(model_path, revision, download_dir) if model_path else None
        problems += pool_problems(rows, facts, tp_size, cpu=not cuda_available)
        problems += spec_governor_problems(ours.spec_governor, argv, tp_size)
        if ours.stats_interval <= 0:
            problems.append(f"--moe-expert-pool-stats-interval {ours.stats_interval}: must be positive")
        if ours.weight_format != "bf16":
            problems.append(
                f"{flag_name('weight_format')} {ours.weight_format}: serving loads unquantized checkpoints into "
                "bf16 rows only (the other formats are for the Python API and the benchmarks); use bf16"
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
                _weight_dtype(argv, facts),
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
    if pool is not None and not cpu and not _has_flag(argv, "--disable-cuda-graph"):
        # PooledMoE's decode steps are capturable (device planner; tested with torch CUDA graphs on an H200),
        # but SGLang's graph runner over pooled layers has not run on a GPU yet. Said in the log by main().
        argv += ["--disable-cuda-graph"]
    if cpu:
        if not _has_flag(argv, "--device"):
            argv += ["--device", "cpu"]
        if not _has_flag(argv, "--max-total-tokens"):
            argv += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
    serve = ServeConfig(
        pool=pool,
        cpu=cpu,
        metrics=_has_flag(argv, "--enable-metrics"),
        stats_interval=ours.stats_interval,
        speculative=_has_flag(argv, "--speculative-algorithm"),
    )
    return LaunchPlan(
        serve=serve, sglang_argv=argv, embedded=embedded, tp_size=tp_size, rank_memory=memory, facts=facts
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
    if "--disable-cuda-graph" in plan.sglang_argv and "--disable-cuda-graph" not in rest:
        logger.warning(
            "pooled_runner: CUDA graphs disabled: SGLang's graph runner over pooled layers is not yet verified "
            "on a GPU (pass --disable-cuda-graph yourself to silence this)"
        )
    try:
        server_args = prepare_sglang(plan)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    serve(server_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
