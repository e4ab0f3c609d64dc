"""The several-operand row gather (`gather_rows_multi`, the planner's admission copy) under the Triton
interpreter against its torch reference: 1-4 operands of different dtypes and row sizes, pool and host
sources, masked pairs, P = 0, 1, 7; and its argument checks."""

from __future__ import annotations

import pytest
import torch
from pooled_runner.kernels.row_gather import gather_rows_multi, gather_rows_multi_reference

DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.uint8)
NUMELS = (1, 7, 2049, 4100)


def operands(
    num_ops: int, R: int, N: int, g: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rows, hosts = [], []
    for i in range(num_ops):
        dtype, n = DTYPES[i], NUMELS[(i + num_ops) % len(NUMELS)]
        rows.append((torch.randn(R, n, generator=g) * 50).to(dtype))
        hosts.append((torch.randn(N, n, generator=g) * 50).to(dtype))
    return rows, hosts


@pytest.mark.parametrize("num_ops", [1, 2, 3, 4])
@pytest.mark.parametrize("num_pairs", [0, 1, 7])
def test_gather_rows_multi_equals_reference(num_ops: int, num_pairs: int) -> None:
    g = torch.Generator().manual_seed(10 * num_ops + num_pairs)
    R, N, offset = 16, 13, 3
    rows, hosts = operands(num_ops, R, N, g)
    # destinations among rows 0..7, pool sources among rows 8..15 (a source must not be a destination), or host
    dst_index = torch.randperm(R // 2, generator=g)[:num_pairs].to(torch.int32)
    codes = torch.randint(R // 2, R + N - offset, (num_pairs,), generator=g).to(torch.int32)
    valid = (torch.rand(num_pairs, generator=g) < 0.7).to(torch.int32)
    want = [r.clone() for r in rows]
    gather_rows_multi_reference(want, hosts, dst_index, codes, valid, R, offset)
    gather_rows_multi(rows, hosts, dst_index, codes, valid, R, offset, force_triton=True, chunk_programs=3)
    for i, (got, exp) in enumerate(zip(rows, want)):
        bad = (got != exp).nonzero()
        assert bad.numel() == 0, f"operand {i}: first mismatches at {bad[:5].tolist()}"
    if num_pairs and int(valid.sum()):  # the copy did something
        p = int(valid.nonzero()[0])
        code = int(codes[p])
        src = want[0][code] if code < R else hosts[0][code - R + offset]  # source rows are never written
        assert torch.equal(rows[0][int(dst_index[p])], src)


def test_gather_rows_multi_rejects_bad_arguments() -> None:
    g = torch.Generator().manual_seed(0)
    rows, hosts = operands(2, 4, 5, g)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="row operands"):
        gather_rows_multi(rows * 3, hosts * 3, idx, idx, idx, 4, 0)
    with pytest.raises(ValueError, match="row operands"):
        gather_rows_multi(rows, hosts[:1], idx, idx, idx, 4, 0)
    with pytest.raises(ValueError, match="src_host"):
        gather_rows_multi(rows, hosts[::-1], idx, idx, idx, 4, 0)
    with pytest.raises(ValueError, match="chunk_programs"):
        gather_rows_multi(rows, hosts, idx, idx, idx, 4, 0, chunk_programs=0)
