"""What the launcher hands to SGLang's spawned children: the resolved PoolConfig plus serving facts.

The launcher resolves one `ServeConfig` and exports it as JSON in `POOLED_RUNNER_SERVE_CONFIG` (children are
started with multiprocessing spawn and inherit the environment); each child reads it back with
`ServeConfig.from_env()`. Nothing here imports SGLang.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pooled_runner import envs
from pooled_runner.config import PoolConfig

ENV_NAME = envs.PREFIX + "SERVE_CONFIG"


@dataclass(frozen=True)
class ServeConfig:
    """Resolved serving configuration.

    Fields:
      pool: the expert pool, or None when pooling is off (`--no-moe-expert-pool`: SGLang's own MoE).
      cpu: the machine has no CUDA: apply the CPU patches in every process.
      metrics: SGLang's `--enable-metrics` is on: export pool gauges.
      stats_interval: log (and export) pool statistics every this many forward steps.
      speculative: SGLang runs speculative decoding (`--speculative-algorithm`): without CUDA the scheduler
        needs the speculative CPU patches too.
      router_scores: hand each layer's router logits to the device planner (its policy reads them:
        `planner_policy` "adaptive-router" or "adaptive-router-duel", on a model whose top-k selects on its logits).
    """

    pool: PoolConfig | None
    cpu: bool
    metrics: bool = False
    stats_interval: int = 64
    speculative: bool = False
    router_scores: bool = False

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServeConfig:
        data = json.loads(text)
        pool = data.pop("pool")
        return cls(pool=PoolConfig(**pool) if pool is not None else None, **data)

    def export(self) -> None:
        """Put this config into the environment, for the children the launcher spawns."""
        os.environ[ENV_NAME] = self.to_json()

    @classmethod
    def from_env(cls) -> ServeConfig | None:
        """The config exported by the launcher, or None when this process was not started by it."""
        text = envs.serve_config()
        return cls.from_json(text) if text else None
