"""`python -m bench.gemv_sweep`: the GEMV decode path's two kernels timed apart (GPU), per tile config.

For each case (shape, format, M; resident experts, softmax top-k routing of random logits) and each config
around `gemv_configs`' default, the gate_up kernel alone and the down + combine kernel alone, in µs per call
(CUDA graph replay) and % of the HBM read bandwidth measured in the same run for that kernel's bytes (gate_up
reads 2/3 of a layer's expert bytes, down 1/3). `--host-rows`: every expert read from a pinned bank instead,
and % of the zero-copy read measured in the same run; `--host-every 8`: every eighth distinct expert of the step
from the bank (bench.kernels' "1/8"), % of the pool rows' bytes at the HBM read plus the host rows' at zero-copy. Each row also gives max |difference| of its output to the
default config's (split K changes only the fp32 summation order). Seeded; the default config runs first.

Usage: python -m bench.gemv_sweep [--cases "deepseek:int4-g128:1,8;qwen3:int4-g128:1"] [--set wide|focus|default|alt]
                                 [--alt "stages=3;split_k2=2"] [--kernels gate_up,down,layer] [--host-rows | --host-every N]
                                 [--out sweep.md]
`--set alt`: the default and each `--alt` config (GemvConfig fields replaced; configs separated by ";"), in
turn, `--rounds` times;
kernel `layer`: the whole GEMV layer (`pooled_fused_moe`, variant "gemv").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import torch
from pooled_runner.kernels.fused_moe import pooled_fused_moe
from pooled_runner.kernels.gemv import GemvConfig, _k_split, gemv_configs, gemv_down_combine, gemv_gate_up

from bench.common import write
from bench.kernel_variants import resident_layer
from bench.kernels import SHAPES, measured_header, time_graph


def gate_up_configs(base: GemvConfig) -> list[GemvConfig]:
    """gate_up tiles around `base`: split K 2 / 4; rows x2 with 8 warps, x4 with 16; 8 warps on the same rows; 2
    warps; rows x2 and split 2; K tiles x2; K tiles of 128 pipelined (4 stages) or not; 3 stages."""
    r = dataclasses.replace
    bn = base.block_n1
    configs = [
        base,
        r(base, split_k1=2),
        r(base, split_k1=4),
        r(base, block_n1=2 * bn, num_warps=8),
        r(base, block_n1=2 * bn, num_warps=8, split_k1=2),
        r(base, block_n1=4 * bn, num_warps=16),
        r(base, num_warps=8),
        r(base, num_warps=2),
        r(base, num_warps=2, split_k1=2),
        r(base, block_n1=2 * bn, split_k1=2),
        r(base, block_k1=2 * base.block_k1),
        r(base, block_k1=128, stages=4, prefetch=False),
        r(base, block_k1=128, stages=0, prefetch=False),
        r(base, block_k1=128, stages=4, prefetch=False, block_n1=2 * bn, num_warps=8),
        r(base, stages=3),
    ]
    return list(dict.fromkeys(configs))


def down_configs(base: GemvConfig) -> list[GemvConfig]:
    """down tiles around `base`: rows x2 / /2; 8 warps (same and x2 rows); 2 warps; K tiles x2, /2 (rows x2); K
    tiles of 128 pipelined (4 stages) or not; 3 stages; rows /4; rows /2 and /4 with K tiles x2; rows /4 with 2
    warps; split K 2 / 4."""
    r = dataclasses.replace
    bn = base.block_n2
    configs = [
        base,
        r(base, block_n2=2 * bn),
        r(base, block_n2=max(8, bn // 2)),
        r(base, num_warps=8),
        r(base, num_warps=8, block_n2=2 * bn),
        r(base, num_warps=2),
        r(base, block_k2=2 * base.block_k2),
        r(base, block_k2=base.block_k2 // 2, block_n2=2 * bn),
        r(base, block_k2=128, stages=4, prefetch=False),
        r(base, block_k2=128, stages=0, prefetch=False),
        r(base, stages=3),
        # fewer rows per program, so that the grid's last wave is fuller (DeepSeek-like down at 64 rows: 896
        # programs at 4 per SM are 1.7 waves), with longer K tiles to keep the words per thread
        r(base, block_n2=max(8, bn // 4)),
        r(base, block_n2=max(8, bn // 2), block_k2=2 * base.block_k2),
        r(base, block_n2=max(8, bn // 4), block_k2=2 * base.block_k2),
        r(base, block_n2=max(8, bn // 4), num_warps=2),
        # K split over 2 / 4 programs: the same tile, smaller work items for the last wave
        r(base, split_k2=2),
        r(base, split_k2=4),
    ]
    return list(dict.fromkeys(configs))


def focus_configs(base: GemvConfig, kernel: str) -> list[GemvConfig]:
    """`--set focus`: around the int4 default of 2026-12-01 (K tiles of 256, no pipeline), the configs that
    trade registers for programs per SM. Compiled for sm_90 (Triton 3.6, on the CPU), the default gate_up tile
    takes 125 registers per thread (4 programs of 4 warps per SM, so split K cannot fit in one wave); 8 warps on
    the same tile take 64, half the rows with 4 warps 80. Plus the ninth session's tiles (K 128, 4 stages)."""
    r = dataclasses.replace
    if kernel == "gate_up":
        bn = base.block_n1
        configs = [
            base,
            r(base, num_warps=8),
            r(base, num_warps=8, split_k1=2),
            r(base, num_warps=8, split_k1=4),
        ]
        configs += [r(base, block_n1=max(4, bn // 2)), r(base, block_n1=max(4, bn // 2), split_k1=2)]
        configs += [r(base, split_k1=2), r(base, stages=3), r(base, block_n1=2 * bn, num_warps=8)]
        configs += [r(base, block_k1=128, stages=4)]
    else:
        bn = base.block_n2
        configs = [
            base,
            r(base, num_warps=8),
            r(base, num_warps=8, block_n2=2 * bn),
            r(base, block_n2=2 * bn),
        ]
        configs += [r(base, block_n2=max(8, bn // 2)), r(base, stages=3), r(base, block_k2=128, stages=4)]
    return list(dict.fromkeys(configs))


# the tile fields each kernel reads (`layer` reads all): an --alt config equal to the default in these and in
# the kernel's warps, load mode and register cap is not rerun
_KERNEL_FIELDS = {
    "gate_up": ("block_n1", "block_k1", "split_k1", "half_dot", "half_x_pack", "schedule_width", "host_wide"),
    "down": (
        "block_n2",
        "block_k2",
        "split_k2",
        "fuse_combine",
        "half_dot",
        "half_x_pack",
        "schedule_width",
        "down_peel",
        "host_wide",
        "host_tall",
    ),
}


def _differs_for(kernel: str, cfg: GemvConfig, base: GemvConfig) -> bool:
    """`cfg` launches `kernel` differently from `base` (the one-launch fields only matter to `layer`)."""
    if kernel not in _KERNEL_FIELDS:
        return cfg != base
    down = kernel == "down"

    def launch(c: GemvConfig) -> tuple:
        tiles = tuple(getattr(c, f) for f in _KERNEL_FIELDS[kernel])
        return (*tiles, c.num_warps, c.prefetch_code(down), c.registers(down))

    return launch(cfg) != launch(base)


def _row(shape, name, M, kernel, cfg: GemvConfig, us, pct, diff) -> str:
    H, I, _, _ = SHAPES[shape]
    bn, bk = (cfg.block_n1, cfg.block_k1) if kernel != "down" else (cfg.block_n2, cfg.block_k2)
    # the splits that run (`_k_split`: never more than the K tiles), not the ones asked for
    s1 = _k_split(H, cfg.block_k1, cfg.split_k1)[0]
    s2 = _k_split(I, cfg.block_k2, cfg.split_k2)[0]

    def both(gate_up, down):  # the kernel's value; a layer's `gate_up/down` where they differ
        return {"gate_up": gate_up, "down": down}.get(
            kernel, gate_up if gate_up == down else f"{gate_up}/{down}"
        )

    split = both(s1, s2)
    prefetch = both(cfg.prefetch_code(), cfg.prefetch_code(down=True))
    regs = both(cfg.registers() or "-", cfg.registers(down=True) or "-")
    return (
        f"| {shape} | {name} | {M} | {kernel} | {bn} | {bk} | {cfg.num_warps} | {prefetch} | {split} | {regs} "
        f"| {_word_dot(cfg)} | {_combine(kernel, cfg)} | {_schedule(cfg)} | {us:.1f} | {pct:.0f}% | {diff:.2e} |"
    )


def _schedule(cfg: GemvConfig) -> str:
    """The schedule column: the pairs' sort width (`schedule_width`; none: pair order), down's first tile ahead
    of its wait (`down_peel`), and one launch."""
    order = f"sort {cfg.schedule_width}" if cfg.schedule_width else "pair order"
    order += ", peel" if cfg.down_peel else ""
    return f"one launch, {order}" if cfg.one_launch else order


def _apply_alt(base: GemvConfig, alt: dict[str, int]) -> GemvConfig:
    """`base` with an --alt config's fields; SystemExit naming the clash where the result is no config (e.g.
    prefetch=1 on a default that peels down: add down_peel=0)."""
    try:
        return dataclasses.replace(base, **alt)
    except ValueError as exc:
        raise SystemExit(f"--alt {alt} on the default {base}: {exc}") from exc


def _combine(kernel: str, cfg: GemvConfig) -> str:
    """The combine column: in down's epilogue (the last arrival sums, `fuse_combine`) or its own kernel; gate_up
    has none."""
    if kernel == "gate_up":
        return "-"
    return "fused" if cfg.fuse_combine or cfg.one_launch else "kernel"


def _word_dot(cfg: GemvConfig) -> str:
    """The word-dot column: fp32, half, or half with x' packed once per program (`half_x_pack`)."""
    return "fp32" if not cfg.half_dot else "half, packed x" if cfg.half_x_pack else "half"


def sweep_case(
    shape: str,
    name: str,
    M: int,
    bandwidths: tuple[float, float],
    g: torch.Generator,
    deadline: float,
    config_set: str = "wide",
    only: list[str] | None = None,
    alts: list[dict] | None = None,
    rounds: int = 1,
    host_every: int = 0,
) -> list[str]:
    """The rows of one case: gate_up configs, then down configs (down reads the default config's act).
    `bandwidths`: GB/s of the HBM read and the zero-copy read; `host_every` (`resident_layer`): every n-th
    distinct expert read from the pinned bank (1: all, 0: none). % bound: of the time to read the pool rows'
    bytes at the HBM read and the host rows' at the zero-copy read (each kernel its share of both)."""
    H, I, _, _ = SHAPES[shape]
    layer = resident_layer(shape, name, M, g, host_every=host_every)
    x, ids, tw, l2p, E, w13, w2, fmt = layer.args
    ids = ids.contiguous()
    base = gemv_configs(H, I, fmt.fmt, ids.numel(), fmt.group)
    act_ref = gemv_gate_up(x, ids, l2p, E, w13, fmt, base).clone()
    kernels = {  # kernel: (its launch for a config, its share of the layer's bytes)
        "gate_up": (lambda c: gemv_gate_up(x, ids, l2p, E, w13, fmt, c), 2 / 3),
        "down": (lambda c: gemv_down_combine(act_ref, ids, tw, l2p, E, w2, fmt, c), 1 / 3),
        "layer": (lambda c: pooled_fused_moe(*layer.args, variant="gemv", gemv_config=c), 1.0),
    }
    rows = []
    unknown = set(only or []) - set(kernels)
    if unknown:
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; known: {', '.join(kernels)}")
    for kernel, (launch, share) in kernels.items():
        if kernel not in (only or ["gate_up", "down"]):
            continue
        ref = launch(base).clone()
        if config_set == "default":
            configs = [base]
        elif config_set == "alt":
            changed = [_apply_alt(base, alt) for alt in alts or []]
            configs = [base, *(c for c in changed if _differs_for(kernel, c, base))] * rounds
        elif config_set == "focus":
            configs = focus_configs(base, kernel)
        else:
            configs = (gate_up_configs if kernel == "gate_up" else down_configs)(base)
        for cfg in configs:
            if time.perf_counter() > deadline:
                return [*rows, f"| {shape} | {name} | {M} | (time budget reached) |"]
            try:
                diff = (launch(cfg).float() - ref.float()).abs().max().item()
                us = time_graph(functools.partial(launch, cfg))
            except Exception as exc:  # a config the launcher refuses: report it, go on with the others
                rows.append(f"| {shape} | {name} | {M} | {kernel} | {cfg} | error: {f'{exc!r}'[:120]} |")
                print(rows[-1], flush=True)
                continue
            rows.append(
                _row(shape, name, M, kernel, cfg, us, 100 * share * layer.bound_us(*bandwidths) / us, diff)
            )
            print(rows[-1], flush=True)
    return rows


def _alt_fields(text: str) -> dict[str, int]:
    """`"k=v,k=v"` -> GemvConfig fields (all integer or boolean fields: the values are taken as integers)."""
    fields = {f.name for f in dataclasses.fields(GemvConfig)}
    alt = {}
    for kv in text.split(","):
        key, sep, value = kv.partition("=")
        if not sep or key.strip() not in fields:
            raise SystemExit(
                f"--alt: {kv!r} is not k=v with k a GemvConfig field ({', '.join(sorted(fields))})"
            )
        alt[key.strip()] = int(value)
    return alt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="deepseek:int4-g128:1,8;qwen3:int4-g128:1,8;deepseek:nvfp4:1")
    ap.add_argument("--budget", type=float, default=240.0, help="seconds before the sweep stops")
    ap.add_argument(
        "--set",
        choices=("wide", "focus", "default", "alt"),
        default="wide",
        help="configs: around the default, focus, or the default alone (A/B runs of two trees)",
    )
    ap.add_argument("--kernels", default="gate_up,down", help="comma list of gate_up, down, layer")
    ap.add_argument(
        "--alt",
        default="",
        help='--set alt: GemvConfig fields of the other configs, "k=v,k=v;k=v" (";" between)',
    )
    ap.add_argument("--rounds", type=int, default=3, help="--set alt: default / alt alternations")
    ap.add_argument(
        "--host-rows",
        action="store_true",
        help="every expert read from a pinned bank (host rows); %% of the zero-copy read instead of HBM",
    )
    ap.add_argument(
        "--host-every",
        type=int,
        default=0,
        help="every n-th distinct expert of the step read from a pinned bank, the rest from the pool (8: "
        "bench.kernels' 1/8; 1: --host-rows); %% of the pool rows' bytes at HBM plus the host rows' at zero-copy",
    )
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.host_every < 0 or (args.host_rows and args.host_every not in (0, 1)):
        raise SystemExit(f"--host-every {args.host_every}: >= 0, and 0 or 1 with --host-rows (every row)")
    host_every = 1 if args.host_rows else args.host_every
    deadline = time.perf_counter() + args.budget
    alts = [_alt_fields(one) for one in args.alt.split(";") if one]
    hbm, zero_copy, lines = measured_header(args.commit)
    where = {
        0: "HBM read",
        1: "zero-copy read (every row on the host)",
    }.get(
        host_every, f"HBM read for pool rows and zero-copy read for host rows (every {host_every}-th expert)"
    )
    lines += [
        f"GEMV kernels apart (µs per call, graph replay; % of the {where} for that kernel's bytes; max |diff| to "
        "the default):",
        "",
        "| shape | format | M | kernel | BN | BK | warps | prefetch | split K | max regs | word dot | combine "
        "| schedule | µs | % bound | max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases.split(";"):
        shape, name, ms = case.split(":")
        for M in (int(m) for m in ms.split(",")):
            lines += sweep_case(
                shape,
                name,
                M,
                (hbm, zero_copy),
                g,
                deadline,
                args.set,
                args.kernels.split(","),
                alts,
                args.rounds,
                host_every,
            )
            torch.cuda.empty_cache()
    try:  # Triton internals: the sweep's rows must not be lost to a change there
        resources = ["", *compiled_resources()]
    except Exception as exc:
        resources = ["", f"(compiled kernels' registers not read: {exc!r})"]
    print("\n".join(resources), flush=True)
    lines += resources
    write(args.out, lines)


def compiled_resources() -> list[str]:
    """Registers and spills of every GEMV kernel compiled in this process (with its tile constexprs), as lines
    (Triton's `CompiledKernel`)."""
    from pooled_runner.kernels import gemv

    keep = ("BLOCK_N", "BLOCK_K", "FMT", "PREFETCH", "HALF_X", "X_PACK", "SPLIT", "HOST_WIDE", "HOST_TALL")
    out = ["Compiled GEMV kernels (registers per thread, spilled registers; constexprs):", ""]
    for kernel in (gemv._gate_up_kernel, gemv._down_kernel):
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                compiled._init_handles()  # fills n_regs / n_spills (done already if it ran)
                # constexprs keyed by argument index (a 1-tuple in Triton 3.6-3.8)
                consts = {
                    kernel.arg_names[key[0] if isinstance(key, tuple) else key]: value
                    for key, value in compiled.src.constants.items()
                }
                consts = {k: v for k, v in consts.items() if k in keep}
                out.append(
                    f"- {compiled.name}: {compiled.n_regs} registers, {compiled.n_spills} spills {consts}"
                )
    return out


if __name__ == "__main__":
    main()
