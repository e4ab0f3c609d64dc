"""Bank-size guard: refuse a configuration whose weight tensors a kernel backend cannot index.

Marlin-lineage MoE kernels add the expert offset, in 16-byte units, into a 32-bit `int`: a weight tensor past
2^31 x 16 B = 32 GiB overflows (seed: 8192 rows of 4 MiB ran, 8193 hit an illegal memory access). Each backend
declares the largest weight tensor it can index; installation checks every pooled weight tensor (pool rows,
staging buffers, a layer's host view) against it and names the largest `--moe-expert-pool-rows` that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from pooled_runner.formats.base import OperandSpec


@dataclass(frozen=True)
class KernelBackend:
    """A MoE kernel backend and the largest weight tensor (bytes) it can index; None = 64-bit, unbounded."""

    name: str
    max_tensor_bytes: int | None
    why: str


TORCH = KernelBackend("torch", None, "plain torch indexing (64-bit)")
POOLED_TRITON = KernelBackend("pooled_runner triton", None, "int64 weight, scale and zero-point offsets")
MARLIN = KernelBackend("marlin", (1 << 31) * 16, "expert offset in 16-byte units held in a 32-bit int")


def max_pool_rows(backend: KernelBackend, operands: tuple[OperandSpec, ...]) -> int | None:
    """The largest row count whose every pool tensor the backend can index (None: no bound)."""
    if backend.max_tensor_bytes is None:
        return None
    return min(backend.max_tensor_bytes // spec.row_bytes for spec in operands)


def check_tensors(
    backend: KernelBackend,
    operands: tuple[OperandSpec, ...],
    num_rows: int,
    num_experts_per_layer: list[int],
) -> None:
    """ValueError listing every pooled weight tensor the backend cannot index, with the fix for each.

    Checked: the pool tensor of each operand (`num_rows` rows) and the largest layer's host view (`E` rows;
    a staging buffer has the same shape, so it is covered by the same check).
    """
    limit = backend.max_tensor_bytes
    if limit is None:
        return
    problems: list[str] = []
    max_rows = max_pool_rows(backend, operands)
    max_experts = max(num_experts_per_layer)
    for spec in operands:
        pool_bytes = num_rows * spec.row_bytes
        if pool_bytes > limit:
            problems.append(
                f"pool tensor {spec.name}: {num_rows} rows x {spec.row_bytes} B = {pool_bytes} B exceeds "
                f"{backend.name}'s {limit} B limit ({backend.why}); the largest --moe-expert-pool-rows that "
                f"fits is {max_rows}"
            )
        layer_bytes = max_experts * spec.row_bytes
        if layer_bytes > limit:
            problems.append(
                f"host view / staging buffer {spec.name}: a layer of {max_experts} experts x {spec.row_bytes} B = "
                f"{layer_bytes} B exceeds {backend.name}'s {limit} B limit, whatever the pool size; use a kernel "
                "backend with 64-bit offsets"
            )
    if problems:
        raise ValueError("bank-size guard: " + "; ".join(problems))
