"""GPU tests of the planner's row gather kernels (`kernels/row_gather.py`) against their torch references:
pool and pinned host sources, rows of awkward sizes, invalid pairs skipped (run by scripts/gpu_check.sh, step
gpu_tests_stack; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16


@pytest.mark.parametrize("num_pairs", [0, 1, 7])
@pytest.mark.parametrize("row_numel", [1, 7, 2049, 70001])
def test_gather_rows_kernel_matches_reference(num_pairs, row_numel):
    from pooled_runner.kernels.row_gather import gather_rows, gather_rows_reference

    g = torch.Generator().manual_seed(num_pairs * 31 + row_numel)
    R, N = 9, 13
    src_dev = torch.randn(R, row_numel, generator=g).to(DTYPE).cuda()
    src_host = torch.randn(N, row_numel, generator=g).to(DTYPE).pin_memory()
    dst = torch.randn(R, row_numel, generator=g).to(DTYPE).cuda()
    dst_index = torch.randperm(R, generator=g)[:num_pairs].cuda()
    codes = torch.randint(0, R + N - 3, (num_pairs,), generator=g).cuda()  # src_dev is not dst: no overlap
    valid = (torch.rand(num_pairs, generator=g) < 0.7).int().cuda()
    expect = dst.cpu().clone()
    gather_rows_reference(expect, dst_index.cpu(), src_dev.cpu(), src_host, codes.cpu(), valid.cpu(), R, 3)
    gather_rows(dst, dst_index, src_dev, src_host, codes, valid, R, 3)
    torch.cuda.synchronize()
    mismatch = (dst.cpu() != expect).nonzero()
    assert mismatch.numel() == 0, f"first mismatches at {mismatch[:5].tolist()}"


@pytest.mark.parametrize("num_pairs", [0, 1, 7])
def test_gather_rows_multi_kernel_matches_reference(num_pairs):
    from pooled_runner.kernels.row_gather import gather_rows_multi, gather_rows_multi_reference

    g = torch.Generator().manual_seed(num_pairs)
    R, N = 16, 13
    numels, dtypes = (70001, 7, 2049), (DTYPE, torch.int32, torch.uint8)
    rows = [(torch.randn(R, n, generator=g) * 50).to(d) for n, d in zip(numels, dtypes)]
    hosts = [(torch.randn(N, n, generator=g) * 50).to(d).pin_memory() for n, d in zip(numels, dtypes)]
    dst_index = torch.randperm(R // 2, generator=g)[
        :num_pairs
    ].int()  # pool sources are rows 8..15: never written
    codes = torch.randint(R // 2, R + N - 3, (num_pairs,), generator=g).int()
    valid = (torch.rand(num_pairs, generator=g) < 0.7).int()
    expect = [r.clone() for r in rows]
    gather_rows_multi_reference(expect, hosts, dst_index, codes, valid, R, 3)
    rows_gpu = [r.cuda() for r in rows]
    gather_rows_multi(rows_gpu, hosts, dst_index.cuda(), codes.cuda(), valid.cuda(), R, 3)
    torch.cuda.synchronize()
    for i, (got, exp) in enumerate(zip(rows_gpu, expect)):
        mismatch = (got.cpu() != exp).nonzero()
        assert mismatch.numel() == 0, f"operand {i}: first mismatches at {mismatch[:5].tolist()}"
