"""NVFP4 experts on Hopper: e2m1 values, an e4m3 scale per 16 values, an fp32 global scale per expert.

Operands per projection p in (w13, w2), rows `[N, K]`: `{p}` `[N, K/2]` uint8 (two e2m1 codes, even k in the
low nibble), `{p}_s` `[N, K/16]` float8_e4m3fn, `{p}_g` `[1]` fp32. `w = e2m1 * s * g`. SM90 has no FP4 tensor
cores: the kernels dequantize to the compute dtype and use bf16/fp16 MMA.
"""

from __future__ import annotations

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
