"""What the GEMM kernels read: per projection (w13, w2), the weight/scale/zero/global operands in both
locations (pool rows `[R, ...]` on the device, the layer's host view `[E, ...]` in pinned host memory), checked
before any launch.

Both locations must have the same per-row shapes, dtypes and (contiguous) strides, so one code path reads
either: the kernel only swaps the base pointer and the int64 row index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dequant import FMT_DENSE, FMT_FP8_BLOCK, FMT_FP8_CHANNEL, FMT_INT4, FMT_NVFP4

MAX_ROW_NUMEL = 2**31 - 1  # in-row offsets are int32; row offsets are int64


@dataclass(frozen=True)
class KernelFormat:
    """The kernel variant of a weight format: FMT id, group (int4 group / fp8 block), zero points."""

    fmt: int
    group: int = 1
    has_zero: bool = False

    def operand_names(self, proj: str) -> tuple[str, str | None, str | None, str | None]:
        """(weight, scale, zero, global) operand names of projection `proj` ('w13' or 'w2')."""
        if self.fmt == FMT_DENSE:
            return proj, None, None, None
        if self.fmt == FMT_INT4:
            return f"{proj}_q", f"{proj}_s", f"{proj}_z" if self.has_zero else None, None
        if self.fmt in (FMT_FP8_CHANNEL, FMT_FP8_BLOCK):
            return proj, f"{proj}_s", None, None
        return proj, f"{proj}_s", None, f"{proj}_g"

    def values_per_element(self) -> int:
        """Weight values stored in one element of the weight operand along K."""
        return {FMT_INT4: 8, FMT_NVFP4: 2}.get(self.fmt, 1)


def kernel_format(weight_format: object) -> KernelFormat:
    """KernelFormat of a `pooled_runner.formats` object (by its class name and fields)."""
    kind = type(weight_format).__name__
    if kind == "Bf16Format":
        return KernelFormat(FMT_DENSE)
    if kind == "Int4Format":
        return KernelFormat(FMT_INT4, weight_format.group, weight_format.zero_point)  # type: ignore[attr-defined]
    if kind == "Fp8Format":
        block = weight_format.block  # type: ignore[attr-defined]
        return KernelFormat(FMT_FP8_CHANNEL) if block is None else KernelFormat(FMT_FP8_BLOCK, block)
    if kind == "Nvfp4Format":
        return KernelFormat(FMT_NVFP4, 16)
    raise ValueError(f"no kernel for weight format {weight_format!r}")


@dataclass(frozen=True)
class Projection:
    """One projection's operands: `pool[i]` `[R, ...]`, `bank[i]` `[E, ...]` (or None), i = w, s, z, g."""

    pool: tuple[torch.Tensor | None, ...]
    bank: tuple[torch.Tensor | None, ...]
    num_rows: int  # R

    @property
    def weight(self) -> torch.Tensor:
        w = self.pool[0]
        assert w is not None
        return w

    def pointers(self) -> list[torch.Tensor]:
        """8 tensors for the kernel's pointer arguments (pool w, s, z, g, bank w, s, z, g); absent -> pool w."""
        # An absent operand points at one of the same dtype in the same location (never read), because
        # the kernel selects pool or bank pointers per block and both branches must have one type.
        w = self.weight
        pool = [t if t is not None else w for t in self.pool]
        bank = [b if b is not None else p for b, p in zip(self.bank, pool)]
        return pool + bank

    def row_strides(self) -> list[int]:
        """Row (expert) stride of w, s, z, g, then N stride of w, s, z."""
        w = self.weight
        ts = [t if t is not None else w for t in self.pool]
        return [t.stride(0) for t in ts] + [t.stride(1) if t.dim() > 2 else 0 for t in ts[:3]]


def _check_tensor(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: shape {tuple(t.shape)} strides {t.stride()} is not contiguous")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    row_numel = t[0].numel() if t.shape[0] else 0
    if row_numel > MAX_ROW_NUMEL:
        raise ValueError(f"{name}: one row has {row_numel} elements; rows must stay below 2^31")


_ANY_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


def _side_operand_rows(
    fmt: KernelFormat, n: int, k: int
) -> dict[int, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]:
    """Row shape and allowed dtypes of the scale (1), zero (2) and global (3) operands of an `[n, k]`
    projection, as `pooled_runner.formats` lays them out (`operand_names` order)."""
    if fmt.fmt == FMT_INT4:
        groups = (n, k // fmt.group)
        return {1: (groups, _ANY_FLOAT), 2: (groups, (torch.uint8,))}
    if fmt.fmt == FMT_FP8_CHANNEL:
        return {1: ((n,), (torch.float32,))}
    if fmt.fmt == FMT_FP8_BLOCK:
        b = fmt.group
        return {1: ((-(-n // b), -(-k // b)), (torch.float32,))}
    if fmt.fmt == FMT_NVFP4:
        return {1: ((n, k // 16), (torch.float8_e4m3fn,)), 3: ((1,), (torch.float32,))}
    return {}


def _check_side_operand(
    name: str, t: torch.Tensor, row: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    """The kernels index scales/zeros/globals by the format's layout: another row shape reads the wrong ones."""
    if tuple(t.shape[1:]) != row or t.dtype not in dtypes:
        raise ValueError(
            f"{name}: rows {tuple(t.shape[1:])} {t.dtype}, expected {list(row)} of {[str(d) for d in dtypes]}"
        )


def make_projection(
    fmt: KernelFormat,
    proj: str,
    pool: dict[str, torch.Tensor],
    bank: dict[str, torch.Tensor] | None,
    n: int,
    k: int,
) -> Projection:
    """Validate and bundle projection `proj` (`[n, k]` dense shape) of the pool rows and the host view.

    ValueError (before any launch) on a missing operand, wrong shape, non-contiguous tensor, pool/bank dtype or
    row-shape mismatch, or a bank that a GPU kernel cannot read (not page-locked).
    """
    names = fmt.operand_names(proj)
    w = pool.get(names[0])
    if w is None:
        raise ValueError(f"pool has no operand {names[0]!r} (has {sorted(pool)})")
    device = w.device
    vpe = fmt.values_per_element()
    if w.dim() != 3 or tuple(w.shape[1:]) != (n, k // vpe):
        raise ValueError(f"pool {names[0]}: shape {tuple(w.shape)}, expected [R, {n}, {k // vpe}]")
    side_rows = _side_operand_rows(fmt, n, k)
    pool_t: list[torch.Tensor | None] = []
    bank_t: list[torch.Tensor | None] = []
    for name in names:
        if name is None:
            pool_t.append(None)
            bank_t.append(None)
            continue
        if name not in pool:
            raise ValueError(f"pool has no operand {name!r} (has {sorted(pool)})")
        p = pool[name]
        _check_tensor(f"pool {name}", p, device)
        if p.shape[0] != w.shape[0]:
            raise ValueError(f"pool {name}: {p.shape[0]} rows, {names[0]} has {w.shape[0]}")
        if name != names[0]:
            _check_side_operand(f"pool {name}", p, *side_rows[names.index(name)])
        pool_t.append(p)
        if bank is None:
            bank_t.append(None)
            continue
        if name not in bank:
            raise ValueError(f"bank has no operand {name!r} (has {sorted(bank)})")
        b = bank[name]
        if b.dtype != p.dtype or tuple(b.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(
                f"bank {name}: row {tuple(b.shape[1:])} {b.dtype} != pool row {tuple(p.shape[1:])} {p.dtype}"
            )
        if not b.is_contiguous():
            raise ValueError(f"bank {name}: shape {tuple(b.shape)} strides {b.stride()} is not contiguous")
        if device.type == "cuda" and not (b.is_cuda or b.is_pinned()):
            raise ValueError(
                f"bank {name}: a pageable host tensor cannot be read by a GPU kernel; page-lock it "
                "(cudaHostRegister, as ExpertBank does)"
            )
        if device.type != "cuda" and b.device != device:
            raise ValueError(f"bank {name}: on {b.device}, pool on {device}")
        bank_t.append(b)
    return Projection(tuple(pool_t), tuple(bank_t), int(w.shape[0]))
