"""What every patch checks before it touches SGLang: the version, and that its target symbol exists."""

from __future__ import annotations

import importlib
from types import ModuleType

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


class PatchError(RuntimeError):
    """A patch cannot be applied: the installed SGLang is not the one it was written against."""


def require_target(module_name: str, attr: str, patch: str) -> ModuleType:
    """Import `module_name`, check the SGLang version and that `attr` exists; return the module.

    Raises PatchError naming the patch, the symbol and the installed version.
    """
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise PatchError(
            f"patch {patch}: written for sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)}, found {version}; "
            "install the pinned version (pip install 'pooled-runner[serve]')"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchError(f"patch {patch}: cannot import {module_name} (sglang {version}): {exc}") from exc
    if not hasattr(module, attr):
        raise PatchError(f"patch {patch}: {module_name}.{attr} does not exist in sglang {version}")
    return module


def require_hook_target(target: str, hook: str) -> None:
    """Before a HookRegistry hook of `target` ("package.module.Class.method" or "package.module.function"):
    the SGLang version, the module and every attribute on the dotted path. PatchError otherwise."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_name = ".".join(parts[:split])
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
        obj: object = require_target(module_name, parts[split], hook)
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                raise PatchError(f"hook {hook}: {target} does not exist (no {attr!r} on {obj!r})")
            obj = getattr(obj, attr)
        return
    raise PatchError(f"hook {hook}: no module of {target} can be imported")
