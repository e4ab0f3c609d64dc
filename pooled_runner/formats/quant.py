"""Quantizers and reference dequantizers for one projection `w [N, K]` (rows = output channels).

Shared by the int4, fp8 and nvfp4 formats: the converters build test and bench inputs from a plain bf16 tensor,
the dequantizers are the torch path and the kernels' reference. All layouts keep N as the leading dimension so
a quantized row has the same `[N, ...]` shape family as the dense one.
"""

from __future__ import annotations

import itertools

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 magnitudes by 3-bit code (e << 1 | m)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
INT4_GROUPS = (32, 64, 128)


def _check_2d(w: torch.Tensor, name: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(w.shape)}, expected [N, K]")


# ---- int4 (W4A16): 8 nibbles per int32 along K, one scale (and zero point) per `group` values ---------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """`q [N, K]` values 0..15 -> `[N, K/8]` int32, value k at bits 4*(k % 8) of word k // 8."""
    N, K = q.shape
    shifts = torch.arange(8, dtype=torch.int64, device=q.device) * 4
    words = (q.to(torch.int64).reshape(N, K // 8, 8) << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: `[N, K/8]` int32 -> `[N, K]` int32 values 0..15."""
    shifts = torch.arange(8, dtype=torch.int32, device=words.device) * 4
    return ((words[..., None] >> shifts) & 0xF).reshape(words.shape[0], -1)


def _nonzero_scale(s: torch.Tensor) -> torch.Tensor:
    """Scales in their storage dtype, a zero one (an all-zero group, or one too small for fp16) made 1: every
    value of such a group then quantizes to the zero code and dequantizes to 0 (a zero scale divided 0 by 0)."""
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize_int4(
    w: torch.Tensor, group: int, zero_point: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`w [N, K]` -> (qweight `[N, K/8]` int32, scales `[N, K/group]`, zeros `[N, K/group]` uint8 or None).

    Symmetric: `w ~ (q - 8) * s`. Zero point: `w ~ (q - z) * s` with z in 0..15.
    """
    _check_2d(w, "w")
    N, K = w.shape
    if group not in INT4_GROUPS or K % group:
        raise ValueError(f"int4: group {group} must be one of {INT4_GROUPS} and divide K={K}")
    wg = w.float().reshape(N, K // group, group)
    if zero_point:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = _nonzero_scale(((hi - lo) / 15).to(scale_dtype))
        z = (-lo / s.float()).round().clamp(0, 15)
        q = ((wg / s.float()[..., None]).round() + z[..., None]).clamp(0, 15)
        zeros: torch.Tensor | None = z.to(torch.uint8)
    else:
        s = _nonzero_scale((wg.abs().amax(-1) / 7).to(scale_dtype))
        q = (wg / s.float()[..., None]).round().clamp(-8, 7) + 8
        zeros = None
    return pack_int4(q.reshape(N, K).to(torch.int32)), s, zeros


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    q = unpack_int4(qweight).float()
    N, K = q.shape
    group = K // scales.shape[1]
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8, dtype=torch.float32)
    w = (q.reshape(N, -1, group) - z[..., None]) * scales.float()[..., None]
    return w.reshape(N, K).to(dtype)


# ---- fp8 e4m3: per output channel or per [block, block] tile, fp32 scales ------------------------------------
def quantize_fp8(w: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (q `[N, K]` float8_e4m3fn, scales fp32 `[N]` (per channel) or `[ceil(N/b), ceil(K/b)]`)."""
    _check_2d(w, "w")
    N, K = w.shape
    wf = w.float()
    if block is None:
        s = (wf.abs().amax(-1) / E4M3_MAX).clamp(min=1e-12)
        q = (wf / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, s
    nb, kb = -(-N // block), -(-K // block)
    # fp32 whatever the default dtype (SGLang loads weights under the model's): the scales are fp32
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:N, :K] = wf
    tiles = padded.reshape(nb, block, kb, block)
    s = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (tiles / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(nb * block, kb * block)
    return q[:N, :K].contiguous().to(torch.float8_e4m3fn), s


def dequantize_fp8(
    q: torch.Tensor, scales: torch.Tensor, block: int | None, dtype: torch.dtype
) -> torch.Tensor:
    N, K = q.shape
    qf = q.float()
    if block is None:
        return (qf * scales.float()[:, None]).to(dtype)
    s = scales.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return (qf * s).to(dtype)


# ---- NVFP4: e2m1 values, one e4m3 scale per 16 values, one fp32 global scale --------------------------------
# midpoints between neighbouring e2m1 magnitudes: a magnitude on one rounds down (to the first of the two, as
# the nearest-value search by argmin this replaced did), one above the last clamps to 6
_E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(E2M1_VALUES))


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign bit 3) of each value of x (already divided by its scales), ties to the smaller
    magnitude. A search over the 7 midpoints: no `[..., 8]` temporary (1 GB for a DeepSeek-V3 w13)."""
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(x.abs().float(), midpoints, right=False)
    return (mag | ((x < 0).to(torch.int64) << 3)).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (packed `[N, K/2]` uint8 (even k in the low nibble), scales `[N, K/16]` e4m3, global `[1]` fp32).

    `w ~ e2m1 * scale * global`.
    """
    _check_2d(w, "w")
    N, K = w.shape
    if K % 16:
        raise ValueError(f"nvfp4: K={K} must be a multiple of 16")
    wf = w.float().reshape(N, K // 16, 16)
    g = (wf.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=1e-12)
    s = (wf.abs().amax(-1) / (E2M1_MAX * g)).clamp(min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(wf / (s.float()[..., None] * g)).reshape(N, K)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), s, g.reshape(1).to(torch.float32)


def dequantize_nvfp4(
    packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    N = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(N, -1).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    vals = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    s = scales.float().repeat_interleave(16, 1)
    return (vals * s * global_scale.float()).to(dtype)
