"""fp8 e4m3 experts (W8A16): e4m3 weights with fp32 scales per output channel or per `[block, block]` tile.

Operands per projection p in (w13, w2), rows `[N, K]`: `{p}` `[N, K]` float8_e4m3fn and `{p}_s` fp32, `[N]`
(per channel) or `[ceil(N/b), ceil(K/b)]` (block b, DeepSeek-style b = 128). `w = q * s`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pooled_runner.formats.base import OperandSpec
from pooled_runner.formats.quant import dequantize_fp8, quantize_fp8

PROJECTIONS = ("w13", "w2")
FP8_BLOCKS = (16, 32, 64, 128)


def checkpoint_format(block: object) -> str:
    """The pool format an fp8 e4m3 checkpoint's experts already are, given its `weight_block_size` `block`: square
    blocks of a size the pool has are fp8-b{block} (`block_format`), and no blocks (None: one scale per tensor,
    per shard) is "fp8", whose per-channel scales hold each shard's one scale on every row exactly. "" otherwise."""
    return "fp8" if block is None else block_format(block)


def block_format(block: object) -> str:
    """The fp8 format whose rows an fp8 e4m3 checkpoint with `weight_block_size` `block` already is
    ("fp8-b128" for DeepSeek-V3's [128, 128]), or "" when the pool has no such format (not square, another size)."""
    if (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and block[0] == block[1]
        and block[0] in FP8_BLOCKS
    ):
        return f"fp8-b{block[0]}"
    return ""


@dataclass(frozen=True)
class Fp8Format:
    dtype: torch.dtype = torch.bfloat16
    block: int | None = None  # None: per output channel

    def __post_init__(self) -> None:
        if self.block is not None and self.block not in FP8_BLOCKS:
            raise ValueError(f"fp8 format: block {self.block} is not one of {FP8_BLOCKS}")
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"fp8 format: compute dtype {self.dtype} is not bf16 or fp16")

    @property
    def name(self) -> str:
        return "fp8" if self.block is None else f"fp8-b{self.block}"

    def operands(self, hidden_size: int, intermediate_size: int) -> tuple[OperandSpec, ...]:
        out = []
        for p, (n, k) in (
            ("w13", (2 * intermediate_size, hidden_size)),
            ("w2", (hidden_size, intermediate_size)),
        ):
            out.append(OperandSpec(p, (n, k), torch.float8_e4m3fn))
            b = self.block
            out.append(OperandSpec(f"{p}_s", (n,) if b is None else (-(-n // b), -(-k // b)), torch.float32))
        return tuple(out)

    def expert_weights(self, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = (dequantize_fp8(rows[p], rows[f"{p}_s"], self.block, self.dtype) for p in PROJECTIONS)
        return w13, w2

    def quantize(self, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
        rows: dict[str, torch.Tensor] = {}
        for p, w in zip(PROJECTIONS, (w13, w2)):
            rows[p], rows[f"{p}_s"] = quantize_fp8(w, self.block)
        return rows
