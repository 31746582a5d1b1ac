"""The attention-family Pallas kernels (interpret mode on the CPU) against their jnp references.

One small mixed batch exercises every case at once: a prefill chunk after a cached prefix (partial first and
last pages), decode rows with 1 + k draft rows at the end of their request, a context shorter than topk blocks,
a long single decode, and padding tokens. Shapes are tiny (page 8, head dim 16) so the interpreter is quick.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.batch import RowPlan, build_batch
from pallas_kernels.attention import dispatch, tuning
from pallas_kernels.attention import kernel as attn_kernel
from pallas_kernels.attention import reference as attn_ref
from pallas_kernels.attention.kv_write import write_pages_pallas, write_pages_xla
from pallas_kernels.attention.ragged import query_blocks
from pallas_kernels.attention.tuning import AttentionTiles, IndexTiles
from pallas_kernels.msa import block_major
from pallas_kernels.msa import kernel as msa_kernel
from pallas_kernels.msa import reference as msa_ref

PS, K, HG, D, DI, TOPK = 8, 2, 4, 16, 16, 4
H = K * HG
SCALE = D ** -0.5
NUM_PAGES = 48


def _mixed_batch():
    """(batch, description). Rows: prefill chunk 13..32 (prefix cached), 1 + 3 drafts at 41..44, a 2-page
    context (< topk blocks), a 1 + 1 draft decode at 70..71 (9 pages > topk), a first-token decode; padding."""
    perm = np.random.default_rng(7).permutation(np.arange(1, NUM_PAGES))  # scattered physical pages, no sink
    pages = iter(perm.tolist())
    take = lambda n: [next(pages) for _ in range(n)]  # noqa: E731
    rows = [
        RowPlan([1] * 20, 13, take(5)),  # prefill chunk: positions 13..32
        RowPlan([1] * 4, 41, take(6)),  # decode + 3 draft rows: positions 41..44
        RowPlan([1] * 1, 11, take(2)),  # short context: 2 visible blocks < topk
        RowPlan([1] * 2, 70, take(9)),  # long decode + 1 draft
        RowPlan([1] * 1, 0, take(1)),  # first token of a request
    ]
    batch, _ = build_batch(rows, PS, 32, 6, 10)  # 28 real tokens + 4 padding; 6 rows (one empty)
    return batch


BATCH = _mixed_batch()


def _ints(rng: np.random.Generator, *shape: int) -> jax.Array:
    """Small integers: every fp32 dot is exact whatever the summation order, and block-score ties are common,
    so equality of block ids tests the tie resolution, not luck."""
    return jnp.asarray(rng.integers(-2, 3, size=shape).astype(np.float32))


def _normal(rng: np.random.Generator, *shape: int, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape).astype(np.float32)).astype(dtype)


def _args(b=BATCH):
    return b.page_table, b.token_row, b.positions


def test_query_blocks_cover_every_token_once():
    b = BATCH
    for bt in (1, 4):
        qbs = query_blocks(b.token_row, b.positions, bt=bt, num_rows=b.page_table.shape[0])
        start, length, row = (np.asarray(x) for x in (qbs.start_Q, qbs.length_Q, qbs.row_Q))
        covered = np.concatenate([np.arange(s, s + n) for s, n in zip(start, length, strict=True) if n])
        assert sorted(covered.tolist()) == list(range(b.num_tokens))
        tr = np.asarray(b.token_row)
        for s, n, r in zip(start, length, row, strict=True):
            assert n <= bt and (n == 0 or (tr[s:s + n] == r).all())


@pytest.mark.parametrize("data,topk_impl", [("ints", "pallas"), ("normal", "pallas"), ("ints", "xla"),
                                            ("ints", "fused"), ("normal", "fused")])
@pytest.mark.parametrize("local_blocks,init_blocks", [(1, 0), (2, 1)])
def test_select_blocks_equal_reference(data, topk_impl, local_blocks, init_blocks):
    rng = np.random.default_rng(1 + local_blocks)
    draw = _ints if data == "ints" else _normal
    iq, ik = draw(rng, BATCH.num_tokens, K, DI), draw(rng, NUM_PAGES, PS, DI)
    want = msa_ref.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=local_blocks,
                                       init_blocks=init_blocks)
    # bp=2 splits the 10-page table over 5 programs; bt=4 puts the 4 draft rows in one program.
    tiles = IndexTiles(bt=4, bp=2, topk=topk_impl)
    got = msa_kernel.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=local_blocks,
                                         init_blocks=init_blocks, tiles=tiles, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # same ids in the same order
    assert (np.asarray(want) == -1).any()  # the short contexts really exercised the -1 padding


def test_select_blocks_one_token_blocks_equal_reference():
    """`block_tokens=1` (what one-row-per-request batches use) is exact on any batch, drafts and chunks too: each
    token gets its own program with a mostly masked bt-row tile."""
    rng = np.random.default_rng(5)
    iq, ik = _ints(rng, BATCH.num_tokens, K, DI), _ints(rng, NUM_PAGES, PS, DI)
    want = msa_ref.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1)
    got = msa_kernel.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1,
                                         tiles=IndexTiles(bt=4, bp=2, block_tokens=1), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fused_topk_one_token_blocks_equal_reference():
    """The scoring kernel's own top-k (the last of a block's 5 page-split programs selects) on one-token blocks,
    the decode configuration it is meant for."""
    rng = np.random.default_rng(6)
    iq, ik = _normal(rng, BATCH.num_tokens, K, DI), _normal(rng, NUM_PAGES, PS, DI)
    want = msa_ref.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1)
    got = msa_kernel.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1,
                                         tiles=IndexTiles(bt=4, bp=2, block_tokens=1, topk="fused"), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_index_tiles_use_one_token_blocks_only_for_pure_decode():
    assert tuning.index_tiles(64, 64, 256, 4).block_tokens == 1
    assert tuning.index_tiles(256, 64, 256, 4).block_tokens is None  # 1 + 3 draft rows per request
    assert tuning.index_tiles(8192, 1, 64, 4).block_tokens is None  # a prefill chunk


def test_index_tiles_fuse_the_topk_only_for_short_decode_contexts():
    assert tuning.index_tiles(64, 64, 64, 4).topk == "fused"  # 8k tokens
    assert tuning.index_tiles(256, 64, 64, 4).topk == "fused"  # drafts at 8k
    assert tuning.index_tiles(64, 64, 256, 4).topk == "pallas"  # 32k: one program would rank 256 blocks
    assert tuning.index_tiles(8192, 1, 64, 4).topk == "pallas"  # a prefill chunk


def test_sparse_decode_splits_its_pages_only_where_the_grid_leaves_the_gpu_idle():
    # M3: 16 selected pages, 4 KV groups. Batch 1: 4 programs unsplit, so 8 splits of 2 pages.
    assert tuning.sparse_tiles(1, 1, 16, 16, num_kv_heads=4) == AttentionTiles(bt=1, pages_per_split=2,
                                                                                num_stages=3, key_tile=64)
    assert tuning.sparse_tiles(8, 8, 16, 16, num_kv_heads=4).pages_per_split == 4
    assert tuning.sparse_tiles(64, 64, 16, 16, num_kv_heads=4).pages_per_split == 16  # measured unsplit at batch 64
    # Batch-invariant mode: one split whatever the batch.
    invariant = {tuning.sparse_tiles(t, t, 16, 16, num_kv_heads=4, invariant=True).pages_per_split for t in (1, 8, 64)}
    assert invariant == {16}


def _selection(rng: np.random.Generator) -> jax.Array:
    iq, ik = _normal(rng, BATCH.num_tokens, K, DI), _normal(rng, NUM_PAGES, PS, DI)
    return msa_ref.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1)


@pytest.mark.parametrize("tiles", [AttentionTiles(bt=1, pages_per_split=2),
                                   AttentionTiles(bt=4, pages_per_split=16, key_tile=4),
                                   AttentionTiles(bt=4, pages_per_split=16, block_major=1),
                                   AttentionTiles(bt=2, pages_per_split=16, block_major=3)],
                         ids=["decode-tiles-split", "union-tiles-half-pages", "block-major", "block-major-3-tiles"])
def test_block_sparse_attention_equal_reference(tiles):
    rng = np.random.default_rng(3)
    blocks = np.array(_selection(rng))
    # -1 padding anywhere in a selection (not only at the end), as another producer might write it.
    drop = rng.random(blocks.shape) < 0.2
    blocks[drop & (blocks > 0)] = -1
    blocks = jnp.asarray(blocks)
    q = _normal(rng, BATCH.num_tokens, H, D, dtype=jnp.bfloat16)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D, dtype=jnp.bfloat16) for _ in range(2))
    want = msa_ref.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE)
    got = msa_kernel.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE, tiles=tiles,
                                                  interpret=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tiles", [AttentionTiles(bt=1, pages_per_split=2, key_tile=4),
                                   AttentionTiles(bt=8, pages_per_split=16)],
                         ids=["decode-tiles-split-half-pages", "prefill-tiles"])
def test_dense_attention_equal_reference(tiles):
    rng = np.random.default_rng(4)
    q = _normal(rng, BATCH.num_tokens, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    want = attn_ref.paged_dense_attention(q, kp, vp, *_args(), SCALE)
    got = attn_kernel.paged_dense_attention(q, kp, vp, *_args(), SCALE, tiles=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_topk_kernel_ties_and_short_rows():
    """All-equal and all-masked rows: lax.top_k's order (lower index first among equals), -1 where nothing is
    visible, forced blocks first."""
    scores = np.zeros((3, 1, 8), np.float32)
    scores[1, 0, 5:] = -np.inf  # blocks past the row's position are -inf: they must come out as -1
    scores[2] = -np.inf
    pos = jnp.asarray([37, 20, 3], jnp.int32)
    kw = dict(block_size=8, num_blocks=8, topk=5, local_blocks=1, init_blocks=1)
    want = msa_kernel.select_from_block_scores(jnp.asarray(scores), pos, **kw)
    got = msa_kernel.topk_blocks(jnp.asarray(scores), pos, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_topk_kernel_reads_query_block_major_scores():
    """`topk_blocks(blocks=...)` on scores laid out as the Mosaic GPU scoring writes them (slot q * bt + i for
    token start_Q[q] + i, unused slots holding garbage) gives the token-major ids of the token-major call."""
    rng = np.random.default_rng(12)
    token_row = jnp.asarray([0] * 37 + [1] * 4 + [2] * 9 + [0] * 14, jnp.int32)  # a short block, then padding
    pos = jnp.asarray(list(range(300, 337)) + list(range(60, 64)) + list(range(9)) + [0] * 14, jnp.int32)
    T, G, W, bt = 64, 4, 32, 8
    scores = rng.integers(-3, 4, (T, G, W)).astype(np.float32)
    scores = np.where(np.arange(W)[None, None, :] <= (np.asarray(pos) // 16)[:, None, None], scores, -np.inf)
    qbs = query_blocks(token_row, pos, bt=bt, num_rows=3)
    Q = qbs.num_blocks
    start, length = np.asarray(qbs.start_Q), np.asarray(qbs.length_Q)
    major = rng.normal(size=(Q * bt, G, W)).astype(np.float32)  # nobody's slots keep this
    for q in range(Q):
        major[q * bt:q * bt + length[q]] = scores[start[q]:start[q] + length[q]]
    kw = dict(block_size=16, num_blocks=24, topk=5, local_blocks=1, init_blocks=1, interpret=True)
    want = msa_kernel.topk_blocks(jnp.asarray(scores), pos, **kw)
    got = msa_kernel.topk_blocks(jnp.asarray(major), pos, blocks=qbs, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kv_write_equal_scatter():
    rng = np.random.default_rng(5)
    pages = _normal(rng, NUM_PAGES, PS, K, D, dtype=jnp.bfloat16)
    new = _normal(rng, BATCH.num_tokens, K, D)
    slots = np.array(BATCH.slot_mapping)[:27]  # 27 rows: the last tile of 8 is partial
    new = new[:27]
    real = slots != 0  # padding tokens all write the sink slot 0: compare the other slots only
    want = write_pages_xla(pages, new, jnp.asarray(slots))
    got = write_pages_pallas(pages, new, jnp.asarray(slots), bt=8, interpret=True)
    flat_w = np.asarray(want.reshape(-1, K, D), np.float32)
    flat_g = np.asarray(got.reshape(-1, K, D), np.float32)
    np.testing.assert_array_equal(flat_g[1:], flat_w[1:])
    np.testing.assert_array_equal(flat_g[slots[real]], np.asarray(new[real].astype(jnp.bfloat16), np.float32))


def test_dispatch_impl():
    """`impl` picks the path; through `dispatch` the kernels equal the references end to end."""
    rng = np.random.default_rng(6)
    iq, ik = _ints(rng, BATCH.num_tokens, K, DI), _ints(rng, NUM_PAGES, PS, DI)
    with pytest.raises(ValueError, match="resolve the KernelChoice"):
        dispatch.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1, impl="auto")
    blocks = dispatch.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1, impl="interpret")
    np.testing.assert_array_equal(
        np.asarray(blocks), np.asarray(msa_ref.paged_select_blocks(iq, ik, *_args(), topk=TOPK, local_blocks=1)))
    q = _normal(rng, BATCH.num_tokens, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    got = dispatch.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE, impl="interpret")
    want = msa_ref.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    slots = BATCH.slot_mapping
    got_kv = dispatch.write_kv_pages(kp, q[:, :K], slots, impl="interpret")  # the Pallas row store at any size
    np.testing.assert_array_equal(np.asarray(got_kv.reshape(-1, K, D)[slots[slots != 0]]),
                                  np.asarray(q[:, :K][np.asarray(slots) != 0]))


def test_block_major_splits_long_batches(monkeypatch):
    """Batches whose partials would pass Pallas' 32-bit offsets are split into calls by tokens; same result."""
    rng = np.random.default_rng(9)
    blocks = _selection(rng)
    q = _normal(rng, BATCH.num_tokens, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    tiles = AttentionTiles(bt=2, pages_per_split=16, block_major=2)
    whole = block_major.block_major_attention(q, kp, vp, *_args(), blocks, scale=SCALE, tiles=tiles, interpret=True)
    monkeypatch.setattr(block_major, "MAX_PARTIAL_ELEMENTS", 10 * K * TOPK * HG * D)  # 9 tokens per call
    split = block_major.block_major_attention(q, kp, vp, *_args(), blocks, scale=SCALE, tiles=tiles, interpret=True)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))


def test_block_major_work_items_cover_each_selection_once():
    """Every selected (token, group, slot) lands in exactly one work item, whose tokens all chose that item's
    block of their own request and group; items hold at most bt tokens, in ascending token order."""
    rng = np.random.default_rng(5)
    blocks = np.array(_selection(rng))
    blocks[rng.random(blocks.shape) < 0.2] = -1
    pt, tr, _ = _args()
    bt = 3
    it = block_major.work_items(jnp.asarray(blocks), tr, num_rows=pt.shape[0], num_blocks=pt.shape[1], bt=bt)
    count, start = np.asarray(it.count_W), np.asarray(it.start_W)
    tok, dest = np.asarray(it.token_P), np.asarray(it.dest_P)
    T, G, N = blocks.shape
    seen = []
    for w in np.nonzero(count)[0]:
        assert 1 <= count[w] <= bt
        toks = tok[start[w]:start[w] + count[w]]
        assert (np.diff(toks) > 0).all()
        for t, d in zip(toks, dest[start[w]:start[w] + count[w]], strict=True):
            g, j = d // N % G, d % N
            assert d // (G * N) == t and g == int(it.group_W[w])
            assert blocks[t, g, j] == int(it.block_W[w]) and int(tr[t]) == int(it.row_W[w])
            seen.append(d)
    assert sorted(seen) == sorted(np.flatnonzero(blocks.reshape(-1) >= 0).tolist())


@pytest.mark.parametrize("selections", ["own", "shared"])
def test_prefill_chunk_block_major_and_union_kernels(selections):
    """A prefill-shaped batch (one request, a 40-token chunk after a 200-token prefix: more rows per request than
    decode) goes through `dispatch` to the KV-block-major tiles, chosen by the table and never on the device (no
    conditional); the union query-block kernel, with tokens' own selections or each 4-token block sharing one,
    equals the reference as well."""
    rng = np.random.default_rng(8)
    batch, _ = build_batch([RowPlan([1] * 40, 200, list(range(1, 32)))], PS, 48, 2, 32)
    args = (batch.page_table, batch.token_row, batch.positions)
    T = batch.num_tokens
    tiles = tuning.sparse_tiles(T, batch.page_table.shape[0], TOPK, HG)
    assert tiles.block_major > 0
    iq, ik = _normal(rng, T, K, DI), _normal(rng, NUM_PAGES, PS, DI)
    blocks = dispatch.paged_select_blocks(iq, ik, *args, topk=TOPK, local_blocks=1, impl="interpret")
    visible = np.asarray(batch.positions)[:40] // PS + 1
    assert (visible > TOPK).mean() > 0.5  # most tokens' selections drop blocks: real sparsity
    if selections == "shared":  # each token takes the selection of its query block's first token
        blocks = blocks[np.arange(T) // tiles.bt * tiles.bt]
    q = _normal(rng, T, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    want = msa_ref.paged_block_sparse_attention(q, kp, vp, *args, blocks, scale=SCALE)
    got = dispatch.paged_block_sparse_attention(q, kp, vp, *args, blocks, scale=SCALE, impl="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # The union kernel, as `--sparse-prefill-kernel union` runs it (the tiles it was measured with).
    got = dispatch.paged_block_sparse_attention(q, kp, vp, *args, blocks, scale=SCALE, impl="interpret", union=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


# ---- engine sizes that are not powers of two: the kernels pad their tiles and mask the padding ---------------


def _wide_batch(width: int):
    """A batch whose page table is `width` pages wide (P = ceil(max_model_len / page size), any number): a
    prefill chunk reaching the table's last page, a decode + 1 draft row, a short context, padding; 16 tokens
    per row, so the dispatch takes the prefill tiles (`pages_per_split` = P: one split padded to a power of 2)."""
    rng = np.random.default_rng(width)
    pages = lambda n: rng.integers(1, NUM_PAGES, size=n).tolist()  # noqa: E731  (repeats are fine: a read is a read)
    end = width * PS
    rows = [
        RowPlan([1] * 40, end - 50, pages(width)),  # a chunk over 6 pages, up to the last but one
        RowPlan([1] * 2, end - 2, pages(width)),  # the table's last page, its last two slots
        RowPlan([1] * 1, 11, pages(2)),
    ]
    batch, _ = build_batch(rows, PS, 64, 4, width)
    return batch


@pytest.mark.parametrize("width", [10, 63])
def test_dense_attention_non_pow2_page_table_equal_reference(width):
    """P = 10 (max_model_len 1280 at page size 128) and 63: the prefill tiles' one split of P pages runs as a
    16- or 64-entry vector whose extra entries are masked; a split of 3 pages as 4-entry vectors, the last one
    partly past the table."""
    b = _wide_batch(width)
    args = (b.page_table, b.token_row, b.positions)
    tiles = tuning.dense_tiles(b.num_tokens, b.page_table.shape[0], width, K, HG)
    assert tiles.pages_per_split == width and tiles.bt > 1  # the prefill tiles, not a power of two
    rng = np.random.default_rng(11)
    q = _normal(rng, b.num_tokens, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    want = attn_ref.paged_dense_attention(q, kp, vp, *args, SCALE)
    got = dispatch.paged_dense_attention(q, kp, vp, *args, SCALE, impl="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    split = attn_kernel.paged_dense_attention(q, kp, vp, *args, SCALE, interpret=True,
                                              tiles=AttentionTiles(bt=2, pages_per_split=3))
    np.testing.assert_allclose(np.asarray(split), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("tiles", [AttentionTiles(bt=1, pages_per_split=5),
                                   AttentionTiles(bt=4, pages_per_split=20, key_tile=4),
                                   AttentionTiles(bt=2, pages_per_split=16, block_major=3)],
                         ids=["decode-tiles", "union-tiles", "block-major"])
def test_block_sparse_attention_non_pow2_topk_equal_reference(tiles):
    """A top-k of 5: decode's page list is a padded 8-entry vector, a query block's per-token selections a
    [bt, 8] tile whose 3 extra columns (-1) match no page, its union list of 4 x 5 entries a padded 32."""
    topk = 5
    rng = np.random.default_rng(12)
    iq, ik = _normal(rng, BATCH.num_tokens, K, DI), _normal(rng, NUM_PAGES, PS, DI)
    blocks = np.array(msa_ref.paged_select_blocks(iq, ik, *_args(), topk=topk, local_blocks=1))
    blocks[(rng.random(blocks.shape) < 0.2) & (blocks > 0)] = -1
    blocks = jnp.asarray(blocks)
    q = _normal(rng, BATCH.num_tokens, H, D)
    kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
    want = msa_ref.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE)
    got = msa_kernel.paged_block_sparse_attention(q, kp, vp, *_args(), blocks, scale=SCALE, tiles=tiles,
                                                  interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_msa_non_pow2_topk_through_dispatch_equal_reference():
    """A prefill chunk with a top-k of 3 through the dispatch, which used to fall back to the reference for a
    top-k that is not a power of two: selection and block-sparse attention (the union or block-major kernel)."""
    topk = 3
    rng = np.random.default_rng(13)
    batch, _ = build_batch([RowPlan([1] * 40, 200, list(range(1, 32)))], PS, 48, 2, 32)
    args = (batch.page_table, batch.token_row, batch.positions)
    T = batch.num_tokens
    iq, ik = _normal(rng, T, K, DI), _normal(rng, NUM_PAGES, PS, DI)
    blocks = dispatch.paged_select_blocks(iq, ik, *args, topk=topk, local_blocks=1, impl="interpret")
    np.testing.assert_array_equal(np.asarray(blocks),
                                  np.asarray(msa_ref.paged_select_blocks(iq, ik, *args, topk=topk, local_blocks=1)))
    # Shared selections (each 4-token block takes its first token's), so the union kernel's per-token masks run.
    # Block-major by default, the union kernel when the operator picks it (`KernelChoice.sparse_prefill`).
    assert tuning.sparse_tiles(T, 2, topk, HG).block_major and not tuning.sparse_tiles(T, 2, topk, HG,
                                                                                       union=True).block_major
    for sel in (blocks, blocks[np.arange(T) // 4 * 4]):
        q = _normal(rng, T, H, D)
        kp, vp = (_normal(rng, NUM_PAGES, PS, K, D) for _ in range(2))
        want = msa_ref.paged_block_sparse_attention(q, kp, vp, *args, sel, scale=SCALE)
        for union in (False, True):
            got = dispatch.paged_block_sparse_attention(q, kp, vp, *args, sel, scale=SCALE, impl="interpret",
                                                        union=union)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def _mosaic_batch(ps: int):
    """A mixed batch at shapes the Mosaic GPU kernel takes (heads per group a multiple of 8, 64-wide head dim):
    a prefill chunk behind a cached prefix, a decode with 3 drafts, a first token, a new 9-token prompt, padding."""
    perm = np.random.default_rng(7).permutation(np.arange(1, 24))
    pages = iter(perm.tolist())
    take = lambda n: [next(pages) for _ in range(n)]  # noqa: E731
    rows = [RowPlan([1] * 37, 90, take(-(-127 // ps))), RowPlan([1] * 4, 200, take(-(-204 // ps))),
            RowPlan([1] * 1, 0, take(1)), RowPlan([1] * 9, 0, take(1))]
    batch, _ = build_batch(rows, ps, 56, 5, -(-204 // ps))
    return batch


@pytest.mark.parametrize("ps,hg,key_tile,stages", [(64, 16, 64, 2), (128, 16, 64, 3), (128, 8, 128, 2)])
def test_mosaic_dense_attention_equal_reference(ps, hg, key_tile, stages):
    """The Mosaic GPU dense attention (attention/kernel_mgpu.py) in jax's GPU interpreter against the reference:
    token-exact causal cutoffs at any position (a chunk behind a prefix, drafts, query blocks cut at request
    ends), whole and half-page key steps, pipelines deeper than a short request's steps."""
    batch = _mosaic_batch(ps)
    rng = np.random.default_rng(4)
    q = _normal(rng, batch.num_tokens, 2 * hg, 64, dtype=jnp.bfloat16)
    kp, vp = (_normal(rng, 24, ps, 2, 64, dtype=jnp.bfloat16) for _ in range(2))
    args = (batch.page_table, batch.token_row, batch.positions)
    want = attn_ref.paged_dense_attention(*(x.astype(jnp.float32) for x in (q, kp, vp)), *args, 0.125)
    tiles = AttentionTiles(bt=8, pages_per_split=16, key_tile=key_tile, num_stages=stages, backend="mosaic")
    got = attn_kernel.paged_dense_attention(q, kp, vp, *args, 0.125, tiles=tiles, interpret=True)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 4e-3  # bf16 P and output
    np.testing.assert_allclose(got, want, atol=3e-2)


@pytest.mark.parametrize("stages", [2, 3])
def test_mosaic_block_scores_equal_triton_kernel(stages):
    """The Mosaic GPU index scoring (msa/kernel_mgpu.py) in jax's GPU interpreter against the Triton kernel: the
    same fp32 block maxima, -inf where unseen, bit for bit on small-integer data (every dot exact), over a chunk
    behind a prefix, drafts, a first token, a new prompt and a 2,100-token-deep decode whose 34 pages take two
    programs (page splits) of 32; and the selected ids through `paged_select_blocks`."""
    perm = np.random.default_rng(7).permutation(np.arange(1, 64))
    pages = iter(perm.tolist())
    take = lambda n: [next(pages) for _ in range(n)]  # noqa: E731
    rows = [RowPlan([1] * 37, 90, take(2)), RowPlan([1] * 4, 2100, take(34)), RowPlan([1] * 1, 0, take(1)),
            RowPlan([1] * 9, 0, take(1))]
    batch, _ = build_batch(rows, 64, 56, 5, 34)
    rng = np.random.default_rng(4)
    iq = _ints(rng, batch.num_tokens, 4, 64).astype(jnp.bfloat16)
    ik = _ints(rng, 64, 64, 64).astype(jnp.bfloat16)
    pt, tr, pos = batch.page_table, batch.token_row, batch.positions
    want = msa_kernel.block_scores(iq, ik, pt, pos, query_blocks(tr, pos, bt=16, num_rows=pt.shape[0]),
                                   tiles=IndexTiles(bt=16, bp=32), interpret=True)
    from pallas_kernels.msa import kernel_mgpu

    got = kernel_mgpu.block_scores(iq, ik, pt, tr, pos, bp=32, stages=stages, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    kw = dict(topk=4, local_blocks=1)
    want_ids = np.asarray(msa_ref.paged_select_blocks(iq, ik, pt, tr, pos, **kw))
    ids = msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=IndexTiles(bt=16, bp=32, num_stages=stages,
                                                                               backend="mosaic"),
                                         interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    # The top-k inside the kernel: all 34 pages in one program of 64.
    fused = IndexTiles(bt=16, bp=64, num_stages=stages, backend="mosaic", topk="fused")
    ids = msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=fused, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    with pytest.raises(ValueError, match="34 pages > bp 32"):
        msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=dataclasses.replace(fused, bp=32), **kw)


@pytest.mark.parametrize("topk,local,init", [(16, 1, 0), (5, 3, 2), (24, 1, 0), (70, 1, 0)])
def test_mosaic_fused_topk_ties_forcing_and_short_rows(topk, local, init):
    """The Mosaic GPU scoring's own top-k against the reference's selection on ties (integer data: many equal
    block maxima), forced local / initial blocks, and rows with fewer visible blocks than top-k (-1 padded)."""
    perm = np.random.default_rng(8).permutation(np.arange(1, 64))
    pages = iter(perm.tolist())
    take = lambda n: [next(pages) for _ in range(n)]  # noqa: E731
    rows = [RowPlan([1] * 40, 600, take(11)), RowPlan([1] * 3, 1200, take(20)), RowPlan([1] * 5, 0, take(1))]
    batch, _ = build_batch(rows, 64, 56, 4, 20)
    rng = np.random.default_rng(9)
    iq = jnp.asarray(rng.integers(-1, 2, (batch.num_tokens, 4, 64)), jnp.bfloat16)
    ik = jnp.asarray(rng.integers(-1, 2, (64, 64, 64)), jnp.bfloat16)
    pt, tr, pos = batch.page_table, batch.token_row, batch.positions
    kw = dict(topk=topk, local_blocks=local, init_blocks=init)
    tiles = IndexTiles(bt=16, bp=32, num_stages=2, backend="mosaic", topk="fused")
    if topk > 64:
        with pytest.raises(ValueError, match="top-k 70 > page size 64"):
            msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=tiles, interpret=True, **kw)
        return
    ids = msa_kernel.paged_select_blocks(iq, ik, pt, tr, pos, tiles=tiles, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(msa_ref.paged_select_blocks(iq, ik, pt, tr, pos, **kw)))


def test_union_page_lists_owner_bits():
    """Each query block's union entries: sorted, distinct, and owner bit i set exactly when token i selected the
    block (selections with -1 anywhere, shared and independent ones)."""
    rng = np.random.default_rng(11)
    blocks = np.array(_selection(rng))
    blocks[rng.random(blocks.shape) < 0.2] = -1
    blocks[8:12] = blocks[8]  # a block of tokens sharing one selection
    qbs = query_blocks(BATCH.token_row, BATCH.positions, bt=4, num_rows=BATCH.page_table.shape[0])
    lists, owners, count = (np.asarray(x) for x in msa_kernel.union_page_lists(jnp.asarray(blocks), qbs, 4))
    for q, (t0, n) in enumerate(zip(np.asarray(qbs.start_Q), np.asarray(qbs.length_Q), strict=True)):
        for g in range(K):
            want = {}
            for i in range(n):
                for b in blocks[t0 + i, g]:
                    if b >= 0:
                        want[int(b)] = want.get(int(b), 0) | (1 << i)
            c = count[q, g]
            assert lists[q, g, :c].tolist() == sorted(want)
            assert owners[q, g, :c].tolist() == [want[b] for b in sorted(want)]
            assert (owners[q, g, c:] == 0).all()


@pytest.mark.parametrize("ps,key_tile,stages,shared,bt", [(64, 64, 2, False, 4), (128, 64, 4, True, 4),
                                                         (64, 64, 2, False, 8), (128, 64, 3, True, 8)])
def test_mosaic_union_sparse_attention_equal_reference(ps, key_tile, stages, shared, bt):
    """The Mosaic GPU block-sparse attention (msa/sparse_mgpu.py) in jax's GPU interpreter against the reference:
    each token's own selection inside its query block's union (independent selections with -1 anywhere, or
    neighbours sharing one), token-exact causal cutoffs on the token's own block, odd step counts (a padding
    step), whole and half-page steps; a chunk behind a prefix, a decode with 3 drafts, a first token, padding.
    bt = 8: query blocks of two warpgroups' tokens on one page stream (paged_shared_union_attention)."""
    perm = np.random.default_rng(7).permutation(np.arange(1, 24))
    pages = iter(perm.tolist())
    take = lambda n: [next(pages) for _ in range(n)]  # noqa: E731
    rows = [RowPlan([1] * 9, 90, take(-(-99 // ps))), RowPlan([1] * 4, 200, take(-(-204 // ps))),
            RowPlan([1] * 1, 0, take(1))]
    batch, _ = build_batch(rows, ps, 16, 4, -(-204 // ps))
    rng = np.random.default_rng(12)
    T, hg, topk = batch.num_tokens, 16, 3
    pos = np.asarray(batch.positions)
    blocks = np.full((T, 2, topk), -1, np.int32)
    for t in range(T):
        for g in range(2):
            own = pos[t] // ps  # the token's own block first: the causal cutoff inside a page
            pick = [own] + [b for b in rng.permutation(own + 1) if b != own][:topk - 1]  # distinct, as top-k's
            blocks[t, g, :len(pick)] = pick
            blocks[t, g, 1:][rng.random(topk - 1) < 0.3] = -1
    if shared:
        blocks = blocks[np.arange(T) // 4 * 4]
    q = _normal(rng, T, 2 * hg, 64, dtype=jnp.bfloat16)
    kp, vp = (_normal(rng, 24, ps, 2, 64, dtype=jnp.bfloat16) for _ in range(2))
    args = (batch.page_table, batch.token_row, batch.positions)
    want = msa_ref.paged_block_sparse_attention(*(x.astype(jnp.float32) for x in (q, kp, vp)), *args,
                                                jnp.asarray(blocks), scale=0.125)
    tiles = AttentionTiles(bt=bt, pages_per_split=16, key_tile=key_tile, num_stages=stages, backend="mosaic")
    got = msa_kernel.paged_block_sparse_attention(q, kp, vp, *args, jnp.asarray(blocks), scale=0.125, tiles=tiles,
                                                  interpret=True)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 4e-3  # bf16 P and output
    np.testing.assert_allclose(got, want, atol=3e-2)
    if bt == 8:
        return  # the shared kernel's warpgroups walk every step: any number of stages
    with pytest.raises(ValueError, match="even number of stages"):
        msa_kernel.paged_block_sparse_attention(q, kp, vp, *args, jnp.asarray(blocks), scale=0.125,
                                                tiles=dataclasses.replace(tiles, num_stages=3), interpret=True)


def test_prefill_tiles_take_mosaic_only_where_the_dispatch_allows():
    """The tile table picks the Mosaic GPU kernels for prefill-shaped steps when the dispatch says they run here
    (a Hopper GPU, compiled, shapes they take), never for decode or batch-invariant steps; on this CPU it never
    says so."""
    for kw in ({}, {"invariant": True}):
        assert tuning.dense_tiles(8192, 1, 64, 4, 16, mosaic=True, **kw).backend == ("triton" if kw else "mosaic")
        assert tuning.index_tiles(8192, 1, 64, 4, mosaic=True, **kw).backend == ("triton" if kw else "mosaic")
        assert tuning.sparse_tiles(8192, 1, 16, 16, mosaic=True, **kw).backend == ("triton" if kw else "mosaic")
    assert tuning.sparse_tiles(8192, 1, 16, 16, mosaic=True, union=True).backend == "mosaic"
    assert tuning.dense_tiles(64, 64, 64, 4, 16, mosaic=True).backend == "triton"  # decode
    assert tuning.index_tiles(64, 64, 64, 4, mosaic=True).backend == "triton"
    # Index scoring: only rows of at least one Mosaic query block (32 tokens at 4 index heads).
    assert tuning.index_tiles(1024, 128, 17, 4, mosaic=True).backend == "triton"  # 8 tokens a row
    assert tuning.index_tiles(1024, 32, 17, 4, mosaic=True).backend == "mosaic"  # 32 tokens a row
    assert tuning.sparse_tiles(64, 64, 16, 16, mosaic=True).backend == "triton"
    assert not dispatch.mosaic_for("dense", 16, 128, 128, interpret=False)  # no wgmma device here
