"""Test-wide settings: 4 virtual CPU devices (so TP2 / TP4 run on the CPU) and no progress bars."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("M3JAX_NO_PROGRESS", "1")

# One persistent XLA compilation cache for the whole run: engines started by different tests (and server
# subprocesses) reuse each other's compiled step buckets instead of recompiling them.
if "M3JAX_COMPILATION_CACHE" not in os.environ:
    import tempfile

    os.environ["M3JAX_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="m3jax-xla-")


@pytest.fixture
def query_blocks_computed(monkeypatch):
    """The block sizes of every query-block computation (`pallas_kernels.attention.ragged._compute`) traced while
    the test runs, in order: clear it between traces."""
    from pallas_kernels.attention import ragged

    computed: list[int] = []
    compute = ragged._compute

    def counting(*args, **kw):
        computed.append(kw["bt"])
        return compute(*args, **kw)

    monkeypatch.setattr(ragged, "_compute", counting)
    return computed
