"""The pooled MoE forward on the kernels: align+locate -> gemm1 (+SiLU*mul) -> gemm2 -> weighted combine, or for
a few routed pairs one of two two-launch decode paths: on tensor cores (`decode.py`) or on CUDA cores
(`gemv.py`).

Graph-safe: every buffer is sized from host-known shapes (T, K, E, block sizes), routing stays on the device,
nothing is read back. Torch references with the same signatures: `fused_moe_ref.py`.
"""

from __future__ import annotations

import torch

from pooled_runner import envs

from . import pdl, splitk
from .align import AlignOutput, align_blocks, max_blocks_for
from .combine import combine
from .decode import DECODE_MAX_PAIRS, decode_moe
from .dequant import FMT_DENSE, FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4, FMT_NVFP4
from .fused_moe_ref import dense_row as dense_row  # re-exported
from .fused_moe_ref import gemm1_ref as gemm1_ref
from .fused_moe_ref import gemm2_ref as gemm2_ref
from .fused_moe_ref import pooled_fused_moe_ref as pooled_fused_moe_ref
from .gemv import GEMV_MAX_PAIRS, GemvConfig, gemv_moe, gemv_supported
from .moe_gemm import INLINE_MAX_PAIRS, DecodeRouting, GemmConfig, gemm1, gemm2, interpreting
from .operands import KernelFormat, Projection, make_projection
from .splitk import SPLITK_MAX_PAIRS, splitk_moe, splitk_supported

# Off: on the H200 (2026-11-30, commit 216b10f) the two-launch decode path was slower than align + gemm1 +
# gemm2 + combine at every decode shape measured (Qwen3-like bf16 M=1: 59.0 vs 41.2 µs; DeepSeek-like bf16
# M=1: 239 vs 184 µs). It stays available (decode=True) and tested.
AUTO_DECODE_PATH = False

# Kernels of decode steps (T*K <= DECODE_STEP_MAX_PAIRS routed pairs; the GEMV up to GEMV_MAX_PAIRS), when the
# caller names none:
#   "align"     align + gemm1 + gemm2 + combine, as wider steps;
#   "align-fc"  align + gemm1 + gemm2 with the combine fused into gemm2 (last arriver per token and N block);
#   "inline"    gemm1 + gemm2 computing the align in every program (T*K <= INLINE_MAX_PAIRS, else "align-fc"),
#               combine fused: two launches; same blocks, tiles and sums as "align", so the same output;
#   "gemv"      gemv.py (CUDA cores, per routed pair); "mma": decode.py;
#   "splitk"    splitk.py: one launch, each program a slice of one pair's activation and its down share
#               (dense weights; others take the default).
# Routed pairs up to which a step counts as a decode step for the variants other than "gemv" (which takes up
# to GEMV_MAX_PAIRS); wider steps take the align path.
DECODE_STEP_MAX_PAIRS = 64
# POOLED_RUNNER_MOE_DECODE, read once here; unset: `default_variant` (measured below).
VARIANTS = ("align", "align-fc", "inline", "gemv", "mma", "splitk")
DECODE_VARIANT = envs.moe_decode_kernel()

# `default_variant`: on the H200 (2026-11-30, commit e87d7f6, bench/kernels.py --variants) "inline" beat "align"
# at M=1 top-8 (8 pairs) for bf16 (Qwen3-like 30.5 vs 31.6 µs, DeepSeek-like 177.1 vs 187.4 µs) and lost by 1-2%
# at 32 pairs (M=4). Where the decode tiles are swapped (`swapped_tiles`) the default is align + swap: at commit
# cce651e, M=1, DeepSeek-like int4 align + swap 160.4 µs vs inline + swap 174.2 (unswapped inline 174.7); for NVFP4
# (226.8 vs inline + swap 224.4) and fp8 (153.7 vs 153.8) the two are a tie, and one rule is kept; the Qwen3-like
# int4 layer moved within noise (34.6 vs inline 34.3). "gemv" was then slower everywhere except the Qwen3-like
# int4 layer at M=1 (30.8 µs); since its x split (2026-12-01) it is the int4 / NVFP4 default below.
INLINE_DEFAULT_MAX_PAIRS = 8
# ... unless a long plan runs beside the step (`long_plan`: the adaptive policies' one-launch plan + copy, 14-20 µs
# per layer at 4-8 tokens on the H200): the align kernel waits for the whole plan, the inline GEMMs start beside it.
# H200, 2026-12-04, bench.planner (6 Qwen3-like bf16 layers, routing that only hits, graph replay), M=4 = 32 pairs,
# plan + MoE µs per step, inline against align (POOLED_RUNNER_MOE_DECODE=align) in one call: adaptive 513.5 vs 557.9
# and 508.9 vs 555.9 (trees 315c1af, 7a78a29), adaptive-router 572.8 vs 639.5 (two calls); lru-cycle's short
# plan the other way, 484.2 vs 481.3 and 479.4 vs 474.8: only the long plans take it.

# Decode steps of at most this many routed pairs take the GEMV path by default, per format. On the H200
# (2026-12-01, commit 0c1b470, `bench/kernels.py --variants --formats int4-g128,nvfp4`), with the x tile split in
# registers, int4 (4-stage K tiles of 128) against the align path with swapped tiles, M = 1 / 2 / 4 / 8:
# DeepSeek-like 101.3 / 177.5 / 327.8 / 624.3 µs vs 159.2 / 320.8 / 523.5 / 938.4; Qwen3-like 21.1 / 27.1 /
# 48.9 / 85.1 vs 34.5 / 47.3 / 69.3 / 110.9. NVFP4 (register prefetch off) at M=1, DeepSeek-like: 205.7 vs 225.3
# µs. Since then int4 uses K tiles of 256 without a pipeline (gemv_configs; layer numbers in docs/BENCHMARKS.md,
# tenth session), which only widens its lead. NVFP4 loads its scales per tile (one per two words) since the
# eleventh session: H200, 2026-12-01, `bench/kernels.py --variants --formats nvfp4`, GEMV against the best other
# variant at M = 1 / 2 / 4 / 8: DeepSeek-like 101.5 / 187.9 / 352.8 / 653.0 µs vs 225.0 / 436.4 / 814.7 / 1565.1,
# Qwen3-like 18.6 / 29.5 / 56.0 / 89.8 vs 43.3 / 60.7 / 102.3 / 167.0: both formats took it up to 64 pairs.
# Since the schedule's 128-wide form (2026-12-03, `bench/kernels.py --variants --formats int4-g128,nvfp4`, H200)
# up to GEMV_MAX_PAIRS = 128, against the fastest other variant (align + swap) at M = 12 / 16: DeepSeek-like
# int4 743.6 / 967.1 µs vs 1337.2 / 1531.4, NVFP4 798.2 / 1055.3 vs 1969.0 / 2526.8.
GEMV_DEFAULT_MAX_PAIRS = {FMT_INT4: GEMV_MAX_PAIRS, FMT_NVFP4: GEMV_MAX_PAIRS}
# ...and only where the pairs touch mostly distinct experts (`distinct_share`): the GEMV reads an expert
# once per routed pair (its schedule puts the pairs of an expert side by side, so L2 may serve the repeats), the
# MMA paths once per step. With few experts and many tokens (e.g. 8 experts, top-2, 16 tokens: 0.45 distinct
# experts per pair) the repeats would dominate. The lowest share measured is 0.64 (Qwen3-like, 128 experts, 16
# tokens of top-8; same run as above), where the GEMV still won: int4 133.7 vs 164.1 µs, NVFP4 141.0 vs 244.0
# (the best other variant); hence 0.6 (below 0.64 not measured). The dense split path keeps 0.75 (its measured
# wins had 0.81-1.0).
GEMV_MIN_DISTINCT_SHARE = 0.6
SPLITK_MIN_DISTINCT_SHARE = 0.75


def distinct_share(num_pairs: int, num_tokens: int, num_experts: int) -> float:
    """Expected distinct experts per routed pair under uniform top-k routing, `E (1 - (1 - k/E)^T) / pairs` with
    k = pairs / T; 1.0 when `num_tokens` or `num_experts` is not given (0). The GEMV and split paths read an
    expert once per routed pair (L2 serves a repeat only if the expert stays there), the MMA paths once per step."""
    if num_tokens <= 0 or num_experts <= 0 or num_pairs <= 0:
        return 1.0
    top_k = num_pairs / num_tokens
    return num_experts * (1.0 - (1.0 - min(top_k / num_experts, 1.0)) ** num_tokens) / num_pairs


def swapped_tiles(weight_fmt: int, intermediate_size: int) -> bool:
    """Whether decode tiles swap their operands (`GemmConfig.swap_ab`) by default. Measured on the H200 (align
    path, commits cce651e and 0c605d1): int4 DeepSeek-like M=8 1098.8 -> 954.5 µs, Qwen3-like M=8 126.1 -> 113.8;
    NVFP4 DeepSeek-like M=1 241.0 -> 226.8; fp8 DeepSeek-like (64-wide gemm1 tiles, I > 1024) M=8 980.5 -> 864.8
    but Qwen3-like (32-wide) M=8 131.7 -> 144.5 µs: fp8 swaps only there; dense bf16 gained nothing (Qwen3-like
    M=4 90.2 -> 96.2): never."""
    if weight_fmt in (FMT_FP8_CHANNEL, FMT_FP8_BLOCK):
        return intermediate_size > 1024
    return weight_fmt in (FMT_INT4, FMT_NVFP4)


# Dense decode steps of at most SPLITK_DEFAULT_MAX_PAIRS routed pairs on experts with I <= SPLITK_DEFAULT_MAX_I
# and H <= SPLITK_DEFAULT_MAX_H, whose T*H sums the last program rounds in one block (<= splitk.SPLITK_TAIL_MAX),
# take the one-launch split path (`splitk.py`), unless the caller gives MMA tiles or the pairs share experts
# heavily. On the H200 (2026-12-03, `bench/splitk_sweep.py`, graph replay, interleaved rounds, fp64 sums; the
# final run, two earlier runs within 0.5%), against the fastest other path: Qwen3-like bf16 M=1 25.99 vs inline
# 28.30 µs (1.089x; 1.220x stock SGLang's 31.7), M=2 45.86 vs inline 47.72 (1.040x); but M=3 and 4 (24 and 32
# pairs) 0.941x and 0.947x: hence 16 pairs. DeepSeek-like (H 7168, I 2048) M=1 170.18 vs align 172.86 (1.016x),
# M=2 329.40 vs inline 335.80 (1.019x), yet left out: its T*H takes the tail more than one block, a form whose
# first version came out wrong on the H200 and whose fix (a barrier per block, volatile loads) has no known
# cause (docs/BENCHMARKS.md, nineteenth session); one block was right in every form tried.
SPLITK_DEFAULT_MAX_PAIRS = 16
SPLITK_DEFAULT_MAX_I = 1024
SPLITK_DEFAULT_MAX_H = 4096


def default_variant(
    weight_fmt: int,
    num_pairs: int,
    intermediate_size: int,
    configs: tuple[GemmConfig, ...] | None = None,
    num_tokens: int = 0,
    num_experts: int = 0,
    hidden_size: int = 0,
    long_plan: bool = False,
) -> str:
    """The decode kernels used when neither the caller nor POOLED_RUNNER_MOE_DECODE names one: the GEMV path
    up to GEMV_DEFAULT_MAX_PAIRS[format] routed pairs, and for dense weights on experts with I <=
    SPLITK_DEFAULT_MAX_I and H <= SPLITK_DEFAULT_MAX_H (0: not given) the one-launch split path up to
    SPLITK_DEFAULT_MAX_PAIRS where T*H <= splitk.SPLITK_TAIL_MAX (one tail block), unless the caller gives MMA
    tiles (`configs`) or the step's pairs share experts heavily (`distinct_share` below GEMV_MIN_DISTINCT_SHARE,
    SPLITK_MIN_DISTINCT_SHARE; 1.0 when `num_tokens` or `num_experts` is 0); else inline up to INLINE_DEFAULT_MAX_PAIRS routed pairs where the tiles
    are not swapped (up to INLINE_MAX_PAIRS with `long_plan`: a long plan runs beside the step, which the
    inline GEMMs start beside and the align kernel waits for), else the align path. Swapped: those of
    `configs` where the caller gives them, else `swapped_tiles`."""
    share = distinct_share(num_pairs, num_tokens, num_experts) if configs is None else 0.0
    if share >= GEMV_MIN_DISTINCT_SHARE and num_pairs <= GEMV_DEFAULT_MAX_PAIRS.get(weight_fmt, 0):
        return "gemv"
    distinct = share >= SPLITK_MIN_DISTINCT_SHARE
    # hidden_size 0: not given (the rule's tables); every program of the split path adds H sums per pair
    narrow = weight_fmt == FMT_DENSE and intermediate_size <= SPLITK_DEFAULT_MAX_I
    narrow = narrow and hidden_size <= SPLITK_DEFAULT_MAX_H
    narrow = narrow and num_tokens * hidden_size <= splitk.SPLITK_TAIL_MAX  # one tail block
    if distinct and narrow and num_pairs <= SPLITK_DEFAULT_MAX_PAIRS:
        return "splitk"
    swapped = any(c.swap_ab for c in configs) if configs else swapped_tiles(weight_fmt, intermediate_size)
    if num_pairs <= (INLINE_MAX_PAIRS if long_plan else INLINE_DEFAULT_MAX_PAIRS) and not swapped:
        return "inline"
    return "align"


def make_projections(
    fmt: KernelFormat,
    pool: dict[str, torch.Tensor],
    bank: dict[str, torch.Tensor] | None,
    hidden_size: int,
    intermediate_size: int,
) -> tuple[Projection, Projection]:
    """Validated (w13, w2) projections of the pool rows `[R, ...]` and one layer's host view `[E, ...]`."""
    w13 = make_projection(fmt, "w13", pool, bank, 2 * intermediate_size, hidden_size)
    w2 = make_projection(fmt, "w2", pool, bank, hidden_size, intermediate_size)
    return w13, w2


def pick_configs(
    num_tokens: int, top_k: int, num_experts: int, H: int, I: int, weight_fmt: int = FMT_DENSE
) -> tuple[GemmConfig, GemmConfig]:
    """Tile shapes for (gemm1, gemm2): small-M decode tiles up to 32 tokens, MMA-sized tiles above."""
    if interpreting():  # the interpreter's cost grows with tile size; correctness only
        return GemmConfig(16, 16, 32, num_stages=1), GemmConfig(16, 16, 32, num_stages=1)
    if num_tokens <= 32:
        # Decode: memory-bound; N tiles small enough that top-k blocks cover the SMs (and one compile per shape).
        # int4 gemm1 N tiles of 64 at both shapes; 3 pipeline stages for bf16, int4 and NVFP4: the H200 stage
        # sweep (commit b977f9e, one layer, graph replay, 4 -> 3 stages) gave DeepSeek-like int4 M=1 190.3 -> 175.4
        # µs and M=8 1069 -> 976 µs, Qwen3-like int4 M=8 (N tiles 32 -> 64) 129.0 -> 125.7 µs, Qwen3-like bf16
        # M=8 135.5 -> 132.6 µs, the other widths within 1% (Qwen3-like bf16 M=1 31.0 vs 31.2, M=16 208.3 vs
        # 208.9). NVFP4's own tiles (32, 64, 64) were not swept at both stage counts in one run: the evidence is
        # across runs only (M=8 924 GB/s with 4 stages at 9222d96, 949 with 3 at 6b3b1c3), weak. fp8 was not
        # swept: it keeps 4.
        # Dense gemm1 N tiles of 32 only at 1-2 tokens on narrow experts: H200 sweep (commit 99e5bff, Qwen3-like
        # bf16, gemm2 with PDL, N tiles 32 -> 64) M=1 28.5 -> 29.6 µs, M=2 49.5 -> 50.2, M=4 90.1 -> 82.3, M=8
        # 127.8 -> 126.2; DeepSeek-like M=4 642.5 -> 633.1 (already 64 there: I > 1024). 9-32 tokens were not
        # swept in one run (Qwen3-like M=16: 204.0 µs with 64 at 47d58cb, 204.6 with 32 at 6b3b1c3, no PDL); fp16
        # follows bf16 unmeasured
        wide = I > 1024 or weight_fmt == FMT_INT4 or (weight_fmt == FMT_DENSE and num_tokens > 2)
        bn1 = 64 if wide else 32
        bn2 = 64
        stages = 4 if weight_fmt in (FMT_FP8_CHANNEL, FMT_FP8_BLOCK) else 3
        # swapped operands for quantized weights (the dequantized tile is the MMA's left operand): `swapped_tiles`
        swap = swapped_tiles(weight_fmt, I)
        # NVFP4: gemm1 N tiles of 32 and K tiles of 64, the best of the H200 tile sweep (e87d7f6, DeepSeek-like
        # M=1: 240.5 µs vs 266.8 with (32, 64, 128)); K tiles of 64 alone with N tiles of 64 gave 298 (f2411ff)
        bk = 64 if weight_fmt == FMT_NVFP4 else 128
        bn1 = 32 if weight_fmt == FMT_NVFP4 else bn1
        return (
            GemmConfig(16, bn1, bk, group_m=1, num_warps=4, num_stages=stages, swap_ab=swap),
            GemmConfig(16, bn2, bk, group_m=1, num_warps=4, num_stages=stages, swap_ab=swap),
        )
    block_m = 32 if num_tokens <= 128 else 64 if num_tokens <= 1024 else 128
    warps = 8 if block_m == 128 else 4
    if block_m == 32 and weight_fmt == FMT_DENSE and I <= 1024:
        # K tiles of 128 and no program grouping at 33-128 tokens on narrow dense experts (a few tokens per
        # expert: still streaming weights): H100, 2026-12-06, bench.wide_tiles, Qwen3-like bf16, interleaved,
        # M=64 430.0 µs against 450.4 with the tiles below, M=128 460.9 against 480.5 (stock SGLang 411.2 and
        # 417.1 there); fp16 follows bf16 unmeasured; not measured on wider experts or quantized formats, which
        # keep the tiles below
        return (
            GemmConfig(32, 64, 128, group_m=1, num_warps=4, num_stages=3),
            GemmConfig(32, 128, 128, group_m=1, num_warps=4, num_stages=3),
        )
    return (
        GemmConfig(block_m, 64, 64, group_m=8, num_warps=warps, num_stages=3),
        GemmConfig(block_m, 128, 64, group_m=8, num_warps=warps, num_stages=3),
    )


def pooled_fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    decode: bool | None = None,
    variant: str | None = None,
    gemv_config: GemvConfig | None = None,
    after_plan: bool = False,
    long_plan: bool = False,
    aligned: AlignOutput | None = None,
) -> torch.Tensor:
    """Routed-experts output `[T, H]` of one pooled layer.

    Args:
      hidden: `[T, H]` bf16/fp16 row-major. topk_ids `[T, K]` int32/int64 (-1 padding), topk_weights `[T, K]`.
      l2p: `[E_max]` int32 location codes of the layer (row, R + e host row, -1 not here).
      w13, w2: projections from `make_projections`. fmt: their kernel format.
      configs: (gemm1, gemm2) tiles; default `pick_configs` (or `decode_configs`).
      decode: the two-launch decode path (`kernels/decode.py`); None: only when AUTO_DECODE_PATH and
        T*K <= DECODE_MAX_PAIRS.
      variant: kernels of a decode step (T*K <= DECODE_STEP_MAX_PAIRS; "gemv" <= GEMV_MAX_PAIRS): one of VARIANTS ("gemv" where
        `gemv_supported`, "mma" as decode=True); None: POOLED_RUNNER_MOE_DECODE, else `default_variant`. Wider steps take the align path.
        `decode` given wins over `variant`. gemv_config: the GEMV path's tiles (default `gemv_configs`).
      after_plan: the step's plan + copy may still be running beside this call's first kernel (the value
        `DevicePlanner.plan` returned, nothing launched since; kernels/plan_copy.py); the GEMV, inline and split
        decode kernels, and the align path's GEMMs on `aligned` blocks, then read location codes as that allows
        (OVERLAP); the other paths, and non-contiguous ids or weights (copied first), start with a plain launch,
        after the plan ends. long_plan: with after_plan,
        the plan is a long one (`DevicePlanner.long_plan`): `default_variant` then prefers the inline path.
      aligned: `align_before_plan`'s output for this step (the same ids, layer and long_plan), or None. Taken
        where the step runs the align path in OVERLAP (after_plan, PDL): the GEMMs then start beside the plan;
        elsewhere it is ignored and the blocks are aligned here, after the plan (its codes are the old table's).
    """
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    if hidden.dim() != 2 or hidden.shape[0] != T:
        raise ValueError(f"hidden: shape {tuple(hidden.shape)}, expected [{T}, H]")
    if T == 0:
        return torch.empty((0, H), dtype=hidden.dtype, device=hidden.device)
    # a copy made here would launch between the plan and the first GEMM, which then is not the plan's dependent
    after_plan = after_plan and topk_ids.is_contiguous() and topk_weights.is_contiguous()
    # the inline preference pays only where its gemm1 starts beside the plan (PDL-launched GEMMs)
    long_plan = long_plan and after_plan and _gemms_overlap(hidden, fmt)
    variant = (
        variant or DECODE_VARIANT or default_variant(fmt.fmt, T * K, I, configs, T, num_experts, H, long_plan)
    )
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    if variant == "splitk" and not splitk_supported(fmt):
        variant = default_variant(fmt.fmt, T * K, I, configs, T, num_experts, H, long_plan)
    if decode is None and variant == "gemv" and T * K <= GEMV_MAX_PAIRS and gemv_supported(fmt, H, I):
        return gemv_moe(
            hidden, topk_ids, topk_weights, l2p, num_experts, w13, w2, fmt, gemv_config, after_plan
        )
    if decode is None and T * K <= DECODE_STEP_MAX_PAIRS:
        if variant == "splitk" and T * K <= SPLITK_MAX_PAIRS:
            return splitk_moe(
                hidden, topk_ids, topk_weights, l2p, num_experts, w13, w2, fmt, None, after_plan
            )
        if variant == "mma" and T * K <= DECODE_MAX_PAIRS:
            decode = True
        if variant in ("align-fc", "inline"):
            cfg1, cfg2 = configs or pick_configs(T, K, num_experts, H, I, fmt.fmt)
            _check_same_block_m(cfg1, cfg2)  # gemm2 reads gemm1's slots by the same block layout
            routing = DecodeRouting(
                topk_ids.contiguous(), l2p, num_experts, topk_weights.contiguous(), after_plan=after_plan
            )
            align = None
            if variant == "align-fc" or T * K > INLINE_MAX_PAIRS:
                align = align_blocks(routing.topk_ids, l2p, num_experts, w13.num_rows, cfg1.block_m)
            act = gemm1(hidden, align, w13, fmt, K, cfg1, routing)
            return gemm2(act, align, w2, fmt, T * K, cfg2, routing, fuse_combine=True)
    if decode if decode is not None else (AUTO_DECODE_PATH and T * K <= DECODE_MAX_PAIRS):
        return decode_moe(hidden, topk_ids, topk_weights, l2p, num_experts, w13, w2, fmt, configs)
    cfg1, cfg2 = configs or pick_configs(T, K, num_experts, H, I, fmt.fmt)
    _check_same_block_m(cfg1, cfg2)
    routing = None
    if aligned is not None and after_plan and decode is None and _gemms_overlap(hidden, fmt):
        want = max_blocks_for(T * K, num_experts, cfg1.block_m)
        if aligned.max_blocks != want or aligned.sorted_pairs.numel() != want * cfg1.block_m:
            raise ValueError(
                f"aligned: {aligned.max_blocks} blocks of {aligned.block_m}, expected {want} of {cfg1.block_m} "
                f"for {T}x{K} pairs over {num_experts} experts: give align_before_plan this step's arguments"
            )
        align = aligned  # aligned before the plan: the GEMMs locate its blocks in OVERLAP, beside the plan
        routing = DecodeRouting(topk_ids, l2p, num_experts, after_plan=True)
    else:
        align = align_blocks(topk_ids.contiguous(), l2p, num_experts, w13.num_rows, cfg1.block_m)
    act = gemm1(hidden, align, w13, fmt, K, cfg1, routing)
    y = gemm2(act, align, w2, fmt, T * K, cfg2, routing)
    return combine(y, topk_ids.contiguous(), topk_weights.contiguous(), l2p, num_experts)


def align_before_plan(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    overlap: bool,
    long_plan: bool = False,
) -> AlignOutput | None:
    """The align launch of a decode step that will run the align path beside its plan, made BEFORE the plan
    (its block layout reads only the ids): with it, `pooled_fused_moe(aligned=...)` starts the GEMMs beside the
    plan instead of behind an align kernel that waits for the whole plan. Arguments as that call's (hidden
    `[T, H]`, topk_ids `[T, K]` contiguous, the layer's `l2p`, `long_plan`); `overlap`: the planner's (its plan
    lets the MoE start beside it). None (nothing launched) unless `overlap`, the step has INLINE_MAX_PAIRS <
    T*K <= DECODE_STEP_MAX_PAIRS routed pairs on the align variant (POOLED_RUNNER_MOE_DECODE or
    `default_variant`) and the GEMMs are PDL-launched.

    Measured on the H200 (2026-12-04, bench.planner, 6 Qwen3-like bf16 layers, routing that only hits, graph
    replay, M=8 = 64 pairs): adaptive plan + MoE 731.9 µs per step against 801.7 with the align after the plan
    (tree 3895ef1 against 315c1af); lru-cycle 668.6 against 688.9 (one machine, the rule widened to it by hand).
    Steps of 9-32 pairs behind a short (LRU) plan keep the align after it: not measured this way; the inline
    path at 64 pairs cost 868 µs against align's 651 (MoE alone, tree 7a78a29)."""
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    if not overlap or not INLINE_MAX_PAIRS < T * K <= DECODE_STEP_MAX_PAIRS or not topk_ids.is_contiguous():
        return None
    if (DECODE_VARIANT or default_variant(fmt.fmt, T * K, I, None, T, num_experts, H, long_plan)) != "align":
        return None
    if not _gemms_overlap(hidden, fmt):
        return None
    cfg1, _ = pick_configs(T, K, num_experts, H, I, fmt.fmt)
    return align_blocks(topk_ids, l2p, num_experts, w13.num_rows, cfg1.block_m, before_plan=True)


def _gemms_overlap(hidden: torch.Tensor, fmt: KernelFormat) -> bool:
    """Whether the MMA GEMMs can run in OVERLAP mode (`moe_gemm.overlap_mode`): PDL-launched, or interpreted."""
    return pdl.pdl_enabled(hidden, fmt.fmt) or interpreting()


def _check_same_block_m(cfg1: GemmConfig, cfg2: GemmConfig) -> None:
    if cfg1.block_m != cfg2.block_m:
        raise ValueError(
            f"gemm1 block_m={cfg1.block_m} != gemm2 block_m={cfg2.block_m}: give both one block_m"
        )
