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


def test_adaptive_speculation_is_checked_at_its_widest_depth(embedded_model: Path) -> None:
    """SGLang's default adaptive slots reach 7 draft steps (8 tokens per request): the lanes and the staging
    check must serve that verify step, not the starting one."""
    from pooled_runner.sglang.spec import check_launch

    args = resolved(embedded_model, *SPEC, "--speculative-adaptive", "--max-running-requests", "1")
    warnings = check_launch(args, pool_rows=12, top_k=4, staging_min_tokens=None)
    assert len(warnings) == 1 and "top_k 4 x (1 + 7 speculative tokens) = 32" in warnings[0], warnings
    with pytest.raises(
        ValueError, match=r"1 \+ 7 speculative tokens = 8 >= --moe-expert-pool-staging-min-tokens 8"
    ):
        check_launch(args, pool_rows=64, top_k=4, staging_min_tokens=8)
    # 64 requests x 8 tokens would be 512 lanes, but SGLang's slots run depth 7 at 1-7 requests only: the lanes
    # warning waits for the scheduler's check, which reads the slots (`_lanes`)
    wide = resolved(embedded_model, *SPEC, "--speculative-adaptive", "--max-running-requests", "64")
    assert check_launch(wide, pool_rows=64, top_k=4, staging_min_tokens=512) == []
    fixed = resolved(
        embedded_model,
        *SPEC[:3],
        "7",
        *SPEC[4:],
        "--speculative-num-draft-tokens",
        "8",
        "--max-running-requests",
        "64",
    )
    warnings = check_launch(fixed, pool_rows=64, top_k=4, staging_min_tokens=512)
    assert len(warnings) == 1 and "512" in warnings[0], warnings  # without adaptive the lanes are 64 x 8


def test_cost_governor_is_refused_where_sglang_turns_adaptive_off(embedded_model: Path) -> None:
    from pooled_runner.sglang.spec_governor import adaptive_refusal

    assert adaptive_refusal(resolved(embedded_model, *SPEC, "--speculative-adaptive")) is None
    topk2 = [*SPEC[:-1], "2", "--speculative-num-draft-tokens", "8", "--speculative-adaptive"]
    refusal = adaptive_refusal(resolved(embedded_model, *topk2))
    assert refusal is not None and "speculative_eagle_topk=2 (only topk=1 is supported)" in refusal
    assert "--moe-expert-pool-spec-governor off" in refusal


def _fake_runner_and_spec(monkeypatch: pytest.MonkeyPatch, adaptive: bool, max_draft: int):  # type: ignore[no-untyped-def]
    """A target runner whose verify width is its draft tokens, and SGLang's runtime context (default slots)."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as runtime_context

    class Runner:
        spec_algorithm = SimpleNamespace(is_speculative=lambda: True)

        def decode_num_tokens_per_req(self, *, num_draft_tokens: int | None = None) -> int:
            return 4 if num_draft_tokens is None else num_draft_tokens  # the starting depth 3: 4 tokens

    spec = SimpleNamespace(
        speculative_adaptive=adaptive, speculative_adaptive_config=None, speculative_eagle_topk=1
    )
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    monkeypatch.setattr(runtime_context, "max_speculative_num_draft_tokens", lambda: max_draft)
    return Runner()


@pytest.mark.parametrize(("adaptive", "expected"), [(False, 4), (True, 8)])
def test_one_request_is_checked_at_the_widest_adaptive_depth(
    monkeypatch: pytest.MonkeyPatch, adaptive: bool, expected: int
) -> None:
    """`_runner_widths` in the scheduler: SGLang's default slots reach depth 7 (8 tokens) at batch size 1, more
    than `max_speculative_num_draft_tokens` (4 here) says: the candidates decide."""
    from pooled_runner.sglang.spec import _runner_widths

    width, how = _runner_widths(_fake_runner_and_spec(monkeypatch, adaptive, max_draft=4))
    assert width == expected, (adaptive, width, how)
    assert ("widest adaptive depth" in how) == adaptive


@pytest.mark.parametrize(("max_running", "expected"), [(1, 8), (7, 56), (16, 64), (256, 256)])
def test_adaptive_lanes_follow_the_depth_of_each_batch_size(
    monkeypatch: pytest.MonkeyPatch, max_running: int, expected: int
) -> None:
    """SGLang's default slots: depth <= 7 at bs 1-7, 3 at 8-31, 1 at 32-63, 0 from 64. Reference: the largest
    bs x (1 + depth) by hand (7 x 8, 16 x 4, 256 x 1), not max_running x 8."""
    from pooled_runner.sglang.spec import _lanes

    lanes, how = _lanes(_fake_runner_and_spec(monkeypatch, True, max_draft=8), max_running, 8)
    assert lanes == expected and "adaptive" in how, (max_running, lanes)
    plain, _ = _lanes(_fake_runner_and_spec(monkeypatch, False, max_draft=4), max_running, 4)
    assert plain == max_running * 4
