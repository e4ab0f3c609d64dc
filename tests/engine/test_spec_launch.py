"""The launcher's speculative checks on SGLang's real resolved `ServerArgs` (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest


def resolved(model: Path, *extra: str):  # type: ignore[no-untyped-def]
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        ["--model-path", str(model), "--device", "cpu", "--max-total-tokens", "4096", *extra]
    )
    args.resolve_once()
    return args


SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]


def test_one_request_with_three_speculative_tokens_has_four_lanes(embedded_model: Path) -> None:
    from pooled_runner.lanes import decode_lanes
    from pooled_runner.sglang.spec import check_launch, tokens_per_request

    args = resolved(
        embedded_model, *SPEC, "--speculative-num-draft-tokens", "4", "--max-running-requests", "1"
    )
    width = tokens_per_request(
        bool(args.speculative_algorithm), args.speculative_num_draft_tokens, args.speculative_eagle_topk
    )
    assert width == 4 and decode_lanes(args.max_running_requests, width - 1) == 4
    assert check_launch(args, pool_rows=16, top_k=4, staging_min_tokens=512) == []
    warnings = check_launch(args, pool_rows=12, top_k=4, staging_min_tokens=None)
    assert len(warnings) == 1 and "top_k 4 x (1 + 3 speculative tokens) = 16" in warnings[0]
    with pytest.raises(
        ValueError, match=r"1 \+ 3 speculative tokens = 4 >= --moe-expert-pool-staging-min-tokens 4"
    ):
        check_launch(args, pool_rows=16, top_k=4, staging_min_tokens=4)


def test_no_speculation_has_nothing_to_check(embedded_model: Path) -> None:
    from pooled_runner.sglang.spec import check_launch

    assert check_launch(resolved(embedded_model), pool_rows=4, top_k=4, staging_min_tokens=1) == []
