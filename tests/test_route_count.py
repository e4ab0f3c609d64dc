"""The route-count kernel (`kernels/route_count.py`) under the Triton interpreter against its torch reference:
random ids with padding and out-of-range values, several layers, saturation, N = 0 and N past one block."""

from __future__ import annotations

import pytest
import torch
from pooled_runner.kernels.route_count import BLOCK, count_routes, count_routes_reference


@pytest.mark.parametrize(("n", "E", "max_count"), [(0, 3, 9), (1, 1, 1), (7, 5, 3), (BLOCK + 13, 33, 40)])
def test_count_routes_equals_reference(n: int, E: int, max_count: int) -> None:
    g = torch.Generator().manual_seed(n + E)
    L, EM = 3, E + 2
    size = L * EM + 1
    start = torch.randint(0, max_count + 1, (size,), generator=g)
    got = (start.clone(), start > max_count // 2, torch.zeros(2, dtype=torch.int32))
    want = tuple(t.clone() for t in got)
    for step in range(4):
        layer = step % L
        dtype = torch.int32 if step % 2 else torch.int64
        ids = torch.randint(-3, E + 2, (n,), generator=g).to(dtype)
        count_routes(ids, *got, layer * EM, E, max_count)
        count_routes_reference(ids, *want, layer * EM, E, max_count)
        for name, a, b in zip(("counts", "routed", "flags"), got, want):
            bad = (a != b).nonzero().flatten().tolist()
            assert not bad, f"step {step}: {name} differs at {bad[:5]}: {a[bad[:5]]} vs {b[bad[:5]]}"
    if n > 0:
        assert int(got[2][0]) == 1  # ids below -1 or >= E were drawn


def test_count_routes_rejects_bad_arguments() -> None:
    counts, routed, flags = (
        torch.zeros(9, dtype=torch.int64),
        torch.zeros(9, dtype=torch.bool),
        torch.zeros(2, dtype=torch.int32),
    )
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="ids"):
        count_routes(ids.float(), counts, routed, flags, 0, 4, 5)
    with pytest.raises(ValueError, match="outside counts"):
        count_routes(ids, counts, routed, flags, 6, 4, 5)
    with pytest.raises(ValueError, match="routed"):
        count_routes(ids, counts, routed.int(), flags, 0, 4, 5)
    with pytest.raises(ValueError, match="max_count"):
        count_routes(ids, counts, routed, flags, 0, 4, 0)
