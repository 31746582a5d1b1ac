"""Compiled steps kept on disk, so that a restart neither traces, lowers nor compiles.

JAX's persistent compilation cache skips only XLA's compile: tracing and lowering a 60-layer step still cost
tens of seconds per shape. Here the whole compiled executable is serialized (`jax.experimental.
serialize_executable`) under a key of everything that shapes it: the model config, the kernel choice, dtype,
sharding, the step's shapes, the jax / jaxlib versions, the devices, XLA_FLAGS, and a hash of the source files that
define the step (m3jax, pallas_kernels, serving). Any difference is another key; a file that fails to load is
recompiled and replaced. JAX's own persistent cache sits beside it (`xla/`) for everything else start-up
compiles (weight preparation, random presets, pools) and as a fallback for the step; an executable that XLA:CPU
read back from that cache does not survive a second serialization ("Function ... not found" when loaded), so
such executables are never written here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

log = logging.getLogger(__name__)

_SOURCE_PACKAGES = ("m3jax", "pallas_kernels", "serving")


@functools.cache
def source_hash() -> str:
    """Hash of every .py file of the packages that define a step: a code change invalidates every entry."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for package in _SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def enable_xla_cache(directory: Path) -> None:
    """JAX's persistent compilation cache, for what start-up compiles besides the step executables."""
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@contextlib.contextmanager
def xla_cache_hits() -> Iterator[list[str]]:
    """Collects JAX persistent-cache hits (when a user turned that cache on) during the block."""
    from jax._src import monitoring

    hits: list[str] = []

    def listener(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    monitoring.register_event_listener(listener)
    try:
        yield hits
    finally:
        monitoring.unregister_event_listener(listener)


class ExecutableCache:
    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory) / "executables"
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(*parts: Any) -> str:
        devices = jax.devices()
        h = hashlib.sha256()
        for part in (*parts, jax.__version__, jax.lib.__version__, devices[0].platform, devices[0].device_kind,
                     len(devices), os.environ.get("XLA_FLAGS", ""), source_hash()):
            h.update(repr(part).encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def load(self, key: str, devices: list[Any]) -> Callable[..., Any] | None:
        """The executable saved under `key`, loaded onto `devices` (the mesh it was compiled for), or None."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.directory / f"{key}.bin"
        if not path.is_file():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - a stale or broken entry is recompiled, never fatal
            log.warning("compiled step %s could not be loaded (%s: %s); compiling it again", path.name,
                        type(e).__name__, e)
            return None

    def save(self, key: str, compiled: Any) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            blob = pickle.dumps(serialize(compiled))
        except Exception as e:  # noqa: BLE001 - a backend that cannot serialize still serves
            log.warning("compiled step could not be serialized (%s: %s); the next start compiles it again",
                        type(e).__name__, e)
            return
        # Written under another name, then renamed: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, self.directory / f"{key}.bin")
