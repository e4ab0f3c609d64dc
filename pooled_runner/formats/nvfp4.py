"""NVFP4 experts on Hopper: e2m1 values, an e4m3 scale per 16 values, an fp32 global scale per expert.

Operands per projection p in (w13, w2), rows `[N, K]`: `{p}` `[N, K/2]` uint8 (two e2m1 codes, even k in the
low nibble), `{p}_s` `[N, K/16]` float8_e4m3fn, `{p}_g` `[1]` fp32. `w = e2m1 * s * g`. SM90 has no FP4 tensor
cores: the kernels dequantize to the compute dtype and use bf16/fp16 MMA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pooled_runner.formats.base import OperandSpec
from pooled_runner.formats.quant import dequantize_nvfp4, quantize_nvfp4

PROJECTIONS = ("w13", "w2")


@dataclass(frozen=True)
class Nvfp4Format:
    dtype: torch.dtype = torch.bfloat16
    name: str = "nvfp4"

    def __post_init__(self) -> None:
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"nvfp4 format: compute dtype {self.dtype} is not bf16 or fp16")

    def operands(self, hidden_size: int, intermediate_size: int) -> tuple[OperandSpec, ...]:
        out = []
        for p, (n, k) in (
            ("w13", (2 * intermediate_size, hidden_size)),
            ("w2", (hidden_size, intermediate_size)),
        ):
            if k % 16:
                raise ValueError(f"nvfp4 format: {p} has K={k}, not a multiple of 16")
            out.append(OperandSpec(p, (n, k // 2), torch.uint8))
            out.append(OperandSpec(f"{p}_s", (n, k // 16), torch.float8_e4m3fn))
            out.append(OperandSpec(f"{p}_g", (1,), torch.float32))
        return tuple(out)

    def expert_weights(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = (dequantize_nvfp4(rows[p], rows[f"{p}_s"], rows[f"{p}_g"], self.dtype) for p in PROJECTIONS)
        return w13, w2

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        rows: dict[str, torch.Tensor] = {}
        for p, w in zip(PROJECTIONS, (w13, w2)):
            rows[p], rows[f"{p}_s"], rows[f"{p}_g"] = quantize_nvfp4(w)
        return rows


def share_gate_up_global(w13_s: torch.Tensor, gate_global: float, up_global: float) -> tuple[float, float]:
    """One global scale for an expert's gate and up halves, which a checkpoint may quantize with two
    (ModelOpt's `weight_scale_2` per projection; the format has one `w13_g` per expert).

    `w13_s`: the expert's block scales `[2I, K/16]` e4m3, gate rows `[0, I)`, up rows `[I, 2I)`, rewritten in
    place. Returns `(g, change)`: `g = max(gate_global, up_global)`, and the half with the smaller global gets
    its block scales multiplied by `its global / g` (<= 1: no overflow) and rounded to e4m3, as TensorRT-LLM's
    fused MoE folds divergent gate/up scales. Equal globals, or a power-of-two ratio whose products stay normal
    e4m3, change nothing but `g`; `change` is the largest relative change of a nonzero block's effective scale
    (`s * global`), 1.0 where a block scale rounded to zero.
    """
    if w13_s.dim() != 2 or w13_s.shape[0] % 2 or w13_s.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w13_s: expected [2I, K/16] float8_e4m3fn, got {tuple(w13_s.shape)} {w13_s.dtype}")
    for name, value in (("gate", gate_global), ("up", up_global)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} global scale {value} is not a positive finite number")
    g = max(gate_global, up_global)
    if gate_global == up_global:
        return g, 0.0
    half = w13_s.shape[0] // 2
    rows, own = (w13_s[:half], gate_global) if gate_global < up_global else (w13_s[half:], up_global)
    before = rows.float() * own
    rows.copy_((rows.float() * (own / g)).to(torch.float8_e4m3fn))
    nonzero = before != 0
    if not bool(nonzero.any()):
        return g, 0.0
    change = ((rows.float() * g - before).abs()[nonzero] / before[nonzero].abs()).max()
    return g, float(change)
