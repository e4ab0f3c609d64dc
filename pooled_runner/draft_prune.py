"""Miss-aware draft-lane pruning for MTP verify steps: draft tokens never cause host traffic only they need.

A verify step carries `1 + num_spec` lanes per request, request-major (`lanes.py`, SGLang's TARGET_VERIFY
layout): request r owns tokens `r * (1 + n) .. r * (1 + n) + n`; lane 0 is the verified token, lanes 1..n its
chain drafts. With adjacent-token expert overlap of 0.3-0.4 the drafts roughly triple a step's distinct experts,
and so its PCIe bytes for misses, while adding only ~1.2 expected tokens per request (acceptance 0.6).

Rule, per pooled layer of a verify step, before planning (on the device, no host sync, graph-capturable):
  - an expert is *paid* if it is resident (`l2p` code < R; a code of -1, not an expert here, counts as paid:
    it moves nothing) or routed by the lane 0 of any request (lane 0 is never pruned: its misses are read or
    admitted anyway);
  - a draft lane *dies* at this layer when its unpaid routes in this step so far (this layer's and the earlier
    layers') exceed `max_draft_misses` (default 0: any unpaid route kills it), or when a lower lane of its
    request is dead (chain: a dead lane kills every higher lane); a budget per step, not per layer, bounds the
    host bytes a live draft can cost (at most `max_draft_misses` rows) whatever the number of layers;
  - a dead lane stays dead for the rest of the step (`lane_alive [T]`, a device buffer at a stable address,
    reset by `arm()` at the start of each verify step with the per-lane miss totals: device fills, captured with
    the step when called inside a capture);
  - its routes become padding (ids -1, weights 0), so it admits nothing, reads nothing from the host, computes
    nothing, and telemetry records only live lanes' routes (-1 is padding there, never the poison bit).
Unpaid experts routed by live draft lanes within the budget are planned as usual (admitted or read); they do
not become paid for other draft lanes (kept simple).

Exactness: a dead lane's output (and every later layer's input for it) is garbage, so the verifier may accept
drafts of request r only up to its last live lane `m_r` (lanes are a chain, so the live lanes are 0..m_r):
emitted tokens = min(accepted drafts, m_r) + 1, every one of them computed as without pruning: live lanes keep
their routes and weights, and a token's expert outputs do not depend on the other tokens of the step (the torch
path is batch-invariant, bit for bit; on the kernels the step keeps its width T, dead lanes being padding, and
the GPU test checks live lanes against the unpruned routing). Lane 0 is never killed, so a step never yields
fewer tokens than num_spec 0. With `max_draft_misses` 0 a live draft lane adds no host bytes at all: its experts are
resident (planned as hits, so this step cannot evict them) or lane 0's.

The caller reads `lane_alive` after the step (its own sync, outside any capture). The SGLang verify step does
not read it yet, so serving leaves pruning off (`PoolConfig.draft_pruning`); the decode bench uses it.

One layer's rule runs as one Triton launch on CUDA (`kernels/draft_prune.py`, `draft_prune`) and as torch ops
elsewhere (`draft_prune_reference`, same signature); `prune_reference` below is an independent plain-Python
form, for tests.
"""

from __future__ import annotations

import torch

from pooled_runner.kernels.draft_prune import draft_prune, draft_prune_reference


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DraftPruner:
    """Per-step draft-lane pruning state of one `PooledMoE` (see module docstring).

    Usage: `arm(num_spec, max_tokens)` before each verify step (its layers follow, in increasing layer order;
    a call at a layer <= the previous one starts a new step), `prune(...)` in every pooled layer, then read
    `lane_alive()` after the step. A step that was not armed is not pruned.

    Args:
      device: where `lane_alive` lives (the pool device).
      max_draft_misses: unpaid routes a draft lane may have in one step and stay alive (>= 0).
      fused: one Triton launch per layer (`kernels/draft_prune.py`); None = on CUDA. True on the CPU runs it
        under the Triton interpreter (tests).
    """

    def __init__(self, device: torch.device, max_draft_misses: int = 0, fused: bool | None = None):
        if max_draft_misses < 0:
            raise ValueError(f"max_draft_misses={max_draft_misses} must be >= 0")
        self.device = torch.device(device)
        self.max_draft_misses = max_draft_misses
        self.fused = self.device.type == "cuda" if fused is None else fused
        self.lane_alive_gpu: torch.Tensor | None = None  # [max_tokens] bool, allocated outside capture
        self.lane_misses_gpu: torch.Tensor | None = None  # [max_tokens] int32: unpaid routes so far this step
        self.num_spec = 0  # drafts per request of the armed / current step
        self._armed = False
        self._active = False  # the current step is a pruned verify step
        self._last_layer: int | None = None
        self._num_tokens = 0  # width of the current step
        self._verify_tokens = 0  # width of the last verify step (armed) Python ran, eagerly or under capture

    def arm(self, num_spec: int, max_tokens: int) -> None:
        """Mark the next step a verify step with `num_spec` drafts per request; reset `lane_alive` to all live.

        Graph-safe: the reset is a device fill (captured when called inside a capture). The buffer is
        allocated (or grown to `max_tokens`) on first use, which must happen outside a capture.
        """
        if num_spec < 1:
            raise ValueError(f"num_spec={num_spec} must be >= 1 (a verify step has drafts to prune)")
        if max_tokens < 1 + num_spec:
            raise ValueError(f"max_tokens={max_tokens} is below one request's lanes (1 + {num_spec})")
        if self.lane_alive_gpu is None or self.lane_alive_gpu.shape[0] < max_tokens:
            if _capturing():
                raise RuntimeError(
                    "draft pruning's lane_alive buffer must be allocated outside a CUDA graph capture: "
                    "run one verify step eagerly before capturing"
                )
            self.lane_alive_gpu = torch.ones(max_tokens, dtype=torch.bool, device=self.device)
            self.lane_misses_gpu = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)
        assert self.lane_misses_gpu is not None
        self.lane_alive_gpu.fill_(True)
        self.lane_misses_gpu.fill_(0)
        self.num_spec = num_spec
        self._armed = True
        self._last_layer = None

    def _begin_layer(self, layer: int, num_tokens: int) -> bool:
        """Step bookkeeping: whether this layer call belongs to a pruned verify step."""
        if self._last_layer is None or layer <= self._last_layer:  # a new step
            self._active, self._armed = self._armed, False
            self._num_tokens = num_tokens
            if self._active:
                self._verify_tokens = num_tokens
        self._last_layer = layer
        if self._active and num_tokens != self._num_tokens:
            raise ValueError(f"layer {layer}: {num_tokens} tokens in a verify step of {self._num_tokens}")
        return self._active

    def prune(
        self,
        layer: int,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        l2p_layer: torch.Tensor,
        num_rows: int,
        num_experts: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_ids, topk_weights)` of one pooled layer with dead lanes' routes turned into padding.

        Args:
          topk_ids: `[T, K]` int32/int64 (-1 padding); T = requests x (1 + num_spec) on a verify step.
          topk_weights: `[T, K]` floating.
          l2p_layer: `[>= E]` int32 location codes of the layer before this step plans it (contiguous).
          num_rows: R. num_experts: E of the layer.
        Returns the inputs themselves when the step is not an armed verify step; else new tensors of the same
        dtypes, and `lane_alive[:T]` updated in place. No host sync. ValueError when T does not split into
        requests of 1 + num_spec lanes or exceeds the buffer.
        """
        if not self._begin_layer(layer, topk_ids.shape[0]):
            return topk_ids, topk_weights
        assert self.lane_alive_gpu is not None and self.lane_misses_gpu is not None
        T = topk_ids.shape[0]
        lanes = 1 + self.num_spec
        if T % lanes or T > self.lane_alive_gpu.shape[0]:
            raise ValueError(
                f"verify step of {T} tokens: expected requests x (1 + num_spec {self.num_spec}) <= "
                f"{self.lane_alive_gpu.shape[0]} tokens"
            )
        prune = draft_prune if self.fused else draft_prune_reference
        return prune(
            topk_ids.contiguous(),
            topk_weights.contiguous(),
            l2p_layer,
            self.lane_alive_gpu[:T],
            self.lane_misses_gpu[:T],
            num_rows,
            num_experts,
            self.num_spec,
            self.max_draft_misses,
        )

    def lane_alive(self, num_tokens: int | None = None) -> torch.Tensor:
        """`[T]` bool device view of the last verify step's live lanes (stable address; a replayed graph
        updates it). T: `num_tokens`, else the width of the last verify step Python ran (eagerly or while
        capturing); pass it after replaying a graph of another width. Steps that were not armed leave it alone.
        Read it after the step (outside capture). RuntimeError before any verify step; ValueError for a width
        beyond the buffer."""
        if self.lane_alive_gpu is None or not self._verify_tokens:
            raise RuntimeError("no verify step has run with draft pruning armed")
        T = self._verify_tokens if num_tokens is None else num_tokens
        if not 0 < T <= self.lane_alive_gpu.shape[0]:
            raise ValueError(f"num_tokens={T}: expected 1..{self.lane_alive_gpu.shape[0]}")
        return self.lane_alive_gpu[:T]


def prune_reference(
    topk_ids: list[list[int]],
    lane_alive: list[bool],
    l2p_layer: list[int],
    num_rows: int,
    num_experts: int,
    num_spec: int,
    max_draft_misses: int = 0,
    lane_misses: list[int] | None = None,
) -> list[bool]:
    """Plain-Python form of one layer's rule (independent, for tests): lanes alive after this layer, from
    `topk_ids [T][K]`, the lanes alive before it and the layer's location codes. `lane_misses` (the unpaid
    routes of each lane in the step's earlier layers, default none) gets this layer's added in place."""
    lanes = 1 + num_spec
    T = len(topk_ids)
    assert T % lanes == 0 and len(lane_alive) == T, (T, lanes, len(lane_alive))

    def routed(e: int) -> bool:
        return 0 <= e < num_experts

    paid = {e for e in range(num_experts) if l2p_layer[e] < num_rows}
    for r in range(T // lanes):
        paid |= {e for e in topk_ids[r * lanes] if routed(e)}
    misses = lane_misses if lane_misses is not None else [0] * T
    out = []
    for t in range(T):
        misses[t] += sum(1 for e in topk_ids[t] if routed(e) and e not in paid)
        if t % lanes == 0:
            out.append(True)
            continue
        out.append(lane_alive[t] and out[t - 1] and misses[t] <= max_draft_misses)
    return out


def emitted_per_request(lane_alive: list[bool], num_spec: int, accept: float) -> list[float]:
    """Expected tokens each request emits from a verify step whose live lanes are `lane_alive` (chain drafts,
    each accepted with probability `accept`): `1 + sum_{j=1..m} accept^j`, m = the request's last live lane."""
    lanes = 1 + num_spec
    out = []
    for r in range(len(lane_alive) // lanes):
        m = 0
        while m < num_spec and lane_alive[r * lanes + m + 1]:
            m += 1
        out.append(sum(accept**j for j in range(m + 1)))
    return out
