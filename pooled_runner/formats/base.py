"""What a weight format is: the operands one expert row holds, and how the torch path reads them.

Shape legend (used across the project):
  T  tokens in the step          K  experts per token (top-k)
  H  hidden size                 I  expert intermediate size (per rank)
  E  logical experts of a layer  R  pool rows (physical, shared by all pooled layers)
  L  pooled layers
A row of operand `w13` is one expert's fused gate/up projection `[2I, H]`, a row of `w2` its down projection
`[H, I]`; quantized formats add scale operands with their own row shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class OperandSpec:
    """One weight operand: the shape of one expert's row and its storage dtype."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        numel = 1
        for d in self.row_shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


class WeightFormat(Protocol):
    """A weight format: operand layout and the torch path's dequantization."""

    @property
    def name(self) -> str: ...

    def operands(self, hidden_size: int, intermediate_size: int) -> tuple[OperandSpec, ...]:
        """The operands of one expert row, in a fixed order."""
        ...

    def expert_weights(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (w13 [2I, H], w2 [H, I]) of one expert from its operand rows, in the compute dtype."""
        ...

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        """Operand rows of one expert from dense `w13 [2I, H]`, `w2 [H, I]` (the format converter)."""
        ...
