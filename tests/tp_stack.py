"""A model-shaped pooled MoE stack under tensor parallelism, one process per rank (gloo on CPU, NCCL on GPUs).

Shared by tests/test_tp.py (two CPU processes, gloo, tiny shapes), tests/test_tp_gpu.py (two H200s, NCCL) and
bench/tp.py. Every rank builds a `PooledMoE` over its shard (`pooled_runner.tp.shard_expert`) of every
expert, generated from one seed, with its own bank and `pool_rows` rows; then runs `steps` decode steps of
`tokens` tokens through all layers like a model: the router is replicated (`x @ gate.T`, softmax top-k),
each layer's pooled output is all-reduced over the ranks and added to the residual, so routing is computed
from replicated hidden states as in SGLang. Each layer's all-reduced output is compared with the unsharded
expert computation on the same inputs (fp32 reference, full weights); the location tables are compared
across ranks (`verify_tables_agree` of each rank's `PooledMoE`, which syncs the device planner's tables on
CUDA) every `check_every` steps; finally rank 1 alone gives back one of layer 1's rows (`evict_expert`, a
boundary operation) and the check must stop both ranks with `TablesDisagree`. Counters come from
`PooledMoE.stats()` (device-planned steps included).

Results: one JSON per rank in `out_dir` (`rank{r}.json`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pooled_runner.config import PoolConfig
from pooled_runner.moe import PooledMoE
from pooled_runner.tp import TablesDisagree, shard_expert, verify_tables_agree

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class StackSpec:
    num_layers: int = 3
    num_experts: int = 8
    hidden: int = 16
    intermediate: int = 12  # full expert intermediate size; each rank holds intermediate / world
    top_k: int = 2
    pool_rows: int = 4  # per rank
    dtype: str = "float32"
    steps: int = 40
    tokens: int = 3  # tokens per decode step
    prefill_tokens: int = 0  # > 0: one prefill step of this many tokens first (staged on CUDA when >= 512)
    check_every: int = 5
    warmup_steps: int = 3  # steps left out of the timing
    seed: int = 0
    reference: bool = True  # compare with the unsharded computation (rank 0)
    # Generate expert weights on the rank's GPU (fast; the bench) instead of the CPU (bit-identical in every
    # process whatever the device; the tests, where rank 0's reference must match rank 1's shards exactly).
    generate_on_device: bool = False


def _gen(seed: int, *key: int, device: torch.device | None = None) -> torch.Generator:
    mixed = seed
    for k in key:
        mixed = (mixed * 1_000_003 + k + 1) % (1 << 62)
    return torch.Generator(device=device or "cpu").manual_seed(mixed)


def full_expert(
    spec: StackSpec, layer: int, expert: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (unsharded) fp32 weights `w13 [2I, H]`, `w2 [H, I]` of one expert, generated on `device`: the same
    in every process using that kind of device (Philox on CUDA is counter-based, so cuda:0 and cuda:1 agree)."""
    device = device or torch.device("cpu")
    g = _gen(spec.seed, 1, layer, expert, device=device)
    w13 = torch.randn(2 * spec.intermediate, spec.hidden, generator=g, device=device) / spec.hidden**0.5
    w2 = torch.randn(spec.hidden, spec.intermediate, generator=g, device=device) / spec.intermediate**0.5
    return w13, w2


def router_weight(spec: StackSpec, layer: int) -> torch.Tensor:
    """`[E, H]` router; a per-expert bias row makes some experts hot (a realistic, skewed hit rate)."""
    g = _gen(spec.seed, 2, layer)
    return torch.randn(spec.num_experts, spec.hidden, generator=g) * (2.0 / spec.hidden**0.5)


def route(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of `x @ gate.T` in fp32: ids `[T, K]` int32 and renormalized weights `[T, K]` fp32."""
    probs = torch.softmax(x.float() @ gate.float().T, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def reference_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Unsharded routed-experts output in fp32 (full weights), `[T, H]`."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13, w2 = experts[e]
        w13f, w2f = w13.to(x.device).float(), w2.to(x.device).float()
        gate_up = xf[tok] @ w13f.T
        inter = w13f.shape[0] // 2
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tok, weights[tok, slot, None].float() * (act @ w2f.T))
    return out


def build_rank_moe(spec: StackSpec, rank: int, world: int, device: torch.device) -> PooledMoE:
    """This rank's pooled stack: its shard of every expert, its own bank and `pool_rows` rows."""
    config = PoolConfig.resolve(pool_rows=spec.pool_rows, device=str(device))
    gen_device = device if spec.generate_on_device else torch.device("cpu")
    moe = PooledMoE(config, spec.hidden, spec.intermediate // world, spec.top_k, _DTYPES[spec.dtype])
    for _ in range(spec.num_layers):
        moe.register_layer(spec.num_experts)

    def loader(layer: int, expert: int) -> dict[str, torch.Tensor]:
        w13, w2 = shard_expert(*full_expert(spec, layer, expert, gen_device), rank, world)
        return moe.format.quantize(w13, w2)

    moe.install(loader)
    return moe


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rank(rank: int, world: int, spec_json: str, init_method: str, out_dir: str) -> None:
    """Entry of one rank (`torch.multiprocessing.spawn(run_rank, args=(world, spec, init, out), nprocs=world)`)."""
    import torch.distributed as dist

    spec = StackSpec(**json.loads(spec_json))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        result = _run(spec, rank, world, device)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


def _diverge(moe: PooledMoE, spec: StackSpec, device: torch.device) -> None:
    """Rank 1 alone changes layer 1's table through the boundary paths (on CUDA the device planner's state is
    synced, changed and loaded back): it gives back a row of layer 1, else plans one step of layer 1 alone,
    routed to an expert not in a row."""
    layer = min(1, spec.num_layers - 1)
    pool = moe.sync_tables()
    owners = [o for o in pool.row_owner if o is not None and o[0] == layer]
    if owners:
        moe.evict_expert(*owners[0])
        return
    missing = [e for e in range(spec.num_experts) if not pool.is_resident(layer, e)]
    ids = torch.tensor([missing[:1] + [-1] * (spec.top_k - 1)], dtype=torch.int32, device=device)
    x = torch.zeros(1, spec.hidden, dtype=_DTYPES[spec.dtype], device=device)
    moe.forward(layer, x, ids, torch.ones(ids.shape, dtype=x.dtype, device=device))


def _run(spec: StackSpec, rank: int, world: int, device: torch.device) -> dict[str, object]:
    import torch.distributed as dist

    dtype = _DTYPES[spec.dtype]
    t0 = time.perf_counter()
    moe = build_rank_moe(spec, rank, world, device)
    install_s = time.perf_counter() - t0
    pool, bank = moe.pool, moe.bank
    assert pool is not None
    gates = [router_weight(spec, i).to(device) for i in range(spec.num_layers)]
    gen_device = device if spec.generate_on_device else torch.device("cpu")
    full = None
    if spec.reference and rank == 0:
        full = [
            [
                tuple(t.to(dtype).to(device) for t in full_expert(spec, i, e, gen_device))
                for e in range(spec.num_experts)
            ]
            for i in range(spec.num_layers)
        ]
    g = torch.Generator().manual_seed(spec.seed + 17)
    max_rel, max_abs, num_checks, step_ms = 0.0, 0.0, 0, []
    lengths = ([spec.prefill_tokens] if spec.prefill_tokens else []) + [spec.tokens] * spec.steps
    for step, T in enumerate(lengths):
        x = torch.randn(T, spec.hidden, generator=g).to(dtype).to(device)  # the same on every rank
        moe_s = 0.0  # pooled forward + all-reduce of every layer (routing and the reference left out)
        for layer in range(spec.num_layers):
            ids, weights_fp32 = route(x, gates[layer], spec.top_k)
            weights = weights_fp32.to(dtype)
            if world > 1:  # rank 0 computed a reference after the last layer: start the clock together
                dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()
            _sync(device)
            start = time.perf_counter()
            out = moe.forward(layer, x, ids, weights)  # [T, H] this rank's share of the experts' output
            dist.all_reduce(out)
            _sync(device)
            moe_s += time.perf_counter() - start
            if full is not None:
                ref = reference_moe(x, ids, weights, full[layer])  # type: ignore[arg-type]
                diff = (out.float() - ref).abs()
                max_abs = max(max_abs, float(diff.max()))
                max_rel = max(max_rel, float(diff.norm() / ref.norm().clamp_min(1e-30)))
            x = x + out
        if step >= spec.warmup_steps + (1 if spec.prefill_tokens else 0):
            step_ms.append(moe_s * 1e3)
        if (step + 1) % spec.check_every == 0:
            verify_tables_agree(moe, step + 1, device=device)  # the moe: syncs the device planner's tables
            num_checks += 1
    verify_tables_agree(moe, len(lengths), device=device)
    num_checks += 1
    stats = moe.stats()  # device-planned steps included (on CUDA the pool's own counters miss them)
    l2p = moe.sync_tables().l2p_host.tolist()  # before the forced disagreement below
    disagreement = ""
    if world > 1:
        if rank == 1:
            _diverge(moe, spec, device)
        try:
            verify_tables_agree(moe, len(lengths) + 1, device=device)
        except TablesDisagree as exc:
            disagreement = str(exc)
    return {
        "rank": rank,
        "world": world,
        "device": str(device),
        "spec": dataclasses.asdict(spec),
        "intermediate_per_rank": moe.intermediate_size,
        "row_bytes": pool.row_bytes,
        "pool_bytes": pool.nbytes,
        "bank_bytes": bank.nbytes if bank is not None else 0,
        "install_s": install_s,
        "max_rel_err": max_rel,
        "max_abs_err": max_abs,
        "num_checks": num_checks,
        "hits": stats.hits,
        "misses": stats.misses,
        "admissions": stats.admissions,
        "evictions": stats.evictions,
        "bytes_copied_to_rows": stats.bytes_copied_to_rows,
        "bytes_read_host_view": stats.bytes_read_host_view,
        "step_ms": step_ms,
        "step_ms_median": statistics.median(step_ms) if step_ms else 0.0,
        "disagreement": disagreement,
        "l2p": l2p,
    }


def launch(spec: StackSpec, world: int, out_dir: Path, port: int) -> list[dict[str, object]]:
    """Run `world` ranks of the stack (torch.multiprocessing spawn) and return their results, rank order."""
    import torch.multiprocessing as mp

    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # CPU ranks share few cores
    init = f"tcp://127.0.0.1:{port}"
    mp.spawn(run_rank, args=(world, json.dumps(dataclasses.asdict(spec)), init, str(out_dir)), nprocs=world)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
