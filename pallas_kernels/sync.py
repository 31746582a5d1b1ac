"""Hand-off between the programs of one Pallas (Triton) launch: the last of a group to finish carries on.

Used where a second launch would cost more than the work it does: the MSA index kernel's in-kernel top-k (the
last page-split program of a query block selects) and split-K MoE gate_up (the last K split of a tile sums the
partials and runs the epilogue).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def when_last(count_ref, index: jax.Array, group_size: int, body: Callable[[], None], *, interpret: bool) -> None:
    """Run `body` in whichever of the `group_size` programs sharing counter `count_ref[index]` gets here last.

    Every thread's stores before this call are issued before the barrier; the counter's atomic add (acquire-
    release, GPU scope) then publishes them, so `body` may read the other programs' stores, with volatile loads
    (served by L2, not a stale L1 line; jax 0.11.2's cache_modifier=".cg" does not lower). The counter must be
    zero at the start of every call: an aliased zeros input."""
    if not interpret:  # the interpreter runs programs one after another and has no barrier primitive
        plgpu.debug_barrier()
    done = plgpu.atomic_add(count_ref, index, jnp.ones((), jnp.int32))
    pl.when(done == group_size - 1)(body)
