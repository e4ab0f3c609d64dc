"""The README's Python example runs as written, and the demo (the main job for now) succeeds."""

from __future__ import annotations

import pathlib
import re

from pooled_runner import demo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = namespace["out"]
    assert tuple(out.shape) == (5, namespace["H"])
    assert namespace["moe"].stats().misses > 0
    assert "PoolStats" in capsys.readouterr().out


def test_demo_outputs_equal_resident(capsys):
    assert demo.main(["--steps", "4", "--layers", "2", "--experts", "9", "--moe-expert-pool-rows", "7"]) == 0
    assert "outputs equal the all-resident layers" in capsys.readouterr().out
