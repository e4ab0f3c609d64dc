"""Unquantized experts: bf16 (fp16 and fp32 accepted, for tests and CPU serving)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pooled_runner.formats.base import OperandSpec

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Bf16Format:
    """Rows are the dense weights themselves: w13 [2I, H] and w2 [H, I] in `dtype`."""

    dtype: torch.dtype = torch.bfloat16
    name: str = "bf16"

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"bf16 format: dtype {self.dtype} is not one of {FLOAT_DTYPES}")

    def operands(self, hidden_size: int, intermediate_size: int) -> tuple[OperandSpec, ...]:
        return (
            OperandSpec("w13", (2 * intermediate_size, hidden_size), self.dtype),
            OperandSpec("w2", (hidden_size, intermediate_size), self.dtype),
        )

    def expert_weights(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return rows["w13"], rows["w2"]

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        """Operand rows of one expert from dense weights (a cast to the format's dtype)."""
        return {"w13": w13.to(self.dtype).contiguous(), "w2": w2.to(self.dtype).contiguous()}
