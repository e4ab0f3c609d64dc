"""W4A16 int4 experts: 8 values per int32 along K, a scale per `group` values, optional 4-bit zero points.

Operands per projection p in (w13, w2), rows `[N, K]` = w13 `[2I, H]`, w2 `[H, I]`:
  `{p}_q` `[N, K/8]` int32, `{p}_s` `[N, K/group]` in the compute dtype, `{p}_z` `[N, K/group]` uint8 (zero
  point variant only). Symmetric: `w = (q - 8) * s`; zero point: `w = (q - z) * s`.
This is GPTQ/AWQ-style group quantization laid out N-major (so a row shares the dense row's leading dimension);
checkpoint loaders repack AWQ/GPTQ tensors into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pooled_runner.formats.base import OperandSpec
from pooled_runner.formats.quant import INT4_GROUPS, dequantize_int4, quantize_int4

PROJECTIONS = ("w13", "w2")


@dataclass(frozen=True)
class Int4Format:
    dtype: torch.dtype = torch.bfloat16
    group: int = 128
    zero_point: bool = False

    def __post_init__(self) -> None:
        if self.group not in INT4_GROUPS:
            raise ValueError(f"int4 format: group {self.group} is not one of {INT4_GROUPS}")
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"int4 format: compute dtype {self.dtype} is not bf16 or fp16")

    @property
    def name(self) -> str:
        return f"int4-g{self.group}" + ("-zp" if self.zero_point else "")

    def _shapes(self, hidden_size: int, intermediate_size: int) -> dict[str, tuple[int, int]]:
        shapes = {"w13": (2 * intermediate_size, hidden_size), "w2": (hidden_size, intermediate_size)}
        for p, (_, k) in shapes.items():
            if k % self.group:
                raise ValueError(f"int4 format: {p} has K={k}, not a multiple of group {self.group}")
        return shapes

    def operands(self, hidden_size: int, intermediate_size: int) -> tuple[OperandSpec, ...]:
        out = []
        for p, (n, k) in self._shapes(hidden_size, intermediate_size).items():
            out.append(OperandSpec(f"{p}_q", (n, k // 8), torch.int32))
            out.append(OperandSpec(f"{p}_s", (n, k // self.group), self.dtype))
            if self.zero_point:
                out.append(OperandSpec(f"{p}_z", (n, k // self.group), torch.uint8))
        return tuple(out)

    def expert_weights(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = (
            dequantize_int4(rows[f"{p}_q"], rows[f"{p}_s"], rows.get(f"{p}_z"), self.dtype)
            for p in PROJECTIONS
        )
        return w13, w2

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        """Operand rows of one expert from its dense `w13 [2I, H]`, `w2 [H, I]`."""
        rows: dict[str, torch.Tensor] = {}
        for p, w in zip(PROJECTIONS, (w13, w2)):
            q, s, z = quantize_int4(w, self.group, self.zero_point, self.dtype)
            rows[f"{p}_q"], rows[f"{p}_s"] = q, s
            if z is not None:
                rows[f"{p}_z"] = z
        return rows
