"""The small-M linear kernel's tile table: from the shard's shapes (M rows, K in, N out) to tiles, or None (XLA).

At M <= 64 rows (decode and small mixed steps) a projection reads its whole weight once and does almost no math:
it is bound by HBM bandwidth alone, and the floor is the weight's bytes over 4.8 TB/s. XLA's GEMMs at these sizes
run at ~1.4-1.5 TB/s on the H200 (issue 23). The kernel (kernel.py) streams the weight in [bk, bn] tiles, all M
rows of x (padded to 16, Triton's smallest dot) against each, and splits K across programs until the grid holds
about two programs per multiprocessor (M3's projections have few output tiles per shard: q at TP8 is
6144 x 1024, 16 tiles of 64 columns), the fp32 partials summed afterwards. The entries are chosen from that
occupancy argument, not yet measured: benchmarks/bench_projection.py times them against XLA ("linear" records)
at every shard shape of TP4 / TP8 / EP8, and this table is where the measured choice goes.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.attention.tuning import NUM_SMS, pow2_at_least

MAX_M = 64  # above: XLA's GEMM (compute starts to matter; its tiles are tuned for it)
MAX_SPLIT = 16


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    bm: int  # rows of x per dot (M padded to it: a power of two, at least 16)
    bn: int  # output columns per program
    bk: int  # K per pipelined step
    split: int  # programs sharing an output tile, each over 1/split of K (fp32 partials)
    warps: int = 4
    stages: int = 4


# Batch-invariant (KernelChoice.batch_invariant): one tile set at every M, from one row to a prefill chunk, so a
# row's dot products are the same instructions over the same K order whatever the other rows are. 64-row blocks
# (the warpgroup MMA's height), 64 x 128 output tiles, and a K split fixed by the shard's K and N alone: enough
# programs for the HBM at one row block, as `pick_tiles` reasons, but never changing with M (kernel.py runs it
# inside each program when the grid is large).
INVARIANT_BM, INVARIANT_BN, INVARIANT_BK = 64, 128, 64
# From this many rows on (prefill), a projection whose N takes 128-wide tiles runs 128 x 128 output tiles (8 warps,
# 3 stages) for the matrix units' sake. Same 64-wide K steps and the same split, so each element's sum is unchanged
# (benchmarks/check_linear_invariance.py checks the rows bitwise on the device). The fp32 router and the norms'
# sums (N <= 128) keep the small tiles.
INVARIANT_WIDE_M = 256


def _occupancy_split(k_steps: int, n_tiles: int) -> int:
    """K splits (a power of two dividing the bk steps evenly, at least two steps each) until one row block's grid
    holds about two programs per multiprocessor. A one-step split is a lone dot, which Triton folds into the next
    add (`acc + dot(x, w)` becomes an MMA into acc): summed inside a program it then rounds differently from the
    same split spread over programs (on the H100, benchmarks/results/linear-invariance-h100.json)."""
    split = 1
    while (n_tiles * split < 2 * NUM_SMS and split < MAX_SPLIT and k_steps % (2 * split) == 0
           and k_steps // (2 * split) >= 2):
        split *= 2
    return split


def invariant_tiles(k: int, n: int, m: int = 1) -> LinearTiles | None:
    """The batch-invariant tiles for an [m, k] @ [k, n] shard, or None if no K tile divides it. The K steps and
    split depend on k and n alone; m only widens the output tile (INVARIANT_WIDE_M). An N that no tile divides (a
    tiny model's 8-expert router) is padded by the kernel to whole tiles."""
    bn, bk = INVARIANT_BN, INVARIANT_BK
    while bn > 16 and n % bn:
        bn //= 2
    while bk > 16 and k % bk:
        bk //= 2
    if k % bk:
        return None
    tiles = LinearTiles(bm=INVARIANT_BM, bn=bn, bk=bk, split=_occupancy_split(k // bk, -(-n // bn)))
    if m >= INVARIANT_WIDE_M and bn == 128 and n > 128:
        tiles = dataclasses.replace(tiles, bm=128, warps=8, stages=3)
    return tiles


def pick_tiles(m: int, k: int, n: int, *, max_m: int = MAX_M, invariant: bool = False) -> LinearTiles | None:
    """Tiles for an [m, k] @ [k, n] shard, or None when the XLA GEMM should run it (m too large, or no tile
    divides the shapes). `invariant`: `invariant_tiles` at every m."""
    if invariant:
        return invariant_tiles(k, n, m) if m >= 1 else None
    if m > max_m or m < 1:
        return None
    bm = max(16, pow2_at_least(m))
    bn = 64
    while bn > 16 and n % bn:
        bn //= 2
    bk = 128 if bm <= 32 else 64  # keep the [bm, bk] x tile and the [bk, bn] weight tile within registers
    while bk > 16 and k % bk:
        bk //= 2
    if n % bn or k % bk:
        return None
    return LinearTiles(bm=bm, bn=bn, bk=bk, split=_occupancy_split(k // bk, n // bn))
