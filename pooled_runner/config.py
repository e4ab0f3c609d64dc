"""The one frozen configuration of a pooled MoE runtime.

`PoolConfig` is built once (from the CLI, or by hand) and handed to everything else. It never holds an
"auto" value: `PoolConfig.resolve()` turns the user's request into concrete choices (device, staging on a
machine without CUDA) and validates it, so no later reader has to guess. CLI flags are derived from the
dataclass fields (`cli_flags()`), so their defaults cannot drift from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pooled_runner import envs
from pooled_runner.formats import FORMATS
from pooled_runner.spec_state_paths import state_path_problem

logger = logging.getLogger("pooled_runner")

AUTO = "auto"
OFF = "off"
SPEC_GOVERNORS = ("off", "cost")  # PoolConfig.spec_governor
# PoolConfig.planner_policy: the keys of `policies.POLICIES` (a test keeps them equal), the default first
PLANNER_POLICIES = (
    "lru-cycle",
    "lru",
    "freq",
    "aging",
    "adaptive",
    "adaptive-router",
    "adaptive-router-duel",
)


@dataclass(frozen=True)
class PoolConfig:
    """How many GPU rows the expert pool has, and how experts move.

    Fields (all resolved; see `resolve`):
      pool_rows: number of device rows shared by all pooled MoE layers (`--moe-expert-pool-rows`).
      weight_format: expert weight format of the bank and the rows; one of `pooled_runner.formats.FORMATS`
        (bf16: the checkpoint's dense weights; int4/fp8/NVFP4: each expert quantized while it loads).
      device: "cuda", "cuda:N" or "cpu". "auto" is only accepted by `resolve`.
      prefill_staging: stream each layer's routed non-resident experts through a ring of chunk buffers in VRAM
        for large uncaptured steps (`staging.py`).
      staging_min_tokens: smallest step (tokens) that is staged.
      staging_chunk_experts: C, experts per staging chunk buffer (the ring holds 3 chunks: 3C expert rows of
        VRAM). Cut to the largest layer's expert count at installation.
      telemetry: accumulate per-(layer, expert) route counters.
      draft_pruning: prune MTP draft lanes that would cause host traffic only they need (`draft_prune.py`);
        acts only on steps the caller marks with `PooledMoE.begin_verify_step` and whose `draft_lane_alive()`
        it reads (the SGLang verify step does not yet: off for serving).
      max_draft_misses: with draft pruning, unpaid routes a draft lane may have in one step and stay alive.
      spec_governor: "off" (SGLang's own speculation) or "cost": with SGLang's `--speculative-adaptive`, choose
        each verify step's depth (0 included) by measured tokens per request per second (`spec_governor.py`).
      spec_governor_state: with spec_governor "cost", where the governors' calibration is kept across
        restarts (`spec_state.py`): read at start (a missing, corrupt or foreign one: start fresh), written
        after 64, 128, 256, 512 verify steps, then every 1024, and at exit. A JSON file, or a directory that
        holds one file per serving configuration (model, pool, GPU, versions: `spec_state_paths.state_file`).
        "auto" (the default): with the cost governor the directory `envs.spec_state_dir()` (`spec_governor`
        under POOLED_RUNNER_CACHE_DIR; made by `resolve`, off with a warning where it cannot be), which only
        `resolve` decides; off without it; "off" or "": off (keywords in any case). Resolved to "" (off), an
        absolute file path, or an absolute directory path ending in a separator (a path naming an existing
        directory, or ending in a separator; decided once, here). A file's directory, or the directory, must
        exist and be writable. `replace` keeps a resolved value: resolve again to change the governor.
      planner_policy: the device planner's residency policy (CUDA decode steps; `policies.POLICIES`):
        "lru-cycle" (the default) and "lru" plan in one fused launch per layer (plan + copy), "adaptive" (LRU or
        hit-count frequency by set dueling), "adaptive-router" (the same, each layer ordered by its router's
        scores where the engine passes them) and "adaptive-router-duel" (adaptive-router with a slow and a fast
        router memory, dueled: `policy_duel.py`) also in one fused launch per layer (plan + copy; with the
        router's scores, one membership launch more; the plan's cost grows with L x E_max); "freq" and "aging"
        with torch ops (a few dozen small kernels per layer). Host-planned steps (prefill, the CPU) use the
        pool's LRU.
    """

    pool_rows: int
    weight_format: str = "bf16"
    device: str = AUTO
    prefill_staging: bool = True
    staging_min_tokens: int = 512
    staging_chunk_experts: int = 16
    telemetry: bool = False
    draft_pruning: bool = False
    max_draft_misses: int = 0
    spec_governor: str = "off"
    spec_governor_state: str = AUTO
    planner_policy: str = PLANNER_POLICIES[0]

    # Help text for the CLI flag of each field; the flag name is `--moe-expert-pool-<field>` unless listed in
    # `_FLAG_NAMES`.
    _HELP: ClassVar[dict[str, str]] = {
        "pool_rows": "GPU rows of the expert pool shared by all pooled MoE layers (required with --model; the "
        "embedded model has its own default).",
        "weight_format": "Expert weight format of the bank and the pool rows: bf16 keeps the checkpoint's weights; "
        "int4-g*, fp8*, nvfp4 quantize each expert of an unquantized checkpoint while it loads (fewer bytes per "
        "miss, approximate weights; needs a bf16/fp16 model).",
        "device": "Device of the pool rows: cuda, cuda:N or cpu (auto: cuda if available, else cpu).",
        "prefill_staging": "Stage a layer's non-resident experts into VRAM for prefill steps of at least "
        "--moe-expert-pool-staging-min-tokens tokens.",
        "staging_min_tokens": "Smallest step, in tokens, that uses prefill staging.",
        "staging_chunk_experts": "Experts per prefill staging chunk buffer (the ring of 3 chunks takes 3x this "
        "many expert rows of VRAM; cut to the largest layer's expert count).",
        "telemetry": "Accumulate per-(layer, expert) route counters.",
        "draft_pruning": "Prune MTP draft lanes whose experts are neither resident nor routed by a verified "
        "token (only for callers that mark verify steps and read the live lanes; SGLang does not yet).",
        "max_draft_misses": "With draft pruning: routes to experts neither resident nor routed by a verified token that a draft "
        "lane may have in one verify step (all layers) and stay live.",
        "spec_governor": "cost: with --speculative-adaptive, choose each verify step's number of draft tokens "
        "(0 included) by measured tokens per request per second instead of by acceptance length alone.",
        "spec_governor_state": "With --moe-expert-pool-spec-governor cost: where the governors' calibration is "
        "kept across restarts, read at start (a missing, corrupt or foreign one: start fresh, with a log line) "
        "and written after 64, 128, 256, 512 verify steps, then every 1024, and at exit: a JSON file (PATH; its "
        "directory must exist and be writable), or a writable directory (one that exists, or a path ending in /) "
        "holding one file per serving configuration (model, pool, GPU, versions). auto (default): "
        "POOLED_RUNNER_SPEC_STATE_DIR (default ~/.cache/pooled_runner/spec_governor); off: none.",
        "planner_policy": "Residency policy of the device planner (CUDA decode steps): lru-cycle (default) or "
        "lru, one fused launch per layer; adaptive (LRU or hit-count frequency, whichever misses less: fewer "
        "misses on skewed routing) or adaptive-router (adaptive, each layer ordered by the router's logits "
        "where the model's top-k selects on them) or adaptive-router-duel (adaptive-router with a slow and a "
        "fast router memory, whichever a shadow cache misses less on), also one fused launch per layer; on "
        "torch ops (a few dozen launches per layer, several times the MoE's time per decode step: for policy "
        "studies): freq, aging.",
    }
    _FLAG_NAMES: ClassVar[dict[str, str]] = {"pool_rows": "--moe-expert-pool-rows"}
    _CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "weight_format": tuple(sorted(FORMATS)),
        "spec_governor": SPEC_GOVERNORS,
        "planner_policy": PLANNER_POLICIES,
    }

    def __post_init__(self) -> None:
        problems = self.problems()
        if self.device == AUTO:
            problems.append("device is 'auto': call PoolConfig.resolve() before use")
        keyword = state_keyword(self.spec_governor_state)
        if keyword in (AUTO, OFF) and not problems:
            # resolved here where nothing is to be decided: off (so no reader ever sees "auto" or "off")
            if keyword == OFF or self.spec_governor != "cost":
                object.__setattr__(self, "spec_governor_state", "")
            else:
                problems.append("spec_governor_state is 'auto': call PoolConfig.resolve() before use")
        if problems:
            raise ValueError("invalid PoolConfig: " + "; ".join(problems))
        if self.max_draft_misses and not self.draft_pruning:
            logger.warning(
                "max_draft_misses=%d has no effect without draft pruning (--moe-expert-pool-draft-pruning)",
                self.max_draft_misses,
            )

    def problems(self) -> list[str]:
        """Every problem with the values, each naming the fix (empty when valid)."""
        out: list[str] = []
        if not isinstance(self.pool_rows, int) or isinstance(self.pool_rows, bool) or self.pool_rows <= 0:
            out.append(f"pool_rows={self.pool_rows!r} must be a positive integer (--moe-expert-pool-rows N)")
        if self.weight_format not in FORMATS:
            out.append(
                f"weight_format={self.weight_format!r} is not one of {sorted(FORMATS)} "
                f"({flag_name('weight_format')})"
            )
        for f in cli_fields():  # the on/off fields
            value = getattr(self, f.name)
            if is_switch(f) and not isinstance(value, bool):  # "no" or "false" would be truthy
                flag = flag_name(f.name)
                out.append(f"{f.name}={value!r} must be True or False ({flag} / --no-{flag[2:]})")
        if type(self.staging_min_tokens) is not int or self.staging_min_tokens < 1:  # not bool, float or str
            out.append(
                f"staging_min_tokens={self.staging_min_tokens!r} must be an integer >= 1 "
                "(--moe-expert-pool-staging-min-tokens N)"
            )
        if type(self.staging_chunk_experts) is not int or self.staging_chunk_experts < 1:  # not bool either
            out.append(
                f"staging_chunk_experts={self.staging_chunk_experts!r} must be an integer >= 1 "
                "(--moe-expert-pool-staging-chunk-experts N)"
            )
        if type(self.max_draft_misses) is not int or self.max_draft_misses < 0:
            out.append(
                f"max_draft_misses={self.max_draft_misses!r} must be an integer >= 0 (--moe-expert-pool-max-draft-misses N)"
            )
        if self.spec_governor not in SPEC_GOVERNORS:
            out.append(
                f"spec_governor={self.spec_governor!r} is not one of {list(SPEC_GOVERNORS)} "
                "(--moe-expert-pool-spec-governor)"
            )
        out += spec_governor_state_problems(self.spec_governor_state, self.spec_governor)
        if self.planner_policy not in PLANNER_POLICIES:
            out.append(
                f"planner_policy={self.planner_policy!r} is not one of {list(PLANNER_POLICIES)} "
                "(--moe-expert-pool-planner-policy)"
            )
        if self.device != AUTO:
            out += device_problems(self.device)
        return out

    @classmethod
    def resolve(cls, **requested: Any) -> PoolConfig:
        """Build a fully resolved config from the user's request ("auto" allowed for `device`).

        Without CUDA the device is "cpu" and prefill staging is turned off with one log line (there is
        nothing to stage on the CPU path). Raises ValueError listing every problem at once.
        """
        device = requested.get("device", AUTO)
        if device == AUTO:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        requested["device"] = device
        # a bad device name is reported by __post_init__ with every other problem (torch.device() would raise)
        if not str(device).startswith("cuda") and requested.get("prefill_staging", True) is True:
            logger.info("prefill staging disabled: device %s has nothing to stage into", device)
            requested["prefill_staging"] = False
        state = requested.get("spec_governor_state", AUTO)
        keyword = state_keyword(state)
        default_directory = keyword == AUTO and requested.get("spec_governor") == "cost"
        if default_directory:  # decided once the rest is valid: no directory is made for a refused request
            requested["spec_governor_state"] = OFF
        elif keyword is None and isinstance(state, str):
            requested["spec_governor_state"] = absolute_state_path(state)
        config = cls(**requested)
        if default_directory:
            config = config.replace(spec_governor_state=default_state_directory())
        # the file system is asked here, once, not at every construction: a config rebuilt in a scheduler
        # (another user, another node) must not fail over a file its loading only reads best-effort
        why = state_path_problem(config.spec_governor_state) if config.spec_governor_state else None
        if why is not None:
            flag = flag_name("spec_governor_state")
            raise ValueError(
                f"{flag} {config.spec_governor_state}: {why}; name a file in an existing, writable directory "
                f"(or such a directory, or off)"
            )
        return config

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def replace(self, **changes: Any) -> PoolConfig:
        return dataclasses.replace(self, **changes)


def device_problems(device: object) -> list[str]:
    """Problems with a pool device name: it must be "cpu", "cuda" or "cuda:N", and CUDA must be there for a
    CUDA device (empty when valid)."""
    hint = "use cuda, cuda:N or cpu (--moe-expert-pool-device)"
    try:
        parsed = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        return [f"device={device!r} is not a torch device: {hint}"]
    if parsed.type not in ("cuda", "cpu"):
        return [f"device={device!r}: the pool runs on CUDA or the CPU only; {hint}"]
    if parsed.type == "cuda" and not torch.cuda.is_available():
        return [f"device={device!r} but CUDA is not available on this machine: use cpu (or auto)"]
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        return [
            f"device={device!r} but this machine has {count} CUDA device(s): use cuda:0..cuda:{count - 1} or {hint}"
        ]
    return []


def spec_governor_state_problems(path: object, governor: str) -> list[str]:
    """Problems with `--moe-expert-pool-spec-governor-state PATH` (empty when valid or off): it keeps the cost
    governor's state, so it needs that governor (whether the server can write it `resolve` asks, once)."""
    if state_keyword(path) is not None:
        return []
    flag = flag_name("spec_governor_state")
    if not isinstance(path, str):
        return [f"spec_governor_state={path!r} must be a path (str), 'auto' or 'off' ({flag} PATH)"]
    out = []
    if governor != "cost":
        out.append(
            f"{flag} {path} keeps the cost governor's calibration: it needs --moe-expert-pool-spec-governor cost "
            f"(got {governor!r}); drop {flag} or add the governor"
        )
    return out


def state_keyword(state: object) -> str | None:
    """The keyword a state flag's value names, AUTO or OFF ("" and any case included); None for a path or a
    non-str."""
    if not isinstance(state, str):
        return None
    keyword = state.strip().lower()
    return OFF if keyword in ("", OFF) else AUTO if keyword == AUTO else None


def absolute_state_path(path: str) -> str:
    """`path` made absolute (the children may run in another working directory), a directory (one that exists
    now, or a path ending in a separator) ending in a separator: what it is is decided here, once
    (`spec_state_paths.state_file`)."""
    expanded = os.path.expanduser(path)
    is_directory = expanded.endswith((os.sep, "/")) or os.path.isdir(expanded)
    absolute = os.path.abspath(expanded)
    return absolute + os.sep if is_directory else absolute


def default_state_directory() -> str:
    """The cost governor's default state directory (`envs.spec_state_dir()`, made if missing) ending in a
    separator; "" (off, with a warning) where it cannot be made or written: the user named no file, so a
    read-only home must not stop the server."""
    directory = os.path.abspath(os.path.expanduser(envs.spec_state_dir())) + os.sep
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        why: str | None = f"it cannot be made ({exc})"
    else:
        why = state_path_problem(directory)
    if why is None:
        return directory
    logger.warning(
        "cost-aware speculation: the governors' calibration is not kept across restarts: the default state "
        "directory %s: %s (set POOLED_RUNNER_SPEC_STATE_DIR, or %s PATH, or %s off)",
        directory,
        why,
        flag_name("spec_governor_state"),
        flag_name("spec_governor_state"),
    )
    return ""


def flag_name(field_name: str) -> str:
    """The CLI flag of a PoolConfig field."""
    return PoolConfig._FLAG_NAMES.get(field_name, "--moe-expert-pool-" + field_name.replace("_", "-"))


def is_switch(f: dataclasses.Field[Any]) -> bool:
    """An on/off field (a `--flag / --no-flag` pair on the CLI)."""
    return f.type in ("bool", bool)


def cli_fields() -> list[dataclasses.Field[Any]]:
    """The dataclass fields that become CLI flags, in declaration order."""
    return [f for f in dataclasses.fields(PoolConfig) if not f.name.startswith("_")]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per PoolConfig field; defaults come from the dataclass (pool_rows is required)."""
    group = parser.add_argument_group("pooled_runner (expert pool)")
    for f in cli_fields():
        name, helptext = flag_name(f.name), PoolConfig._HELP[f.name]
        if is_switch(f):
            group.add_argument(
                name, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=helptext
            )
        elif f.default is dataclasses.MISSING:
            group.add_argument(name, dest=f.name, type=int, default=None, help=helptext)
        else:
            kind = type(f.default)
            choices = PoolConfig._CHOICES.get(f.name)
            group.add_argument(
                name, dest=f.name, type=kind, default=f.default, choices=choices, help=helptext
            )


def config_from_cli(args: argparse.Namespace) -> PoolConfig:
    """Resolve a PoolConfig from parsed flags; ValueError lists every problem with the flag to fix."""
    values = {f.name: getattr(args, f.name) for f in cli_fields()}
    if values["pool_rows"] is None:
        raise ValueError(f"{flag_name('pool_rows')} N is required (N = GPU rows of the expert pool)")
    return PoolConfig.resolve(**values)
