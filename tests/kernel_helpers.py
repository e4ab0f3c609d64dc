"""Builders and float comparison shared by the kernel tests (CPU interpreter and GPU)."""

from __future__ import annotations

import torch

from pooled_runner.formats import make_format


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 2e-2) -> None:
    """bf16-level tolerance: |out - ref| <= rel * (|ref| + max|ref|); names the first mismatch coordinates."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(o).all(), (
        f"{what}: non-finite values at {(~torch.isfinite(o)).nonzero()[:5].tolist()}"
    )
    scale = r.abs().max().item() if r.numel() else 0.0
    bad = ((o - r).abs() > rel * (r.abs() + scale)).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {r.numel()} mismatch, first at {i}: {o[i].item()} vs {r[i].item()} "
            f"(max|ref| {scale:.4g}); first coordinates {bad[:5].tolist()}"
        )


def build_layer(
    format_name: str,
    H: int,
    I: int,
    E: int,
    R: int,
    g: torch.Generator,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    num_not_here: int = 1,
    host_rows: bool = True,
):
    """A layer of E experts in format `format_name`: bank `[E, ...]` (host view), pool `[R, ...]` holding a
    random R of them, l2p `[E + 2]` with codes row / R + e / -1 (`num_not_here` experts, and the 2 padding).

    On a GPU `device` the weights are drawn and quantized there (a generator seeded from `g`), so the GPU tests'
    real-H-and-I layers do not wait on CPU quantization in every pytest worker at once; the bank then comes
    back to the CPU (not pinned), the pool and l2p stay on `device`."""
    fmt = make_format(format_name, dtype)
    draw_g = g
    if device != "cpu":
        draw_g = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=g)))
    bank: dict[str, torch.Tensor] = {}
    for e in range(E):  # each expert into its bank row as it is made: no second copy of the bank on a GPU
        row = fmt.quantize(
            torch.randn(2 * I, H, generator=draw_g, device=device) / H**0.5,
            torch.randn(H, I, generator=draw_g, device=device) / I**0.5,
        )
        for k, v in row.items():
            if e == 0:
                bank[k] = torch.empty((E, *v.shape), dtype=v.dtype, device=v.device)
            bank[k][e] = v
    pool = {k: torch.empty((R, *v.shape[1:]), dtype=v.dtype, device=device) for k, v in bank.items()}
    l2p = torch.full((E + 2,), -1, dtype=torch.int32)
    l2p[:E] = R + torch.arange(E, dtype=torch.int32)
    perm = torch.randperm(E, generator=g)
    for r in range(min(R, E)):
        e = int(perm[r])
        l2p[e] = r
        for k in pool:
            pool[k][r] = bank[k][e]
    for e in perm[E - num_not_here :].tolist() if num_not_here else []:
        l2p[e] = -1
    if device != "cpu":
        l2p = l2p.to(device)
        bank = {k: v.cpu() for k, v in bank.items()} if host_rows else {}
        if torch.device(device).type == "cuda":  # the bank's device copy: not held by this worker's allocator
            torch.cuda.empty_cache()
    return fmt, pool, (bank if host_rows else None), l2p


def random_routing(T: int, K: int, E: int, g: torch.Generator, pad_prob: float = 0.1):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.long().reshape(T, K)
    ids[torch.rand(T, K, generator=g) < pad_prob] = -1
    return ids, torch.rand(T, K, generator=g) + 0.05


def small_layer_args(H: int, I: int, E: int, R: int, T: int, K: int, seed: int) -> tuple:
    """`pooled_fused_moe`'s first arguments `(x, ids, w, l2p, E, w13, w2, fmt)` for a small bf16 layer of E
    experts, R in pool rows and one not here (`build_layer`), and T tokens routed to K of them (CPU)."""
    from pooled_runner.kernels.fused_moe import make_projections
    from pooled_runner.kernels.operands import kernel_format

    g = torch.Generator().manual_seed(seed)
    fmt_obj, pool, bank, l2p = build_layer("bf16", H, I, E, R, g)
    fmt = kernel_format(fmt_obj)
    w13, w2 = make_projections(fmt, pool, bank, H, I)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = random_routing(T, K, E, g)
    return x, ids, w, l2p, E, w13, w2, fmt


def e2m1_words_and_values(g: torch.Generator, num_random: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 words of eight e2m1 codes (code j at bits 4j..4j+3, as the NVFP4 GEMV reads the packed bytes) and
    their values / 16384 in fp32 `[N, 8]` (the GEMV's word decode; the 2^14 goes into the row factor): 16
    words that put every code at every position (a different code at each), then `num_random` random words."""
    from pooled_runner.formats.quant import E2M1_VALUES

    codes = (torch.arange(16)[:, None] + 3 * torch.arange(8)[None, :]) % 16  # [16, 8]
    codes = torch.cat([codes, torch.randint(0, 16, (num_random, 8), generator=g)])
    words = (codes << (4 * torch.arange(8))[None, :]).sum(1)  # int64, 0 .. 2^32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return words, table[codes] / 16384.0


def assert_exact_values(out: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """`out` equal to `want` bit for bit (fp32: -0.0 is not 0.0; shapes and dtypes equal), naming the first
    mismatching coordinates."""
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)}, want {tuple(want.shape)}"
    assert out.dtype == want.dtype, f"{what}: dtype {out.dtype}, want {want.dtype}"
    out, want = out.cpu(), want.cpu()
    if out.dtype == torch.float32:
        bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()
    else:
        bad = (out != want).nonzero()
    first = [(c, out[tuple(c)].item(), want[tuple(c)].item()) for c in bad[:4].tolist()]
    assert bad.numel() == 0, f"{what}: {len(bad)} values differ; first (coordinates, got, want): {first}"


def packed_x_pairs(x: torch.Tensor, top: int) -> torch.Tensor:
    """`x [K]` scaled as `gemv_half.x_half_scale` scales it (by 2^(top + 127 - e), e the fp32 exponent field of
    max |x|, at least top + 1) and packed as `x_half_pack` writes it: `[K / 8, 4]` int32, pair j of a word holds
    the fp16 of its values j (low half) and j + 4 (high half). A plain torch reference of the workspace row."""
    xf = x.float()
    e = max(int(xf.abs().max().view(torch.int32)) >> 23 & 255, top + 1)
    bits = (xf * 2.0 ** (top + 127 - e)).half().view(torch.int16).int() & 0xFFFF
    words = bits.view(-1, 8)
    return (words[:, :4] | (words[:, 4:] << 16)).int()


def record_x_pairs_workspaces(monkeypatch) -> list[torch.Tensor]:
    """Patches `workspace.x_pairs_workspace` (the GEMV launchers' `half_x_pack` workspace allocation) to also
    append each workspace it allocates to the returned list, so a test can read what the kernels wrote."""
    from pooled_runner.kernels import workspace

    workspaces: list[torch.Tensor] = []
    allocate = workspace.x_pairs_workspace

    def recorded(*args):
        workspaces.append(allocate(*args))
        return workspaces[-1]

    monkeypatch.setattr(workspace, "x_pairs_workspace", recorded)
    return workspaces
