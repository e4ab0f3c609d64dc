"""GEMV decode path (few routed pairs): two launches (or one) on CUDA cores, no align, no tensor cores.

  gate_up:      one program per (routed pair, N block of I): `act[pair, n] = silu(x[t] . gate[n]) * (x[t] . up[n])`
                with the gate/up sums and the activation rounded to the compute dtype, as `gemm1` stores them.
  down_combine: one program per (routed pair, N block of H): `y[pair, n] = round(act[pair] . w2[n])`; the last of
                the token's K programs of an N block (a self-resetting arrival counter per (token, N block))
                sums `w[t, k] * y[t*K + k]` in k order in fp32, exactly as `combine` does (of K x split_k2 with
                K split: `gemv_tiles._down_tile`); no float atomics, so the output does not depend on scheduling.
                `fuse_combine=False` leaves the sum to `combine`.
  one_launch:   both in one grid (`_fused_kernel`): gate_up tiles first, a down tile waits for its pair's
                act (see the kernel for why this cannot deadlock and what happens if a wait gives up).

Why (decode, M <= 8 tokens): with one token per routed pair the MMA path pads M to 16 rows and passes every
dequantized B tile through shared memory to reach the MMA layout; here a program streams `[BLOCK_N, BLOCK_K]`
weight tiles as packed int32 words (16-byte loads), turns each word into fp32 values with one or two integer
ops per value and FMAs them against x, and sums over K once at the end. x: dense and fp8 read it through
pointers broadcast over the rows (the words' layout, no layout conversion); int4 and NVFP4 load the tile's x
once, contiguous, and split it in registers (`gemv_words._x_split8`). The grid is pairs x N blocks, so even one
token's top-8 gives a few hundred programs. Loads run ahead of use by `GemvConfig`: the next tile in registers
(`prefetch`, dense and fp8 by default) or Triton's pipeline (`stages`); int4 and NVFP4 by default neither
(int4: K tiles of 256, each row's 128 bytes per tile keep the loads near the HBM rate, and at one token on
layers of whole 512 tiles the half word dot at 512; NVFP4: the half word dot with K tiles of 512 at 128
registers; with the half dot, down's first tile is loaded before its PDL wait, `down_peel`; `gemv_configs`). gate_up can
split K over programs (`split_k1`, parts summed in order by the last arrival) where pairs x N blocks are few;
down too (`split_k2`: fp32 parts summed in split order by the token's last arrival, which combines).

Per format (one int32 word holds VPW values along K; value j of word w is element `VPW * w + j`):
  dense bf16 (VPW 2): `w << 16` and `w & 0xFFFF0000` are the two values as fp32. fp16: converted halves.
  int4 (VPW 8): nibbles 2i and 2i + 1 shifted together to bits 12..15 and 16..19 read, OR-ed with the
      exponents of 2048.0 and 128.0, as `2048 + q` and `128 + q` exactly; per pair of words (one group)
      `s * (sum_j v_j x_j - 2048 sum_even x - 128 sum_odd x - z sum x)` = `s * sum (q - z) x` (z = 8 without
      zero points), one FFMA chain started from the offsets.
  NVFP4 (VPW 8): e2m1 codes j and j + 4 become the two halves of an fp16x2 (`value / 2^14`, subnormal 0.5
      exact); the e4m3 scale per 16 values multiplies the sum of its two words (a tile loads its scales as one
      `[BN, KW / 2]` block); `* 2^14 * global` at the end.
  fp8 e4m3 (VPW 4): bytes j and j + 2 become an fp16x2 (`value / 2^8`, subnormals exact); block scales per
      word, channel scales and `* 2^8` at the end.
Numerics differ from the MMA path only in rounding: dequantized weights are not rounded to the compute dtype
(the scale multiplies a word's fp32 sum, int4's and NVFP4's the sum of a pair of words), and the K sum is one
fp32 sum per row in a different order.

With PDL (sm_90+, `pdl.gemv_pdl_enabled`) down is a programmatic dependent of gate_up: it finds its pair and
location while gate_up finishes, then waits before it reads act (DeepSeek-like int4 M=1 on the H200: 76.3 -> 74.7
µs per layer; kernels/pdl.py has the rule and the numbers).

Host rows work as in the other paths (the program picks the pool or host-view base by the pair's location
code); host pairs are scheduled first (they are the stragglers), pool pairs sorted by expert so that pairs
sharing an expert run side by side (L2 serves the repeat). Graph-safe: buffers sized from T, K, H, I; the
arrival counters are a per-device workspace zeroed once and reset by the kernels themselves (one stream at a
time). As for every kernel here, make the first call of a shape before graph capture: it compiles (no
autotuning: tiles come from `gemv_configs`) and allocates the workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .combine import combine
from .gemm_args import (
    _TL_DTYPES,
    _check_act_inputs,
    _check_dense_dtype,
    _check_proj_shape,
    interpreting,
)
from .gemv_args import _check_gemv, _half_x, _host_tall, _host_wide, _word_args
from .gemv_args import gemv_supported as gemv_supported  # re-exported: fused_moe
from .gemv_config import _VALUES_PER_WORD, GemvConfig, _pairs_pow2, gemv_configs, reg_limit
from .gemv_config import _int4_block_k as _int4_block_k  # re-exported: the tests call it
from .gemv_config import _k_split as _k_split  # re-exported: bench.gemv_sweep
from .gemv_schedule import _slot_pair as _slot_pair  # re-exported: the tests call it
from .gemv_schedule import _slot_pair_by_id
from .gemv_tiles import _down_tile, _gate_up_tile
from .operands import KernelFormat, Projection
from .workspace import _COUNTERS as _COUNTERS  # re-exported: tests and the bench read the workspace here
from .workspace import MAX_SYNC_PAIRS, SYNC_WORDS, _counters, counters_ready, x_pairs_args
from .workspace import spin_timeouts as spin_timeouts

GEMV_MAX_PAIRS = MAX_SYNC_PAIRS  # T*K up to this (128: the per-pair words of the sync workspace)
SPIN_LIMIT = 1 << 22  # polls before a waiting down tile of `_fused_kernel` gives up (~1 s, not a hang)


@triton.jit
def _gate_up_kernel(
    x_ptr, act_ptr, part_ptr, cnt_ptr, ids_ptr, l2p_ptr, xp_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_experts, num_rows, I, H, stride_x, stride_act, stride_xp, c0, c1, tiles_per_split,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, PDL: tl.constexpr, OVERLAP: tl.constexpr, HALF_X: tl.constexpr, X_PACK: tl.constexpr,
    HOST_WIDE: tl.constexpr,
):  # fmt: skip
    if not OVERLAP:
        # the kernel before it; then down (reads l2p before its wait) may launch: kernels/pdl.py
        pdl.wait(PDL)
    pdl.trigger(PDL)  # OVERLAP: down settles host codes after its wait, as this kernel does before its loads
    # program (slot, N block, split): a pair's splits run side by side
    num_nb = tl.cdiv(I, BLOCK_N)
    item = tl.program_id(0) // SPLIT
    if OVERLAP:  # beside the plan + copy (plan_copy.py): wait for it only on a host code, and before the end
        pair, code = _slot_pair_by_id(
            ids_ptr, l2p_ptr, item // num_nb, num_pairs, num_experts, num_rows, P_POW2, PDL
        )
    else:
        pair, code = _slot_pair(ids_ptr, l2p_ptr, item // num_nb, num_pairs, num_experts, num_rows, P_POW2)
    _gate_up_tile(
        pair, code, item % num_nb, tl.program_id(0) % SPLIT, tiles_per_split, x_ptr, act_ptr, part_ptr,
        cnt_ptr, ids_ptr, l2p_ptr, xp_ptr, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se, w_sn, s_sn,
        z_sn, num_pairs, num_experts, num_rows, I, H, stride_x, stride_act, stride_xp, c0, c1,
        TOP_K, P_POW2, BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH, EVEN_K, SPLIT,
        HALF_X, X_PACK, HOST_WIDE,
    )  # fmt: skip
    if OVERLAP:
        # so that this kernel's completion implies the plan's (down and the next layer rely on it)
        pdl.wait(PDL)


@triton.jit
def _down_kernel(
    act_ptr, y_ptr, part_ptr, out_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr, xp_ptr,
    wp, sp, zp, gp, wb, sb, zb, gb,
    w_se, s_se, z_se, g_se, w_sn, s_sn, z_sn,
    num_pairs, num_experts, num_rows, H, I, stride_act, stride_y, stride_out, stride_xp, c0, c1, tiles_per_split,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, NATIVE_FP8: tl.constexpr,
    COMPUTE: tl.constexpr, VPW: tl.constexpr, PREFETCH: tl.constexpr, FUSE_COMBINE: tl.constexpr,
    EVEN_K: tl.constexpr, PDL: tl.constexpr, OVERLAP: tl.constexpr, SPLIT: tl.constexpr, HALF_X: tl.constexpr,
    X_PACK: tl.constexpr, PEEL: tl.constexpr, HOST_WIDE: tl.constexpr, HOST_TALL: tl.constexpr,
):  # fmt: skip
    num_nb = tl.cdiv(H, BLOCK_N)
    item = tl.program_id(0) // SPLIT
    slot = item // num_nb
    if OVERLAP:  # gate_up ran beside the plan + copy (see gate_up): the same rule for codes
        pair, code = _slot_pair_by_id(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2, PDL)
    else:
        pair, code = _slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2)
    # nothing above reads what gate_up writes (act) or the arrival counters; every program waits, those of
    # unrouted pairs too, so that this kernel's completion still implies gate_up's. PEEL: after the first tile's
    # loads, in `_down_tile`. Those read the weight rows at the code found above, as the code itself is read:
    # without OVERLAP the plan + copy was complete before gate_up passed its wait (which precedes its trigger);
    # with OVERLAP the code was read with acquire semantics after the copy published it, a host code settled
    # (`_slot_pair_by_id`), the rule gate_up's loads rely on
    if not PEEL:
        pdl.wait(PDL)
    _down_tile(
        pair, code, item % num_nb, tl.program_id(0) % SPLIT, tiles_per_split, act_ptr, y_ptr, part_ptr, out_ptr,
        cnt_ptr, ids_ptr, l2p_ptr, tw_ptr, xp_ptr, wp, sp, zp, gp, wb, sb, zb, gb, w_se, s_se, z_se, g_se, w_sn,
        s_sn, z_sn, num_experts, num_rows, H, I, stride_act, stride_y, stride_out, stride_xp, c0, c1,
        TOP_K, BLOCK_N, BLOCK_K, FMT, GROUP, HAS_ZERO, NATIVE_FP8, COMPUTE, VPW, PREFETCH, FUSE_COMBINE,
        EVEN_K, False, SPLIT, HALF_X, X_PACK, PEEL, PDL, HOST_WIDE, HOST_TALL,
    )  # fmt: skip


# ---- launchers -----------------------------------------------------------------------------------------------
def gemv_gate_up(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    fmt: KernelFormat,
    config: GemvConfig,
    after_plan: bool = False,
) -> torch.Tensor:
    """`act [T*K, I]` (compute dtype): row `t*K + k` for each pair routed here; other rows are left unset.

    hidden: `[T, H]` bf16/fp16 row-major. topk_ids: `[T, K]` contiguous. w13: the `[2I, H]` projection.
    after_plan: the step's plan + copy may still be running (`DevicePlanner.overlap`): OVERLAP (`_overlap`).
    """
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w13.weight.shape[1] // 2
    _check_act_inputs(hidden, hidden.dtype, "hidden", H)
    _check_dense_dtype(fmt, w13, hidden.dtype)
    _check_proj_shape(fmt, w13, 2 * I, H, "GEMV w13")
    _check_gemv(fmt, H, config.block_k1)
    if not topk_ids.is_contiguous() or hidden.shape[0] != T:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} (contiguous) and hidden {tuple(hidden.shape)}: one T"
        )
    num_pairs = T * K
    act = torch.empty((max(num_pairs, 1), I), dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return act
    ptrs, strides, native, c0, c1 = _word_args(w13, fmt)
    num_nb = triton.cdiv(I, config.block_n1)
    split, tiles_per_split = _k_split(H, config.block_k1, config.split_k1)
    if split > 1 and not counters_ready(act.device, num_pairs * num_nb):
        # the workspace's growth launches kernels: this one is no longer the plan's dependent
        after_plan = False
    if split > 1:
        part = torch.empty(
            num_pairs * num_nb * split * 2 * config.block_n1, dtype=torch.float32, device=act.device
        )
        cnt = _counters(act.device, num_pairs * num_nb)[SYNC_WORDS:]
    else:
        part, cnt = act, act  # not read
    use_pdl = pdl.gemv_pdl_enabled(hidden)
    xp, stride_xp = x_pairs_args(config.half_x_pack, T, H, l2p)
    _gate_up_kernel[(num_pairs * num_nb * split,)](
        hidden, act, part, cnt, topk_ids, l2p, xp, *ptrs, *strides,
        num_pairs, num_experts, w13.num_rows, I, H, hidden.stride(0), act.stride(0), stride_xp, c0, c1,
        tiles_per_split,
        TOP_K=K, P_POW2=_pairs_pow2(num_pairs, config.schedule_width), BLOCK_N=config.block_n1, BLOCK_K=config.block_k1,
        FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero, NATIVE_FP8=native,
        COMPUTE=_TL_DTYPES[hidden.dtype], VPW=_VALUES_PER_WORD[fmt.fmt], PREFETCH=config.prefetch_code(),
        EVEN_K=H % config.block_k1 == 0, SPLIT=split, PDL=use_pdl, OVERLAP=_overlap(after_plan, use_pdl),
        HALF_X=_half_x(config, fmt, H), X_PACK=config.half_x_pack,
        HOST_WIDE=_host_wide(config.host_wide, H, config.block_k1, config.block_n1, split),
        num_warps=config.num_warps, num_stages=1,
        **({"launch_pdl": True} if use_pdl else {}), **reg_limit(config),
    )  # fmt: skip
    return act


def gemv_down_combine(
    act: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w2: Projection,
    fmt: KernelFormat,
    config: GemvConfig,
    after_plan: bool = False,
) -> torch.Tensor:
    """`out [T, H]`: `sum_k w[t, k] * round(act[t*K + k] @ w2_e.T)` over the pairs routed here, in k order.

    act: `[>= T*K, I]` from `gemv_gate_up`. Every element of `out` is written (0 for a token with no pair here).
    after_plan: as `gemv_gate_up`'s (give both the same).
    """
    T, K = topk_ids.shape
    H = w2.weight.shape[1]
    I = act.shape[1]
    _check_act_inputs(act, act.dtype, "act", I)
    _check_dense_dtype(fmt, w2, act.dtype)
    _check_proj_shape(fmt, w2, H, I, "GEMV w2")
    _check_gemv(fmt, I, config.block_k2)
    tw = topk_weights.contiguous()
    if tw.shape != (T, K) or not topk_ids.is_contiguous() or act.shape[0] < T * K:
        raise ValueError(
            f"topk_weights {tuple(tw.shape)}, topk_ids {tuple(topk_ids.shape)}, act {tuple(act.shape)}"
        )
    num_pairs = T * K
    split, tiles_per_split = _k_split(I, config.block_k2, config.split_k2)
    if num_pairs == 0:  # top-k 0: every token's output is the empty sum
        return torch.zeros((T, H), dtype=act.dtype, device=act.device)
    if split == 1:
        y = torch.empty((num_pairs, H), dtype=act.dtype, device=act.device)
        part = y  # not read
    else:  # the fused combine sums the parts (`GemvConfig`): no y
        part = torch.empty((num_pairs, split, H), dtype=torch.float32, device=act.device)
        y = part  # not read
    out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    num_nb = triton.cdiv(H, config.block_n2)
    cnt = _counters(act.device, T * num_nb)[SYNC_WORDS:]
    ptrs, strides, native, c0, c1 = _word_args(w2, fmt)
    use_pdl = pdl.gemv_pdl_enabled(act)
    xp, stride_xp = x_pairs_args(config.half_x_pack, num_pairs, I, l2p)
    wide = _host_wide(config.host_wide, I, config.block_k2, config.block_n2, split)
    _down_kernel[(num_pairs * num_nb * split,)](
        act, y, part, out, cnt, topk_ids, l2p, tw, xp,
        *ptrs, *strides, num_pairs, num_experts, w2.num_rows, H, I, act.stride(0), H, out.stride(0), stride_xp,
        c0, c1, tiles_per_split,
        TOP_K=K, P_POW2=_pairs_pow2(num_pairs, config.schedule_width), BLOCK_N=config.block_n2, BLOCK_K=config.block_k2,
        FMT=fmt.fmt, GROUP=fmt.group, HAS_ZERO=fmt.has_zero, NATIVE_FP8=native,
        COMPUTE=_TL_DTYPES[act.dtype], VPW=_VALUES_PER_WORD[fmt.fmt], PREFETCH=config.prefetch_code(down=True),
        FUSE_COMBINE=config.fuse_combine, EVEN_K=I % config.block_k2 == 0, PDL=use_pdl,
        OVERLAP=_overlap(after_plan, use_pdl), SPLIT=split, HALF_X=_half_x(config, fmt, I),
        X_PACK=config.half_x_pack, PEEL=config.down_peel and split == 1,
        HOST_WIDE=wide,
        HOST_TALL=_host_tall(config.host_tall, split, wide),
        num_warps=config.num_warps, num_stages=1,
        **({"launch_pdl": True} if use_pdl else {}),
        **reg_limit(config, down=True),
    )  # fmt: skip
    if not config.fuse_combine:
        return combine(y, topk_ids, tw, l2p, num_experts)
    return out


def gemv_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    config: GemvConfig | None = None,
    after_plan: bool = False,
) -> torch.Tensor:
    """`pooled_fused_moe` on the GEMV path (same contract; rounding as described in the module docstring).
    `after_plan`: see `gemv_gate_up` (the one-launch variant ignores it: a plain launch, after the plan ends)."""
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2] * fmt.values_per_element()
    cfg = config or gemv_configs(H, I, fmt.fmt, T * K, fmt.group)
    ids = topk_ids.contiguous()
    if cfg.one_launch:
        from .gemv_one import gemv_one_launch

        return gemv_one_launch(hidden, ids, topk_weights, l2p, num_experts, w13, w2, fmt, cfg)
    act = gemv_gate_up(hidden, ids, l2p, num_experts, w13, fmt, cfg, after_plan)
    return gemv_down_combine(act, ids, topk_weights, l2p, num_experts, w2, fmt, cfg, after_plan)


def _overlap(after_plan: bool, use_pdl: bool) -> bool:
    """OVERLAP mode (the kernels' comments): asked for, and PDL-launched (or the interpreter, which tests it)."""
    return after_plan and (use_pdl or interpreting())


# the references live in gemv_ref.py (imported last: they use gemv_configs); re-exported for the callers
from .gemv_one import gemv_one_launch  # noqa: E402
from .gemv_ref import _pair_codes as _pair_codes  # noqa: E402
from .gemv_ref import gemv_down_combine_ref, gemv_gate_up_ref, gemv_moe_ref  # noqa: E402

__all__ = [
    "GemvConfig",
    "gemv_configs",
    "gemv_down_combine",
    "gemv_down_combine_ref",
    "gemv_gate_up",
    "gemv_gate_up_ref",
    "gemv_moe",
    "gemv_moe_ref",
    "gemv_one_launch",
    "gemv_supported",
]  # fmt: skip
