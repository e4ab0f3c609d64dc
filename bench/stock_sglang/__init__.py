"""Stock SGLang 0.5.23's Triton fused MoE, runnable without SGLang: its kernels and tuned configs copied by
`scripts/vendor_stock_sglang.py` (`kernels.py`, `configs/`; CI checks the copy against the installed SGLang), and
the decode-width launch sequence on them (`moe.py`; its gated SiLU, CUDA in stock, as a Triton kernel of the
same shape: `activation.py`), timed beside ours by `bench/stock_compare.py`."""
