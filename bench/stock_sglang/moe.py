"""Stock SGLang 0.5.23's Triton fused MoE, decode to prefill, on its own kernels (`kernels.py`, copied verbatim).

`stock_fused_experts` replays what SGLang's `fused_experts_impl` launches for resident bf16/fp16 experts without
expert parallelism (every local expert owned: no expert filter): the align, the gate/up GEMM, the gated SiLU, the
down GEMM with the routing weights, the top-k combine (`moe_sum_reduce_triton` up to 32 tokens, the CUDA
`moe_sum_reduce` above, `torch.add` at top-2, none at top-1). The launches' arguments, grids, PDL flags and tile
configs are stock's (`fused_moe_triton_kernels.invoke_fused_moe_kernel`, `moe_align_block_size`,
`fused_moe_triton_config`, `fused_moe.moe_combine_topk`).

Stock's CUDA kernels are not on the GPU image (SGLang's `sgl_kernel` and its tvm-ffi ops); each has a stand-in:
- the gated SiLU (`silu_and_mul`): a Triton kernel with the same grid, bytes and PDL hooks (`activation.py`);
- the top-k sum above 32 tokens (`moe_sum_reduce`): stock's own Triton top-k sum, the one it runs up to 32;
- the align where stock runs its CUDA kernel (M x top_k > 64, or E + 1 <= 64 buckets): `align.align_stand_in`
  in torch, computed by the caller once per routing and passed in (`aligned`), so that launch is not timed.
Where stock's align is its single-launch Triton kernel (M x top_k <= 64 and E + 1 > 64: every decode step of
the Qwen3-like and DeepSeek-like shapes up to M = 8 with top-8), that kernel runs. `skip_stand_ins=True` leaves
the SiLU and the top-k sum stand-ins out (the down GEMM then reads an unwritten buffer): with the align outside,
stock's own launches only (not a lower bound on its time: the launches' PDL chain changes with them). Tuned
configs asking for TMA are refused, not approximated.
On SM90+ (`pdl`) this is stock's sequence; below, stock sums up to 32 tokens with a torch.compile'd sum instead
(same values). `routed_scaling_factor` is 1 (Qwen3's and Mixtral's; DeepSeek-V3's 2.5 changes a constant of the
same launches).

Shapes: x [M, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [M, K] fp32;
topk_ids [M, K] int32. `reference_fused_experts` is the plain torch MoE with the same signature.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from bench.stock_sglang import kernels
from bench.stock_sglang.activation import silu_and_mul
from bench.stock_sglang.align import align_stand_in, max_padded_tokens

# stock's gates for the single-launch align (moe_align_small_numel.SMALL_NUMEL_LIMIT and
# moe_align_block_size._CUDA_SMALL_BATCH_MAX_BUCKETS)
SMALL_NUMEL_LIMIT = 64
CUDA_SMALL_BATCH_MAX_BUCKETS = 64
# fused_moe._use_moe_sum_reduce_torch_compile: up to this many tokens stock sums the top-k with its Triton kernel
# (on SM90+), above with the CUDA moe_sum_reduce
TRITON_SUM_MAX_TOKENS = 32
CONFIG_DIR = Path(__file__).parent / "configs"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def load_configs(
    E: int, N: int, device_name: str, triton_version: str, *, down: bool = False
) -> dict[int, dict[str, Any]] | None:
    """Stock's `get_moe_configs(E, N, dtype=None)` for bf16: the tuned file of this Triton version, else of the
    newest other version that has one; a missing down file falls back to the up configs. None: the default."""
    name = f"E={E},N={N},device_name={device_name.replace(' ', '_')}{'_down' if down else ''}.json"
    versions = sorted(
        (p.name.removeprefix("triton_").replace("_", ".") for p in CONFIG_DIR.glob("triton_*")),
        key=_version_key,
        reverse=True,
    )
    for version in [triton_version] + [v for v in versions if v != triton_version]:
        path = CONFIG_DIR / f"triton_{version.replace('.', '_')}" / name
        if path.exists():
            return {int(k): v for k, v in json.loads(path.read_text()).items()}
    return load_configs(E, N, device_name, triton_version) if down else None


def default_config(M: int, E: int) -> dict[str, int]:
    """Stock's `get_default_config` for bf16/fp16 (not deterministic mode, not marlin)."""
    if M <= E:
        return {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}


def pick_configs(
    M: int, E: int, I: int, device_name: str, triton_version: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(gate/up config, down config or None) as stock's `try_get_optimal_moe_config(return_down_config=True)`
    resolves them for M tokens; a config asking for TMA is refused (that path is not reproduced here)."""
    configs = load_configs(E, I, device_name, triton_version)
    config = dict(configs[min(configs, key=lambda m: abs(m - M))] if configs else default_config(M, E))
    down_configs = load_configs(E, I, device_name, triton_version, down=True)
    down = dict(down_configs[min(down_configs, key=lambda m: abs(m - M))]) if down_configs else None
    if down is not None:
        down["BLOCK_SIZE_M"] = config["BLOCK_SIZE_M"]  # one align serves both GEMMs
    for name, c in (("gate/up", config), ("down", down)):
        if c is not None and c.get("USE_TMA", False):
            raise NotImplementedError(
                f"M={M}: stock's tuned {name} config asks for TMA ({c}); not reproduced here"
            )
        if c is not None:
            c.pop("USE_TMA", None)
    return config, down


def _check(x, w13, w2, topk_weights, topk_ids) -> None:
    M, H = x.shape
    E, two_i, _ = w13.shape
    assert x.dtype in (torch.bfloat16, torch.float16), x.dtype
    assert w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert w13.shape == (E, two_i, H) and w2.shape == (E, H, two_i // 2), (x.shape, w13.shape, w2.shape)
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32, (
        topk_ids.dtype,
        topk_weights.dtype,
    )
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == M, (
        topk_ids.shape,
        topk_weights.shape,
        M,
    )
    assert topk_weights.stride(1) == 1 and topk_ids.is_contiguous()
    assert topk_ids.numel() > 0, "no routed pairs"


def uses_cuda_align(numel: int, num_experts: int) -> bool:
    """Whether stock aligns `numel` routed pairs over `num_experts` with its CUDA kernel (not its single-launch
    Triton one): above 64 pairs, or at most 64 buckets (`moe_align_block_size`)."""
    return numel > SMALL_NUMEL_LIMIT or num_experts + 1 <= CUDA_SMALL_BATCH_MAX_BUCKETS


def _check_aligned(aligned, numel: int, E: int, block: int) -> None:
    size = max_padded_tokens(numel, E, block)
    sorted_ids, expert_ids, num_post = aligned
    assert sorted_ids.shape == (size,) and expert_ids.shape == (triton.cdiv(size, block),), (
        f"aligned buffers {tuple(sorted_ids.shape)}, {tuple(expert_ids.shape)}: expected ({size},), "
        f"({triton.cdiv(size, block)},) for {numel} pairs, {E} experts, M block {block}"
    )
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32 and num_post.numel() >= 1


def _gemm(A, B, C, topk_weights, topk_ids, sorted_ids, expert_ids, num_post, *, mul_routed_weight, top_k,
          router_topk, config, pdl: bool) -> None:  # fmt: skip
    """Stock's `invoke_fused_moe_kernel` for unquantized weights (no bias, no TMA, no LoRA, no fused sum)."""
    grid = (
        triton.cdiv(sorted_ids.shape[0], config["BLOCK_SIZE_M"])
        * triton.cdiv(B.shape[1], config["BLOCK_SIZE_N"]),
    )
    pdl_kwargs = {"USE_GDC": True, "launch_pdl": True, "GDC_EARLY": A.shape[0] <= 512} if pdl else {}
    kernels.fused_moe_kernel[grid](
        A, None, B, None, None, C, None, None, topk_weights, sorted_ids, expert_ids, num_post, None,
        B.shape[1], B.shape[2], sorted_ids.shape[0], topk_ids.numel(),
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), 0, 0, C.stride(-2), C.stride(-1),
        0, 0, 0, 0, 0, 0, 0,
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k,
        compute_type=tl.bfloat16 if A.dtype == torch.bfloat16 else tl.float16,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        even_Ks=B.shape[2] % config["BLOCK_SIZE_K"] == 0, c_sorted=False, swap_ab=False,
        FUSE_ADD_TO_OUTPUT=False, A_OUTPUT_SLICES=1, A_OUTPUT_SLICE_WIDTH=0, A_OUTPUT_SLICE_K=0,
        MASK_OUTPUT=False, FUSE_SUM_ALL_REDUCE=False, ROUTER_TOPK=router_topk, FUSE_SWIGLU=False,
        **pdl_kwargs, **config,
    )  # fmt: skip


def stock_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[dict[str, Any], dict[str, Any] | None],
    *,
    pdl: bool,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    skip_stand_ins: bool = False,
) -> torch.Tensor:
    """[M, H] = sum_k topk_weights[m, k] * w2[e] @ (silu(gate_e x) * up_e x), e = topk_ids[m, k], as stock
    launches it (module docstring). `configs`: `pick_configs(M, ...)`; `pdl`: stock's `is_arch_support_pdl()`
    (compute capability >= 9). `aligned`: where stock runs its CUDA align (`uses_cuda_align`), required:
    `align.align_stand_in(topk_ids, configs[0]["BLOCK_SIZE_M"], E)`; elsewhere refused (stock's Triton align
    runs). `skip_stand_ins`: leave the launches standing in for stock's CUDA kernels out (timing only: the result
    is then not the MoE). Allocates its buffers as stock does (graph capture keeps them)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    config, down = configs
    M, K = topk_ids.shape
    E, N, H = w13.shape
    numel, block = topk_ids.numel(), config["BLOCK_SIZE_M"]
    gdc = {"USE_GDC": True, "launch_pdl": True} if pdl else {}
    if uses_cuda_align(numel, E):
        assert aligned is not None, (
            f"M x top_k = {numel}, E = {E}: stock runs its CUDA align kernel here; pass "
            "aligned=align.align_stand_in(topk_ids, BLOCK_SIZE_M, E)"
        )
        _check_aligned(aligned, numel, E, block)
        sorted_ids, expert_ids, num_post = aligned
    else:
        assert aligned is None, f"M x top_k = {numel}, E = {E}: stock's Triton align runs here, not `aligned`"
        # moe_align_block_size's buffers
        size = max_padded_tokens(numel, E, block)
        sorted_ids = torch.empty(size, dtype=torch.int32, device=x.device)
        expert_ids = torch.empty(triton.cdiv(size, block), dtype=torch.int32, device=x.device)
        num_post = torch.empty(1, dtype=torch.int32, device=x.device)
        kernels._moe_align_small_numel_kernel[(1,)](
            topk_ids, sorted_ids, expert_ids, num_post, E + 1, block, numel,
            NP=triton.next_power_of_2(max(numel, 2)), NB=triton.next_power_of_2(max(expert_ids.numel(), 2)),
            WRITE_INACTIVE_PREFIX_COUNT=False, num_warps=4, **gdc,
        )  # fmt: skip
    gate_up = torch.empty(numel, N, dtype=x.dtype, device=x.device)
    routing = (topk_weights, topk_ids, sorted_ids, expert_ids, num_post)
    _gemm(x, w13, gate_up, *routing, mul_routed_weight=False, top_k=K, router_topk=1, config=config, pdl=pdl)
    act = torch.empty(numel, N // 2, dtype=x.dtype, device=x.device)
    if not skip_stand_ins:
        silu_and_mul(gate_up, act, pdl=pdl)
    out = torch.empty_like(x)
    # top-1: the down GEMM writes the output itself (stock's `_use_intermediate` is False)
    per_pair = out.view(M, 1, H) if K == 1 else torch.empty(M, K, H, dtype=x.dtype, device=x.device)
    _gemm(
        act,
        w2,
        per_pair,
        *routing,
        mul_routed_weight=True,
        top_k=1,
        router_topk=K,
        config=down or config,
        pdl=pdl,
    )
    if K == 2:
        _add_top2(per_pair, out)
    elif K > 2 and (M <= TRITON_SUM_MAX_TOKENS or not skip_stand_ins):
        # stock's moe_sum_reduce_triton; above 32 tokens it stands in for the CUDA moe_sum_reduce
        kernels._moe_sum_reduce_kernel[(M, triton.cdiv(H, 2048))](
            per_pair, *per_pair.stride(), out, *out.stride(), token_num=M, topk_num=K, hidden_dim=H,
            routed_scaling_factor=1.0, BLOCK_M=1, BLOCK_DIM=2048, NUM_STAGE=1, num_warps=16, **gdc,
        )  # fmt: skip
    return out


def stock_call(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[functools.partial[torch.Tensor], tuple[dict[str, Any], dict[str, Any] | None], bool]:
    """Stock's MoE of one routing on this card, ready to time: (the call, its tiles, whether stock would run
    its CUDA align there). The tiles are this card's and Triton's (`pick_configs`; NotImplementedError where
    they ask for TMA); where the CUDA align runs, its stand-in's output is made here, once, so it is not timed
    (routing does not change while timed). `pdl`: stock's `is_arch_support_pdl()` on the sm_90+ cards the
    benches admit."""
    M, E, I = topk_ids.shape[0], w13.shape[0], w2.shape[2]
    configs = pick_configs(M, E, I, torch.cuda.get_device_name(x.device), triton.__version__)
    cuda_align = uses_cuda_align(topk_ids.numel(), E)
    aligned = align_stand_in(topk_ids, configs[0]["BLOCK_SIZE_M"], E) if cuda_align else None
    call = functools.partial(
        stock_fused_experts, x, w13, w2, topk_weights, topk_ids, configs, pdl=True, aligned=aligned
    )
    return call, configs, cuda_align


def _add_top2(per_pair: torch.Tensor, out: torch.Tensor) -> None:
    """Stock's top-2 combine (`moe_combine_topk` at routed scaling 1): one torch add."""
    torch.add(per_pair[:, 0], per_pair[:, 1], out=out)


def reference_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[dict[str, Any], dict[str, Any] | None] | None = None,
    *,
    pdl: bool = False,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    skip_stand_ins: bool = False,
) -> torch.Tensor:
    """The same MoE in plain torch, fp32 accumulation, rounding where stock rounds (gate/up output, the SiLU
    product, each pair's down output); `configs`, `pdl`, `aligned` and `skip_stand_ins` are ignored (the
    signature is the kernel's)."""
    M, K = topk_ids.shape
    I = w13.shape[1] // 2
    out = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    for m in range(M):
        for k in range(K):
            e = int(topk_ids[m, k])
            gu = (w13[e].float() @ x[m].float()).to(x.dtype).float()
            act = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(x.dtype).float()
            pair = (topk_weights[m, k] * (w2[e].float() @ act)).to(x.dtype)
            out[m] += pair.float()
    return out.to(x.dtype)
