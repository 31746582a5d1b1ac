"""Block-sparse attention for prefill-sized steps on Mosaic GPU: a query block over its tokens' union of pages.

Same result as the Triton union kernel (`kernel.paged_block_sparse_attention` with query blocks of 4 tokens):
each token attends to the keys of the blocks it selected itself, up to its own position. Why a second backend:
the Triton kernel's 8k prefill chunk runs at 3.6x (256-token drift) to 5.5x its compute floor, and the Pallas
Triton lowering cannot overlap one page's softmax with the next page's matrix work. This is the structure of
`attention/kernel_mgpu.py` (the dense FA3-style kernel) over a per-(query block, group) page list, in two forms.

Shared pages (`paged_shared_union_attention`, the table's): query blocks of 2 x 64 / heads_per_group tokens,
whose two compute warpgroups walk the block's one page stream, each over its own tokens' 64 rows: the dense
kernel's own `_kernel` over the listed pages. A page read serves 128 rows; the union is over twice the tokens.
On an H100 at an 8k chunk it beat the split form on random and on overlapping selections alike
(benchmarks/results/attention-prefill-h100-037031e.json).

Split pages (`paged_union_attention`, below): one program per (query block of 64 / heads_per_group tokens, KV
group); its 64 rows (row r: token r // hg, head
r % hg) are wgmma's M. The list holds the distinct blocks the block's tokens selected, sorted, each with its
owner bits (`kernel.union_page_lists`). The memory warpgroup streams the listed pages, `key_tile` keys a step,
through `stages` K and V buffers; both compute warpgroups hold the same 64 rows and take alternate steps (each
its own running max, sum and accumulator), so one's softmax overlaps the other's matrix work without a second
query block and its larger union. A step masks a row unless its token owns the block and the key is at or
before the token's position. Odd step counts get one fully masked step (a re-read of the last page) so the two
warpgroups' turns pair up. At the end warpgroup 1 hands its state to warpgroup 0 through shared memory, which
merges the two (log-sum-exp) and stores the rows.

With an even number of stages each buffer belongs to one warpgroup (step s: buffer s % stages, warpgroup s % 2),
so every barrier is waited on, phase after phase, by the same threads.

Interpret mode: `plgpu.InterpretGPUParams` (jax's GPU interpreter), where wgmma reads both operands from shared
memory, so P goes through a shared-memory tile there; that is the only difference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.kernel_mgpu import (
    LOG2E,
    WG_ROWS,
    heaviest_first,
    launch,
    load_kv,
    load_query_rows,
    mask_keys,
    per_row,
    row_positions,
    scores,
    smem_tiles,
    softmax_and_pv,
    softmax_start,
    split_token_attention,
    stream_pages,
    take_turn,
    token_bits,
    wait_query_rows,
)


def tokens_per_block(heads_per_group: int, shared: bool = False) -> int:
    """A query block's tokens: one warpgroup's 64 rows, or two with `shared` (paged_shared_union_attention)."""
    return (2 if shared else 1) * (WG_ROWS // heads_per_group)


def shared_form(block_tokens: int, heads_per_group: int) -> bool:
    """How tiles name the form: query blocks (`AttentionTiles.bt`) longer than one warpgroup's tokens are the
    shared-pages form's."""
    return block_tokens > tokens_per_block(heads_per_group)


def supports(heads_per_group: int, head_dim: int, page_size: int, key_tile: int, stages: int,
             shared: bool = False) -> bool:
    return (WG_ROWS % heads_per_group == 0 and heads_per_group % 8 == 0 and head_dim % 64 == 0
            and key_tile % 64 == 0 and page_size % key_tile == 0 and stages >= 2 and (shared or stages % 2 == 0))


def _kernel(start_ref, length_ref, row_ref, page_table_ref, pos_ref, list_ref, owners_ref, count_ref, q_ref, k_ref,
            v_ref, o_ref, scoped, *, hg: int, ps: int, kt: int, stages: int, scale: float, interpret: bool):
    (qo_smem2, k_smem, v_smem, p_smem2, acc_smem, ml_smem), (k_loaded, v_loaded, q_loaded, handed), \
        (k_used, v_used), turn = scoped
    qb, g, wg = heaviest_first(start_ref.shape[0]), lax.axis_index("g"), lax.axis_index("wg")
    T = q_ref.shape[0]
    D = q_ref.shape[-1]
    t0, n, row = start_ref[qb], length_ref[qb], row_ref[qb]
    steps_per_page = ps // kt
    count = jnp.where(n > 0, count_ref[qb, g], 0)
    real_steps = count * steps_per_page
    num_steps = real_steps + lax.rem(real_steps, 2)  # even: the two compute warpgroups take turns

    def step_page(s):  # list entry of step s, and its page key offset (a padding step re-reads the last entry)
        return jnp.minimum(s // steps_per_page, count - 1), lax.rem(s, steps_per_page) * kt

    turn_taken = functools.partial(take_turn, turn)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        qo = qo_smem2.at[wg]
        tpb = WG_ROWS // hg
        load_query_rows(q_ref, qo, q_loaded, t0=t0, first=0, wg=wg, g=g, hg=hg)  # both: the block's tokens
        pos_row, _ = row_positions(pos_ref, t0, 0, n, rows_per_token=hg, cols=kt, num_tokens=T)
        tok_bit = token_bits(0, hg, kt)
        wait_query_rows(q_loaded, wg, hg)

        c = scale * LOG2E  # m is kept in units of c * score: p = 2^(c s - m)
        acc, m_i, l_i = softmax_start(D)

        # With two buffers or more per warpgroup, the next step's K is waited for beside this step's P @ V (as in
        # the dense kernel); with one, that buffer is this step's, free only after it: wait at the step's start.
        ahead = stages >= 4

        if ahead:
            pl.when(wg < num_steps)(lambda: plgpu.barrier_wait(k_loaded.at[wg]))

        pl.when(wg == 1)(turn_taken)

        def step(j, carry):
            s = 2 * j + wg
            slot = lax.rem(s, stages)
            entry, key0 = step_page(s)
            owners = jnp.where(s < real_steps, owners_ref[qb, g, entry], 0)
            key0 = list_ref[qb, g, entry] * ps + key0
            if not ahead:
                plgpu.barrier_wait(k_loaded.at[slot])
            s_ = scores(qo, k_smem.at[slot], kt, turn_taken)
            plgpu.barrier_arrive(k_used.at[slot])
            # A row sees a key when its token owns the block and the key is not past the token's position.
            limit = jnp.where((tok_bit & owners) != 0, pos_row, -1)
            s_ = mask_keys(s_, key0, limit)

            def next_k():
                if ahead:
                    pl.when(s + 2 < num_steps)(lambda: plgpu.barrier_wait(k_loaded.at[lax.rem(s + 2, stages)]))

            return softmax_and_pv(s_, carry, c, v_tile=v_smem.at[slot], v_loaded=v_loaded.at[slot],
                                  v_used=v_used.at[slot], turn=turn, p_tile=p_smem2.at[wg] if interpret else None,
                                  after_pv=next_k, interpret=interpret)

        acc, m_i, l_i = lax.fori_loop(0, num_steps // 2, step, (acc, m_i, l_i))
        pl.when(wg == 0)(turn_taken)

        @pl.when(wg == 1)
        def _hand_over():
            acc_smem[...] = acc
            ml_smem.at[0][...] = m_i
            ml_smem.at[1][...] = l_i
            plgpu.barrier_arrive(handed)

        @pl.when(wg == 0)
        def _merge_and_store():
            plgpu.barrier_wait(handed)
            m_1 = plgpu.load(ml_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            l_1 = plgpu.load(ml_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
            acc_1 = plgpu.load(acc_smem, layout=plgpu.Layout.WGMMA)
            m = jnp.maximum(m_i, m_1)
            a_0, a_1 = jnp.exp2(m_i - m), jnp.exp2(m_1 - m)
            l = l_i * a_0 + l_1 * a_1
            out = (acc * per_row(a_0, D) + acc_1 * per_row(a_1, D)) / per_row(jnp.where(l > 0, l, 1.0), D)
            qo[...] = out.astype(qo.dtype)
            plgpu.commit_smem()
            for i in range(tpb):
                @pl.when(i < n)
                def _(i: int = i) -> None:
                    plgpu.copy_smem_to_gmem(qo.at[pl.ds(i * hg, hg)], o_ref.at[t0 + i, pl.ds(g * hg, hg)])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(s, slot):
            entry, key0 = step_page(s)
            load_kv(k_ref, v_ref, k_smem, v_smem, k_loaded, v_loaded, page=page_table_ref[row, list_ref[qb, g, entry]],
                    key0=key0, kt=kt, g=g, slot=slot)

        stream_pages(load, num_steps, stages, (k_used, v_used))


def paged_union_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table_RP: jax.Array,
                          pos_T: jax.Array, qbs, page_list_QGL: jax.Array, owners_QGL: jax.Array,
                          count_QG: jax.Array, scale: float, *, key_tile: int, stages: int,
                          interpret: bool = False) -> jax.Array:
    """Block-sparse attention over query blocks of `tokens_per_block(hg)` tokens (`qbs`) and their union page
    lists (`kernel.union_page_lists` on those blocks); KVPages' [pages, page_size, K, hd] pools, bf16 or f16."""
    T, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    hg = H // K
    kt = min(key_tile, ps)
    if not supports(hg, D, ps, kt, stages):
        raise ValueError(f"the Mosaic GPU block-sparse attention takes heads per group dividing 64 in multiples "
                         f"of 8, head_dim and key tiles in multiples of 64, an even number of stages: got hg={hg}, "
                         f"hd={D}, page={ps}, key tile={kt}, stages={stages}")
    dt = q_THD.dtype
    scratch = [*smem_tiles(D, kt, stages, dt, interpret),
               plgpu.SMEM((WG_ROWS, D), jnp.float32),  # warpgroup 1's accumulator, handed to warpgroup 0
               plgpu.SMEM((2, WG_ROWS), jnp.float32)]  # and its running max and sum
    tpb = WG_ROWS // hg

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, hg=hg, ps=ps, kt=kt, stages=stages, scale=scale,
                                    interpret=interpret),
            scratch,
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2 * tpb), plgpu.Barrier()),
            (plgpu.Barrier(num_barriers=stages),) * 2,  # a buffer is released by the one warpgroup that reads it
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    call = launch(entry, "sparse_union_attention_mgpu", jax.ShapeDtypeStruct((T, H, D), dt), qbs.num_blocks, K,
                  interpret)
    return call(qbs.start_Q, qbs.length_Q, qbs.row_Q, page_table_RP.astype(jnp.int32), pos_T.astype(jnp.int32),
                page_list_QGL.astype(jnp.int32), owners_QGL.astype(jnp.int32), count_QG.astype(jnp.int32), q_THD,
                k_pages, v_pages)


def paged_shared_union_attention(q_THD: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                 page_table_RP: jax.Array, pos_T: jax.Array, qbs, page_list_QGL: jax.Array,
                                 owners_QGL: jax.Array, count_QG: jax.Array, scale: float, *, key_tile: int,
                                 stages: int, interpret: bool = False) -> jax.Array:
    """`paged_union_attention`'s result over query blocks of `tokens_per_block(hg, shared=True)` tokens: both
    compute warpgroups walk the block's one union of pages, each over its own tokens' rows (the dense kernel's
    split, attention/kernel_mgpu.py, over a page list). A page read then serves 128 rows instead of 64, at the
    cost of a union over twice the tokens."""
    _, H, D = q_THD.shape
    _, ps, K, _ = k_pages.shape
    hg = H // K
    kt = min(key_tile, ps)
    if not supports(hg, D, ps, kt, stages, shared=True):
        raise ValueError(f"the Mosaic GPU block-sparse attention takes heads per group dividing 64 in multiples "
                         f"of 8, head_dim and key tiles in multiples of 64, 2+ stages: got hg={hg}, hd={D}, "
                         f"page={ps}, key tile={kt}, stages={stages}")
    return split_token_attention(q_THD, k_pages, v_pages, page_table_RP, pos_T, qbs,
                                 (page_list_QGL, owners_QGL, count_QG), scale, kt=kt, stages=stages,
                                 interpret=interpret, name="sparse_shared_attention_mgpu")
