"""An empty one-program Triton kernel (optionally a programmatic dependent launch that waits first thing): the
floor of what a kernel launch of its own costs in a replayed graph (`bench/planner.py --node-cost`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pooled_runner.kernels.pdl import pdl_available
from pooled_runner.kernels.pdl import trigger as _pdl_trigger
from pooled_runner.kernels.pdl import wait as _pdl_wait


@triton.jit
def _empty_kernel(ptr, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    _pdl_wait(PDL)
    _pdl_trigger(TRIGGER)  # the next kernel (PDL-launched) may start now
    if tl.program_id(0) < 0:  # never: keeps the argument used
        tl.store(ptr, 0)


def launch_empty(t: torch.Tensor, pdl: bool = False, trigger: bool = False) -> None:
    """Launch the empty kernel on `t`'s device (never writes `t`); `pdl` where `pdl_available(t)`; `trigger`: it
    lets the next kernel launch first thing (as the plan + copy with `early_trigger`)."""
    can_pdl = pdl_available(t)
    launch: dict[str, object] = {"launch_pdl": True} if pdl and can_pdl else {}
    _empty_kernel[(1,)](t, PDL=pdl and can_pdl, TRIGGER=trigger and can_pdl, num_warps=1, **launch)
