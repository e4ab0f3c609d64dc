"""Expert weight formats. Each names its operands and how the torch path turns a row into dense weights."""

from __future__ import annotations

import torch

from pooled_runner.formats.base import OperandSpec, WeightFormat
from pooled_runner.formats.bf16 import Bf16Format

# Format names accepted by PoolConfig.weight_format.
FORMATS = ("bf16",)


def make_format(name: str, dtype: torch.dtype) -> WeightFormat:
    """The format object for a config's `weight_format` and the model's compute dtype."""
    if name == "bf16":
        return Bf16Format(dtype)
    raise ValueError(f"weight format {name!r} is not one of {FORMATS}")


__all__ = ["FORMATS", "Bf16Format", "OperandSpec", "WeightFormat", "make_format"]
