"""Row gather: copy whole expert rows into destination rows, each source a pool row or a host (bank) row.

For pair p with `valid[p] != 0`: `dst[dst_index[p]] = src_dev[code]` if `code = src_code[p] < num_rows`, else
`src_host[host_offset + code - num_rows]` (the location-code convention of `l2p`: `0..R-1` pool row, `R + e`
host row e of the layer whose first bank row is `host_offset`). Pairs with `valid[p] == 0` copy nothing.

This is the planner's admission copy (SM gather from the pinned bank, ordered on the stream before the GEMM)
and it is graph-safe: fixed pair count, no host sync, invalid pairs masked inside the kernel. On CUDA the host
source must be page-locked (a Triton kernel reads a pinned tensor through its device address); on the CPU the
torch reference runs.
"""

from __future__ import annotations

import torch

try:  # Triton is optional for the CPU core
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None  # type: ignore[assignment]


def _check_args(
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    src_dev: torch.Tensor,
    src_host: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
) -> None:
    if dst.dim() != 2 or src_dev.dim() != 2 or src_host.dim() != 2:
        raise ValueError(
            f"dst {tuple(dst.shape)}, src_dev {tuple(src_dev.shape)}, src_host {tuple(src_host.shape)}: "
            "expected 2-d [rows, row_numel] views"
        )
    row_numel = dst.shape[1]
    for name, t in (("src_dev", src_dev), ("src_host", src_host)):
        if t.shape[1] != row_numel or t.dtype != dst.dtype:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} dtype {t.dtype}, expected [*, {row_numel}] {dst.dtype}"
            )
    for name, t in (("dst", dst), ("src_dev", src_dev), ("src_host", src_host)):
        if not t.is_contiguous():
            raise ValueError(f"{name} with strides {t.stride()} is not contiguous")
    num_pairs = dst_index.shape[0]
    for name, t in (("dst_index", dst_index), ("src_code", src_code), ("valid", valid)):
        if t.dim() != 1 or t.shape[0] != num_pairs:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{num_pairs}]")
        if t.device != dst.device:
            raise ValueError(f"{name} is on {t.device}, expected {dst.device}")
    if src_dev.shape[0] != num_rows:
        raise ValueError(f"src_dev has {src_dev.shape[0]} rows, expected num_rows={num_rows}")
    if host_offset < 0:
        raise ValueError(f"host_offset={host_offset} must be >= 0")


def gather_rows_reference(
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    src_dev: torch.Tensor,
    src_host: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
) -> None:
    """Torch reference of `gather_rows` (host-synchronizing: not for graph capture)."""
    _check_args(dst, dst_index, src_dev, src_host, src_code, valid, num_rows, host_offset)
    for p in valid.nonzero().flatten().tolist():
        code = int(src_code[p])
        src = src_dev[code] if code < num_rows else src_host[host_offset + code - num_rows]
        dst[int(dst_index[p])].copy_(src.to(dst.device))


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(
        dst_ptr,
        dst_index_ptr,
        src_dev_ptr,
        src_host_ptr,
        src_code_ptr,
        valid_ptr,
        num_rows,
        host_offset,
        row_numel,
        BLOCK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        num_chunk_programs = tl.num_programs(1)
        valid = tl.load(valid_ptr + pair)
        if valid != 0:
            code = tl.load(src_code_ptr + pair).to(tl.int64)
            dst_row = tl.load(dst_index_ptr + pair).to(tl.int64)
            dst_base = dst_ptr + dst_row * row_numel
            offs = tl.arange(0, BLOCK)
            if code < num_rows:
                src_base = src_dev_ptr + code * row_numel
            else:
                src_base = src_host_ptr + (code - num_rows + host_offset) * row_numel
            for start in range(chunk * BLOCK, row_numel, num_chunk_programs * BLOCK):
                idx = start + offs
                mask = idx < row_numel
                x = tl.load(src_base + idx, mask=mask)
                tl.store(dst_base + idx, x, mask=mask)


GATHER_BLOCK = 2048
MAX_CHUNK_PROGRAMS = 32


def gather_rows(
    dst: torch.Tensor,
    dst_index: torch.Tensor,
    src_dev: torch.Tensor,
    src_host: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
    force_triton: bool = False,
    check_pinned: bool = True,
) -> None:
    """Copy rows (see module docstring). `dst`, `src_dev` `[R?, n]` on the device, `src_host` `[N, n]` (pinned
    on CUDA); `dst_index`, `src_code`, `valid` `[P]` integer tensors on dst's device. P may be 0.

    CUDA (or `force_triton`, for the Triton interpreter on CPU) launches the Triton kernel; otherwise the torch
    reference runs. `check_pinned=False` skips the page-lock query (a CUDA API call) for callers that checked
    once before capture.
    """
    _check_args(dst, dst_index, src_dev, src_host, src_code, valid, num_rows, host_offset)
    if not (dst.is_cuda or force_triton):
        gather_rows_reference(dst, dst_index, src_dev, src_host, src_code, valid, num_rows, host_offset)
        return
    if triton is None:  # pragma: no cover
        raise RuntimeError("gather_rows on CUDA needs Triton")
    if check_pinned and dst.is_cuda and src_host.device.type == "cpu" and not src_host.is_pinned():
        raise ValueError("src_host is pageable: a kernel can only read page-locked host memory")
    num_pairs, row_numel = dst_index.shape[0], dst.shape[1]
    if num_pairs == 0 or row_numel == 0:
        return
    chunk_programs = min(MAX_CHUNK_PROGRAMS, triton.cdiv(row_numel, GATHER_BLOCK))
    grid = (num_pairs, chunk_programs)
    _gather_rows_kernel[grid](
        dst,
        dst_index,
        src_dev,
        src_host,
        src_code,
        valid,
        num_rows,
        host_offset,
        row_numel,
        BLOCK=GATHER_BLOCK,
    )


# --------------------------------------------------------------------------------------------------
# Several operands in one launch (the planner's admission copy: one launch per layer step, not per operand).
MAX_MULTI_OPERANDS = 4
# per pair and operand (128 measured no faster on the H200 trace and slower at M=4-8)
MULTI_CHUNK_PROGRAMS = 32


def _check_multi(
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    dst_index: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
) -> None:
    if not 1 <= len(rows) <= MAX_MULTI_OPERANDS or len(hosts) != len(rows):
        raise ValueError(
            f"{len(rows)} row operands and {len(hosts)} host operands: expected 1..{MAX_MULTI_OPERANDS}, equal"
        )
    for dst, host in zip(rows, hosts):
        _check_args(dst, dst_index, dst, host, src_code, valid, num_rows, host_offset)


def gather_rows_multi_reference(
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    dst_index: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
) -> None:
    """Torch reference of `gather_rows_multi`: `gather_rows_reference` for each operand, rows as the device
    source (host-synchronizing)."""
    _check_multi(rows, hosts, dst_index, src_code, valid, num_rows, host_offset)
    for dst, host in zip(rows, hosts):
        gather_rows_reference(dst, dst_index, dst, host, src_code, valid, num_rows, host_offset)


if triton is not None:

    @triton.jit
    def _copy_row(
        dst_ptr,
        src_dev_ptr,
        src_host_ptr,
        code,
        dst_row,
        num_rows,
        host_offset,
        row_numel,
        chunk,
        num_chunks,
        BLOCK: tl.constexpr,
    ):
        offs = tl.arange(0, BLOCK)
        dst_base = dst_ptr + dst_row * row_numel
        if code < num_rows:
            src_base = src_dev_ptr + code * row_numel
        else:
            src_base = src_host_ptr + (code - num_rows + host_offset) * row_numel
        for start in range(chunk * BLOCK, row_numel, num_chunks * BLOCK):
            idx = start + offs
            mask = idx < row_numel
            tl.store(dst_base + idx, tl.load(src_base + idx, mask=mask), mask=mask)

    @triton.jit
    def _gather_rows_multi_kernel(
        dst_index_ptr,
        src_code_ptr,
        valid_ptr,
        num_rows,
        host_offset,
        rows0,
        host0,
        numel0,
        rows1,
        host1,
        numel1,
        rows2,
        host2,
        numel2,
        rows3,
        host3,
        numel3,
        NUM_OPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        chunk = tl.program_id(1)
        op = tl.program_id(2)
        num_chunks = tl.num_programs(1)
        if tl.load(valid_ptr + pair) != 0:
            code = tl.load(src_code_ptr + pair).to(tl.int64)
            dst_row = tl.load(dst_index_ptr + pair).to(tl.int64)
            if op == 0:
                _copy_row(
                    rows0,
                    rows0,
                    host0,
                    code,
                    dst_row,
                    num_rows,
                    host_offset,
                    numel0,
                    chunk,
                    num_chunks,
                    BLOCK,
                )
            if NUM_OPS > 1:  # noqa: SIM102 (constexpr prune; Triton has no `and` on tensors)
                if op == 1:
                    _copy_row(
                        rows1,
                        rows1,
                        host1,
                        code,
                        dst_row,
                        num_rows,
                        host_offset,
                        numel1,
                        chunk,
                        num_chunks,
                        BLOCK,
                    )
            if NUM_OPS > 2:  # noqa: SIM102 (constexpr prune; Triton has no `and` on tensors)
                if op == 2:
                    _copy_row(
                        rows2,
                        rows2,
                        host2,
                        code,
                        dst_row,
                        num_rows,
                        host_offset,
                        numel2,
                        chunk,
                        num_chunks,
                        BLOCK,
                    )
            if NUM_OPS > 3:  # noqa: SIM102 (constexpr prune; Triton has no `and` on tensors)
                if op == 3:
                    _copy_row(
                        rows3,
                        rows3,
                        host3,
                        code,
                        dst_row,
                        num_rows,
                        host_offset,
                        numel3,
                        chunk,
                        num_chunks,
                        BLOCK,
                    )


def gather_rows_multi(
    rows: list[torch.Tensor],
    hosts: list[torch.Tensor],
    dst_index: torch.Tensor,
    src_code: torch.Tensor,
    valid: torch.Tensor,
    num_rows: int,
    host_offset: int,
    force_triton: bool = False,
    chunk_programs: int = MULTI_CHUNK_PROGRAMS,
) -> None:
    """`gather_rows(rows[i], dst_index, rows[i], hosts[i], src_code, valid, ...)` for up to 4 operands in one
    launch: operand i's `[R, n_i]` pool rows (also the device source) and `[N, n_i]` bank rows (pinned on CUDA;
    not checked here: the caller checks once before capture). Same pair contract; P may be 0. Graph-safe.
    Pairs run in parallel: a pool row that is a source must not also be a destination of the same call (the
    planner's admissions only read the bank).
    CUDA (or `force_triton`, the interpreter) launches the kernel; otherwise the torch reference runs."""
    _check_multi(rows, hosts, dst_index, src_code, valid, num_rows, host_offset)
    if chunk_programs < 1:
        raise ValueError(f"chunk_programs={chunk_programs} must be >= 1")
    if not (rows[0].is_cuda or force_triton):
        gather_rows_multi_reference(rows, hosts, dst_index, src_code, valid, num_rows, host_offset)
        return
    if triton is None:  # pragma: no cover
        raise RuntimeError("gather_rows_multi on CUDA needs Triton")
    num_pairs, max_numel = dst_index.shape[0], max(r.shape[1] for r in rows)
    if num_pairs == 0 or max_numel == 0:
        return
    chunks = max(1, min(chunk_programs, triton.cdiv(max_numel, GATHER_BLOCK)))
    ops: list[object] = []
    for i in range(MAX_MULTI_OPERANDS):
        j = min(i, len(rows) - 1)  # unused slots repeat the last operand (never read: NUM_OPS masks them)
        ops += [rows[j], hosts[j], rows[j].shape[1]]
    _gather_rows_multi_kernel[(num_pairs, chunks, len(rows))](
        dst_index, src_code, valid, num_rows, host_offset, *ops, NUM_OPS=len(rows), BLOCK=GATHER_BLOCK
    )
