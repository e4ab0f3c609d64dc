"""The row-gather kernel against its torch reference on the CPU, under Triton's interpreter.

Run in a fresh interpreter process: `triton.jit` picks the interpreter when it decorates the kernel, and the
planner modules of this session are already imported without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent(
    """
    import torch
    from pooled_runner.kernels.row_gather import gather_rows, gather_rows_reference

    for num_pairs in (0, 1, 7):
        for row_numel in (1, 7, 2049, 5000):
            g = torch.Generator().manual_seed(num_pairs * 31 + row_numel)
            R, N, offset = 9, 13, 3
            src_dev = torch.randn(R, row_numel, generator=g)
            src_host = torch.randn(N, row_numel, generator=g)
            dst = torch.randn(R, row_numel, generator=g)
            dst_index = torch.randperm(R, generator=g)[:num_pairs]
            codes = torch.randint(0, R + N - offset, (num_pairs,), generator=g)
            valid = (torch.rand(num_pairs, generator=g) < 0.7).int()
            expect = dst.clone()
            gather_rows_reference(expect, dst_index, src_dev, src_host, codes, valid, R, offset)
            gather_rows(dst, dst_index, src_dev, src_host, codes, valid, R, offset, force_triton=True)
            bad = (dst != expect).nonzero()
            assert bad.numel() == 0, f"pairs {num_pairs} numel {row_numel}: mismatch at {bad[:5].tolist()}"
    print("gather ok")
    """
)


def test_gather_rows_kernel_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "gather ok" in proc.stdout, proc.stdout + proc.stderr


PLANNER_SCRIPT = textwrap.dedent(
    """
    import functools
    import torch
    import pooled_runner.planner as planner_mod
    from pooled_runner.kernels.row_gather import gather_rows
    from pooled_runner.bank import ExpertBank
    from pooled_runner.formats.base import OperandSpec
    from pooled_runner.pool import ExpertPool
    from pooled_runner.policies import FreqDecayPolicy

    # the planner's admission copies through the Triton kernel (interpreted) instead of the torch reference
    planner_mod.gather_rows = functools.partial(gather_rows, force_triton=True)
    ops = (OperandSpec("w13", (6, 5), torch.bfloat16), OperandSpec("w2", (7,), torch.bfloat16))
    layers = [9, 4, 7]
    bank = ExpertBank(ops, layers, pin=False)
    g = torch.Generator().manual_seed(0)
    for t in bank.tensors_host.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    pool = ExpertPool(ops, layers, 5, torch.device("cpu"), bank)
    pool.fill()
    planner = planner_mod.DevicePlanner(pool, FreqDecayPolicy(decay_steps=2), max_routed=6)
    for step in range(30):
        layer = step % 3
        ids = torch.randint(-1, layers[layer], (3, 2), generator=g)
        planner.plan(layer, ids)
    owners = planner.row_owner[:5].tolist()
    for row, flat in enumerate(owners):
        layer, expert = divmod(flat, 9)
        for name, t in pool.rows_gpu.items():
            assert torch.equal(t[row], bank.row(layer, expert)[name]), (row, flat)
    planner.check_invariants()
    assert planner.counter_values()["admissions"] > 5
    print("planner gather ok")
    """
)


def test_planner_admissions_through_the_interpreted_kernel():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", PLANNER_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "planner gather ok" in proc.stdout, proc.stdout + proc.stderr


def test_gather_rows_reference_and_argument_checks():
    from pooled_runner.kernels.row_gather import gather_rows

    src_dev = torch.arange(12.0).reshape(3, 4)
    src_host = 100 + torch.arange(20.0).reshape(5, 4)
    dst = torch.zeros(3, 4)
    gather_rows(
        dst, torch.tensor([2, 0]), src_dev, src_host, torch.tensor([1, 3 + 4]), torch.tensor([1, 1]), 3, 0
    )
    assert dst.tolist() == [[116.0, 117.0, 118.0, 119.0], [0.0] * 4, [4.0, 5.0, 6.0, 7.0]]
    import pytest

    with pytest.raises(ValueError, match=r"src_host has shape \(5, 3\)"):
        gather_rows(
            dst,
            torch.tensor([0]),
            src_dev,
            src_host[:, :3].contiguous(),
            torch.tensor([0]),
            torch.tensor([1]),
            3,
            0,
        )
    with pytest.raises(ValueError, match=r"valid has shape \(2,\), expected \[1\]"):
        gather_rows(dst, torch.tensor([0]), src_dev, src_host, torch.tensor([0]), torch.tensor([1, 1]), 3, 0)
