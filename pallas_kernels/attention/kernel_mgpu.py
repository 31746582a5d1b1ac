"""Dense paged attention for prefill-sized steps on Mosaic GPU: warp-specialised, TMA-fed wgmma (FA3-style).

Same query blocks, rows and result as `kernel.paged_dense_attention` (the Triton kernel) with its prefill tiles.
Why a second backend: the Triton kernel's 8k prefill chunk runs at ~1.96x its compute floor, and the Pallas
Triton lowering cannot express what closes that gap: one warpgroup loading K/V pages by TMA while two compute
warpgroups alternate on the tensor cores, each one's softmax overlapping the other's matrix work. This is the
structure of jax's own Hopper flash attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`), here over a
page table, with grouped-query rows and token-exact causal masks.

One program per (query block, KV group). A query block is `2 * 64 / heads_per_group` tokens of one request
(`ragged.query_blocks`; 8 tokens for M3's 16 heads per group); compute warpgroup w takes its tokens
w * 64 / hg .. , whose hg heads each make its 64 wgmma rows (row r: token r // hg, head r % hg), loaded as one
TMA copy of [hg, hd] per token. The memory warpgroup streams the request's pages 0 .. max_pos // page_size,
`key_tile` keys a step (a whole page or half of one), K and V through `stages` buffers each; both compute
warpgroups walk every step, the leading pages that all their rows see whole without the causal mask. Scores,
softmax (base 2, the scale folded into one multiply-add, a finite running-max start so a row that sees no key
gives 0) and the P @ V operand stay in registers: P is wgmma's A operand.

Interpret mode: `plgpu.InterpretGPUParams` (jax's GPU interpreter), where wgmma reads both operands from shared
memory, so P goes through a shared-memory tile there; that is the only difference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.ragged import query_blocks

WG_ROWS = 64  # rows of one compute warpgroup's wgmma: tokens x heads of its share of the query block
M_INIT = -1e30  # finite running-max start (see kernel.M_INIT)
LOG2E = math.log2(math.e)


def supports(heads_per_group: int, head_dim: int, page_size: int, key_tile: int) -> bool:
    """Shapes this kernel takes: a token's heads are whole 8-row tiles of the 64 rows, 64-wide swizzle atoms."""
    return (WG_ROWS % heads_per_group == 0 and heads_per_group % 8 == 0 and head_dim % 64 == 0
            and key_tile % 64 == 0 and page_size % key_tile == 0)


def tokens_per_block(heads_per_group: int) -> int:
    return 2 * (WG_ROWS // heads_per_group)


def heaviest_first(num_blocks: int) -> jax.Array:
    """In-kernel, this program's query block, the grid's "qb" axis in reverse: a causal prefill's last blocks read
    the most pages, so they start first and the short early ones fill the grid's tail (FA3's causal order)."""
    return num_blocks - 1 - lax.axis_index("qb")


def per_row(v: jax.Array, cols: int) -> jax.Array:
    """A per-row vector (wgmma's row layout, e.g. a row reduction) broadcast across `cols` columns."""
    return lax.broadcast_in_dim(v, (WG_ROWS, cols), [0])


NO_ROW = jnp.iinfo(jnp.int32).max  # row_positions' smallest position when the warpgroup has no token


def row_positions(pos_ref, t0: jax.Array, first: jax.Array, n: jax.Array, *, rows_per_token: int, cols: int,
                  num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """In-kernel, for a compute warpgroup's 64 rows (row r: token first + r // rows_per_token of the query block
    of `n` tokens at `t0`): each row's position in wgmma's row layout, -1 for rows of tokens past the block (they
    see nothing), and the smallest valid position (NO_ROW when none), whose page and those before it every valid
    row sees whole. `cols`: the width of the score tiles the positions are compared with."""
    tok_ids = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, cols), 0, layout=plgpu.Layout.WGMMA) // rows_per_token
    pos_2d = jnp.full((WG_ROWS, cols), -1, jnp.int32)
    min_pos = jnp.int32(NO_ROW)
    for i in range(WG_ROWS // rows_per_token):
        valid = first + i < n
        p_i = jnp.where(valid, pos_ref[jnp.minimum(t0 + first + i, num_tokens - 1)], -1)
        pos_2d = jnp.where(tok_ids == i, p_i, pos_2d)
        min_pos = jnp.where(valid, jnp.minimum(min_pos, p_i), min_pos)
    return jnp.max(pos_2d, axis=1), min_pos


def take_turn(turn) -> None:
    """The two compute warpgroups alternate on the tensor cores (as jax's attention_mgpu does)."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def load_query_rows(q_ref, qo, q_loaded, *, t0: jax.Array, first: jax.Array | int, wg: jax.Array, g: jax.Array,
                    hg: int) -> None:
    """A compute warpgroup's 64 query rows into `qo`: rows i*hg .. are token first + i's heads of group g, one TMA
    copy of [hg, hd] per token (a clamped token past the batch is unused), each on its own barrier."""
    T = q_ref.shape[0]
    tpw = WG_ROWS // hg
    for i in range(tpw):
        t = jnp.minimum(t0 + first + i, T - 1)
        plgpu.copy_gmem_to_smem(q_ref.at[t, pl.ds(g * hg, hg)], qo.at[pl.ds(i * hg, hg)], q_loaded.at[wg * tpw + i])


def wait_query_rows(q_loaded, wg: jax.Array, hg: int) -> None:
    tpw = WG_ROWS // hg
    for i in range(tpw):
        plgpu.barrier_wait(q_loaded.at[wg * tpw + i])


def softmax_start(D: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax's start (acc, m, l) in wgmma's layouts: a finite running max, so that a row that sees
    no key gives 0."""
    m_i = plgpu.layout_cast(jnp.full((WG_ROWS,), M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((WG_ROWS, D), 0, jnp.float32), plgpu.Layout.WGMMA)
    return acc, m_i, l_i


def load_kv(k_ref, v_ref, k_smem, v_smem, k_loaded, v_loaded, *, page: jax.Array, key0: jax.Array, kt: int,
            g: jax.Array, slot: jax.Array) -> None:
    """The memory warpgroup's copy of keys key0 .. key0 + kt of group g on `page` into K / V buffer `slot`."""
    keys = pl.ds(key0, kt)
    plgpu.copy_gmem_to_smem(k_ref.at[page, keys, g], k_smem.at[slot], k_loaded.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[page, keys, g], v_smem.at[slot], v_loaded.at[slot])


def scores(qo, k_tile, kt: int, take_turn) -> jax.Array:
    """S = q k^T of one key step [64, kt] in fp32; the compute warpgroups' turn is taken once its wgmma is
    issued (as jax's attention_mgpu does)."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, qo, k_tile.transpose((1, 0)))
        take_turn()
        return acc_ref[...]

    return pl.run_scoped(qk, plgpu.ACC((WG_ROWS, kt), jnp.float32))


def mask_keys(s_: jax.Array, key0: jax.Array, limit_row: jax.Array) -> jax.Array:
    """Scores of keys key0 .. key0 + kt - 1, -inf past each row's limit (its position; -1: the row sees none)."""
    kpos = plgpu.broadcasted_iota(jnp.int32, s_.shape, 1, layout=plgpu.Layout.WGMMA) + key0
    return jnp.where(kpos <= per_row(limit_row, s_.shape[1]), s_, -jnp.inf)


def softmax_and_pv(s_: jax.Array, carry: tuple, c: float, *, v_tile, v_loaded, v_used, turn, p_tile, after_pv,
                   interpret: bool) -> tuple:
    """One key step of the online softmax over masked scores `s_` (base 2: the running max m is kept in units of
    c * score, p = 2^(c s - m)) and P @ V into the accumulator, P staying in registers as wgmma's A operand.
    `carry`: (acc, m, l). The turn is handed over once the softmax is done and taken back before P @ V;
    `after_pv()` runs once P @ V is issued (the next step's K wait); `v_used` is arrived at once it is done. In the
    interpreter (`p_tile`: a shared tile),
    which runs wgmma from shared memory only and has no rule for run_state, P goes through shared memory and
    P @ V into a fresh accumulator added to acc (the same sum, rounded once more)."""
    acc, m_i, l_i = carry
    m_new = jnp.maximum(m_i, s_.max(axis=1) * c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s_ * c - per_row(m_new, s_.shape[1]))
    acc = acc * per_row(alpha, acc.shape[1])
    l_i = l_i * alpha + p.sum(axis=1)
    p16 = p.astype(v_tile.dtype)
    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
    plgpu.barrier_arrive(turn)  # softmax done
    plgpu.barrier_wait(v_loaded)
    plgpu.barrier_wait(turn)  # the tensor cores are free

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)
        after_pv()

    if interpret:
        p_tile[...] = p16
        plgpu.commit_smem()
        p16 = p_tile

        def pv_fresh(acc_ref):
            pv(acc_ref)
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((WG_ROWS, acc.shape[1]), jnp.float32))
    else:
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(v_used)
    return acc, m_new, l_i


def stream_pages(load, num_steps: jax.Array, stages: int, used: tuple) -> None:
    """The memory warpgroup's loop: `load(step, slot)` for every step, `stages` ahead of the compute warpgroups,
    a slot reloaded once its `used` barriers say both have read it; the last steps' releases are waited for too,
    so that every phase of the barriers is observed before they go (what jax's GPU interpreter checks when a
    barrier is deallocated; on the GPU it costs a few waits per program)."""
    for i in range(stages):
        pl.when(i < num_steps)(functools.partial(load, i, i))

    @pl.loop(0, jnp.maximum(num_steps - stages, 0))
    def _(s):
        slot = lax.rem(s, stages)
        for barrier in used:
            plgpu.barrier_wait(barrier.at[slot])
        load(s + stages, slot)

    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _(s):
        for barrier in used:
            plgpu.barrier_wait(barrier.at[lax.rem(s, stages)])


def token_bits(first: jax.Array | int, hg: int, cols: int) -> jax.Array:
    """In-kernel, each of a compute warpgroup's 64 rows' bit in a block's owner words (row r: token
    first + r // hg of the query block, bit 1 << that token), in wgmma's row layout."""
    tok = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, cols), 0, layout=plgpu.Layout.WGMMA) // hg
    bit_2d = jnp.zeros((WG_ROWS, cols), jnp.int32)
    for i in range(WG_ROWS // hg):
        bit_2d = jnp.where(tok == i, 1 << i, bit_2d)
    return jnp.max(bit_2d, axis=1) << first


def _kernel(start_ref, length_ref, row_ref, max_pos_ref, page_table_ref, pos_ref, *refs, hg: int, ps: int,
            kt: int, stages: int, scale: float, interpret: bool, listed: bool):
    """`listed`: the program's pages are its (query block, group)'s list of distinct selected blocks with owner
    bits (`msa.kernel.union_page_lists`; block-sparse, msa/sparse_mgpu.py), each row masked unless its token owns
    the block, instead of the request's pages in order."""
    *lists, q_ref, k_ref, v_ref, o_ref, scoped = refs
    (qo_smem2, k_smem, v_smem, p_smem2), (k_loaded, v_loaded, q_loaded), (k_used, v_used), turn = scoped
    qb, g, wg = heaviest_first(start_ref.shape[0]), lax.axis_index("g"), lax.axis_index("wg")
    T = q_ref.shape[0]
    P = page_table_ref.shape[1]
    D = q_ref.shape[-1]
    t0, n, row = start_ref[qb], length_ref[qb], row_ref[qb]
    steps_per_page = ps // kt
    if listed:
        list_ref, owners_ref, count_ref = lists
        num_pages = jnp.where(n > 0, count_ref[qb, g], 0)
    else:
        num_pages = jnp.where(n > 0, jnp.minimum(max_pos_ref[qb] // ps + 1, P), 0)
    num_steps = num_pages * steps_per_page

    def logical_page(s):  # of step s
        return list_ref[qb, g, s // steps_per_page] if listed else s // steps_per_page

    turn_taken = functools.partial(take_turn, turn)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo = qo_smem2.at[wg]
        tpw = WG_ROWS // hg  # tokens of this warpgroup
        first = wg * tpw
        load_query_rows(q_ref, qo, q_loaded, t0=t0, first=first, wg=wg, g=g, hg=hg)

        pos_row, min_pos = row_positions(pos_ref, t0, first, n, rows_per_token=hg, cols=kt, num_tokens=T)
        if listed:  # every step masked: a row sees a listed block only when its token owns it
            whole_steps = 0
            tok_bit = token_bits(first, hg, kt)
        else:
            whole_steps = jnp.where(min_pos == NO_ROW, 0,
                                    jnp.minimum((min_pos + 1) // ps, num_pages)) * steps_per_page
        wait_query_rows(q_loaded, wg, hg)

        c = scale * LOG2E  # m is kept in units of c * score: p = 2^(c s - m)
        acc, m_i, l_i = softmax_start(D)

        @pl.when(num_steps > 0)
        def _():
            plgpu.barrier_wait(k_loaded.at[0])

        pl.when(wg == 1)(turn_taken)

        def step(s, carry, masked: bool):
            slot = lax.rem(s, stages)
            s_ = scores(qo, k_smem.at[slot], kt, turn_taken)
            plgpu.barrier_arrive(k_used.at[slot])
            if masked:
                if listed:
                    key0 = logical_page(s) * ps + lax.rem(s, steps_per_page) * kt
                    limit = jnp.where((tok_bit & owners_ref[qb, g, s // steps_per_page]) != 0, pos_row, -1)
                else:
                    key0 = s * kt  # pages are read in logical order: step s holds keys s*kt ..
                    limit = pos_row
                s_ = mask_keys(s_, key0, limit)

            def next_k():
                pl.when(s + 1 < num_steps)(lambda: plgpu.barrier_wait(k_loaded.at[lax.rem(s + 1, stages)]))

            return softmax_and_pv(s_, carry, c, v_tile=v_smem.at[slot], v_loaded=v_loaded.at[slot],
                                  v_used=v_used.at[slot], turn=turn, p_tile=p_smem2.at[wg] if interpret else None,
                                  after_pv=next_k, interpret=interpret)

        carry = lax.fori_loop(0, whole_steps, functools.partial(step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = lax.fori_loop(whole_steps, num_steps, functools.partial(step, masked=True), carry)
        pl.when(wg == 0)(turn_taken)

        acc = acc / per_row(jnp.where(l_i > 0, l_i, 1.0), acc.shape[1])
        qo[...] = acc.astype(qo.dtype)
        plgpu.commit_smem()
        for i in range(tpw):
            @pl.when(first + i < n)
            def _(i: int = i) -> None:
                plgpu.copy_smem_to_gmem(qo.at[pl.ds(i * hg, hg)], o_ref.at[t0 + first + i, pl.ds(g * hg, hg)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(s, slot):
            load_kv(k_ref, v_ref, k_smem, v_smem, k_loaded, v_loaded, page=page_table_ref[row, logical_page(s)],
                    key0=lax.rem(s, steps_per_page) * kt, kt=kt, g=g, slot=slot)

        stream_pages(load, num_steps, stages, (k_used, v_used))


def smem_tiles(D: int, kt: int, stages: int, dt, interpret: bool) -> list:
    """The attention kernels' shared tiles: each compute warpgroup's Q (then output) rows, the K and V rings, and
    in the interpreter each warpgroup's P tile."""
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # 64 bf16 = one 128-byte swizzle
    return [plgpu.SMEM((2, WG_ROWS, D), dt, transforms=tiled),
            plgpu.SMEM((stages, kt, D), dt, transforms=tiled),
            plgpu.SMEM((stages, kt, D), dt, transforms=tiled),
            plgpu.SMEM((2, WG_ROWS, kt), dt, transforms=tiled) if interpret else None]


def launch(entry, name: str, out_type, num_blocks: int, num_groups: int, interpret: bool):
    """The attention kernels' launch: one program per (query block "qb", KV group "g"), 3 warpgroups "wg" (two
    compute, one memory), fast approximate exp2; `name` is how the kernel shows in profiles."""
    entry.__name__ = entry.__qualname__ = name
    return plgpu.kernel(
        entry, out_type=out_type, grid=(num_blocks, num_groups), grid_names=("qb", "g"),
        num_threads=3, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)


def paged_dense_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                          token_row_T: jax.Array, pos_T: jax.Array, scale: float, *, key_tile: int, stages: int,
                          interpret: bool = False) -> jax.Array:
    """`kernel.paged_dense_attention` (KVPages' [pages, page_size, K, hd] pools) on Mosaic GPU; bf16 or f16."""
    T, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    hg = H // K
    kt = min(key_tile, ps)
    if not supports(hg, D, ps, kt) or stages < 2:
        raise ValueError(f"the Mosaic GPU dense attention takes heads per group dividing 64 in multiples of 8, "
                         f"head_dim and key tiles in multiples of 64, 2+ stages: got hg={hg}, hd={D}, "
                         f"page={ps}, key tile={kt}, stages={stages}")
    qbs = query_blocks(token_row_T, pos_T, bt=tokens_per_block(hg), num_rows=page_table_RP.shape[0])
    return split_token_attention(q_THD, k_pages, v_pages, page_table_RP, pos_T, qbs, (), scale, kt=kt,
                                 stages=stages, interpret=interpret, name="dense_paged_attention_mgpu")


def split_token_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                          pos_T: jax.Array, qbs, lists: tuple, scale: float, *, kt: int, stages: int,
                          interpret: bool, name: str) -> jax.Array:
    """The launch of `_kernel` over query blocks `qbs` of `tokens_per_block(hg)` tokens, both compute warpgroups
    walking one stream of pages, each over its own tokens' rows. `lists`: () for the request's pages in order
    (dense), or (page list [Q, G, L], owner bits [Q, G, L], count [Q, G]) for listed pages (block-sparse)."""
    T, H, D = q_THD.shape
    K = k_pages.shape[2]
    hg = H // K
    dt = q_THD.dtype
    scratch = smem_tiles(D, kt, stages, dt, interpret)
    tpw = WG_ROWS // hg

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, hg=hg, ps=k_pages.shape[1], kt=kt, stages=stages, scale=scale,
                                    interpret=interpret, listed=bool(lists)),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2 * tpw)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    return launch(entry, name, jax.ShapeDtypeStruct((T, H, D), dt), qbs.num_blocks, K, interpret)(
        qbs.start_Q, qbs.length_Q, qbs.row_Q, qbs.max_pos_Q, page_table_RP.astype(jnp.int32), pos_T.astype(jnp.int32),
        *(x.astype(jnp.int32) for x in lists), q_THD, k_pages, v_pages)
