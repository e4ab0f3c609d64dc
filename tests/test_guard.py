"""Bank-size guard at the exact 2^31 x 16 B boundary, and its message."""

from __future__ import annotations

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.formats.base import OperandSpec
from pooled_runner.guard import MARLIN, POOLED_TRITON, check_tensors, max_pool_rows

MiB = 1 << 20
# A w13 row of exactly 4 MiB (bf16 [2I, H] with 2I*H*2 = 4 MiB) and a w2 row of 2 MiB.
OPS = (OperandSpec("w13", (1024, 2048), torch.bfloat16), OperandSpec("w2", (2048, 512), torch.bfloat16))


def test_four_mib_rows_8192_fit_8193_do_not():
    assert OPS[0].row_bytes == 4 * MiB
    assert max_pool_rows(MARLIN, OPS) == 8192
    check_tensors(MARLIN, OPS, 8192, [256] * 4)
    with pytest.raises(ValueError) as err:
        check_tensors(MARLIN, OPS, 8193, [256] * 4)
    msg = str(err.value)
    assert (
        "pool tensor w13: 8193 rows x 4194304 B = 34363932672 B exceeds marlin's 34359738368 B limit" in msg
    )
    assert "the largest --moe-expert-pool-rows that fits is 8192" in msg
    assert "w2" not in msg.split("w13", 1)[1].split(";")[0]  # w2 (2 MiB rows) still fits at 8193


def test_unbounded_backends_accept_anything():
    assert max_pool_rows(POOLED_TRITON, OPS) is None
    check_tensors(POOLED_TRITON, OPS, 10**6, [10**6])


def test_a_layer_too_large_for_any_pool_size_is_named():
    with pytest.raises(ValueError, match=r"host view / staging buffer w13: a layer of 8193 experts"):
        check_tensors(MARLIN, OPS, 16, [8193])


def test_installation_runs_the_guard():
    moe = PooledMoE(PoolConfig(pool_rows=4, device="cpu"), 16, 8, top_k=2, dtype=torch.float32)
    moe.register_layer(6)
    tiny = type(MARLIN)("tiny", 16 * 16 * 4 * 3, "test backend")  # three w13 rows of [16, 16] fp32
    moe.kernel_backend = tiny
    with pytest.raises(ValueError, match="the largest --moe-expert-pool-rows that fits is 3"):
        moe.install(lambda layer, e: {"w13": torch.randn(16, 16), "w2": torch.randn(16, 8)})
