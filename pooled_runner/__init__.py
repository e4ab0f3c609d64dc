"""pooled_runner: serve MoE models whose routed experts do not fit in GPU memory.

Core API (imports without SGLang and without a GPU):
  PoolConfig  one frozen, resolved configuration (`PoolConfig.resolve(pool_rows=...)`)
  PooledMoE   register MoE layers, install their experts (bank + pool), run the pooled forward
  ExpertBank  host rows of every expert;  ExpertPool  device rows + location tables + LRU
"""

from pooled_runner.bank import ExpertBank
from pooled_runner.config import PoolConfig
from pooled_runner.moe import PooledMoE
from pooled_runner.pool import ExpertPool, PoolStats
from pooled_runner.torch_path import expert_mlp

__version__ = "0.1.0"

__all__ = ["ExpertBank", "ExpertPool", "PoolConfig", "PoolStats", "PooledMoE", "__version__", "expert_mlp"]
