"""One-launch decode path for dense weights (bf16/fp16): each program computes a slice of one routed pair's
activation and at once that slice's share of the down projection, added into an fp64 sum per token.

  program (slot, j): the pair of schedule slot `slot` (host pairs first, `gemv_schedule._slot_pair`) and the
      slice `n = j*BLOCK_N .. +BLOCK_N` of I:
      `act[n] = round(silu(round(x[t] @ gate[n].T)) * round(x[t] @ up[n].T))`   (as gemm1 stores it)
      `acc[t, :] += w[t, k] * (act[n] @ w2[:, n].T)`                  (fp64 atomic adds of fp32 values)
  the last program to arrive (a self-resetting counter in `workspace`) rounds `acc` into `out [T, H]` and
  zeroes `acc` for the next launch.

Why: at decode widths the two-launch paths (gemm1 then gemm2) pay a kernel boundary -- gemm1's tail, gemm2's
launch and ramp -- where DRAM sits partly idle; here no program waits for another (the down slice needs only
the program's own activation slice), so one launch streams both projections. The cost: every program adds H
values per pair (L2 atomics), and the per-pair down output is not rounded to the compute dtype before the
weighted sum (the other paths round it, as the torch path does): results differ from theirs by rounding.

Why fp64 sums: the programs add in whatever order they finish. fp32 sums would round differently per order, and
a few outputs per launch would change by an ulp from run to run. Each addend is an fp32 value (24-bit
significand); in fp64 (53 bits) the sum of N addends is exact while the largest and the smallest nonzero one
are less than 2^(28 - log2 N) apart (2^21 for the ~100 addends of an output at Qwen3-like M=1), so the order
cannot matter (a sufficient condition, and data-dependent: a simulation of that case with random weights found
it unmet for about 1e-4 of the outputs, none of which changed with the order). Past it, the order moves the sum
by about 2^-53 of the largest partial sum, which shows only where the sum lies that close to a rounding boundary
of the output dtype. So a launch gives the same output as any other with the same
inputs (eager, graph replay, any schedule), but for such near-ties.

PDL (`kernels/pdl.py`): launched as a programmatic dependent of the kernel before it and waits first thing; in
OVERLAP (beside the plan + copy, `after_plan`) it takes its pair by id, reads the code with acquire, waits on a
host code (`gemv_schedule._slot_pair_by_id`) and waits before it ends. It triggers nothing.

Graph-safe: fixed buffers; the fp64 sums and the counter live in a per-device workspace, zero between launches
(one stream at a time), allocated by the first call of a size (make it before capture, as the compile).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from .dequant import FMT_DENSE
from .gemm_args import (
    _TL_DTYPES,
    _check_act_inputs,
    _check_dense_dtype,
    _check_proj_shape,
    _launch_args,
    interpreting,
    launch_fitting,
)
from .gemm_parts import _mma, _row_bases
from .gemv_schedule import _slot_pair, _slot_pair_by_id
from .operands import KernelFormat, Projection
from .workspace import MAX_SYNC_PAIRS, SYNC_WORDS, _counters, _float_sums, counters_ready, sums_ready

SPLITK_MAX_PAIRS = 64  # T*K up to this (the schedule sorts P_POW2 keys in every program)
SPLITK_TAIL_MAX = 4096  # sums rounded per load by the last program


@dataclass(frozen=True)
class SplitConfig:
    """Tiles of the one-launch path: `block_n` values of I per program (the down slice's K, so >= 16 for the
    MMA), `block_k` the gate/up K tile (of H), `block_h` the down tile (of H). Default: the best of the H200
    sweep at Qwen3-like bf16 M=1 (docs/BENCHMARKS.md, eighteenth session); other cards' measured tiles are in
    `DEVICE_TILES`."""

    block_n: int = 64
    block_k: int = 128
    block_h: int = 256
    num_warps: int = 8
    num_stages: int = 4
    # fp32 sums instead of fp64: from 0.5% slower to 1.8% faster on the H100 (2026-12-02, two runs of
    # bench/splitk_sweep.py --forms fp32), about 0.9 µs faster at Qwen3-like M=1 on the H200 (across runs); but
    # the rounding then depends on the programs' order, so outputs change by an ulp from run to run: for the
    # bench's comparison only
    fp32_sums: bool = False


# shared memory of the default tile (Triton 3.6-3.8, sm_80-sm_120): more than sm_86 / sm_89 / sm_120 give a block
DEFAULT_TILE_SMEM = 110_592

# Tiles measured best on a card other than the H200 the default was swept on, by `torch.cuda.get_device_name`
# (as SGLang keys its tuned configs). H100 SXM (2026-12-06, `bench.splitk_sweep`, Qwen3-like bf16, 5 interleaved
# rounds, HBM read 2970 GB/s): down tiles of 128 with 4 warps against the default's 256 with 8, M = 1 / 2 / 4 / 8:
# 33.09 / 59.90 / 106.75 / 191.20 µs vs 33.51 / 62.25 / 109.28 / 192.26; again on another H100 (HBM read 3000 GB/s),
# M = 1 / 2 / 4: 32.12 / 59.32 / 105.74 vs 32.55 / 61.76 / 107.08.
DEVICE_TILES: dict[str, SplitConfig] = {
    "NVIDIA H100 80GB HBM3": SplitConfig(block_h=128, num_warps=4),
}


def splitk_configs(
    hidden_size: int, intermediate_size: int, device: torch.device | None = None
) -> SplitConfig:
    """Default tiles (the interpreter gets small ones: its cost grows with tile size). On a CUDA `device`: the
    card's measured tiles where `DEVICE_TILES` has its name; else, where its blocks get less shared memory than
    the default tile needs (sm_86, sm_89, sm_120: 99 KiB), one stage less (72 KiB; not measured there)."""
    if interpreting():
        return SplitConfig(16, 32, 32, num_stages=1)
    if device is not None and device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tiles = DEVICE_TILES.get(_device_name(index))
        if tiles is not None:
            return tiles
        props = torch.cuda.get_device_properties(device)
        if getattr(props, "shared_memory_per_block_optin", DEFAULT_TILE_SMEM) < DEFAULT_TILE_SMEM:
            return SplitConfig(num_stages=3)
    return SplitConfig()


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@triton.jit
def _splitk_kernel(
    x_ptr, out_ptr, sum_ptr, cnt_ptr, ids_ptr, l2p_ptr, tw_ptr,
    w1p, w1b, w1_se, w1_sn, w2p, w2b, w2_se, w2_sn,
    num_tokens, num_pairs, num_experts, num_rows, I, H, stride_x, stride_out, num_programs,
    TOP_K: tl.constexpr, P_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, COMPUTE: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr, OVERLAP: tl.constexpr, TAIL_BLOCK: tl.constexpr, FP32_SUMS: tl.constexpr = False,
):  # fmt: skip
    if not OVERLAP:
        pdl.wait(PDL)  # the kernel before it (nothing triggers early but the plan + copy in OVERLAP)
    num_nb = tl.cdiv(I, BLOCK_N)
    slot = tl.program_id(0) // num_nb
    pid_n = tl.program_id(0) % num_nb
    if OVERLAP:
        pair, code = _slot_pair_by_id(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2, PDL)
    else:
        pair, code = _slot_pair(ids_ptr, l2p_ptr, slot, num_pairs, num_experts, num_rows, P_POW2)
    rows = tl.arange(0, 16)  # the MMA's M: row 0 is the pair's token, rows 1-15 are zeros
    if code >= 0:
        w1, _s, _z, _g = _row_bases(code, num_rows, w1p, w1p, w1p, w1p, w1b, w1b, w1b, w1b, w1_se, 0, 0, 0)
        w2, _s, _z, _g = _row_bases(code, num_rows, w2p, w2p, w2p, w2p, w2b, w2b, w2b, w2b, w2_se, 0, 0, 0)
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        acc_g = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            a = tl.load(x_ptr + token * stride_x + rows[:, None] * 0 + offs_k[None, :],
                        mask=(rows == 0)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            m = n_ok[None, :] & k_ok[:, None]
            bg = tl.load(w1 + offs_n[None, :] * w1_sn + offs_k[:, None], mask=m, other=0.0).to(COMPUTE)
            bu = tl.load(w1 + (offs_n + I)[None, :] * w1_sn + offs_k[:, None], mask=m, other=0.0).to(COMPUTE)
            acc_g = _mma(a, bg, acc_g, DOT_F32)
            acc_u = _mma(a, bu, acc_u, DOT_F32)
        gate = acc_g.to(COMPUTE).to(tl.float32)
        up = acc_u.to(COMPUTE).to(tl.float32)
        act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)  # [16, BLOCK_N], rows 1-15 zero
        wk = tl.load(tw_ptr + pair).to(tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            # B [BLOCK_N, BLOCK_H]: w2 rows h, columns n (the program's slice of I)
            b = tl.load(w2 + offs_h[None, :] * w2_sn + offs_n[:, None], mask=h_ok[None, :] & n_ok[:, None],
                        other=0.0).to(COMPUTE)  # fmt: skip
            part = _mma(act, b, tl.zeros((16, BLOCK_H), dtype=tl.float32), DOT_F32)
            y = tl.sum(tl.where((rows == 0)[:, None], part, 0.0), axis=0) * wk  # [BLOCK_H] fp32
            if FP32_SUMS:  # order-dependent rounding: the bench's comparison only (SplitConfig.fp32_sums)
                tl.atomic_add(sum_ptr + token * H + offs_h, y, mask=h_ok, sem="relaxed", scope="gpu")
            else:
                tl.atomic_add(
                    sum_ptr + token * H + offs_h, y.to(tl.float64), mask=h_ok, sem="relaxed", scope="gpu"
                )
    # every program arrives (those of unrouted pairs too): the last one finishes the launch
    tl.debug_barrier()  # every thread's adds happen before the (release) arrival
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # extends the arrival's acquire to the threads that read the sums below
    if arrived == num_programs - 1:
        tl.store(cnt_ptr, 0)  # ready for the next launch
        # the T*H sums TAIL_BLOCK per load: one load where T*H <= SPLITK_TAIL_MAX (Qwen3-like T <= 2, the only
        # case the default takes), where the first form's loop of BLOCK_H per load cost 1 µs (H200: Qwen3-like
        # M=1 27.18 -> 26.15 µs)
        offs = tl.arange(0, TAIL_BLOCK)
        for s0 in range(0, num_tokens * H, TAIL_BLOCK):
            idx = s0 + offs
            ok = idx < num_tokens * H
            # a barrier per block, and volatile loads: without both (Triton 3.6, H200, 2026-12-03) the outputs
            # of the second and later blocks came out wrong, the same launch twice differing (a form with both
            # was right in 40 of 40 launches per case, T 1-4, H 2048 and 7168; the old loop's BLOCK_H blocks,
            # one value per thread, were right too); which of the two matters was not isolated
            tl.debug_barrier()
            total = tl.load(sum_ptr + idx, mask=ok, other=0.0, volatile=True)
            dst = out_ptr + (idx // H).to(tl.int64) * stride_out + idx % H
            tl.store(dst, total.to(tl.float32).to(COMPUTE), mask=ok)
            tl.store(sum_ptr + idx, tl.zeros((TAIL_BLOCK,), dtype=sum_ptr.dtype.element_ty), mask=ok)
    if OVERLAP:
        pdl.wait(PDL)  # this kernel's completion implies the plan's


def splitk_supported(fmt: KernelFormat) -> bool:
    """Whether the one-launch path takes this format (dense bf16/fp16 weights only)."""
    return fmt.fmt == FMT_DENSE


def splitk_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    config: SplitConfig | None = None,
    after_plan: bool = False,
) -> torch.Tensor:
    """`pooled_fused_moe` in one launch for dense weights and T*K <= SPLITK_MAX_PAIRS: `out [T, H]`, every
    element written (0 for a token with no pair routed here); rounding as in the module docstring.

    hidden: `[T, H]` bf16/fp16 row-major; topk_ids / topk_weights `[T, K]`; l2p `[E_max]` int32 codes.
    after_plan: the step's plan + copy may still be running beside this launch (OVERLAP, see the module).
    """
    T, K = topk_ids.shape
    H = hidden.shape[1]
    I = w2.weight.shape[2]
    if not splitk_supported(fmt):
        raise ValueError(
            f"one-launch split path (kernels/splitk.py): dense weights only, got format {fmt.fmt}"
        )
    _check_act_inputs(hidden, hidden.dtype, "hidden", H)
    _check_dense_dtype(fmt, w13, hidden.dtype)
    _check_dense_dtype(fmt, w2, hidden.dtype)
    _check_proj_shape(fmt, w13, 2 * I, H, "split path w13")
    _check_proj_shape(fmt, w2, H, I, "split path w2")
    num_pairs = T * K
    if num_pairs > min(SPLITK_MAX_PAIRS, MAX_SYNC_PAIRS):
        raise ValueError(
            f"one-launch split path: {num_pairs} routed pairs > SPLITK_MAX_PAIRS={SPLITK_MAX_PAIRS}"
        )
    # a copy launched here would come between the plan and this kernel, which then is not the plan's dependent
    after_plan = after_plan and topk_ids.is_contiguous() and topk_weights.is_contiguous()
    ids = topk_ids.contiguous()
    tw = topk_weights.contiguous()
    if tw.shape != (T, K) or hidden.shape[0] != T:
        raise ValueError(
            f"topk_weights {tuple(tw.shape)}, hidden {tuple(hidden.shape)}: expected [{T}, {K}], [{T}, H]"
        )
    cfg = config or splitk_configs(H, I, hidden.device)
    tiles = (cfg.block_n, cfg.block_k, cfg.block_h)
    if any(b < 16 or b & (b - 1) for b in tiles):
        raise ValueError(f"one-launch split path: tiles {cfg}: block_n, block_k, block_h powers of two >= 16")
    if num_pairs == 0:  # no program would run: nothing routed, every row zero
        return torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((T, H), dtype=hidden.dtype, device=hidden.device)
    sum_dtype = torch.float32 if cfg.fp32_sums else torch.float64
    if not (counters_ready(hidden.device, 1) and sums_ready(hidden.device, T * H, sum_dtype)):
        # the workspace's growth launches kernels: this one is no longer the plan's dependent
        after_plan = False
    cnt = _counters(hidden.device, 1)[SYNC_WORDS:]
    sums = _float_sums(hidden.device, T * H, sum_dtype)
    ptrs, strides, _native = _launch_args(w13, fmt)
    ptrs2, strides2, _native = _launch_args(w2, fmt)
    grid = num_pairs * triton.cdiv(I, cfg.block_n)
    tail = min(SPLITK_TAIL_MAX, triton.next_power_of_2(T * H))
    use_pdl = pdl.pdl_enabled(hidden, fmt.fmt)
    launch_fitting(_splitk_kernel, (grid,),
        hidden, out, sums, cnt, ids, l2p, tw,
        ptrs[0], ptrs[4], strides[0], strides[4], ptrs2[0], ptrs2[4], strides2[0], strides2[4],
        T, num_pairs, num_experts, w13.num_rows, I, H, hidden.stride(0), out.stride(0), grid,
        TOP_K=K, P_POW2=max(16, triton.next_power_of_2(num_pairs)), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_H=cfg.block_h, COMPUTE=_TL_DTYPES[hidden.dtype], DOT_F32=interpreting(),
        PDL=use_pdl, OVERLAP=after_plan and (use_pdl or interpreting()), FP32_SUMS=cfg.fp32_sums,
        TAIL_BLOCK=tail,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if use_pdl else {}),
    )  # fmt: skip
    return out


def splitk_moe_ref(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    l2p: torch.Tensor,
    num_experts: int,
    w13: Projection,
    w2: Projection,
    fmt: KernelFormat,
    config: SplitConfig | None = None,
    after_plan: bool = False,
) -> torch.Tensor:
    """Reference of `splitk_moe` in plain torch: the activation rounded as gemm1 rounds it, each pair's down
    output weighted in fp32 (not rounded), summed in fp64, then rounded once (through fp32)."""
    from .fused_moe import dense_row

    T, K = topk_ids.shape
    H = hidden.shape[1]
    ids = topk_ids.long().cpu()
    codes = l2p.cpu()
    tw = topk_weights.float().cpu()
    x = hidden.cpu()
    dtype = hidden.dtype
    total = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0 or e >= num_experts or int(codes[e]) < 0:
                continue
            w_up = dense_row(w13, fmt, int(codes[e]), dtype).float()
            w_down = dense_row(w2, fmt, int(codes[e]), dtype).float()
            I = w_down.shape[1]
            gate_up = (w_up @ x[t].float()).to(dtype).float()
            gate, up = gate_up[:I], gate_up[I:]
            act = (gate * torch.sigmoid(gate) * up).to(dtype).float()
            total[t] += (tw[t, k] * (w_down @ act)).double()
    return total.float().to(dtype).to(hidden.device)
