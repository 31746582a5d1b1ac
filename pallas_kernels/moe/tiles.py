"""The MoE kernels' tile table: the one place that maps (token count, weight format) to tile shapes.

Three regimes, by the number of rows each expert gets (M3: 128 experts, top-4, plus the shared slot that
every token visits):
  decode  (T <= 128: at most ~4 rows per routed expert): bound by streaming the touched experts' weights
          once. Rows are padded to 16 (the smallest MMA height), N tiles are narrow so that even a single
          token's 5 expert slots give the 132 multiprocessors enough programs, and deep pipelining keeps
          bytes in flight.
  mid     (T <= 2048: tens of rows per expert): still bound by weight bytes, but an expert's rows span a
          few row blocks; blocks of one expert sit next to each other in launch order (`group`), so they
          read each weight tile at about the same time and the repeats hit L2.
  prefill (larger T: hundreds of rows per expert): bound by the matrix units. 128-row blocks and wide N
          tiles, with the launch order grouped so that the x tiles of `group` row blocks stay in L2 while all
          N tiles of those blocks run.

Keys of `MoeTiles` (per kernel: `gu` = gate+up GEMM with the SwiGLU-OAI epilogue, `dn` = down GEMM):
  bm      rows per block; every expert's rows are padded to a multiple of it (one expert per block).
  bn      output columns per program (for `gu`, per matrix: the program makes bn gate and bn up columns).
  bk      K per pipelined step (MX formats need a multiple of 128, their pair-packing group; moe/layout.py).
  warps / stages   Triton's num_warps / num_stages.
  split   programs per output tile, each over 1/split of K (kernel.py; single-token MXFP8 down uses 2).
  group   row blocks that run N-tile by N-tile together before the next group (L2 reuse, see above).
  tail_heights  shorter row heights for a slot's last block, ascending powers of two under bm: a block holding at
          most h pairs computes h rows (the smallest such h), skipping the padding's MMA work and x reads for the
          same weight tiles (kernel._for_used_block). (bm // 2,) halves; (bm // 4, bm // 2) quarters too. Heights
          under 16 rows are dropped on the GPU (Triton's smallest dot).
  mx_mode "expand": widen a weight piece (scale broadcast over its 32-row blocks) before its dot;
          "subdot": one dot per 32-row scale block, scaling its [bm, bn] result.
          "expand_asm" (the table's mode for both MX formats): fields of two 16-bit words widened to bf16 by
          inline PTX bit moves and one packed bf16 scale multiply per pair (layout.widening_ptx); for MXFP8 9-11%
          faster at decode sizes than the first four-op version, which was 16-20% faster than "expand". Exact only
          for scales up to layout.ASM_BF16_MAX_SCALE: weights prepared with larger ones carry layout.WIDE_SCALES
          and run "expand". Runs as "expand" in interpret mode.
          Timed and dropped: "subdot_f32" (subdot widened through f32; 1.70-2.42x) and "f16_subdot" (f16
          activations, one hardware cvt.rn.f16x2.e4m3x2 per pair, each 32-row sub-dot scaled in fp32: 30% fewer
          loop instructions offline, yet 1.25-2.56x over 7 tile sets against expand_asm's 1.20-1.67x at T = 1..128
          in the same run; benchmarks/results/moe-h200-f16.json, commit 873ba16), and "fp8_mma" (fp8 x fp8 dots
          on the unwidened bytes, activations split into two exact e4m3 terms: 2.6-3.1x slower at T = 1..128,
          moe-h200-fp8mma-1.json, commit b020d3c), and "split_asm" (byte 0 of each word widened by integer
          bit moves, byte 1 by the conversion unit to f16: 1.03-1.15x slower at T = 1..128, moe-h200-split-1.json,
          commit 2eb6709).
          Override: M3JAX_MOE_MX_MODE.
  mx_rows K rows of MX words widened per dot: 32 (one scale block) or 64 (MXFP8 only: two blocks, the scale
          chosen per row), fewer and larger dots.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    bn: int
    bk: int
    warps: int
    stages: int
    split: int = 1  # programs per output tile, each over 1/split of K (more programs when there are few tiles)


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    regime: str
    bm: int
    gu: KernelTiles
    dn: KernelTiles
    group: int
    mx_mode: str = "expand"
    tail_heights: tuple[int, ...] = ()  # rows a short last block computes (kernel._for_used_block)
    mx_rows: int = 32  # K rows of MX weight words widened per dot: 32 (one scale block) or 64 (half a group)
    # "triton": kernel.py's Pallas Triton kernels; "mosaic": kernel_mgpu.py's warp-specialised Mosaic GPU
    # kernels (bf16 experts, bm = 128, no split K, no tail_heights: a block of <= 64 pairs runs one of its two
    # compute warpgroups; `warps` is unused, bn / bk / stages / group mean what they mean for Triton).
    backend: str = "triton"
    # Mosaic GPU, MXFP8 experts: how the two compute warpgroups widen a step's weights (kernel_mgpu._grouped_gemm):
    # "each", each the whole step into a tile of its own; "split", each half into one shared tile; "swap",
    # wgmma's operands swapped so that each widens its own 64 columns into registers, never into shared memory
    # (bn = 128; gate_up writes act^T, down reads it as it stands and its epilogue stores y transposed back to
    # [M, D]; kernel_mgpu._grouped_gemm_swapped). All GPU-checked (benchmarks/check_mosaic.py).
    mx_widen: str = "each"

    def __post_init__(self) -> None:
        h = self.tail_heights
        assert list(h) == sorted(set(h)) and all(0 < x < self.bm and x & (x - 1) == 0 for x in h), h
        assert self.mx_rows in (32, 64), self.mx_rows
        assert self.backend in ("triton", "mosaic"), self.backend
        assert self.mx_widen in ("split", "each", "swap"), self.mx_widen
        if self.backend == "mosaic":
            assert self.bm == 128 and self.gu.split == self.dn.split == 1 and not self.tail_heights, self

    def replace(self, **kw: object) -> MoeTiles:
        if "bm" in kw and "tail_heights" not in kw:  # a new block height keeps the tail heights below it
            kw["tail_heights"] = tuple(h for h in self.tail_heights if h < kw["bm"])  # type: ignore[operator]
        return dataclasses.replace(self, **kw)  # type: ignore[arg-type]


# Upper token bounds of each regime (inclusive).
DECODE_MAX_T = 128
MID_MAX_T = 2048

# Keyed by (regime, format); a format without its own entry uses the "dense" one. The dense entries were timed
# on one H200 (benchmarks/bench_moe.py; docs/benchmarks.md "MoE kernels": decode at 1.03-1.05x of the weight-
# streaming floor for T = 8..128, prefill 447 TFLOP/s at T = 8192 with 4 stages against 428 with 3). The MXFP8
# decode entry was timed too (below); the other MX entries are chosen from offline Triton 3.6 sm_90 builds (no
# register spills, no local memory) and were not timed in their final layout. Every entry fits two or more
# programs per multiprocessor where the regime is bandwidth-bound.
_K = KernelTiles
GPU_TABLE: dict[tuple[str, str], MoeTiles] = {
    ("decode", "dense"): MoeTiles("decode", bm=16, gu=_K(bn=64, bk=128, warps=4, stages=4),
                                  dn=_K(bn=128, bk=128, warps=4, stages=4), group=1),
    # MXFP8 decode is bound by widening the bytes in registers (the integer pipe), not by HBM. The inline-PTX
    # widening ("expand_asm") needs ~30% fewer instructions than the conversion path; 8 warps per program, 3
    # stages. H200, T = 1 / 8 / 32 / 128 with the 3-op widening: 1.54 / 1.18 / 1.15 / 1.18x the floor, against
    # 1.70 / 1.27 / 1.25 / 1.28x with the earlier 4-op one (same run, benchmarks/results/moe-h200-asm3.json);
    # 3 stages beat 4 (1.66 / 1.34 / 1.31 / 1.33 vs 1.73 / 1.37 / 1.32 / 1.39x, moe-h200-mx-asm-sweep.json), and
    # of 11 tile sets this one is best at T = 8 and 32 on the new widening too.
    ("decode", "mxfp8"): MoeTiles("decode", bm=16, gu=_K(bn=64, bk=128, warps=8, stages=3),
                                  dn=_K(bn=128, bk=128, warps=8, stages=3), group=1, mx_mode="expand_asm"),
    # Half-height tail blocks (tail_heights=(32,)): T = 2048, same run, bf16 5.13 against 5.55 ms (kernel-busy 5.01
    # against 5.30), MXFP8 13.44 against 15.59 ms (benchmarks/results/moe-h200-half-tail.json). Not measured for
    # the 32-row MXFP4 blocks, so off there.
    ("mid", "dense"): MoeTiles("mid", bm=64, gu=_K(bn=64, bk=128, warps=4, stages=4),
                               dn=_K(bn=128, bk=128, warps=4, stages=4), group=8, tail_heights=(32,)),
    # MXFP8 mid: 32-row blocks, 8 warps (warps split N, so no warp widens another's weight columns) and 3 stages,
    # two programs per SM. The 64-row 4-warp entry it replaces built to one 4-warp program per SM (wgmma, widened
    # weights back through shared memory, 172 registers). Same process, kernel-busy: T = 512 2.445 against
    # 6.852 ms, T = 2048 6.305 against 13.146 ms; 64 rows at 8 warps 3.743 / 11.20, 16 rows 2.989 / 8.988 ms
    # (benchmarks/results/moe-h200-mid-mx8.json).
    ("mid", "mxfp8"): MoeTiles("mid", bm=32, gu=_K(bn=64, bk=128, warps=8, stages=3),
                               dn=_K(bn=128, bk=128, warps=8, stages=3), group=8, mx_mode="expand_asm",
                               tail_heights=(16,)),
    # gate+up: a 128 x (2 x 128) output tile per program (two accumulators); down: 128 x 256 with 3 stages, the
    # shape of the best plain Pallas matmul on this GPU (gpu.md). T = 8192, same run: 10.24 ms against 11.12 ms
    # with a 128 x 128 down tile at 4 stages (benchmarks/results/moe-h200-explore.json). Groups of 4 row blocks
    # (was 16): 10.09 vs 10.37 ms and 9.83 vs 10.67 ms in two sweeps (moe-h200-8192-sweep*.json), but the same
    # tiles measure 9.8-10.7 ms across processes, so the gain is within that spread; 1, 2, 6, 8, 24, 32: slower.
    # Half-height tail blocks: T = 8192, same process, kernel-busy 10.03 and 10.07 ms against 10.53 ms
    # (benchmarks/results/moe-h200-half-tail-8192.json); in a later process 9.78 ms against 10.35 / 10.63 without,
    # and 9.75 / 10.03 ms with 32-row tails too, no clear gain (moe-h200-tails-bf16-2.json).
    ("prefill", "dense"): MoeTiles("prefill", bm=128, gu=_K(bn=128, bk=64, warps=8, stages=4),
                                   dn=_K(bn=256, bk=64, warps=8, stages=3), group=4, tail_heights=(64,)),
    # MX tiles are widened in registers before the MMA: narrower gate+up tiles keep that spill-free. Tail blocks
    # of 32 or 64 rows: T = 8192, same process, kernel-busy 21.11 / 21.03 ms against 21.99 ms without, while
    # halves alone measured 23.20 / 23.18 ms (benchmarks/results/moe-h200-tails-mxfp8-2.json). 64-row pieces
    # (mx_rows): T = 8192, same process, 20.02 against 23.43 ms wall; at T <= 2048 they measured 1.5-1.7x slower
    # (benchmarks/results/moe-h200-mx-rows.json), so only prefill takes them.
    ("prefill", "mxfp8"): MoeTiles("prefill", bm=128, gu=_K(bn=64, bk=128, warps=8, stages=4),
                                   dn=_K(bn=128, bk=128, warps=8, stages=4), group=16, mx_mode="expand_asm",
                                   tail_heights=(32, 64), mx_rows=64),
}
# The Mosaic GPU kernels (kernel_mgpu.py), where the device runs them (`device.wgmma_device`) and the entry takes the
# layer's shapes as it stands (`kernel.kernel_tiles`): per format, the smallest token count that takes them and the
# tiles. MXFP8: "swap", the weights widened in registers as wgmma's A operand, down at 3 stages.
# - T = 8192, H100: 11.28 ms (kernel-busy 11.13) against 20.07 ms (18.56) for the Triton prefill entry in the same
#   run (benchmarks/results/moe-mosaic-mx-h100-8aad53c.json, where it is "swap_down"), and 10.16-10.45 ms for bf16
#   experts in three earlier runs (-5da6a56, -5d34121, -fc8ba0f): 1.08-1.11x.
# - Mid sizes against the Triton mid entry, H100, one process each: T = 1024 3.64 ms against 4.17 (kernel-busy
#   3.46 against 3.99), T = 2048 4.33 against 6.73; T = 512 3.15 against 2.97, where Triton stays
#   (moe-mid-mx-h100-1024-47a239b.json, moe-mid-mx-h100-512-2048-47a239b.json). So from 1,024 tokens.
# Equal to the Triton kernels and the reference on the GPU (mosaic-check-h100-f3d47e2.json at T = 600; the mid-size
# runs above against the reference at 512, 1024 and 2048: relative error 5.31e-3, the Triton entry's).
MOSAIC_TABLE: dict[str, tuple[int, MoeTiles]] = {
    "mxfp8": (1024, MoeTiles("prefill", bm=128, gu=_K(bn=128, bk=128, warps=4, stages=2),
                             dn=_K(bn=128, bk=128, warps=4, stages=3), group=1, backend="mosaic", mx_widen="swap")),
}

# MXFP4 widens by the same inline-PTX scheme (layout.widening_ptx; a few more bit ops per pair) from the same
# 16-bit words, so it starts from the MXFP8 entries. Its words hold 32-element runs: 32-row pieces only.
for _reg in ("decode", "mid", "prefill"):
    GPU_TABLE[(_reg, "mxfp4")] = GPU_TABLE[(_reg, "mxfp8")].replace(mx_rows=32)

# One token: its 5 slots give each GEMM only 240 programs for 132 SMs. Splitting down's K in two (fp32 partials,
# summed by the combine) lifts MXFP8 to 0.095 ms = 1.40x the floor against 0.104-0.107 ms (1.53-1.57x) unsplit;
# splitting gate_up as well (its last program per tile sums the partials), 3 or 4 ways, or bf16 at all, measured
# slower (H200, same run, benchmarks/results/moe-h200-splitk.json). Stream K (equal runs of the flattened (tile,
# K step) space over 240-720 programs, shares summed by each tile's last program; commit 5b645b0) was slower too:
# gate_up 59.3-59.9 against 54.6 us, down 33.2-34.9 against 31.0 us, with an even spread no faster than the uneven
# one (moe-h200-streamk-2.json, docs/benchmarks.md).
SINGLE_TOKEN_DOWN_SPLIT = {"mxfp8": 2}

# Per-shard fill (the topology-aware part of this table). The decode entries were measured at M3's full expert
# width (F = 3072: 48 gate_up output tiles of 64 columns per slot). A TP shard holds F / devices columns: at TP8
# one token's 5 slots make 5 x 6 = 30 gate_up programs for 132 multiprocessors, a quarter of the GPU streaming the
# weights. So, for decode tiles whose gate_up grid (row blocks x N tiles) falls under NUM_SMS programs, gate_up's
# K is split (2 or 4 ways, the last program of a tile summing the partials; kernel.py) until it does not: TP8 at
# T = 1: 30 -> 120 programs, TP4: 60 -> 240. Full-width shards (TP1, EP) never trigger it (T = 1: 240 programs).
# From occupancy, not measured: benchmarks/bench_projection.py times the per-shard MoE at these shapes.
NUM_SMS = 132
SHARD_FILL_MAX_SPLIT = 4


def fill_shard(tiles: MoeTiles, num_blocks: int, d_model: int, d_ff: int) -> MoeTiles:
    """`tiles` with gate_up's K split until its grid of `num_blocks` row blocks x N tiles holds NUM_SMS programs
    (decode regime, Triton backend, tiles not already split; see above)."""
    gu = tiles.gu
    if tiles.regime != "decode" or tiles.backend != "triton" or gu.split > 1 or d_ff % gu.bn:
        return tiles
    programs, steps, split = num_blocks * (d_ff // gu.bn), d_model // gu.bk, 1
    while programs * split < NUM_SMS and split < SHARD_FILL_MAX_SPLIT and steps % (2 * split) == 0:
        split *= 2
    return tiles if split == 1 else tiles.replace(gu=dataclasses.replace(gu, split=split))


# Interpret mode (CPU tests) runs every program as a loop iteration: tiny tiles keep the test shapes
# (D, F of a few hundred) multi-tile in every direction, which is what the tests are about.
INTERPRET_TILES = MoeTiles("interpret", bm=16, gu=KernelTiles(bn=64, bk=128, warps=4, stages=1),
                           dn=KernelTiles(bn=64, bk=128, warps=4, stages=1), group=2)


def block_and_tile(u: jax.Array, nb: int, nt: int, group: int) -> tuple[jax.Array, jax.Array]:
    """Output tile u -> (row block, N tile): row blocks fastest inside groups of `group`, then N tiles, so the
    tiles in flight share weight tiles (blocks of one expert) and x tiles in L2. Both backends launch in this
    order (Triton: one program a tile; Mosaic: persistent CTAs walking it)."""
    per_group = group * nt
    first = (u // per_group) * group
    size = jnp.minimum(nb - first, group)
    local = u % per_group
    return first + local % size, local // size


def regime(num_tokens: int) -> str:
    if num_tokens <= DECODE_MAX_T:
        return "decode"
    return "mid" if num_tokens <= MID_MAX_T else "prefill"


def pick_tiles(num_tokens: int, fmt: str, *, interpret: bool = False, mosaic: bool = False) -> MoeTiles:
    """Tiles for `num_tokens` rows of `fmt` weights ("bf16" | "mxfp8" | "mxfp4"); `mosaic`: MOSAIC_TABLE's entry
    where it has one for this many tokens (the caller says the device runs them)."""
    if interpret:
        tiles = INTERPRET_TILES
    else:
        reg = regime(num_tokens)
        entry = MOSAIC_TABLE.get(fmt) if mosaic else None
        if entry is not None and num_tokens >= entry[0]:
            tiles = entry[1].replace(regime=reg)
        else:
            tiles = GPU_TABLE.get((reg, fmt), GPU_TABLE[(reg, "dense")])
        if num_tokens == 1 and fmt in SINGLE_TOKEN_DOWN_SPLIT:
            tiles = tiles.replace(dn=dataclasses.replace(tiles.dn, split=SINGLE_TOKEN_DOWN_SPLIT[fmt]))
    if fmt != "dense" and tiles.gu.bk % 128:
        # MX weights are pair-packed in groups of 128 along K (moe/layout.py): at least one group per step.
        tiles = tiles.replace(gu=dataclasses.replace(tiles.gu, bk=128))
    if fmt != "dense" and tiles.dn.bk % 128:
        tiles = tiles.replace(dn=dataclasses.replace(tiles.dn, bk=128))
    mode = os.environ.get("M3JAX_MOE_MX_MODE")
    if mode:
        tiles = tiles.replace(mx_mode=mode)
    return tiles


def invariant_tiles(fmt: str, num_tokens: int, *, interpret: bool = False) -> MoeTiles:
    """The batch-invariant tiles (KernelChoice.batch_invariant) for a call of `num_tokens` rows: the table's entry
    for that count without split K or a shard fill; where that entry widens MX weights in 64-row pieces (MXFP8
    prefill) or runs another backend, the mid entry instead.

    A row's bits must not depend on what the step holds. Triton folds `acc + dot(x, w)` into MMAs that accumulate
    into acc, so an element's sum is the same sequence of 16-deep MMA steps whatever the block height, N tile or K
    step. On the H100 every bf16 and MXFP8 table entry gives a row the same bits, bf16 prefill included, but MXFP8
    prefill, whose 64-row MX pieces regroup the sum (benchmarks/check_moe_invariance.py,
    results/moe-invariance-h100-16844d1.json). One tile set for every T (the mid entry, as before) cost the decode
    step 23% at batch 32 on the H200: 64-row blocks where decode needs 16."""
    if interpret:
        return INTERPRET_TILES
    tiles = pick_tiles(max(num_tokens, 2), fmt)  # 2: one token's split down is not invariant
    if tiles.mx_rows != 32 or tiles.backend != "triton":
        tiles = pick_tiles(MID_MAX_T, fmt)
    return tiles.replace(regime="invariant", gu=dataclasses.replace(tiles.gu, split=1),
                         dn=dataclasses.replace(tiles.dn, split=1))


def fit_tiles(tiles: MoeTiles, d_model: int, d_ff: int, fmt: str) -> MoeTiles | None:
    """`tiles` shrunk (halving bn / bk) until they divide the layer's shapes; None when no tile fits (then the
    dispatch uses the reference). The GPU table's entries fit M3 as they are."""
    min_k = 16 if fmt == "dense" else 128  # MMA depth / MX pair-packing group

    def fit(kt: KernelTiles, k: int, n: int) -> KernelTiles | None:
        bn, bk, split = kt.bn, kt.bk, kt.split
        while bn > 16 and n % bn:
            bn //= 2
        while bk > min_k and k % bk:
            bk //= 2
        if n % bn or k % bk or bk < min_k:
            return None
        while (k // bk) % split:  # every split takes the same whole number of K steps
            split -= 1
        return dataclasses.replace(kt, bn=bn, bk=bk, split=split)

    gu, dn = fit(tiles.gu, d_model, d_ff), fit(tiles.dn, d_ff, d_model)
    if gu is None or dn is None:
        return None
    return tiles.replace(gu=gu, dn=dn)
