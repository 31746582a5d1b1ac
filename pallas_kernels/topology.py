"""The device mesh as the kernels see it, and the one table of what each device runs under it.

`Topology` is a static, hashable value (a field of `pallas_kernels.choice.KernelChoice`, so part of a compiled
step's identity and of the executable cache's key): one mesh axis (`tp`) of `size` devices and a copy of the
logical-axis rules of `m3jax/sharding.py`, the one rules table (`ShardingRules.topology` makes it; `spec_for` below
is the function both use, so a weight, a page pool and a kernel operand with the same logical axes always get the
same placement). The sharded ops (`pallas_kernels/sharded.py`) wrap each kernel in a `jax.shard_map` over
`Topology.mesh()` whose operand specs come from `spec_for`: inside, every kernel and every tile table sees the
shard's shapes (heads, KV heads, expert slots, expert width of one device), so tiles are picked per shard by the
same tables that pick them on one device.

What each device runs is decided here, once, from the rules and the shapes (the "mode" of an op family):

  attention (dense, MSA index + top-k, block-sparse, K/V/index-K writes), `attention_mode`:
    split         K % size == 0: a device holds H/size query heads, K/size KV heads and their pages (a per-shard
                  page pool: the pool's KV-head axis is split), and the index heads of its KV groups. No
                  collective inside the op: the o-projection's row-parallel GEMM sums the heads (one all-reduce).
    replicate_kv  size % K == 0 (TP8 with M3's 4 KV heads): as vLLM does, KV heads are replicated, one per
                  device: the pool's KV-head axis is `size` wide (`kv_heads`), device i holds KV head
                  i // (size / K), computes it, and writes it (the devices sharing a head write the same values).
                  The index top-k runs for the device's group only; its [T, 1, topk] selections are all-gathered
                  (T x K x topk int32: 2 KB a decode row) so that every device holds the [T, K, topk] selections
                  the model carries between layers.
    replicated    anything else (heads that do not divide): every device runs the whole op.
    The index-K pool has no head axis (one shared index key head): replicated, written identically everywhere.

  MoE, `moe_mode` (the shared expert, when it has the routed width, is one more slot of the same kernel launch):
    tp            the rules split each expert's F (`expert_mlp`): every device runs every slot over F/size columns
                  of gate/up and F/size rows of down; the fp32 combine gives a partial [T, D] per device, summed by
                  one all-reduce (psum) in the activation dtype, as a row-parallel GEMM would.
    ep            the rules split the experts: device i holds experts [i E/size, (i + 1) E/size) and, stacked as its
                  last slot, the whole shared expert (prepared per shard: `checkpoints.prepare`). The residual
                  stream is replicated after the attention's all-reduce, so the tokens are already on every device
                  (the "all-gather" costs nothing): each device routes all T tokens, keeps the (token, expert)
                  pairs of its experts plus the shared expert for tokens t with t % size == i, runs the grouped
                  GEMMs on those rows only, and one all-reduce sums the partial [T, D] outputs. An all-to-all
                  dispatch would move each token's k + 1 rows (k + 1 = 5 times the all-reduce's [T, D] per
                  direction) in static shapes padded to the worst case, and XLA's ragged all-to-all has no CPU
                  implementation to test it with (jax 0.11.2: "ragged-all-to-all is not supported by XLA:CPU"),
                  so the all-reduce is the EP collective at every token count.
    replicated    experts and width both unsplit: every device runs the whole MoE, no collective.

Dense linears (q/k/v/o, index projections, dense MLPs) stay XLA's SPMD-partitioned GEMMs unless
`pallas_kernels.linear` takes them (small M); the rules give column-parallel q/k/v/gate/up and row-parallel o/down.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

__all__ = ["Topology", "SINGLE"]


@dataclasses.dataclass(frozen=True)
class Topology:
    size: int = 1  # devices on the mesh axis
    axis: str = "tp"
    # Logical axis -> mesh axis (or None: replicated), m3jax/sharding.py's table as a hashable tuple.
    rules: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a topology needs at least one device, got size={self.size}")

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def mesh_axis(self, logical: str) -> str | None:
        return dict(self.rules).get(logical)

    def spec_for(self, shape: tuple[int, ...], axes: tuple[str, ...], what: str = "") -> PartitionSpec:
        """The placement of an array with these logical axes: each axis on the mesh axis its rule names, unless the
        mesh does not divide it (then replicated). Refuses two dimensions on one mesh axis."""
        rules = dict(self.rules)
        out: list[str | None] = []
        for size, axis in zip(shape, axes, strict=True):
            mesh_axis = rules.get(axis)
            # A mesh axis of size 1 splits nothing; naming it anyway gives shardings that equal a step's
            # (unnamed) output placement in effect but not in jit's cache key, and would recompile every bucket.
            if mesh_axis is not None and (size % self.size != 0 or self.size == 1):
                mesh_axis = None
            if mesh_axis is not None and mesh_axis in out:
                raise ValueError(f"{what}: logical axes {axes} put two dimensions on mesh axis {mesh_axis!r}")
            out.append(mesh_axis)
        while out and out[-1] is None:  # the canonical form jit gives its outputs: same placement, same cache key
            out.pop()
        return PartitionSpec(*out)

    def splits(self, logical: str, size: int) -> bool:
        """Whether an axis of this logical name and size is split over the devices."""
        return self.sharded and self.mesh_axis(logical) == self.axis and size % self.size == 0

    def mesh(self) -> AbstractMesh:
        """The mesh the sharded ops' shard_maps run over: the context's abstract mesh when it is this one (as
        under `pallas_kernels.gpu_lowering.abstract_gpu`, which carries the device kind the Triton lowering
        reads), else an abstract mesh of `size` devices, which jit binds to the operands' concrete devices."""
        ctx = jax.sharding.get_abstract_mesh()
        if not ctx.empty and ctx.axis_names == (self.axis,) and ctx.axis_sizes == (self.size,):
            return ctx
        return AbstractMesh((self.size,), (self.axis,), axis_types=(AxisType.Auto,))

    # ---- the modes (see the module docstring) -----------------------------------------------------------------

    def attention_mode(self, num_heads: int, num_kv_heads: int) -> str:
        if not self.splits("q_heads", num_heads):
            return "replicated"
        if self.splits("kv_heads", num_kv_heads):
            return "split"
        if self.mesh_axis("kv_heads") == self.axis and self.size % num_kv_heads == 0:
            return "replicate_kv"
        return "replicated"

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> int:
        """KV heads in the page pool's head axis: `num_kv_heads`, or one per device when they are replicated."""
        return self.size if self.attention_mode(num_heads, num_kv_heads) == "replicate_kv" else num_kv_heads

    def moe_mode(self, num_experts: int, d_ff: int) -> str:
        if self.splits("experts", num_experts):
            return "ep"
        if self.splits("expert_mlp", d_ff):
            return "tp"
        return "replicated"


SINGLE = Topology()
