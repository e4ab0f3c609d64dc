"""Layer level, against the real SGLang classes on CPU: a `FusedMoE` built under SGLang's runtime context and
loaded through its real weight loader from the embedded safetensors checkpoint, against `PooledFusedMoE`
built and loaded the same way (its experts in the bank, 6 pool rows for 32 experts)."""

from __future__ import annotations

import logging

import pytest
import torch

from pooled_runner import PoolConfig
from tests.engine.layer_setup import NUM_LAYERS, E, H, I, K, assert_layers_agree, build, load


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)])
def test_pooled_layer_matches_sglang_fused_moe(runtime, checkpoint, dtype: torch.dtype, atol: float) -> None:  # type: ignore[no-untyped-def]
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopK

    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.method import PooledMoEMethod

    sd = {k: v.to(dtype) for k, v in checkpoint.items()}
    ref = [build(FusedMoE, i, dtype) for i in range(NUM_LAYERS)]
    pooled = [build(PooledFusedMoE, i, dtype) for i in range(NUM_LAYERS)]
    assert all(isinstance(p.quant_method, PooledMoEMethod) for p in pooled)
    for i in range(NUM_LAYERS):
        for layer in (ref[i], pooled[i]):
            load(layer, i, sd)
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    moe = runtime.require_moe()
    assert moe.pool is not None and moe.bank is not None and moe.pool.num_rows == 6
    # Bank rows hold exactly what SGLang's loader put into the device weights (gate rows, then up rows).
    for i in range(NUM_LAYERS):
        for e in (0, 7, E - 1):
            row = moe.bank.row(i, e)
            assert torch.equal(row["w13"], ref[i].w13_weight[e]) and torch.equal(
                row["w2"], ref[i].w2_weight[e]
            )
    assert pooled[0].w13_weight.numel() == 0  # the device placeholder is released after loading
    topks = [TopK(top_k=K, renormalize=True, layer_id=i) for i in range(NUM_LAYERS)]
    g = torch.Generator().manual_seed(0)
    for T in (1, 7, 33, 0):
        for i in range(NUM_LAYERS):
            x = torch.randn(T, H, generator=g).to(dtype)
            logits = x.float() @ sd[f"model.layers.{i}.mlp.gate.weight"].float().T
            routing = topks[i](x, logits)
            got = pooled[i](x, routing)
            assert got.shape == (T, H) and got.dtype == dtype
            if T:  # SGLang's native reference cannot reshape an empty step; the pooled layer can
                expected = ref[i](x, routing)
                diff = (got.float() - expected.float()).abs()
                worst = divmod(int(diff.argmax()), H)
                assert diff.max() <= atol, (
                    f"T={T} layer {i}: max diff {diff.max():.3g} at (token, col) {worst}"
                )
    stats = moe.stats()
    assert stats.misses > 0 and stats.evictions > 0  # 6 rows for 32 experts: the pool really moved rows


@pytest.mark.parametrize("fmt", ["int4-g32-zp", "fp8-b16", "nvfp4"])
def test_quantized_pool_matches_sglang_on_the_dequantized_weights(
    sglang_context, checkpoint, fmt: str
) -> None:  # type: ignore[no-untyped-def]
    """`--moe-expert-pool-weight-format` int4/fp8/NVFP4 quantizes each expert while SGLang's loader writes its
    shards: the bank rows equal the format's converter on the weights SGLang's own `FusedMoE` loaded, and the
    pooled layer equals that `FusedMoE` once its weights are replaced by the dequantized ones."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    from pooled_runner.formats import make_format
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    dtype = torch.bfloat16
    converter = make_format(fmt, dtype)
    sd = {k: v.to(dtype) for k, v in checkpoint.items()}
    pool = PoolConfig.resolve(pool_rows=6, device="cpu", weight_format=fmt)
    rt = PoolRuntime(ServeConfig(pool=pool, cpu=True))
    set_runtime(rt)
    try:
        ref = [build(FusedMoE, i, dtype) for i in range(NUM_LAYERS)]
        pooled = [build(PooledFusedMoE, i, dtype) for i in range(NUM_LAYERS)]
        # SGLang loads under the model's default dtype (loader.py, set_default_torch_dtype): so does this
        with set_default_torch_dtype(dtype):
            for i in range(NUM_LAYERS):
                for layer in (ref[i], pooled[i]):
                    load(layer, i, sd)
                    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
        moe = rt.require_moe()
        assert moe.bank is not None and moe.format.name == fmt and rt.loader is None  # loading is over
        for i in range(NUM_LAYERS):
            for e in range(E):
                expected = converter.quantize(ref[i].w13_weight[e], ref[i].w2_weight[e])
                row = moe.bank.row(i, e)
                for name, tensor in expected.items():
                    assert torch.equal(row[name].view(torch.uint8), tensor.view(torch.uint8)), (
                        f"{fmt} layer {i} expert {e} {name}"
                    )
                w13, w2 = converter.expert_weights(expected)  # the reference computes with these
                ref[i].w13_weight.data[e] = w13
                ref[i].w2_weight.data[e] = w2
        assert_layers_agree(pooled, ref, sd, dtype, seed=11, what=fmt)
        assert moe.stats().misses > 0 and moe.stats().evictions > 0
    finally:
        set_runtime(None)


def test_placeholders_the_rows_cannot_take_are_refused(sglang_context) -> None:  # type: ignore[no-untyped-def]
    """A base method whose placeholders are neither the pool format's rows nor dense experts (fp8 scales in
    32x32 blocks for fp8-b16 rows) is refused when the layer is built, naming both layouts."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

    from pooled_runner.sglang.method import PooledMoEMethod
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    rt = PoolRuntime(
        ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu", weight_format="fp8-b16"), cpu=True)
    )
    set_runtime(rt)
    try:
        config = Fp8Config(
            is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[32, 32]
        )
        method = PooledMoEMethod(Fp8MoEMethod(config), rt)
        with pytest.raises(
            ValueError,
            match=r"the Fp8MoEMethod placeholders .*'w13_s': \(\(2, 2\), torch.float32\).* are neither the fp8-b16 rows",
        ):
            build(FusedMoE, 0, torch.bfloat16, quant_method=method)
    finally:
        set_runtime(None)


def test_routed_scaling_is_applied_where_sglang_applies_it(runtime, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek/GLM layers carry a routed scaling factor. Without CUDA SGLang's own method leaves it to the model
    (which multiplies after the experts), so the pooled layer must not apply it too: equal to `FusedMoE` here."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopK

    from pooled_runner.sglang.layer import PooledFusedMoE

    ref = build(FusedMoE, 0, torch.float32, routed_scaling_factor=2.5)
    pooled = build(PooledFusedMoE, 0, torch.float32, routed_scaling_factor=2.5)
    for layer in (ref, pooled):
        load(layer, 0, checkpoint)
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, H, generator=g)
    routing = TopK(top_k=K, renormalize=True, layer_id=0)(
        x, x @ checkpoint["model.layers.0.mlp.gate.weight"].T
    )
    got, expected = pooled(x, routing), ref(x, routing)
    diff = (got - expected).abs()
    assert diff.max() <= 1e-5, f"max diff {diff.max():.3g} at (token, col) {divmod(int(diff.argmax()), H)}"
    assert expected.abs().max() > 1e-3


def test_clamped_swiglu_layers_stay_unpooled(runtime) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.float32, swiglu_limit=7.0)
    assert not layer.is_pooled and layer.w13_weight.shape[0] == E
    assert runtime.not_pooled == {"clamped SwiGLU (swiglu_limit)": ["model.layers.0.mlp.experts"]}


def test_malformed_checkpoint_names_the_tensor(runtime, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.float32)
    param = layer.w13_weight
    bad = checkpoint["model.layers.0.mlp.experts.3.gate_proj.weight"][:, :-1]  # one column short
    with pytest.raises(ValueError, match=r"w13_weight \(expert 3, shard w1, shape \(32, 63\)\)"):
        param.weight_loader(param, bad, "w13_weight", shard_id="w1", expert_id=3)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"expert id 16 out of range \[0, 16\)"):
        param.weight_loader(param, bad, "w13_weight", shard_id="w1", expert_id=16)  # type: ignore[operator]
    down = checkpoint["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(
        ValueError, match=r"shard 'w2' for the w13_weight parameter .* takes shards \['w1', 'w3'\]"
    ):
        param.weight_loader(param, down, "w13_weight", shard_id="w2", expert_id=3)  # type: ignore[operator]


def test_missing_expert_is_reported_after_loading(runtime, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.float32)
    load(layer, 0, checkpoint, skip="model.layers.0.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="did not provide expert 5 w3"):
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]


def test_first_weights_on_several_threads_allocate_the_bank_once(runtime) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek's loader submits expert tensors to a thread pool, so the first weights can arrive on several
    threads while the bank (hundreds of GiB, pinned) is still being allocated: it must be allocated once."""
    import threading
    import time

    from pooled_runner.sglang.layer import PooledFusedMoE

    build(PooledFusedMoE, 0, torch.float32)
    moe = runtime.require_moe()
    allocate, calls = moe.allocate, []

    def slow_allocate() -> None:
        calls.append(1)
        time.sleep(0.05)
        allocate()

    moe.allocate = slow_allocate
    loaders, start = [], threading.Barrier(4)

    def first_weight() -> None:
        start.wait()
        loaders.append(runtime.ensure_loader())

    threads = [threading.Thread(target=first_weight) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({id(loader) for loader in loaders}) == 1 and len(loaders) == 4


def test_a_weight_after_the_pool_is_built_is_refused(runtime, checkpoint) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.layer import PooledFusedMoE

    layer = build(PooledFusedMoE, 0, torch.float32)
    load(layer, 0, checkpoint)
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr,operator]
    assert runtime.require_moe().pool is not None and runtime.loader is None
    param = layer.w2_weight
    weight = checkpoint["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(RuntimeError, match="an expert weight arrived after every pooled layer had loaded"):
        param.weight_loader(param, weight, "w2_weight", shard_id="w2", expert_id=3)  # type: ignore[operator]


def test_unhandled_layers_stay_unpooled_with_one_warning(runtime, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.method import PooledMoEMethod

    with caplog.at_level(logging.WARNING, logger="pooled_runner"):
        layers = [build(PooledFusedMoE, i, torch.float32, with_bias=True) for i in range(3)]
    assert not any(isinstance(layer.quant_method, PooledMoEMethod) for layer in layers)
    assert layers[0].w13_weight.shape[0] == E  # experts stay on the device, as SGLang builds them
    assert runtime.not_pooled == {"expert biases": [f"model.layers.{i}.mlp.experts" for i in range(3)]}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not pooled (expert biases)" in warnings[0].getMessage()


def test_guard_runs_when_the_sglang_layer_allocates(sglang_context: None, checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The runtime hands its kernel backend to PooledMoE; the first expert load allocates and is refused."""
    from pooled_runner.guard import KernelBackend
    from pooled_runner.sglang.layer import PooledFusedMoE
    from pooled_runner.sglang.runtime import PoolRuntime, set_runtime
    from pooled_runner.sglang.serve_config import ServeConfig

    w13_row_bytes = 2 * I * H * 4  # float32 [2I, H]
    bounded = KernelBackend("bounded", 5 * w13_row_bytes, "test: five w13 rows")
    rt = PoolRuntime(ServeConfig(pool=PoolConfig.resolve(pool_rows=6, device="cpu"), cpu=True), bounded)
    set_runtime(rt)
    try:
        layers = [build(PooledFusedMoE, i, torch.float32) for i in range(NUM_LAYERS)]
        assert rt.require_moe().kernel_backend is bounded
        with pytest.raises(ValueError) as err:
            load(layers[0], 0, checkpoint)
        msg = str(err.value)
        assert f"pool tensor w13: 6 rows x {w13_row_bytes} B" in msg
        assert "the largest --moe-expert-pool-rows that fits is 5" in msg
        assert not rt.require_moe().allocated  # refused before any storage was allocated
    finally:
        set_runtime(None)


def test_default_backend_on_cpu_is_the_torch_path(runtime) -> None:  # type: ignore[no-untyped-def]
    from pooled_runner.guard import TORCH
    from pooled_runner.sglang.layer import PooledFusedMoE

    build(PooledFusedMoE, 0, torch.float32)
    assert runtime.require_moe().kernel_backend is TORCH


def test_draft_model_layers_are_not_pooled(runtime, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """Layers built in SGLang's draft scope (MTP/NextN heads) keep their experts on the device."""
    from sglang.srt.layers.moe.utils import draft_model_build_scope

    from pooled_runner.sglang.layer import PooledFusedMoE

    target = build(PooledFusedMoE, 0, torch.float32)
    with caplog.at_level(logging.WARNING, logger="pooled_runner"), draft_model_build_scope():
        draft = build(PooledFusedMoE, 1, torch.float32)
    assert target.is_pooled and not draft.is_pooled and draft.is_draft
    assert draft.w13_weight.shape[0] == E  # all experts on the device, as SGLang builds them
    assert runtime.not_pooled == {"draft-model layer": ["model.layers.1.mlp.experts"]}
    assert len(runtime.require_moe().num_experts_per_layer) == 1  # only the target layer registered
    assert any("not pooled (draft-model layer)" in r.getMessage() for r in caplog.records)


def test_hook_targets_are_checked_against_the_sglang_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer and lanes hooks check their SGLang symbols and version before HookRegistry touches them."""
    import sglang
    from pooled_runner.patches._check import PatchError, require_hook_target

    from pooled_runner.sglang.layer import TARGET
    from pooled_runner.sglang.spec import ALLOC_TARGET, GRAPHS_TARGET

    for target in (TARGET, ALLOC_TARGET, GRAPHS_TARGET):
        require_hook_target(target, "test")
    with pytest.raises(
        PatchError, match=r"ModelRunner.init_cuda_graph does not exist \(no 'init_cuda_graph'"
    ):
        require_hook_target(GRAPHS_TARGET[:-1], "test")
    with pytest.raises(PatchError, match="fused_moe_triton.layer.FusedMoEX does not exist"):
        require_hook_target(TARGET + "X", "test")
    monkeypatch.setattr(sglang, "__version__", "0.5.24")
    with pytest.raises(PatchError, match="patch test: written for sglang 0.5.23, found 0.5.24"):
        require_hook_target(ALLOC_TARGET, "test")
