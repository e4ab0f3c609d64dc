"""The router-score membership kernel (`kernels/membership.py`, the interpreter on the CPU) against its torch
reference and the plain-Python host form, at awkward sizes with infinities, NaN rows and padding tokens."""

from __future__ import annotations

import pytest
import torch
from pooled_runner.kernels.membership import RAMP, add_membership, add_membership_reference

from pooled_runner.policy_router import MEMBER_UNIT, membership_units_host

# inf - inf in the interpreter's numpy: the kernel masks the NaN out, numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _scores(T: int, E: int, extra: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    s = torch.randn(T, E + extra, generator=g) * 3
    if T > 1:
        s[1, 0] = float("inf")
    if T > 2:
        s[2, E // 2] = float("nan")  # this token does not vote
    if T > 3:
        s[3, :] = float("-inf")  # every difference is NaN: adds nothing
    if T > 4 and E > 2:
        s[4, :2] = s[4, 2]  # ties at the k-th score
    return s.to(dtype)


@pytest.mark.parametrize(
    ("T", "E", "K", "extra"),
    [(0, 5, 2, 0), (1, 1, 1, 0), (1, 7, 2, 3), (7, 9, 3, 1), (6, 5, 8, 0), (9, 33, 8, 2), (3, 129, 8, 0)],
)
@pytest.mark.parametrize(
    ("dtype", "width"), [(torch.float32, 2.0), (torch.bfloat16, 0.5), (torch.float16, 7.0)]
)
def test_kernel_equals_reference_and_host_form(T, E, K, extra, dtype, width):
    g = torch.Generator().manual_seed(T * 100 + E + K)
    scores = _scores(T, E, extra, dtype, g)
    ids = torch.randint(-1, E + 2, (T, K), generator=g)
    if T > 5:
        ids[5] = -1  # a padding lane: no vote
    scale = torch.tensor([RAMP / width], dtype=torch.float64)
    base = torch.randint(0, 1000, (E + 2,), generator=g) * MEMBER_UNIT
    got, want = base.clone(), base.clone()
    add_membership(scores, ids, got, E, scale, MEMBER_UNIT)
    add_membership_reference(scores, ids, want, E, scale, MEMBER_UNIT)
    diff = (got != want).nonzero().flatten()
    assert diff.numel() == 0, f"differs at {diff[:6].tolist()}: {got[diff[:6]]} vs {want[diff[:6]]}"
    valid = [any(0 <= e < E for e in row) for row in ids.tolist()]
    host = membership_units_host(scores[:, :E].double().tolist(), valid, K, E, width)
    assert (got[:E] - base[:E]).tolist() == [u * MEMBER_UNIT for u in host]
    assert torch.equal(got[E:], base[E:])  # past E: untouched
    if T >= 2:
        assert int((got - base).sum()) > 0


def test_a_strided_slice_of_wider_scores():
    """The planner hands the layer's columns of a wider logits tensor: row stride > E."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 40, generator=g)
    scores = wide[:, 3:20]  # [5, 17], row stride 40
    ids = torch.randint(0, 11, (5, 4), generator=g)
    scale = torch.tensor([RAMP / 2.0], dtype=torch.float64)
    got, want = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    add_membership(scores, ids, got, 11, scale, 1)
    add_membership_reference(scores.contiguous(), ids, want, 11, scale, 1)
    assert torch.equal(got, want) and int(got.sum()) > 0


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_every_copy_of_a_two_dimensional_member_gets_the_units(copies: int) -> None:
    """The duel's two memberships (a `[C, >= E]` view of a wider state: row stride past E): each row gets the
    units a 1-D slice gets, from different starting values; the columns past E stay."""
    g = torch.Generator().manual_seed(copies)
    E, T, K = 13, 6, 3
    scores = torch.randn(T, E, generator=g) * 2
    ids = torch.randint(-1, E, (T, K), generator=g)
    scale = torch.tensor([RAMP / 1.5], dtype=torch.float64)
    state = torch.randint(0, 500, (copies, 40), generator=g) * MEMBER_UNIT
    got = state.clone()
    add_membership(scores, ids, got[:, 5 : 5 + E + 2], E, scale, MEMBER_UNIT)  # [C, E + 2], row stride 40
    units = torch.zeros(E, dtype=torch.int64)
    add_membership_reference(scores, ids, units, E, scale, MEMBER_UNIT)
    assert int(units.sum()) > 0
    want = state.clone()
    want[:, 5 : 5 + E] += units
    bad = (got != want).nonzero().tolist()
    assert not bad, f"differs at {bad[:6]}"


def test_bad_input_is_refused_and_changes_nothing():
    scores, ids = torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64)
    member, scale = torch.zeros(8, dtype=torch.int64), torch.tensor([32.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"scores: shape \(3, 8\).*\[T, >= 9\]"):
        add_membership(scores, ids, member, 9, scale, 1)
    with pytest.raises(ValueError, match="unit stride"):
        add_membership(torch.randn(8, 3).t(), ids, member, 8, scale, 1)
    with pytest.raises(ValueError, match=r"ids: shape \(2, 2\)"):
        add_membership(scores, ids[:2], member, 8, scale, 1)
    with pytest.raises(ValueError, match="member: shape"):
        add_membership(scores, ids, member.int(), 8, scale, 1)
    with pytest.raises(ValueError, match="scale: shape"):
        add_membership(scores, ids, member, 8, scale.float(), 1)
    assert int(member.abs().sum()) == 0
