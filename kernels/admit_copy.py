"""The admission copy of the one-launch plans (`plan_copy.py` for LRU, `plan_adaptive_copy.py` for the adaptive
policies): the launch geometry (programs, chunks, operand slots, PDL / cooperative / ticket flags), the argument
checks, and the copy loop every role runs once role 0 has published its pairs (`plan_copy.py`'s docstring gives
the protocol). The copy visits pairs 0..n-1 of the published count n and copies those with `valid != 0`: n is
the admissions for LRU (a prefix, all valid), for the adaptive plans the pairs up to the last admitted one
(`valid` checked all the same)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .plan_sync import ARRIVAL, SYNC_WORDS
from .row_gather import _check_args

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]
if triton is not None:
    from .pdl import pdl_available

MAX_FUSED_OPERANDS = 8  # int4 with zero points and NVFP4 have 6
ONE_LAUNCH_WARPS = (1, 2, 4, 8)  # the warps per program a one-launch plan + copy takes
COPY_PROGRAMS = 32  # P: co-resident on any recent GPU; each streams its items at a few GB/s from the bank
# Elements per program per loop step: twice gather_rows_multi's block, so that each of the fewer programs keeps
# twice the bytes in flight (a read of the pinned bank waits ~1-2 µs on PCIe).
COPY_BLOCK = 4096


def cooperative_launch_supported() -> bool:
    """Whether this Triton's CUDA backend takes `launch_cooperative_grid` (Triton >= 3.3)."""
    if triton is None:  # pragma: no cover
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def check_copy(
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    victims: torch.Tensor,
    codes: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
    sync: torch.Tensor,
    num_programs: int,
    chunk_programs: int,
) -> None:
    """ValueError naming the first bad copy argument (operand count, row/bank shapes, sync words, programs)."""
    if not 1 <= len(rows) <= MAX_FUSED_OPERANDS or len(hosts) != len(rows):
        raise ValueError(
            f"{len(rows)} row operands and {len(hosts)} host operands: expected 1..{MAX_FUSED_OPERANDS}, equal"
        )
    for dst, host in zip(rows, hosts):
        _check_args(dst, victims, dst, host, codes, valid, num_rows, host_offset)
    if sync.shape != (SYNC_WORDS,) or sync.dtype != torch.int32 or sync.device != victims.device:
        raise ValueError(
            f"sync: shape {tuple(sync.shape)} dtype {sync.dtype} on {sync.device}; expected "
            f"[{SYNC_WORDS}] int32 on {victims.device}"
        )
    if num_programs < 1 or chunk_programs < 1:
        raise ValueError(f"num_programs={num_programs}, chunk_programs={chunk_programs} must be >= 1")


class CopyLaunch(NamedTuple):
    """How a one-launch plan is launched: its grid, the copy's chunks and operand slots, and the flags."""

    programs: int  # P, the grid
    chunks: int  # programs per (pair, operand): C, capped at the row's blocks
    ops: list[object]  # MAX_FUSED_OPERANDS x (rows, host, numel); unused slots repeat the last operand
    launch: dict[str, object]  # num_warps, launch_pdl, launch_cooperative_grid
    pdl: bool  # launched as a programmatic dependent (PDL available and asked for)
    can_pdl: bool  # PDL available on this device (the early trigger needs it)
    ticket: bool  # a plain grid of P > 1: roles by ticket


def copy_launch(
    ids: torch.Tensor,
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    num_pairs: int,
    num_programs: int,
    chunk_programs: int,
    cooperative: bool | None,
    pdl: bool,
    num_warps: int,
) -> CopyLaunch:
    """The launch of a one-launch plan of `num_pairs` pairs over `rows` (see `plan_lru_copy`'s arguments)."""
    max_numel = max(r.shape[1] for r in rows)
    chunks = max(1, min(chunk_programs, triton.cdiv(max_numel, COPY_BLOCK)))
    programs = max(1, min(num_programs, num_pairs * len(rows) * chunks))
    assert num_pairs + 1 < ARRIVAL and programs < 1 << 15, (num_pairs, programs)  # the sync word's fields
    ops: list[object] = []
    for i in range(MAX_FUSED_OPERANDS):
        j = min(i, len(rows) - 1)  # unused slots repeat the last operand (never read: NUM_OPS prunes them)
        ops += [rows[j], hosts[j], rows[j].shape[1]]
    if num_warps not in ONE_LAUNCH_WARPS:
        raise ValueError(f"num_warps={num_warps}: expected one of {ONE_LAUNCH_WARPS}")
    launch: dict[str, object] = {"num_warps": num_warps}
    can_pdl = pdl_available(ids)
    pdl = pdl and can_pdl
    if pdl:
        launch["launch_pdl"] = True
    if cooperative and ids.is_cuda and programs > 1 and cooperative_launch_supported():
        launch["launch_cooperative_grid"] = True
    # a plain grid of P > 1 takes its roles by ticket (under the interpreter too: programs in id order)
    ticket = programs > 1 and "launch_cooperative_grid" not in launch
    return CopyLaunch(programs, chunks, ops, launch, pdl, can_pdl, ticket)


if triton is not None:
    from .row_gather import _copy_row

    @triton.jit
    def _copy_slot(
        SLOT: tl.constexpr,
        NUM_OPS: tl.constexpr,
        op,
        rows_ptr,
        host_ptr,
        numel,
        code,
        dst_row,
        num_rows,
        host_offset,
        chunk,
        num_chunks,
        BLOCK: tl.constexpr,
    ):
        if SLOT < NUM_OPS:  # noqa: SIM102 (constexpr prune; Triton has no `and` on tensors)
            if op == SLOT:
                _copy_row(
                    rows_ptr,
                    rows_ptr,
                    host_ptr,
                    code,
                    dst_row,
                    num_rows,
                    host_offset,
                    numel,
                    chunk,
                    num_chunks,
                    BLOCK,
                )

    @triton.jit
    def _copy_published_pairs(
        pid, num_programs, num_published, valid_ptr, codes_ptr, victims_ptr, R, host_offset, num_chunks,
        rows0, host0, numel0, rows1, host1, numel1, rows2, host2, numel2, rows3, host3, numel3,
        rows4, host4, numel4, rows5, host5, numel5, rows6, host6, numel6, rows7, host7, numel7,
        NUM_OPS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """This role's share of the copy: items (pair, operand, chunk) over pairs 0..n-1, item i by role i mod P,
        chunk c of a row = its blocks c, c + C, ... of BLOCK elements; a pair with `valid == 0` copies nothing."""
        per_pair = NUM_OPS * num_chunks
        for item in range(pid, num_published * per_pair, num_programs):
            pair = item // per_pair
            op = item % per_pair // num_chunks
            chunk = item % num_chunks
            # volatile: written in this launch by role 0 (no stale L1 line)
            if tl.load(valid_ptr + pair, volatile=True) != 0:
                code = tl.load(codes_ptr + pair, volatile=True).to(tl.int64)
                dst_row = tl.load(victims_ptr + pair, volatile=True).to(tl.int64)
                # fmt: off
                _copy_slot(0, NUM_OPS, op, rows0, host0, numel0,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(1, NUM_OPS, op, rows1, host1, numel1,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(2, NUM_OPS, op, rows2, host2, numel2,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(3, NUM_OPS, op, rows3, host3, numel3,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(4, NUM_OPS, op, rows4, host4, numel4,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(5, NUM_OPS, op, rows5, host5, numel5,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(6, NUM_OPS, op, rows6, host6, numel6,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                _copy_slot(7, NUM_OPS, op, rows7, host7, numel7,
                           code, dst_row, R, host_offset, chunk, num_chunks, BLOCK)
                # fmt: on
