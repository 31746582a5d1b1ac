"""Which implementation each hot-op family runs: a static value handed to the forward, never read while tracing.

`KernelChoice(attention=..., moe=...)` is frozen and hashable, so it is part of a jitted step's static arguments
(and of the key of a serialized executable): two engines in one process can run different kernels, and changing
an environment variable after start-up changes nothing. `resolve` turns "auto" into the concrete choice for the
backend and device count; `m3jax.settings` reads the environment defaults (M3JAX_ATTENTION_IMPL,
M3JAX_MOE_IMPL) once, when a configuration is built.

- "pallas": the compiled Pallas kernels (Triton lowering): what a GPU runs.
- "interpret": the same kernels through Pallas' interpreter: how CI checks them on the CPU.
- "reference": the plain-jnp definitions.

`batch_invariant`: every op family runs one tile configuration whatever the step's token and row counts (no
decode / mid / prefill regimes, no split counts chosen from occupancy, the dense linears, the router and the
lm_head through the Pallas linear kernel at every M), so that no kernel's arithmetic for a row depends on what else
is in the step; the RMS norms' sums go through the linear kernel as well, and the steps compile without XLA's excess
precision (`compiler_options`). The tile tables say what each family runs then. The forward is then bitwise
row-invariant on the CPU (interpret mode), and on an H100 the engine's greedy tokens are batch- and
chunking-invariant (m3-slice-1moe): docs/benchmarks.md, "Batch invariance".

`topology` (pallas_kernels/topology.py): the device mesh and sharding rules the forward runs under. On more than
one device every op family runs through `jax.shard_map` (pallas_kernels/sharded.py), whatever the implementation:
each device runs the kernel (or the reference) on its own shard, and XLA never has to partition a `pallas_call`
(which it cannot: it would gather the operands onto every device). `M3Model` attaches its rules' topology
(`KernelChoice.on`); a choice without one runs every op unsharded.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.topology import SINGLE, Topology

IMPLS = ("reference", "pallas", "interpret")
CHOICES = ("auto", *IMPLS)
SPARSE_PREFILL = ("block_major", "union")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    attention: str = "reference"  # ragged paged attention, MSA index + top-k, block-sparse attention, KV writes
    moe: str = "reference"  # the fused MoE grouped GEMMs
    topology: Topology = SINGLE  # the mesh and rules the ops are sharded by (one device: none)
    batch_invariant: bool = False  # one tile configuration for every batch (see above)
    # Block-sparse prefill's kernel (`attention.tuning.sparse_tiles`): "block_major" or "union". Static, chosen by
    # the operator: a choice on the device needs a conditional, whose predicate the GPU runtime reads back on the
    # host, and the dispatch of every prefill step would wait for the device at each sparse layer.
    sparse_prefill: str = "block_major"

    def __post_init__(self) -> None:
        for family in ("attention", "moe"):
            value = getattr(self, family)
            if value not in CHOICES:
                raise ValueError(f"kernel choice for {family}: {value!r} is not one of {CHOICES}")
        if self.sparse_prefill not in SPARSE_PREFILL:
            raise ValueError(f"sparse prefill kernel {self.sparse_prefill!r} is not one of {SPARSE_PREFILL}")

    @property
    def compiler_options(self) -> dict[str, bool] | None:
        """XLA options every step compiled with this choice needs (`jax.jit(..., compiler_options=...)`).
        Batch-invariant: no excess precision. By default XLA may drop a bf16 rounding between two fp32 ops
        (convert f32 -> bf16 -> f32), and whether it finds such a pair depends on the shapes around it (a pad
        between the RMS norm's bf16 output and the router's fp32 input comes and goes with the token count), so a
        row's router logits, and its experts, would move with the batch."""
        return {"xla_allow_excess_precision": False} if self.batch_invariant else None

    def resolve(self, device_count: int = 1) -> KernelChoice:
        """'auto' -> the Pallas kernels on a GPU, the references elsewhere, on any number of devices (the sharded
        ops run the kernels per shard; `device_count` no longer changes the choice and is kept for callers)."""
        del device_count
        gpu = jax.default_backend() == "gpu"
        attention = self.attention if self.attention != "auto" else "pallas" if gpu else "reference"
        moe = self.moe if self.moe != "auto" else "pallas" if gpu else "reference"
        return dataclasses.replace(self, attention=attention, moe=moe)

    def on(self, topology: Topology) -> KernelChoice:
        """The same choice, run under `topology` (a rules object's `.topology`)."""
        return dataclasses.replace(self, topology=topology)

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.attention, self.moe)


REFERENCE = KernelChoice()
INTERPRET = KernelChoice("interpret", "interpret")
