"""The tile table of the attention-family kernels: the one place where tile sizes are chosen from real shapes.

Rows per request (T / R) tells decode (1 + k draft rows per request) from prefill chunks; the page-table width
P and the head dims size the rest. Figures behind each choice: docs/benchmarks.md, "Attention kernels"
(H200, jax 0.11.2, Triton lowering), results in benchmarks/results/attention-h200.json. Interpret mode uses the
same tiles so CI runs the code the GPU runs.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.msa.kernel_mgpu import tokens_per_block as mosaic_tokens_per_block

# Below this many new rows a step's K / V / index-K write stays an XLA scatter, from it on the Pallas row store:
# 64 rows 10.3 vs 14.6 us, 8192 rows 41.0 vs 15.3 us (32 writes in one jitted loop, 8.6 GB pool); the threshold
# is the linear interpolation of those two points, not a measurement.
KV_WRITE_PALLAS_MIN_ROWS = 1024

# At most this many query rows per request row of the bucket (tokens / rows, rows padded to max_num_seqs) is
# "decode-like": one page read must serve few query rows, the op is bandwidth-bound and the grid must split the
# pages to fill 132 SMs. More is a prefill chunk: compute-bound, query blocks of many rows so the matrix units
# see M >= 64. 4 covers a verify step of 1 + 3 draft rows per request. At 8, the engine's 1,024-token bucket
# (128 rows) took the decode tiles, and a lone 1k prompt ran its block-sparse attention one token per program:
# 559 us against 98 us with the prefill tiles (H100, m3-slice-1moe, kernel-busy,
# benchmarks/results/engine-prefill-h100-1moe-214053d/). Its steps hold over 512 tokens and at most 128 decode
# rows, so they are mostly prefill whatever the mix.
DECODE_ROWS_PER_REQUEST = 4
# The fewest selected pages a decode program of the block-sparse attention reads when the grid is split.
MIN_SPARSE_PAGES_PER_SPLIT = 2
NUM_SMS = 132  # H200
# Decode index: page tables up to this wide (8k tokens) take the top-k inside the scoring kernel (index_tiles).
FUSED_TOPK_MAX_PAGES = 64


@dataclasses.dataclass(frozen=True)
class IndexTiles:
    bt: int  # query tokens per program (M = bt * index heads rows in each dot)
    bp: int  # pages (= MSA blocks) per program; the grid's second axis splits the page table
    num_warps: int = 4
    num_stages: int = 3
    # Top-k over the block scores: "pallas" (msa.kernel.topk_blocks, a second launch), "xla" (lax.top_k) or
    # "fused" (the last program of each query block selects inside the scoring kernel: no second launch).
    topk: str = "pallas"
    # Tokens per query block (None: bt). 1 when every request has one row: each token is then its own block
    # (nothing to share), the program's bt-row tile is mostly masked, and the block metadata is an iota instead
    # of the run search's handful of small XLA kernels.
    block_tokens: int | None = None
    # Every page through the masked loop body, as AttentionTiles.mask_every_page: which body scores a page
    # otherwise depends on the other tokens of the query block (padding at position 0 joins the last request's
    # run), and on the GPU the two bodies' dots need not round alike.
    mask_every_page: bool = False
    # Scoring: "triton" (msa/kernel.py) or "mosaic" (msa/kernel_mgpu.py: warp-specialised, TMA-fed wgmma, for
    # prefill-sized steps; its own query blocks of 2 x 64 / index heads tokens, `bp` pages per program (a
    # multiple of 32 up to the page size), `num_stages` index-K buffers; the top-k as `topk` says, "fused" only
    # when one program sees every page of a row: bp >= the page table's width).
    backend: str = "triton"


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    bt: int  # query tokens per program (M = bt * heads per KV group rows in each dot)
    # Pages (entries of the page list) per program; > list length means no split. Any value: the kernel rounds it
    # up to a power of two (its entry vector is a Triton tile) and masks the entries past the list.
    pages_per_split: int
    num_warps: int = 4
    num_stages: int = 3
    key_tile: int | None = None  # keys per loop step (None: a whole page); half a page halves each stage's smem
    # Block-sparse prefill: 0 = query blocks over their tokens' union of pages; n >= 1 = KV-block-major
    # (msa/block_major.py): one program per (group, selected block, up to n tiles of bt tokens that chose it),
    # partial results merged afterwards.
    block_major: int = 0
    # Dense: every page through the masked loop body, none through the unmasked one. Which pages a row sees in
    # which body depends on the first token of its query block, i.e. on how the step cut the request, and the two
    # bodies need not round alike (the compiler may contract `s * c - m * c` differently around the select).
    mask_every_page: bool = False
    # Dense: "triton" (kernel.py) or "mosaic" (kernel_mgpu.py: warp-specialised, TMA-fed wgmma, for prefill-sized
    # steps; `key_tile` keys per step and `num_stages` K/V buffers; bt is its own, 2 x 64 rows / heads per group).
    # Block-sparse union (block_major 0): "mosaic" is msa/sparse_mgpu.py in one of two forms by `bt`: 2 x 64 rows
    # / heads per group tokens, each compute warpgroup its own on one page stream (`sparse_mgpu.shared_form`), or
    # 64 rows / heads per group tokens whose two compute warpgroups take alternate pages (an even `num_stages`).
    backend: str = "triton"


# The Mosaic GPU entries of the tables below (measured where they are used), in one place so that the dispatch's
# shape check (`dispatch.mosaic_for`) tests the tiles the tables return; page counts are filled per call.
MOSAIC_INDEX = IndexTiles(bt=16, bp=64, num_stages=4, backend="mosaic")
MOSAIC_SPARSE = AttentionTiles(bt=8, pages_per_split=0, num_stages=3, key_tile=128, backend="mosaic")
MOSAIC_DENSE = AttentionTiles(bt=8, pages_per_split=0, key_tile=128, num_stages=3, backend="mosaic")


def pow2_at_least(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): what every Triton tile size must be."""
    return 1 << max(0, (x - 1).bit_length())


def _rows_per_request(num_tokens: int, num_rows: int) -> int:
    return max(1, -(-num_tokens // max(1, num_rows)))


def index_tiles(num_tokens: int, num_rows: int, pages_per_row: int, index_heads: int, *,
                invariant: bool = False, mosaic: bool = False) -> IndexTiles:
    """`mosaic`: the Mosaic GPU scoring takes these shapes on this device (dispatch decides; prefill only)."""
    rows = _rows_per_request(num_tokens, num_rows)
    # The dot needs M = bt * heads >= 16 rows on the matrix units (Triton's minimum).
    min_bt = pow2_at_least(max(1, -(-16 // index_heads)))
    if rows <= DECODE_ROWS_PER_REQUEST and not invariant:
        # Bandwidth-bound: long page streams per program pipeline best, as long as the grid still holds ~2
        # programs per SM (H200, batch 64, kernel alone: 8k 16 pages/program 1.77x its floor vs 8 pages 2.3x;
        # 32k 64 pages 1.32x; 128k 64 pages 1.24x, 32 pages 1.11-1.26x across runs).
        want = max(1, num_rows * pages_per_row // (2 * NUM_SMS))
        # Short contexts select inside the scoring kernel, saving the second launch and the gap before it
        # (8k, same runs: 46.9 against 67.4 us, 73.3 against 81.7 us). Long ones do not: one program then ranks
        # hundreds of blocks alone (16k 109.0 against 83.0 us, 32k 159.8 against 151.7, 128k 619 against 550;
        # benchmarks/results/attention-h200-fused-1.json and -fused-2.json).
        topk = "fused" if pages_per_row <= FUSED_TOPK_MAX_PAGES else "pallas"
        return IndexTiles(bt=max(min_bt, pow2_at_least(rows)), bp=min(64, max(8, pow2_at_least(want))),
                          topk=topk, block_tokens=1 if num_tokens <= num_rows else None)
    # Prefill: compute-bound; M = 64 rows per dot (8k chunk: 180 us vs 237 us at M = 128), 32 pages per program
    # (8k chunk, kernel-busy: 16 pages 146.5 / 147.9 us against 153.7 / 152.3 us with 8 in two cases of one run,
    # attention-h200-prefill-4.json; 32 pages 133.2-133.7 us against 145.6-146.7 us with 16 in three cases of the
    # next, attention-h200-prefill-5.json).
    # Batch-invariant: these tiles for every step. A decode token then scores in a 64-row dot like a prefill
    # token (the row's arithmetic does not change with the dot's height), and the top-k is always the second
    # launch, whose result does not depend on how the pages were split.
    # Mosaic GPU (msa/kernel_mgpu.py), where it runs: 64 pages a program, 4 stages, the Pallas top-k after it.
    # 8k chunk, H100, kernel-busy, three cases in two runs: 124.8-128.9 us against 130.9-135.4 us for these
    # Triton tiles (the scoring kernel 54-55 against 85 us; the top-k inside it, a 92 us kernel, loses;
    # benchmarks/results/attention-prefill-h100-5da6a56.json and -5d34121.json). Not batch-invariant mode's.
    # Only for requests of at least one Mosaic query block (32 tokens at 4 index heads): shorter ones leave a
    # compute warpgroup idle, and the second launch costs more than it saves (H100, m3-slice-1moe, a 1k bucket of
    # 128 rows of 8 tokens: 13.5 us scoring + 5.1 us top-k against 9.3 us for the Triton tiles;
    # engine-step-h100-1moe-ca7527f.json against -4a2c932.json).
    if mosaic and not invariant and rows >= mosaic_tokens_per_block(index_heads):
        return MOSAIC_INDEX
    return IndexTiles(bt=max(min_bt, pow2_at_least(max(1, 64 // index_heads))), bp=32, mask_every_page=invariant)


def sparse_tiles(num_tokens: int, num_rows: int, topk: int, heads_per_group: int, *, num_kv_heads: int = 1,
                 invariant: bool = False, union: bool = False, mosaic: bool = False) -> AttentionTiles:
    """`num_kv_heads`: KV groups on this device (the grid's second axis). `mosaic`: the Mosaic GPU union kernel
    takes these shapes on this device (dispatch decides)."""
    rows = _rows_per_request(num_tokens, num_rows)
    if rows <= DECODE_ROWS_PER_REQUEST or invariant:
        # Batch-invariant: this per-token kernel for prefill tokens too. Each token reads its own selected pages
        # in its own order, as at decode; the prefill kernels below visit a query block's union of pages, or
        # merge per-block partials, in an order that depends on the other tokens of the chunk.
        # One token per program reading its own topk pages (no union list to build). Split only where the
        # grid would leave most multiprocessors idle (batch 1: one program per KV group; H100, 16 pages: 33 us
        # unsplit, 9 us at 2 pages a split, attention-split-b1-h100-1moe-295fec8.json): at batch 64 the merge
        # of split partials cost more than the parallelism gained (32k: 94 us unsplit, 102-160 us split).
        # Never in batch-invariant mode, whose split must not change with the batch.
        per_split = topk
        if not invariant:
            want_splits = max(1, NUM_SMS // max(1, num_tokens * num_kv_heads))
            per_split = max(MIN_SPARSE_PAGES_PER_SPLIT, pow2_at_least(-(-topk // want_splits)))
        # Half-page key steps (whole pages with 3 stages: 1.99 / 1.51 / 1.87x the floor at 8k / 32k / 128k).
        # 3 stages, not 4: 70 KB of shared memory instead of 102 KB, so three programs share a multiprocessor
        # instead of two (same run: 78.9 / 78.6 / 84.6 us against 86.7 / 87.0 / 83.1 us with 4 stages,
        # benchmarks/results/attention-h200-depth.json).
        return AttentionTiles(bt=1, pages_per_split=min(per_split, topk), num_stages=3, key_tile=64)
    # Prefill: KV-block-major (msa/block_major.py): each selected (token, block) pair computed once, a page read
    # once for up to 16 tiles of 4 tokens that chose it. 8k chunk, random selections, same run, kernel-busy:
    # 2,760 us against 3,548 us for query blocks of 4 tokens over their union of pages (8 / 4 / 1 tiles per
    # program 2,799 / 2,920 / 2,840 us; 8-token tiles 3,791 us; benchmarks/results/attention-h200-prefill-3.json).
    # Of the 2,760 us, the merge of the bf16 partials is 533 us. (The union kernel: 3.5 ms against 5.6 ms one
    # token per program and 8.0 ms for 8 tokens.)
    # Neighbouring tokens whose selections overlap favour the union kernel, which then reads few pages that a
    # token did not choose and writes no partials. 8k chunk, same run (attention-h200-prefill-4.json): with index
    # queries drifting over 256 tokens a 4-token block's union holds 15.5 pages per group against 56.5 selected
    # pairs, and the union kernel takes 2,090 us against 2,647 us block-major; with independent random queries,
    # 26.8 against 56.5, 3,485 us against 2,665 us. Block-major costs the same in both; the union kernel about
    # 185 us + 123 us per page of a block's union. They meet at 20.1 / 56.5 = 0.356 pages per pair: an
    # interpolation between the two measured points, not a measured crossover. The next run
    # (attention-h200-prefill-5.json) timed the choice: it took union at 0.276 pages per pair (64-token drift)
    # and 0.274 (256), 2,110 / 2,103 us against 2,098 / 2,096 forced, and block-major at 0.475 (random),
    # 2,732 us against 2,649 forced (the union page lists' sorts, computed for the predicate then).
    # Block-major alone, no device-side choice: choosing needs a lax.cond, and on the GPU the runtime reads a
    # conditional's predicate back on the host, so the dispatch of every prefill step waited for the device at
    # each sparse layer (H100, m3-slice-1moe, 1k prefill: 1.94 ms to dispatch, 63% of it in cuStreamSynchronize
    # under XLA's ConditionalThunk, against 0.34 ms for a decode step; benchmarks/profile_dispatch.py,
    # benchmarks/results/dispatch-h100-1moe-25254b8/). Each sparse layer then waited for the host to launch its
    # second half, and the host could not build the next step meanwhile. The union kernel is the operator's static
    # choice instead (`union`: `KernelChoice.sparse_prefill`, `--sparse-prefill-kernel union`), for models whose
    # neighbouring tokens choose overlapping pages.
    # Mosaic GPU (msa/sparse_mgpu.py), where it runs, for either choice: 8-token query blocks whose two compute
    # warpgroups walk one union page stream, each over its own 4 tokens (the shared form: a page read serves 128
    # rows), whole pages, 3 stages. 8k chunk, H100, kernel-busy (one run,
    # benchmarks/results/attention-prefill-h100-037031e.json): random selections 1,909 us against 2,215 for
    # 4-token blocks whose warpgroups split the pages (half pages, 4 stages) and 2,947 block-major; 256-token
    # drift 1,085 against 1,411 and 2,945 (the shared form at half pages, 4 stages: 2,279 / 1,274).
    if mosaic:
        return dataclasses.replace(MOSAIC_SPARSE, pages_per_split=4 * topk)
    if union:  # the union kernel's tiles when it was measured against block-major (above)
        return AttentionTiles(bt=4, pages_per_split=4 * topk, num_stages=3, key_tile=64)
    return AttentionTiles(bt=4, pages_per_split=4 * topk, num_stages=2, block_major=16)


def dense_tiles(num_tokens: int, num_rows: int, pages_per_row: int, num_kv_heads: int,
                heads_per_group: int, *, invariant: bool = False, mosaic: bool = False) -> AttentionTiles:
    """`mosaic`: the Mosaic GPU kernel takes these shapes on this device (dispatch decides; prefill only)."""
    rows = _rows_per_request(num_tokens, num_rows)
    if rows <= DECODE_ROWS_PER_REQUEST and not invariant:
        # Flash-decoding split so that requests x groups x splits is ~16 programs per SM (32k, batch 64: 8 splits
        # ran 1.17-1.23x the floor, 4 splits 1.24x, 2 splits 1.22x), but never under 16 pages per split: the
        # merge of partials then costs more than it gains (8k: 8 pages 1.44x, 16 pages 1.30x, 32 pages 1.29x).
        want_splits = max(1, 16 * NUM_SMS // max(1, num_rows * num_kv_heads))
        per_split = max(16, pow2_at_least(-(-pages_per_row // want_splits)))
        return AttentionTiles(bt=pow2_at_least(rows), pages_per_split=per_split)
    # M = 128 rows: the flash-attention forward shape (M = 256 exceeds the 227 KB of shared memory). 3 stages:
    # 8k chunk, kernel-busy, two cases in one run, 2,697 / 2,720 us against 2,883 / 2,907 us with 2
    # (attention-h200-prefill-4.json; before the unmasked whole-page loop, 2 stages had measured faster).
    # Batch-invariant: these tiles for every step, never split: a decode token is a query block of one token
    # whose keys are visited in page order by one program, the same dot shapes as a prefill token's; and every
    # page through the masked body (AttentionTiles.mask_every_page).
    # Mosaic GPU (attention/kernel_mgpu.py, FA3-style), where it runs: whole pages, 3 stages. 8k chunk, H100,
    # kernel-busy: 1,836 / 1,868 us against 2,706 / 2,720 us for the Triton tiles below (1.32-1.34x the compute
    # floor against 1.94-1.95x; attention-prefill-h100-5da6a56.json, -5d34121.json). Not batch-invariant mode's.
    if mosaic and not invariant:
        return dataclasses.replace(MOSAIC_DENSE, pages_per_split=pages_per_row)
    bt = pow2_at_least(max(1, 128 // heads_per_group))
    return AttentionTiles(bt=bt, pages_per_split=pages_per_row, num_warps=8, num_stages=3,
                          mask_every_page=invariant)
