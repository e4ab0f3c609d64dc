"""kernels/workspace.py: the per-device sync workspace grows without freeing what captured graphs point at."""

from __future__ import annotations

import torch
from pooled_runner.kernels import workspace


def test_growth_keeps_the_old_buffer_and_the_error_word():
    device = torch.device("cpu")
    saved = workspace._COUNTERS.pop(device, None)
    try:
        first = workspace._counters(device, 10)
        assert first.numel() >= workspace.SYNC_WORDS + 10 and int(first.abs().sum()) == 0
        first[0] = 3  # a sticky error word
        assert workspace._counters(device, 20) is first  # fits: no new buffer
        grown = workspace._counters(device, first.numel())  # needs more than it has
        assert grown is not first and grown.numel() >= workspace.SYNC_WORDS + first.numel()
        assert int(grown[0]) == 3 and int(grown[1:].abs().sum()) == 0
        assert any(t is first for t in workspace._RETIRED), "the replaced buffer was dropped"
    finally:
        workspace._COUNTERS.pop(device, None)
        if saved is not None:
            workspace._COUNTERS[device] = saved
