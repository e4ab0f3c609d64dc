"""`DenseLoader`: dense shards written piece by piece (as SGLang's per-expert loader does) into a pool of every
weight format. The bank rows must equal the format's converter applied to the whole dense expert, whatever the
order the shards arrive in, and the pooled forward must equal the dense reference on the dequantized weights."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pooled_runner import PoolConfig, PooledMoE
from pooled_runner.dense_load import DenseLoader
from pooled_runner.formats import make_format
from tests.reference import dense_reference, random_expert_weights, random_routing

H, I = 64, 32  # the smallest sizes every format's groups divide (int4 group 32, NVFP4 16)
EXPERTS = (5, 3)  # odd, and different per layer
K = 2

FORMATS = ["bf16", "int4-g32", "int4-g32-zp", "fp8", "fp8-b16", "fp8-b128", "nvfp4"]


def _moe(fmt: str, rows: int, dtype: torch.dtype) -> PooledMoE:
    moe = PooledMoE(PoolConfig.resolve(pool_rows=rows, device="cpu", weight_format=fmt), H, I, K, dtype)
    for num_experts in EXPERTS:
        moe.register_layer(num_experts)
    moe.allocate()
    return moe


def _shard(w: dict[str, torch.Tensor], shard: str) -> tuple[str, slice, torch.Tensor]:
    """(operand, rows of the dense operand, the checkpoint tensor) of one shard: w1 the gate rows of w13, w3
    the up rows (as SGLang's loader places them), w2 all of w2."""
    if shard == "w2":
        return "w2", slice(None), w["w2"]
    part = slice(0, I) if shard == "w1" else slice(I, 2 * I)
    return "w13", part, w["w13"][part]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """SGLang loads weights under the model's dtype as torch's default (`set_default_torch_dtype`)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _load_shuffled(loader: DenseLoader, weights: dict, seed: int) -> None:
    """Every shard of every expert, in a random order across experts (so several are in flight at once),
    under the model's dtype as the default one, as SGLang loads."""
    order = [(layer, e, s) for layer, n in enumerate(EXPERTS) for e in range(n) for s in ("w1", "w3", "w2")]
    g = torch.Generator().manual_seed(seed)
    with default_dtype(loader.moe.dtype):
        for i in torch.randperm(len(order), generator=g).tolist():
            layer, e, shard = order[i]
            operand, part, tensor = _shard(weights[(layer, e)], shard)
            loader.expert_views(layer, e)[operand][part].copy_(tensor)
            loader.written(layer, e, shard)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [K, sum(EXPERTS)])  # a bank and a pool of K rows; every expert resident
def test_rows_equal_the_converter_and_forward_equals_reference(fmt: str, rows: int) -> None:
    dtype = torch.float32 if fmt == "bf16" else torch.bfloat16
    seed = FORMATS.index(fmt) * 10 + rows
    weights = random_expert_weights(len(EXPERTS), max(EXPERTS), H, I, dtype, seed)
    moe = _moe(fmt, rows, dtype)
    loader = DenseLoader(moe)
    assert loader.in_place(0) == loader.in_place(1) == (fmt == "bf16")
    _load_shuffled(loader, weights, seed)
    assert loader.num_pending == 0
    for layer in range(len(EXPERTS)):
        assert loader.missing(layer) == []
    if fmt == "bf16":
        assert loader.peak_pending == 0 and loader.num_quantized == 0
    else:
        assert loader.peak_pending > 1 and loader.num_quantized == sum(EXPERTS)
    # the rows, before finalize moves them, against the format's converter on the whole dense expert
    converter = make_format(fmt, dtype)
    for layer, n in enumerate(EXPERTS):
        for e in range(n):
            w = weights[(layer, e)]
            expected = converter.quantize(w["w13"], w["w2"])
            got = moe.expert_rows(layer, e)
            assert set(got) == set(expected)
            for name, tensor in expected.items():
                assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), (
                    f"{fmt} layer {layer} expert {e} {name}: first differing byte at "
                    f"{(got[name].view(torch.uint8) != tensor.view(torch.uint8)).nonzero()[:1].tolist()}"
                )
    moe.finalize()
    # the forward computes with the dequantized weights: bit-equal to the dense reference on them
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(4):
        layer = step % len(EXPERTS)
        dense = {}
        for e in range(EXPERTS[layer]):
            w13, w2 = converter.expert_weights(converter.quantize(**weights[(layer, e)]))
            dense[e] = {"w13": w13, "w2": w2}
        T = (1, 7, 0, 3)[step]
        hidden = torch.randn(T, H, generator=g).to(dtype)
        ids, topk_w = random_routing(T, K, EXPERTS[layer], g)
        out = moe.forward(layer, hidden, ids, topk_w)
        ref = dense_reference(hidden, ids, topk_w, dense)
        mismatch = (out != ref).nonzero()
        assert mismatch.numel() == 0, f"{fmt} step {step}: first mismatches at {mismatch[:5].tolist()}"
    if rows < sum(EXPERTS):
        assert moe.stats().misses > 0


def test_bf16_writes_land_in_the_bank_in_place() -> None:
    moe = _moe("bf16", K, torch.float32)
    loader = DenseLoader(moe)
    rows, bank = loader.expert_views(1, 2), moe.expert_rows(1, 2)
    assert all(rows[n].data_ptr() == bank[n].data_ptr() for n in ("w13", "w2"))
    loader.written(1, 2, "w2")
    assert loader.missing(1) == [
        *(f"expert {e} {s}" for e in range(2) for s in ("w1", "w3", "w2")),
        "expert 2 w1",
        "expert 2 w3",
    ]


def test_quantized_experts_wait_for_their_last_shard() -> None:
    dtype = torch.bfloat16
    weights = random_expert_weights(1, 1, H, I, dtype, seed=3)[(0, 0)]
    moe = _moe("int4-g32", K, dtype)
    loader = DenseLoader(moe)
    before = {n: t.clone() for n, t in moe.expert_rows(0, 0).items()}
    for shard in ("w3", "w2"):
        operand, part, tensor = _shard(weights, shard)
        loader.expert_views(0, 0)[operand][part].copy_(tensor)
        loader.written(0, 0, shard)
    assert loader.num_pending == 1 and loader.missing(0)[:1] == ["expert 0 w1"]
    # nothing quantized yet (bytes: the bank is allocated empty, and NaN != NaN)
    assert all(
        torch.equal(moe.expert_rows(0, 0)[n].view(torch.uint8), before[n].view(torch.uint8)) for n in before
    )
    operand, part, tensor = _shard(weights, "w1")
    loader.expert_views(0, 0)[operand][part].copy_(tensor)
    loader.written(0, 0, "w1")
    assert loader.num_pending == 0 and loader.num_quantized == 1
    expected = make_format("int4-g32", dtype).quantize(weights["w13"], weights["w2"])
    assert all(torch.equal(moe.expert_rows(0, 0)[n], t) for n, t in expected.items())


def test_bad_shards_are_refused_with_the_expert_named() -> None:
    moe = _moe("nvfp4", K, torch.bfloat16)
    loader = DenseLoader(moe)
    with pytest.raises(ValueError, match=r"shard 'w4' is not one of \['w1', 'w2', 'w3'\]"):
        loader.written(0, 0, "w4")
    for shard in ("w1", "w3", "w2"):
        loader.expert_views(0, 1)
        loader.written(0, 1, shard)
    with pytest.raises(ValueError, match="layer 0 expert 1: a shard arrived after the expert was complete"):
        loader.expert_views(0, 1)
    with pytest.raises(ValueError, match=r"expert 3 out of range \[0, 3\) for layer 1"):
        loader.expert_views(1, 3)
    with pytest.raises(RuntimeError, match=r"written\(layer=1, expert=0, 'w2'\) without expert_views\(\)"):
        loader.written(1, 0, "w2")
    with pytest.raises(RuntimeError, match="needs an allocated PooledMoE"):
        DenseLoader(PooledMoE(PoolConfig.resolve(pool_rows=K, device="cpu"), H, I, K, torch.float32))


def test_an_fp8_block_checkpoint_lands_in_place_beside_a_dense_layer() -> None:
    """Layer 0 from an fp8 checkpoint in 16x16 blocks: its weights and `weight_scale_inv` blocks are the
    fp8-b16 format's rows, written as they are. Layer 1 (a layer the checkpoint left unquantized) writes dense
    shards, quantized into the same format on load. Both end as the converter's bytes."""
    from pooled_runner.formats.quant import quantize_fp8

    dtype = torch.bfloat16
    weights = random_expert_weights(len(EXPERTS), max(EXPERTS), H, I, dtype, seed=41)
    moe = _moe("fp8-b16", K, dtype)
    loader = DenseLoader(moe)
    native = ("w13", "w13_s", "w2", "w2_s")
    loader.set_operands(0, native)
    assert loader.in_place(0) and not loader.in_place(1)
    with pytest.raises(ValueError, match=r"layer 0 writes operands \['w13', 'w2'\], and before"):
        loader.set_operands(0, ("w13", "w2"))
    with pytest.raises(ValueError, match="neither the fp8-b16 format's"):
        loader.set_operands(1, ("w13", "w13_s"))
    for e in range(EXPERTS[0]):
        w = weights[(0, e)]
        gate, up, down = (quantize_fp8(t, 16) for t in (w["w13"][:I], w["w13"][I:], w["w2"]))
        views = loader.expert_views(0, e)
        for shard, (q, scale), part in (("w1", gate, slice(0, I)), ("w3", up, slice(I, 2 * I))):
            views["w13"][part].copy_(q)
            loader.written(0, e, shard, "w13")
            views["w13_s"][part.start // 16 : part.stop // 16].copy_(scale)
            if e != 2:  # expert 2's up scales never arrive
                loader.written(0, e, shard, "w13_s")
        views["w2"].copy_(down[0])
        views["w2_s"].copy_(down[1])
        loader.written(0, e, "w2", "w2")
        loader.written(0, e, "w2", "w2_s")
    assert loader.missing(0) == ["expert 2 w1 w13_s", "expert 2 w3 w13_s"]
    named = loader.missing(0, {"w13_s": "w13_weight_scale_inv"})  # as the engine calls them
    assert named == ["expert 2 w1 w13_weight_scale_inv", "expert 2 w3 w13_weight_scale_inv"]
    loader.written(0, 2, "w1", "w13_s")
    loader.written(0, 2, "w3", "w13_s")
    assert loader.missing(0) == [] and loader.num_quantized == 0 and loader.num_pending == 0
    for e in range(EXPERTS[1]):
        views = loader.expert_views(1, e)
        views["w13"].copy_(weights[(1, e)]["w13"])
        views["w2"].copy_(weights[(1, e)]["w2"])
        for shard in ("w1", "w3", "w2"):
            loader.written(1, e, shard)
    assert loader.missing(1) == [] and loader.num_quantized == EXPERTS[1]
    converter = make_format("fp8-b16", dtype)
    for layer, n in enumerate(EXPERTS):
        for e in range(n):
            expected = converter.quantize(weights[(layer, e)]["w13"], weights[(layer, e)]["w2"])
            for name, tensor in expected.items():
                got = moe.expert_rows(layer, e)[name]
                assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), (layer, e, name)


@pytest.mark.parametrize("fmt", ["int4-g32", "nvfp4"])
def test_shards_from_several_threads(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek's SGLang loader hands each expert tensor to a thread pool: the shards of one expert arrive on
    different threads at once. Every expert must still be quantized once, from all three shards. (A dense
    buffer made slowly widens the window in which two threads could each make one for the same expert.)"""
    dtype = torch.bfloat16
    weights = random_expert_weights(len(EXPERTS), max(EXPERTS), H, I, dtype, seed=51)
    moe = _moe(fmt, K, dtype)
    loader = DenseLoader(moe)
    make = loader._new_buffers

    def slowly() -> dict[str, torch.Tensor]:
        time.sleep(0.005)
        return make()

    monkeypatch.setattr(loader, "_new_buffers", slowly)
    jobs = [(layer, e, s) for layer, n in enumerate(EXPERTS) for e in range(n) for s in ("w1", "w3", "w2")]
    random.Random(52).shuffle(jobs)
    start = threading.Barrier(6)

    def load(job: tuple[int, int, str]) -> None:
        layer, e, shard = job
        operand, part, tensor = _shard(weights[(layer, e)], shard)
        view = loader.expert_views(layer, e)[operand]
        view[part].copy_(tensor)
        loader.written(layer, e, shard)

    def worker(index: int) -> None:
        start.wait()
        for job in jobs[index::6]:
            load(job)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for future in [pool.submit(worker, i) for i in range(6)]:
            future.result()
    assert loader.num_quantized == sum(EXPERTS) and loader.num_pending == 0
    converter = make_format(fmt, dtype)
    for layer, n in enumerate(EXPERTS):
        assert loader.missing(layer) == []
        for e in range(n):
            expected = converter.quantize(weights[(layer, e)]["w13"], weights[(layer, e)]["w2"])
            for name, tensor in expected.items():
                got = moe.expert_rows(layer, e)[name]
                assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), (layer, e, name)


def test_many_experts_in_flight_are_warned_about_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint that keeps an expert's tensors far apart holds many dense buffers: said once, in GiB."""
    from pooled_runner import dense_load

    moe = _moe("int4-g32", K, torch.bfloat16)
    loader = DenseLoader(moe)
    assert loader.dense_bytes == (2 * I * H + H * I) * 2
    monkeypatch.setattr(dense_load, "PENDING_WARN_BYTES", 2 * loader.dense_bytes)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        for e in range(EXPERTS[0]):
            loader.expert_views(0, e)
            loader.written(0, e, "w1")
    warnings = [r.getMessage() for r in caplog.records if "waiting for their last tensor" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("pooled_runner: 3 experts are waiting"), warnings
    assert loader.num_pending == EXPERTS[0] and loader.peak_pending == EXPERTS[0]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)"
)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "bf16"])
def test_a_cuda_pool_holds_the_converters_bytes(fmt: str) -> None:
    """A CUDA pool (pinned bank) loaded shard by shard holds the bytes of the format's converter, at a
    Qwen3-30B-like size (H=2048, I=768). (Quantizing on the GPU instead rounded a few fp8 and NVFP4 values the
    other way on the H200, 2026-12-05: the loader quantizes on the host.)"""
    hidden, inter = 2048, 768
    moe = PooledMoE(
        PoolConfig.resolve(pool_rows=K, device="cuda", weight_format=fmt), hidden, inter, K, torch.bfloat16
    )
    moe.register_layer(3)
    moe.allocate()
    loader = DenseLoader(moe)
    assert moe.bank is not None and moe.bank.pinned
    g = torch.Generator().manual_seed(FORMATS.index(fmt))
    converter = make_format(fmt, torch.bfloat16)
    for e in range(3):
        w13 = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(torch.bfloat16)
        views = loader.expert_views(0, e)
        views["w13"].copy_(w13)
        views["w2"].copy_(w2)
        for shard in ("w1", "w3", "w2"):
            loader.written(0, e, shard)
        expected = converter.quantize(w13, w2)
        for name, tensor in expected.items():
            got = moe.expert_rows(0, e)[name]
            assert got.device.type == "cpu"  # the bank
            same = got.view(torch.uint8) == tensor.view(torch.uint8)
            assert bool(same.all()), (
                f"{fmt} expert {e} {name}: first differing byte {(~same).nonzero()[:1].tolist()}"
            )
