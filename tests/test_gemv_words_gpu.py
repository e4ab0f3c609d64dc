"""GPU test of the NVFP4 GEMV's word decode as compiled for CUDA (its PTX form and its Triton-ops form; the
interpreter can run only the second: tests/test_kernels_gemv.py). Run by scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_helpers import assert_exact_values, e2m1_words_and_values

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("asm", [True, False], ids=["ptx", "triton-ops"])
def test_e2m1_word_decode_is_exact(asm):
    """`gemv_words.e2m1_decode` (`_E2M1_ASM`: rotate, selects, shifts, masks, `cvt.f32.f16`; or the same as
    Triton ops) bit for bit against a table lookup and `e2m1_decode_ref`: every code at every position of a
    word, then random words, at N = 0, 1, 7 and all (a partial last block)."""
    from pooled_runner.kernels import gemv_words

    words, want = e2m1_words_and_values(torch.Generator().manual_seed(6), 100_003)
    assert_exact_values(gemv_words.e2m1_decode_ref(words.cuda()).cpu(), want, "e2m1 decode reference")
    for n in (0, 1, 7, words.numel()):
        got = gemv_words.e2m1_decode(words[:n].cuda(), asm=asm)
        assert_exact_values(got, want[:n], f"e2m1 decode asm={asm}, N={n}")
