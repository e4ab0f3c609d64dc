"""The fused LRU plan kernel (`kernels/plan_lru.py`) under the Triton interpreter against its plain-Python
reference: random residency states, awkward sizes (one row, one expert, odd counts, T*K not dividing any
block, ids out of range and padding), exact equality of every table, counter and output."""

from __future__ import annotations

import random

import pytest
import torch
from pooled_runner.kernels import plan_lru as plan_lru_module
from pooled_runner.kernels.plan_lru import plan_lru, plan_lru_reference


def random_state(L: int, EM: int, E: int, R: int, seed: int) -> dict[str, torch.Tensor]:
    """Flat l2p, owners and stamps of a random consistent residency (about 70% of rows used)."""
    g = torch.Generator().manual_seed(seed)
    l2p = torch.full((L * EM,), -1, dtype=torch.int32)
    for layer in range(L):
        l2p[layer * EM : layer * EM + E] = R + torch.arange(E, dtype=torch.int32)
    owner = torch.full((R + 1,), -1, dtype=torch.int64)
    stamp = torch.full((R + 1,), -1, dtype=torch.int64)
    flats = torch.randperm(L * E, generator=g).tolist()
    used = []
    for row in range(R):
        if flats and float(torch.rand(1, generator=g)) < 0.7:
            layer, e = divmod(flats.pop(), E)
            owner[row] = layer * EM + e
            l2p[layer * EM + e] = row
            used.append(row)
    for i, row in enumerate(torch.randperm(len(used), generator=g).tolist()):
        stamp[used[row]] = i + 1
    return {
        "l2p": l2p,
        "row_owner": owner,
        "row_stamp": stamp,
        "clock": torch.tensor([len(used)], dtype=torch.int64),
        "counters": torch.randint(0, 50, (5,), generator=g),
    }


def run(
    fn, st: dict[str, torch.Tensor], ids: torch.Tensor, layer: int, E: int, EM: int, R: int, P: int, bm: int
):
    out = [torch.full((P,), 99, dtype=torch.int32) for _ in range(3)]
    counts = torch.full((EM,), 7, dtype=torch.int32)
    cycle = st.get("cycle")
    telemetry = (st["tel_counts"], st["tel_routed"], st["tel_flags"], 9) if "tel_counts" in st else None
    fn(
        ids,
        st["l2p"],
        st["row_owner"],
        st["row_stamp"],
        st["clock"],
        st["counters"],
        counts,
        *out,
        layer,
        E,
        EM,
        R,
        bm,
        1 if bm == 16 else 2,
        cycle,
        telemetry,
    )
    return out


@pytest.mark.parametrize("trial", range(24))
def test_plan_lru_equals_reference(trial: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if trial % 4 < 2:  # token counts by atomics in global memory, not in registers (the path of wide steps)
        monkeypatch.setattr(plan_lru_module, "MAX_COUNT_MATRIX", 0)
    rnd = random.Random(trial)
    L, E = rnd.randint(1, 3), rnd.choice([1, 3, 7, 16, 33])
    EM, R = E + rnd.randint(0, 2), rnd.choice([1, 2, 5, 9, 33, 70])
    T, K = rnd.choice([0, 1, 2, 7]), rnd.randint(1, min(4, E))
    bm = rnd.choice([16, 2])
    a = random_state(L, EM, E, R, trial)
    if trial % 2:  # cycle protection, from a state where the previous cycle began mid-history
        a["cycle"] = torch.tensor(
            [L - 1, int(a["clock"][0]) // 2 + 1, int(a["clock"][0]) // 3], dtype=torch.int64
        )
    if trial % 3:  # route telemetry recorded by the plan kernel, saturating at 9
        a["tel_counts"] = torch.randint(0, 9, (L * EM + 1,), generator=torch.Generator().manual_seed(trial))
        a["tel_routed"] = a["tel_counts"] > 4
        a["tel_flags"] = torch.zeros(2, dtype=torch.int32)
    b = {k: v.clone() for k, v in a.items()}
    g = torch.Generator().manual_seed(trial)
    for step in range(6):
        layer = rnd.randrange(L) if step % 3 else step // 3 % L
        ids = torch.randint(-2, E + 2, (T * K,), generator=g).to(rnd.choice([torch.int32, torch.int64]))
        P = min(E, R, max(T * K, 1))
        got = run(plan_lru, a, ids, layer, E, EM, R, P, bm)
        want = run(plan_lru_reference, b, ids, layer, E, EM, R, P, bm)
        for key in a:
            bad = (a[key] != b[key]).nonzero().flatten().tolist()
            assert not bad, f"trial {trial} step {step}: {key} differs at {bad[:5]}: {a[key]} vs {b[key]}"
        for name, x, y in zip(("victims", "codes", "valid"), got, want):
            valid = want[2] != 0  # entries past the admissions are don't-care in both
            assert torch.equal(x[valid], y[valid]) and torch.equal(got[2], want[2]), f"{name}: {x} vs {y}"


def test_plan_lru_rejects_bad_arguments() -> None:
    st = random_state(1, 4, 4, 3, 0)
    ids = torch.tensor([0, 1], dtype=torch.int64)
    out = [torch.zeros(2, dtype=torch.int32) for _ in range(3)]
    counts = torch.zeros(4, dtype=torch.int32)
    args = [ids, st["l2p"], st["row_owner"], st["row_stamp"], st["clock"], st["counters"], counts, *out]
    with pytest.raises(ValueError, match="ids"):
        plan_lru(ids.float(), *args[1:], 0, 4, 4, 3, 16, 1)
    with pytest.raises(ValueError, match="num_experts"):
        plan_lru(*args, 0, 5, 4, 3, 16, 1)
    with pytest.raises(ValueError, match="l2p"):
        plan_lru(*args, 1, 4, 4, 3, 16, 1)  # layer 1 is not in a one-layer table
    with pytest.raises(ValueError, match="counts"):
        plan_lru(*args[:6], counts[:2], *out, 0, 4, 4, 3, 16, 1)
    with pytest.raises(ValueError, match="victims"):
        plan_lru(*args[:7], out[0].long(), *out[1:], 0, 4, 4, 3, 16, 1)
