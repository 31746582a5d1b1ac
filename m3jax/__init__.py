"""m3jax: MiniMax M3 in JAX. `from m3jax import load_model`.

The names below are imported on first use (PEP 562), so that `m3jax serve` reaches its signal handlers before
jax is imported: a SIGTERM in the first seconds of start-up then exits 0 like one at any later moment."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["load_model", "M3Model", "M3Config", "preset"]
_WHERE = {"load_model": "m3jax.api", "M3Model": "m3jax.api", "M3Config": "m3jax.config", "preset": "m3jax.config"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'm3jax' has no attribute {name!r}")
