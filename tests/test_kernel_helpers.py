"""tests/kernel_helpers.build_layer, the layers of the kernel tests: its device branch (the GPU tests draw and
quantize there) on the CPU through the device string "cpu:0", against its contract."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import build_layer


@pytest.mark.parametrize("name", ["bf16", "int4-g32", "int4-g64-zp", "fp8", "fp8-b16", "nvfp4"])
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_build_layer_contract(name, device):
    H, I, E, R, num_not_here = 128, 64, 7, 4, 2
    fmt, pool, bank, l2p = build_layer(name, H, I, E, R, torch.Generator().manual_seed(5), device=device,
                                       num_not_here=num_not_here)  # fmt: skip
    assert bank is not None and l2p.shape == (E + 2,) and l2p.dtype == torch.int32, l2p
    codes = l2p.cpu()
    assert codes[E:].tolist() == [-1, -1], codes
    in_rows = [e for e in range(E) if 0 <= codes[e] < R]
    in_host = [e for e in range(E) if codes[e] == R + e]
    assert int((codes[:E] == -1).sum()) == num_not_here and len(in_rows) == R, codes
    assert len(set(codes[in_rows].tolist())) == R, f"two experts share a row: {codes}"
    assert len(in_rows) + len(in_host) + num_not_here == E, codes
    for k, rows in bank.items():
        assert rows.device.type == "cpu" and rows.shape[0] == E, (k, rows.device, rows.shape)
        assert pool[k].shape == (R, *rows.shape[1:]) and pool[k].dtype == rows.dtype, k
        for e in in_rows:  # a pool row holds its expert's bank row, bitwise
            assert torch.equal(pool[k][int(codes[e])].cpu(), rows[e]), (k, e)
    # the drawn weights' scale (1/sqrt(fan-in)) survives the format: dequantized rows of every expert
    experts = [fmt.expert_weights({k: v[e] for k, v in bank.items()}) for e in range(E)]
    for e, (w13, w2) in enumerate(experts):
        assert w13.shape == (2 * I, H) and w2.shape == (H, I), (w13.shape, w2.shape)
        for w, fan_in in ((w13, H), (w2, I)):
            std = w.float().std().item() * fan_in**0.5
            assert 0.8 < std < 1.2, f"{name} expert {e}: std x sqrt(fan-in) {std:.3f}"
    assert not any(torch.equal(experts[0][0], w13) for w13, _ in experts[1:]), "experts drawn alike"
    other = build_layer(name, H, I, E, R, torch.Generator().manual_seed(6), device=device, num_not_here=2)
    k0 = next(iter(bank))
    assert not torch.equal(other[2][k0], bank[k0]), "the seed does not reach the weights"
    again = build_layer(name, H, I, E, R, torch.Generator().manual_seed(5), device=device, num_not_here=2)
    assert torch.equal(again[3].cpu(), codes) and all(torch.equal(again[2][k], bank[k]) for k in bank), (
        "not seeded"
    )
