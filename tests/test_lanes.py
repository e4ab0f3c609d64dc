"""Decode lanes and chunk alignment."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pooled_runner.lanes import aligned_chunk_size, check_rows_for_verify, decode_lanes, takes_decode_path


def test_verify_steps_of_one_request_stay_on_the_decode_path():
    lanes = decode_lanes(max_running_requests=1, num_speculative_tokens=3)
    assert lanes == 4 and takes_decode_path(4, lanes) and not takes_decode_path(5, lanes)
    assert decode_lanes(48, 1) == 96 and decode_lanes(7) == 7


def test_bad_lane_inputs():
    with pytest.raises(ValueError, match="max_running_requests=0"):
        decode_lanes(0)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        decode_lanes(2, -1)


def test_rows_below_one_verify_step_warn_with_numbers():
    assert check_rows_for_verify(32, 8, 3) is None
    msg = check_rows_for_verify(31, 8, 3)
    assert msg is not None and "8 x (1 + 3 speculative tokens) = 32" in msg and "use >= 32 rows" in msg


def test_seed_case_and_messages():
    plan = aligned_chunk_size(8192, page_size=1, state_grid=4608)
    assert (plan.effective, plan.grid) == (4608, 4608)
    assert plan.message() == "chunked prefill: requested 8192, effective 4608 (grid 4608)"
    assert aligned_chunk_size(8192, page_size=64, state_grid=256).effective == 8192
    assert aligned_chunk_size(250, page_size=1, state_grid=64).effective == 192
    assert aligned_chunk_size(1000).effective == 1000  # non-hybrid, page 1: unchanged
    with pytest.raises(ValueError, match="use --chunked-prefill-size >= 384"):
        aligned_chunk_size(300, page_size=128, state_grid=192)


@given(
    requested=st.integers(1, 100_000),
    page=st.integers(1, 256),
    align=st.one_of(st.none(), st.integers(1, 5000)),
    grid=st.one_of(st.none(), st.integers(1, 5000)),
)
def test_effective_is_the_largest_aligned_size_within_budget(requested, page, align, grid):
    full = math.lcm(page, align or 1, grid or 1)
    if requested < full:
        with pytest.raises(ValueError):
            aligned_chunk_size(requested, page, align, grid)
        return
    plan = aligned_chunk_size(requested, page, align, grid)
    assert plan.grid == full and plan.effective % full == 0
    assert plan.effective <= requested < plan.effective + full


def test_speculative_checks_warn_refuse_with_numbers():
    from pooled_runner.lanes import check_speculative

    ok = check_speculative(32, 8, 4, max_running_requests=1, staging_min_tokens=512)
    assert ok.warnings == [] and ok.problems == []
    rows = check_speculative(31, 8, 4, max_running_requests=1, staging_min_tokens=None)
    assert rows.problems == [] and len(rows.warnings) == 1 and "use >= 32 rows" in rows.warnings[0]
    refused = check_speculative(4096, 8, 512, max_running_requests=1, staging_min_tokens=512)
    assert len(refused.problems) == 1
    msg = refused.problems[0]
    assert "1 + 511 speculative tokens = 512 >= --moe-expert-pool-staging-min-tokens 512" in msg
    assert "use at most 510 speculative tokens (--speculative-num-draft-tokens <= 511)" in msg
    assert check_speculative(4096, 8, 511, 1, 512).problems == []  # the largest width that stays apart
    wide = check_speculative(4096, 8, 4, max_running_requests=128, staging_min_tokens=512)
    assert wide.problems == [] and "decode lanes 512 = --max-running-requests 128 x 4" in wide.warnings[0]
    assert "prefill staging starts at 513 tokens" in wide.warnings[0]
    assert check_speculative(4096, 8, 4, 127, 512).warnings == []


def test_adaptive_decode_lanes_take_the_widest_batch() -> None:
    from pooled_runner.lanes import adaptive_decode_lanes

    def width_at(bs: int) -> int:  # depth 7 below 8 requests, 3 below 32, then 0
        return 8 if bs < 8 else 4 if bs < 32 else 1

    by_hand = {1: 8, 5: 40, 9: 56, 20: 80, 33: 124, 200: 200}
    for max_running, lanes in by_hand.items():
        assert adaptive_decode_lanes(max_running, width_at) == lanes, max_running
    with pytest.raises(ValueError, match="max_running_requests=0"):
        adaptive_decode_lanes(0, width_at)
