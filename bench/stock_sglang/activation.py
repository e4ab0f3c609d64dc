"""A Triton stand-in for stock SGLang 0.5.23's gated SiLU, the CUDA `act_and_mul_kernel` of
`sglang/kernels/jit/csrc/elementwise/activation.cuh` (reached through `sglang.kernels.ops.activation.silu_and_mul`),
which SGLang compiles at run time through tvm-ffi, absent from the GPU image.

Same work and launch shape as stock's: the [T, 2I] gate/up rows (gate first) in, [T, I] = silu(gate) * up out,
flattened; stock's 256-thread blocks of one 16-byte vector per thread are one program of 2048 elements here
(256 threads x 8 bf16); silu and the product in fp32, rounded once; with PDL, the loads wait on the kernel before
(`gdc_wait`) and the next kernel is released after the store (`gdc_launch_dependents`), as stock's
PDLWaitPrimary / PDLTriggerSecondary do. Not stock's binary: `bench/stock_compare.py` also times stock without
this launch, a lower bound on stock's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one program: stock's 256 threads x one 16-byte vector (8 bf16 / fp16) each
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, I, numel, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    row = offs // I
    col = offs - row * I
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(gate_up_ptr + row * (2 * I) + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * (2 * I) + I + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor, *, pdl: bool) -> None:
    """out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]; gate_up [T, 2I], out [T, I], both contiguous, same
    bf16/fp16 dtype; T = 0 launches nothing. `pdl`: launched as a programmatic dependent (sm_90+)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    assert out.shape == (T, I), (gate_up.shape, out.shape)
    assert gate_up.dtype == out.dtype and out.dtype in (torch.bfloat16, torch.float16), (
        gate_up.dtype,
        out.dtype,
    )
    assert gate_up.is_contiguous() and out.is_contiguous()
    assert I % 8 == 0, f"I={I}: stock's kernel works on 16-byte vectors"
    if T == 0:
        return
    gdc = {"USE_GDC": True, "launch_pdl": True} if pdl else {"USE_GDC": False}
    _silu_and_mul_kernel[(triton.cdiv(T * I, BLOCK),)](
        gate_up, out, I, T * I, BLOCK=BLOCK, num_warps=NUM_WARPS, **gdc
    )


def reference_silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor, *, pdl: bool = False) -> None:
    """The same in torch (fp32, one rounding); `pdl` is ignored."""
    I = gate_up.shape[1] // 2
    g = gate_up.float()
    out.copy_((torch.nn.functional.silu(g[:, :I]) * g[:, I:]).to(out.dtype))
