"""Per-device int32 workspace of the kernels that synchronize programs of one launch: arrival counters of the
fused combines (`gemv._down_tile`, `decode_align._arrive_and_combine`), of split-K gate_up
(`gemv_tiles._gate_up_tile`) and the sync words of the one-launch GEMV kernel, and the fp64 sums of the one-launch
split path (`splitk.py`). Zero between launches: each kernel resets what it uses (one stream at a time per
device), except the sticky error word 0 (`spin_timeouts`). Also the GEMV's x' pairs (`x_pairs_workspace`): a
fresh tensor per launch, written before it is read.
"""

from __future__ import annotations

import torch

MAX_SYNC_PAIRS = 128  # routed pairs a synchronizing launch may have (per-pair words below)
SYNC_WORDS = 2 + 2 * MAX_SYNC_PAIRS  # [0] error, [1] ticket, ready and passed counts per pair; then arrivals

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_SUMS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# Buffers replaced by a larger one stay alive: graphs captured before the growth keep their addresses.
_RETIRED: list[torch.Tensor] = []


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The sync words (`_fused_kernel`) and `n` combine arrival counters from SYNC_WORDS on, all zero between
    launches (each kernel resets what it uses) except the sticky error word 0. Allocated on first use of a
    size; make that first use happen before graph capture (warm-up), as for compilation."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < SYNC_WORDS + n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kernel workspace of {SYNC_WORDS + n} words first needed during a CUDA graph capture: run one "
                "eager step of this width before capturing (warm-up)"
            )
        new = torch.zeros(max(SYNC_WORDS + n, 4096), dtype=torch.int32, device=device)
        if buf is not None:
            new[0] = buf[0]
            _RETIRED.append(buf)
        buf = new
        _COUNTERS[device] = buf
    return buf


def counters_ready(device: torch.device, n: int) -> bool:
    """Whether `_counters(device, n)` would return the existing buffer (no allocation, no kernel launched)."""
    buf = _COUNTERS.get(device)
    return buf is not None and buf.numel() >= SYNC_WORDS + n


def spin_timeouts(device: torch.device) -> int:
    """Nonzero if a one-launch GEMV step on `device` gave up waiting (its output was wrong); host sync."""
    buf = _COUNTERS.get(torch.device(device))
    return 0 if buf is None else int(buf[0].item())


def _float_sums(device: torch.device, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """`n` sums of `dtype` (`splitk.py`: fp64), zero between launches (the kernel's last program zeroes what
    it used). Allocated on first use of a size, as `_counters` (make that use happen before graph capture)."""
    buf = _SUMS.get((device, dtype))
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kernel workspace of {n} {dtype} sums first needed during a CUDA graph capture: run one eager step "
                "of this width before capturing (warm-up)"
            )
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 16384), dtype=dtype, device=device)
        _SUMS[(device, dtype)] = buf
    return buf


def sums_ready(device: torch.device, n: int, dtype: torch.dtype = torch.float64) -> bool:
    """Whether `_float_sums(device, n, dtype)` would return the existing buffer (no allocation)."""
    buf = _SUMS.get((device, dtype))
    return buf is not None and buf.numel() >= n


def x_pairs_workspace(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """`[rows, K / 2]` int32 for the x' pairs of `GemvConfig.half_x_pack` (4 per 8-value word: as many bytes as
    a bf16 row), written and read by the GEMV kernels of one launch (`gemv_half.x_half_pack`). A fresh tensor per
    launch (stream-ordered reuse by the caching allocator)."""
    return torch.empty((max(rows, 1), k // 2), dtype=torch.int32, device=device)


def x_pairs_args(packed: bool, rows: int, k: int, dummy: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The GEMV kernels' `xp_ptr` and its row stride: with `packed` (`GemvConfig.half_x_pack`) a fresh
    `x_pairs_workspace` on `dummy`'s device; else `dummy` itself, stride 0 (never read: X_PACK is off), so a
    launch without it allocates nothing."""
    if not packed:
        return dummy, 0
    xp = x_pairs_workspace(rows, k, dummy.device)
    return xp, xp.stride(0)
