"""Triton kernels of pooled_runner, installed as `pooled_runner.kernels`.

Each kernel is a launcher (shape/stride/dtype asserts, grid, block sizes), a `@triton.jit` body and a torch
reference with the same signature.
"""
