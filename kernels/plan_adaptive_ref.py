"""Torch reference of `plan_adaptive` (same signature, same in-place results): whole-tensor sorts and pairwise
comparisons where the kernel searches keys one pair at a time. Written from the rule in `plan_adaptive.py`'s
docstring, not from the kernel; tests compare the two at awkward sizes."""

from __future__ import annotations

import torch

from .plan_adaptive import NEVER, AdaptiveRule, AdaptiveState

INT64_MAX = torch.iinfo(torch.int64).max


def plan_adaptive_reference(
    ids: torch.Tensor,
    l2p: torch.Tensor,
    row_owner: torch.Tensor,
    row_stamp: torch.Tensor,
    clock: torch.Tensor,
    counters: torch.Tensor,
    counts: torch.Tensor,
    victims: torch.Tensor,
    codes: torch.Tensor,
    valid: torch.Tensor,
    layer: int,
    num_experts: int,
    max_experts: int,
    num_rows: int,
    block_m: int,
    min_reads: int,
    state: AdaptiveState,
    rule: AdaptiveRule,
) -> None:
    """`plan_adaptive` in torch ops (no Triton); `counts` is left as it was."""
    E, EM, R, L = num_experts, max_experts, num_rows, rule.num_layers
    lo = layer * EM
    flat_ids = ids.to(torch.int64)
    routed = (flat_ids >= 0) & (flat_ids < E)
    tokens = torch.bincount(flat_ids[routed], minlength=E)[:E]  # [E]
    present = tokens > 0
    now = int(clock.item()) + 1
    clock.fill_(now)
    value_counts = _observe(state, rule, layer, lo, present, now, R)

    code = l2p[lo : lo + E].to(torch.int64)
    hit, miss = present & (code < R), present & (code >= R)
    row_stamp[code[hit]] = now
    cand = miss & ((tokens + block_m - 1) // block_m >= min_reads)
    mode = int(state.mode.item())
    value = value_counts[lo : lo + E]
    experts = sorted(torch.nonzero(cand).flatten().tolist(), key=lambda e: (-int(value[e]) * mode, e))

    stamp, owner = row_stamp[:R].tolist(), row_owner[:R].tolist()
    vkeys = {}
    for r in range(R):
        if stamp[r] == now:
            continue
        if owner[r] < 0:
            vkeys[r] = (-1, (stamp[r] + 1) * R + r)
        else:
            v = (int(value_counts[owner[r]]) + rule.bonus * int(now - stamp[r] < L)) * mode
            vkeys[r] = (v, (stamp[r] + 1) * R + r)
    rows = sorted(vkeys, key=lambda r: vkeys[r])
    valid.zero_()
    victims.zero_()
    codes.fill_(R)
    admitted = evicted = 0
    for i, (e, r) in enumerate(zip(experts[: victims.shape[0]], rows)):
        old = owner[r]
        admit = old < 0 or mode == 0 or int(value[e]) + rule.bonus >= vkeys[r][0]
        victims[i], codes[i], valid[i] = r, R + e, int(admit)
        if admit:
            if old >= 0:
                l2p[old] = R + old % EM
                evicted += 1
            l2p[lo + e], row_owner[r], row_stamp[r] = r, lo + e, now
            admitted += 1
    num_hits, num_misses = int(hit.sum()), int(miss.sum())
    counters += torch.tensor(
        [num_hits, num_misses, admitted, num_misses - admitted, evicted],
        dtype=torch.int64,
        device=counters.device,
    )


def _orders(state: AdaptiveState, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The memberships `[n]` and ranked counts `[n + 1]` of each order: none without the router, one with it,
    slow then fast with the duel (views of `state.member` / `state.ranked`)."""
    if state.member is None or state.ranked is None:
        return [], []
    copies = 2 if state.order_misses is not None else 1
    return list(state.member.view(copies, n)), list(state.ranked.view(copies, n + 1))


def _frequency_out(
    value_counts: torch.Tensor, last_all: torch.Tensor, lo: int, e: int, now: int, L: int, rule: AdaptiveRule,
    num_rows: int,
) -> bool:  # fmt: skip
    """Is expert `e` of the layer at `lo` outside an idealized frequency cache of `num_rows` rows ranked by
    (value + recent bonus, last use), as of the previous tick?"""
    n = last_all.shape[0]
    value_all = value_counts[:n] + rule.bonus * ((now - 1 - last_all) < L).to(torch.int64)
    t, v = int(last_all[lo + e]), int(value_all[lo + e])
    above = (value_all > v) | ((value_all == v) & (last_all > t))
    return t == NEVER or int(above.sum()) >= num_rows


def _observe(
    state: AdaptiveState,
    rule: AdaptiveRule,
    layer: int,
    lo: int,
    present: torch.Tensor,
    now: int,
    num_rows: int,
) -> torch.Tensor:
    """The policy's update: shadows, decays, misses, mode, chain starts, last use; with the router, the ranked
    counts of the layer; with the duel, the order duel. Returns the counts the decisions read (the chosen
    order's ranked counts with the router, else the counts)."""
    L, E = rule.num_layers, present.shape[0]
    n = state.last_use.shape[0]
    last_all = state.last_use
    members, rankeds = _orders(state, n)
    duel = state.order_misses is not None and state.order_state is not None
    chosen = int(state.order_state[0]) if duel else 0  # type: ignore[index]
    shadow_counts = rankeds[chosen] if rankeds else state.count
    lru_only = freq_only = 0
    order_only = [0, 0]  # the duel: misses of the slow / fast order's frequency shadow only
    for e in torch.nonzero(present).flatten().tolist():
        t = int(last_all[lo + e])
        lru_out = t == NEVER or int((last_all > t).sum()) >= num_rows
        freq_out = _frequency_out(shadow_counts, last_all, lo, e, now, L, rule, num_rows)
        lru_only += int(lru_out and not freq_out)
        freq_only += int(freq_out and not lru_out)
        if duel:
            slow, fast = (_frequency_out(r, last_all, lo, e, now, L, rule, num_rows) for r in rankeds)
            order_only[0] += int(slow and not fast)
            order_only[1] += int(fast and not slow)
    if layer == 0:
        state.count.sub_(state.count >> rule.decay_shift)
        shifts = (rule.member_decay_shift, rule.fast_decay_shift)
        for member, ranked, shift in zip(members, rankeds, shifts):
            member.sub_(member >> shift)
            ranked.sub_(ranked >> rule.decay_shift)
    state.mode.fill_(_duel(state.misses, [lru_only, freq_only], layer == 0, rule, rule.floor))
    if duel:
        order_misses, order_state = state.order_misses, state.order_state
        assert order_misses is not None and order_state is not None
        chosen = _duel(order_misses, order_only, layer == 0, rule, rule.order_floor)
        order_state[0] = chosen  # the order chosen, ticks that ended with it fast, all ticks
        order_state[1] += chosen
        order_state[2] += 1
    last = last_all[lo : lo + E]
    state.count[lo : lo + E] += (present & (last != now - L)).to(torch.int64) * rule.one
    last.copy_(torch.where(present, now, last))
    em = n // L
    count = state.count[lo : lo + em].tolist()
    curve = sorted(count, reverse=True)
    for member, ranked in zip(members, rankeds):
        layer_member = member[lo : lo + em].tolist()
        order = sorted(range(em), key=lambda e: (-layer_member[e], -count[e], e))
        for c, e in zip(curve, order):
            ranked[lo + e] = c
    return rankeds[chosen] if rankeds else state.count


def _duel(misses: torch.Tensor, only: list[int], decay: bool, rule: AdaptiveRule, floor: int) -> int:
    """Set dueling: `misses [2]` (decayed first if `decay`) += `only` (first-only, second-only misses) x score;
    1 when the second wins clearly. The mode (LRU, frequency) and the duel's order (slow, fast)."""
    if decay:
        misses.sub_(misses >> rule.duel_shift)
    misses.add_(torch.tensor(only, dtype=torch.int64, device=misses.device) * rule.score)
    first, second = (int(x) for x in misses.tolist())
    return int(second + (second >> rule.margin_shift) + floor < first)
