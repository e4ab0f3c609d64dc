"""`patches/cpu_cache_locs.py`: SGLang's verify write window at draft depth 0 on a machine without CUDA.

Reference: the window read straight from `req_to_token` (each request's slots from its current length on).
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("draft_token_num", [1, 2, 4])
def test_write_window_is_planned_after_the_patch(
    monkeypatch: pytest.MonkeyPatch, draft_token_num: int
) -> None:
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    from pooled_runner.patches import cpu_cache_locs

    monkeypatch.setattr(cache_locs, "_is_xpu", cache_locs._is_xpu)  # restored after the test
    gen = torch.Generator().manual_seed(draft_token_num)
    num_reqs, pool_len = 3, 23
    req_to_token = (
        torch.randperm(7 * pool_len, generator=gen)[: 5 * pool_len].view(5, pool_len).to(torch.int32)
    )
    req_pool_indices = torch.tensor([4, 0, 2])
    seq_lens = torch.tensor([7, 1, pool_len - draft_token_num])

    def window() -> torch.Tensor | None:
        return cache_locs.assign_extend_cache_locs_uniform_func(
            req_pool_indices, req_to_token, seq_lens, num_reqs, draft_token_num, torch.device("cpu")
        )

    assert window() is None  # SGLang 0.5.23 without CUDA and without its CPU engine: no window at all
    cpu_cache_locs.apply()
    got = window()
    expected = torch.cat(
        [
            req_to_token[r, s : s + draft_token_num]
            for r, s in zip(req_pool_indices.tolist(), seq_lens.tolist())
        ]
    ).to(torch.int64)
    assert got is not None and torch.equal(got, expected), (got, expected)


def test_native_cpu_engine_and_npu_branches_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    from pooled_runner.patches import cpu_cache_locs

    for flag in ("_is_cpu", "_is_npu"):
        monkeypatch.setattr(cache_locs, "_is_xpu", False)
        monkeypatch.setattr(cache_locs, flag, True)
        cpu_cache_locs.apply()
        assert cache_locs._is_xpu is False, flag
        monkeypatch.setattr(cache_locs, flag, False)
