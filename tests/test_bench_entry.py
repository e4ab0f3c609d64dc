"""Every runnable module (`python -m bench.X`, `python scripts/X.py`, `python -m pooled_runner.X`) that defines a
top-level `main` calls it under `if __name__ == "__main__":`. Without the guard `python -m` imports the module
and exits 0 having done nothing: `bench/gemv_sweep.py` lost it in an edit and a GPU step printed nothing,
green (2026-12-05)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every package's modules, subpackages included (`python -m pooled_runner.sglang.X` runs as well)
MODULES = sorted(
    {
        p.resolve()
        for folder in ("bench", "scripts", "pooled_runner", "kernels", "patches")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__init__.py"
    }
)


def _defines_main(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def _calls_main_when_run(tree: ast.Module) -> bool:
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and "__name__" in ast.unparse(node.test)
            and "__main__" in ast.unparse(node.test)
        ):
            return any("main(" in ast.unparse(stmt) for stmt in node.body)
    return False


@pytest.mark.parametrize(
    "path", [p for p in MODULES if _defines_main(ast.parse(p.read_text()))], ids=lambda p: p.stem
)
def test_a_module_with_main_runs_it_as_a_script(path: Path) -> None:
    assert _calls_main_when_run(ast.parse(path.read_text())), (
        f"{path.relative_to(ROOT)} defines main() but never calls it under if __name__ == '__main__'"
    )


def test_the_check_sees_modules_with_main() -> None:
    names = {p.stem for p in MODULES if _defines_main(ast.parse(p.read_text()))}
    assert {"gemv_sweep", "spec_family_model", "launch"} <= names, sorted(names)
    assert any(p.parent.name == "sglang" for p in MODULES), "subpackages are not searched"
