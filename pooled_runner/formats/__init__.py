"""Expert weight formats. Each names its operands and how the torch path turns a row into dense weights."""

from __future__ import annotations

import torch

from pooled_runner.formats.base import OperandSpec, WeightFormat
from pooled_runner.formats.bf16 import Bf16Format
from pooled_runner.formats.fp8 import FP8_BLOCKS, Fp8Format
from pooled_runner.formats.int4 import Int4Format
from pooled_runner.formats.nvfp4 import Nvfp4Format
from pooled_runner.formats.quant import INT4_GROUPS

# Format names accepted by PoolConfig.weight_format.
FORMATS = (
    "bf16",
    *(f"int4-g{g}{zp}" for g in INT4_GROUPS for zp in ("", "-zp")),
    "fp8",
    *(f"fp8-b{b}" for b in FP8_BLOCKS),
    "nvfp4",
)


def make_format(name: str, dtype: torch.dtype) -> WeightFormat:
    """The format object for a config's `weight_format` and the model's compute dtype."""
    if name not in FORMATS:
        raise ValueError(f"weight format {name!r} is not one of {FORMATS}")
    if name == "bf16":
        return Bf16Format(dtype)
    if name.startswith("int4-g"):
        group, _, zp = name[len("int4-g") :].partition("-")
        return Int4Format(dtype, int(group), zero_point=zp == "zp")
    if name.startswith("fp8"):
        return Fp8Format(dtype, int(name[len("fp8-b") :]) if name != "fp8" else None)
    return Nvfp4Format(dtype)


__all__ = [
    "FORMATS",
    "Bf16Format",
    "Fp8Format",
    "Int4Format",
    "Nvfp4Format",
    "OperandSpec",
    "WeightFormat",
    "make_format",
]
