"""Grouped-GEMM MoE in Pallas (Triton lowering on the GPU, `interpret=True` on the CPU).

Data flow for T tokens, top-k routing, S expert slots (the shared expert, when stacked, is slot S-1 and every
token visits it with weight 1):

  route (fp32, the reference's `route`) -> sort_and_pad: the T*(k+1) (token, slot) pairs sorted by slot, each
  slot's rows padded to the block height bm, so every row block belongs to exactly one slot
  -> gate_up kernel: act_MF = SwiGLU-OAI(x @ W_gate[slot], x @ W_up[slot]), x = h[row_token] gathered by the
                     kernel's own x loads (both accumulators in one program)
  -> down kernel:    y_MD = act @ W_down[slot]
  -> combine: out[t] = sum over its k+1 choices j of w[t, j] * y[dest[t, j]]  (one XLA gather-sum, fp32: the
              routing weights applied here need no per-row weight array in the layout)

Kernel grid: one axis of (row block x N tile) programs. Each program reads its row block's slot from
`slot_B` (-1 for blocks past the last used one, which return at once), streams that slot's [K, bn] weight
tiles (bf16, or MX bytes widened in registers), and writes only its own [bm, bn] output tile, so no two
programs touch the same rows (gpu.md's race trap). Program ids run row blocks fastest within groups of
`group` blocks, then N tiles: the programs in flight share weight tiles (blocks of one expert) and x tiles
(prefill), so repeats hit L2. With `MoeTiles.tail_heights` (e.g. (32, 64) at bm = 128), a block holding at most h
pairs (`rows_B`) runs an h-row dot over its first h rows and leaves the padding rows below them unwritten.

Split K (`KernelTiles.split` > 1, for calls with too few output tiles to fill the GPU): `split` neighbouring
programs share one output tile, each over 1/split of K. down then writes fp32 partials [split, M, D] that the
combine sums; gate_up's programs store fp32 partials and the last of a tile to finish (an atomic counter) sums
them in split order and runs the epilogue, so the result does not depend on which finished last.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import mx
from pallas_kernels.device import wgmma_device
from pallas_kernels.moe import kernel_mgpu, layout
from pallas_kernels.moe.reference import dense_mlp, route, swiglu_oai
from pallas_kernels.moe.tiles import KernelTiles, MoeTiles, block_and_tile, fill_shard, fit_tiles, pick_tiles
from pallas_kernels.ordered import ordered_sum
from pallas_kernels.sync import when_last


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The sorted-and-padded rows of one MoE call (M = nb * bm rows, nb row blocks)."""

    row_token_M: jax.Array  # token whose hidden state fills each row (0 for padding rows)
    slot_B: jax.Array  # expert slot of each row block; -1 past the last used block
    dest_TJ: jax.Array  # the row of each (token, choice); choice k is the shared slot when it is stacked
    w_TJ: jax.Array  # fp32 combine weight of each (token, choice): routing weight * routed_scaling, 1 for the
    #                  shared slot
    rows_B: jax.Array  # rows of each block that hold a (token, choice) pair (the rest are padding); 0 if unused


def max_row_blocks(num_rows: int, num_slots: int, bm: int) -> int:
    """Static bound on the used row blocks: sum_s ceil(n_s / bm) <= ceil(R / bm) + S, and <= R (a used block
    holds at least one row)."""
    return min(num_rows, -(-num_rows // bm) + num_slots)


# Up to this many (token, slot) pairs the layout is built by comparisons instead of an argsort and scatters:
# [R, R] and [M, R] masks that XLA reduces in a few fused kernels instead of a dozen small ones (sort, three
# scatters, two scans). H200, bf16, T = 8 / 32 / 128: the routing glue around the two kernels 15 / 28 / 41 us
# against 23 / 62 / 60 us with the argsort (benchmarks/results/moe-h200-layout.json). Beyond it the masks grow
# quadratically.
COMPARE_LAYOUT_MAX_PAIRS = 1024


def sort_and_pad(idx_TK: jax.Array, w_TK: jax.Array, *, num_slots: int, shared_slot: bool, bm: int,
                 routed_scaling: float, method: str | None = None) -> RowLayout:
    """The rows of every slot contiguous (pairs in token order) and padded to bm. `method`: "compare" or
    "argsort" build the same layout; None picks by size."""
    e_TJ, w_TJ = routed_pairs(idx_TK, w_TK, num_slots=num_slots, shared_slot=shared_slot,
                              routed_scaling=routed_scaling)
    return _pairs_layout(e_TJ, w_TJ, num_slots=num_slots, bm=bm, method=method)


def routed_pairs(idx_TK: jax.Array, w_TK: jax.Array, *, num_slots: int, shared_slot: bool,
                 routed_scaling: float) -> tuple[jax.Array, jax.Array]:
    """Each token's (slot, fp32 combine weight) pairs [T, J]: its k experts, weighted by routed_scaling, and the
    shared slot (the last one), weight 1, when the shared expert is stacked with them."""
    T = idx_TK.shape[0]
    e_TJ = idx_TK.astype(jnp.int32)
    w_TJ = w_TK.astype(jnp.float32) * routed_scaling
    if shared_slot:
        e_TJ = jnp.concatenate([e_TJ, jnp.full((T, 1), num_slots - 1, jnp.int32)], axis=1)
        w_TJ = jnp.concatenate([w_TJ, jnp.ones((T, 1), jnp.float32)], axis=1)
    return e_TJ, w_TJ


def pairs_layout(e_TJ: jax.Array, w_TJ: jax.Array, *, num_slots: int, bm: int,
                 method: str | None = None) -> RowLayout:
    """`sort_and_pad` for explicit (token, slot) pairs with their fp32 combine weights, where slot `num_slots`
    means "computed nowhere" (an expert-parallel device's pairs of other devices' experts): those pairs sort
    into row blocks of their own after every real slot's, whose `slot_B` is -1 (the kernels return at once), and
    the combine must mask them (`combine(..., valid_TJ=e_TJ < num_slots)`): their rows are never written."""
    lay = _pairs_layout(e_TJ.astype(jnp.int32), w_TJ.astype(jnp.float32), num_slots=num_slots + 1, bm=bm,
                        method=method)
    skip_B = lay.slot_B == num_slots
    return dataclasses.replace(lay, slot_B=jnp.where(skip_B, -1, lay.slot_B), rows_B=jnp.where(skip_B, 0, lay.rows_B))


def _pairs_layout(e_TJ: jax.Array, w_TJ: jax.Array, *, num_slots: int, bm: int, method: str | None) -> RowLayout:
    T, J = e_TJ.shape
    R = T * J
    if T == 1:
        # One token: its J slots are distinct (top-k picks distinct experts; the shared slot is another one),
        # so each gets its own row block with the token in the block's first row. No sort and no scatters: at
        # decode sizes the general path's dozen small XLA kernels cost more than the two GEMM kernels' slack
        # (H200, M3 shapes: 0.165 -> 0.149 ms, 1.26x -> 1.13x the weight-streaming floor).
        return RowLayout(jnp.zeros(J * bm, jnp.int32), e_TJ.reshape(-1),
                         (jnp.arange(J, dtype=jnp.int32) * bm)[None, :], w_TJ, jnp.ones((J,), jnp.int32))
    flat_e = e_TJ.reshape(-1)
    if method is None:
        method = "compare" if R <= COMPARE_LAYOUT_MAX_PAIRS else "argsort"
    if method == "compare":
        return _compare_layout(flat_e, w_TJ, T=T, J=J, num_slots=num_slots, bm=bm)
    sizes_S = jnp.zeros(num_slots, jnp.int32).at[flat_e].add(1)
    blocks_S = (sizes_S + bm - 1) // bm
    bend_S = jnp.cumsum(blocks_S)
    start_S = jnp.cumsum(sizes_S) - sizes_S
    order_R = jnp.argsort(flat_e, stable=True)
    e_sorted = flat_e[order_R]
    dest_sorted = (bend_S - blocks_S)[e_sorted] * bm + jnp.arange(R, dtype=jnp.int32) - start_S[e_sorted]
    dest_R = jnp.zeros(R, jnp.int32).at[order_R].set(dest_sorted, unique_indices=True)
    nb = max_row_blocks(R, num_slots, bm)
    M = nb * bm
    row_token_M = jnp.zeros(M, jnp.int32).at[dest_R].set(jnp.arange(R, dtype=jnp.int32) // J,
                                                           unique_indices=True)
    blocks = jnp.arange(nb, dtype=jnp.int32)
    # compare_all: one vectorised compare instead of a loop (a GPU while loop syncs with the host per step).
    slot_B = jnp.searchsorted(bend_S, blocks, side="right", method="compare_all").astype(jnp.int32)
    slot_B = jnp.where(blocks < bend_S[-1], slot_B, -1)
    return RowLayout(row_token_M, slot_B, dest_R.reshape(T, J), w_TJ,
                     _block_rows(slot_B, sizes_S, bend_S - blocks_S, bm))


def _compare_layout(e_R: jax.Array, w_TJ: jax.Array, *, T: int, J: int, num_slots: int, bm: int) -> RowLayout:
    """sort_and_pad's layout without a sort or a scatter: every quantity is a masked sum, so XLA fuses them."""
    R = T * J
    nb = max_row_blocks(R, num_slots, bm)
    M = nb * bm
    r = jnp.arange(R, dtype=jnp.int32)
    s = jnp.arange(num_slots, dtype=jnp.int32)
    sizes_S = jnp.sum(e_R[:, None] == s[None, :], axis=0, dtype=jnp.int32)
    blocks_S = (sizes_S + bm - 1) // bm
    bstart_S = jnp.sum(jnp.where(s[:, None] < s[None, :], blocks_S[:, None], 0), axis=0, dtype=jnp.int32)
    # A pair's row within its slot: how many earlier pairs chose the same slot (the stable sort's order).
    rank_R = jnp.sum((e_R[None, :] == e_R[:, None]) & (r[None, :] < r[:, None]), axis=1, dtype=jnp.int32)
    dest_R = bstart_S[e_R] * bm + rank_R
    # Each row takes the one pair that lands on it (none for padding rows): sums with at most one term.
    hit_MR = dest_R[None, :] == jnp.arange(M, dtype=jnp.int32)[:, None]
    row_token_M = jnp.sum(jnp.where(hit_MR, r[None, :] // J, 0), axis=1, dtype=jnp.int32)
    bend_S = bstart_S + blocks_S
    blocks = jnp.arange(nb, dtype=jnp.int32)
    slot_B = jnp.sum(bend_S[None, :] <= blocks[:, None], axis=1, dtype=jnp.int32)  # the slot holding block b
    slot_B = jnp.where(blocks < bend_S[-1], slot_B, -1)
    return RowLayout(row_token_M, slot_B, dest_R.reshape(T, J), w_TJ, _block_rows(slot_B, sizes_S, bstart_S, bm))


def _block_rows(slot_B: jax.Array, sizes_S: jax.Array, bstart_S: jax.Array, bm: int) -> jax.Array:
    """Pairs in each row block: its slot's rows past the block's start, at most bm (0 for unused blocks)."""
    s = jnp.maximum(slot_B, 0)
    b = jnp.arange(slot_B.shape[0], dtype=jnp.int32)
    return jnp.where(slot_B >= 0, jnp.clip(sizes_S[s] - (b - bstart_S[s]) * bm, 0, bm), 0).astype(jnp.int32)


# ---- in-kernel pieces ------------------------------------------------------------------------------------


def _block_and_tile(nb: int, nt: int, group: int, split: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Program id -> (row block, N tile, K split): the `split` programs of one output tile next to each other
    (so they run together), output tiles in `tiles.block_and_tile`'s order."""
    b, j = block_and_tile(pl.program_id(0) // split, nb, nt, group)
    return b, j, pl.program_id(0) % split


def _k_steps(k: int, kt: KernelTiles, s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The K steps [lo, hi) that split s of kt.split accumulates."""
    per = k // kt.bk // kt.split
    return s * per, (s + 1) * per


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _piece_scales(s_word: jax.Array, block: int, rows: int) -> jax.Array:
    """The E8M0 scale bytes of `rows` weight rows starting at K block `block` of a group: [1, bn] for one 32-row
    block, [64, bn] for two (the bytes chosen per row in registers: a reshape would go through shared memory)."""
    if rows == mx.BLOCK:
        return (s_word >> (8 * block)) & 0xFF
    first = jax.lax.broadcasted_iota(jnp.int32, (rows, s_word.shape[1]), 0) < mx.BLOCK
    return jnp.where(first, (s_word >> (8 * block)) & 0xFF, (s_word >> (8 * block + 8)) & 0xFF)


def _mac(acc: jax.Array, x_ref, rows: pl.Slice | jax.Array, k0: jax.Array, w_refs: tuple, slot: jax.Array,
         col0: jax.Array, *, fmt: str, bn: int, bk: int, mx_mode: str, mx_rows: int) -> jax.Array:
    """acc += x[rows, k0:k0+bk] @ W[slot, k0:k0+bk, col0:col0+bn], W decoded from its format. `rows`: a slice of
    x's rows, or the [bm] row indices to gather (gate_up reads the tokens' hidden states in place)."""
    cdt = x_ref.dtype
    cols = pl.ds(col0, bn)
    if fmt == "dense":
        return acc + _dot(x_ref[rows, pl.ds(k0, bk)], w_refs[0][slot, pl.ds(k0, bk), cols].astype(cdt))
    # MX (layout.py): a 128-group of K is `per` runs of `run` elements; word r of the group holds element r of
    # every run (field j = run j), and one uint32 per column holds the group's four block scales. A dot takes
    # `piece` word rows and one field: K elements j * run + c * piece onwards.
    q_ref, s_ref = w_refs
    bits, per = layout.BITS[fmt], layout.PER_WORD[fmt]
    run = layout.MX_GROUP // per
    piece = mx.BLOCK if mx_mode == "subdot" else min(mx_rows, run)  # subdot scales each dot's result by one block
    for g in range(bk // layout.MX_GROUP):
        kg = k0 + g * layout.MX_GROUP
        s_word = s_ref[slot, pl.ds(kg // layout.MX_GROUP, 1), cols]  # [1, bn] uint32
        for c in range(run // piece):
            word = q_ref[slot, pl.ds(kg // per + c * piece, piece), cols]  # [piece, bn] uint16
            for j in range(per):
                first = j * run + c * piece  # the dot's first K element within the group
                s_byte = _piece_scales(s_word, first // mx.BLOCK, piece)  # [1 or piece, bn]
                x = x_ref[rows, pl.ds(kg + first, piece)]
                if mx_mode == "expand_asm":
                    # Widened by inline PTX (layout.widening_ptx): a few bit ops and a packed bf16 multiply per
                    # pair of elements, against ~4.6 conversion and bit ops per element the plain way.
                    s = jnp.broadcast_to(layout.asm_bf16_scale(s_byte, fmt), word.shape)
                    [w] = pltriton.elementwise_inline_asm(
                        layout.widening_ptx(fmt, j), args=[word, s], constraints="=r,r,r", pack=2,
                        result_shape_dtypes=[jax.ShapeDtypeStruct(word.shape, jnp.bfloat16)])
                    acc = acc + _dot(x, w.astype(cdt))
                    continue
                code = (word.astype(jnp.int32) >> (bits * j)) & ((1 << bits) - 1)
                if mx_mode == "expand":
                    w = (layout.decode_codes(code, fmt) * mx.e8m0_to_f32(s_byte)).astype(cdt)
                    acc = acc + _dot(x, w)
                else:  # "subdot": widen straight to the compute dtype, scale the piece's dot result
                    acc = acc + _dot(x, layout.decode_codes(code, fmt, cdt)) * mx.e8m0_to_f32(s_byte)
    return acc


def _for_used_block(slot: jax.Array, rows_ref, b: jax.Array, bm: int, heights: tuple[int, ...], body) -> None:
    """body(m) for a used row block, m = the rows it computes: the smallest of `heights` (ascending, each < bm)
    that holds the block's pairs, else bm (`MoeTiles.tail_heights`: a slot's last block is half padding on
    average, and a shorter dot skips the padding's MMA work and x reads while reading the same weight tiles).
    The rows past m stay unwritten: they are padding, which nothing reads back (down reads the same m rows, the
    combine only real rows)."""
    if not heights:
        pl.when(slot >= 0)(lambda: body(bm))
        return
    n, lo = rows_ref[b], 0
    for h in (*heights, bm):
        pl.when((slot >= 0) & (n > lo) & (n <= h))(functools.partial(body, h))
        lo = h


def _gate_up_kernel(slot_ref, rows_ref, token_ref, x_ref, *refs, n_w: int, fmt: str, bm: int, kt: KernelTiles,
                    nb: int, nt: int, group: int, mx_mode: str, mx_rows: int, tail_heights: tuple[int, ...],
                    alpha: float, limit: float, interpret: bool):
    g_refs, u_refs = refs[:n_w], refs[n_w:2 * n_w]
    o_ref = refs[-1] if kt.split == 1 else refs[-3]  # (split-K: count in, act, partials, count out)
    b, j, ks = _block_and_tile(nb, nt, group, kt.split)
    slot = slot_ref[b]

    def block(m: int) -> None:
        row0 = pl.multiple_of(b * bm, bm)
        n0 = pl.multiple_of(j * kt.bn, kt.bn)
        # The block's rows are tokens' hidden states, gathered by each x load (no [M, D] copy of x in HBM).
        tok_B = token_ref[pl.ds(row0, m)]
        mac = functools.partial(_mac, x_ref=x_ref, rows=tok_B, slot=slot, col0=n0, fmt=fmt, bn=kt.bn, bk=kt.bk,
                                mx_mode=mx_mode, mx_rows=mx_rows)

        def step(i, accs):
            k0 = pl.multiple_of(i * kt.bk, kt.bk)
            return mac(accs[0], k0=k0, w_refs=g_refs), mac(accs[1], k0=k0, w_refs=u_refs)

        zeros = jnp.zeros((m, kt.bn), jnp.float32)
        gate, up = jax.lax.fori_loop(*_k_steps(x_ref.shape[1], kt, ks), step, (zeros, zeros))
        rows, cols = pl.ds(row0, m), pl.ds(n0, kt.bn)

        def epilogue(gate: jax.Array, up: jax.Array) -> None:
            # SwiGLU-OAI (the reference's own function) on the fp32 accumulators, before the one rounding to bf16.
            o_ref[rows, cols] = swiglu_oai(gate, up, alpha=alpha, limit=limit).astype(o_ref.dtype)

        if kt.split == 1:
            epilogue(gate, up)
        else:
            _last_split_sums(refs[-2], refs[-1], gate, up, b * nt + j, ks, rows, cols, epilogue, split=kt.split,
                             interpret=interpret)

    _for_used_block(slot, rows_ref, b, bm, tail_heights, block)


def _last_split_sums(part_ref, count_ref, gate, up, tile, ks, rows, cols, epilogue, *, split: int,
                     interpret: bool) -> None:
    """Split-K gate_up: each of a tile's `split` programs stores its fp32 partials; the last to finish
    (pallas_kernels/sync.py) sums them all in split order, so the result does not depend on which finished
    last, and runs the epilogue."""
    F = part_ref.shape[2] // 2
    up_cols = pl.ds(cols.start + F, cols.size)
    part_ref[ks, rows, cols] = gate
    part_ref[ks, rows, up_cols] = up

    def sum_and_finish() -> None:
        def part(i: int, c: pl.Slice) -> jax.Array:
            return pltriton.load(part_ref.at[pl.ds(i, 1), rows, c], volatile=True)[0]

        g, u = part(0, cols), part(0, up_cols)
        for i in range(1, split):
            g, u = g + part(i, cols), u + part(i, up_cols)
        epilogue(g, u)

    when_last(count_ref, tile, split, sum_and_finish, interpret=interpret)


def _down_kernel(slot_ref, rows_ref, a_ref, *refs, fmt: str, bm: int, kt: KernelTiles, nb: int, nt: int,
                 group: int, mx_mode: str, mx_rows: int, tail_heights: tuple[int, ...]):
    w_refs, o_ref = refs[:-1], refs[-1]
    b, j, ks = _block_and_tile(nb, nt, group, kt.split)
    slot = slot_ref[b]

    def block(m: int) -> None:
        row0 = pl.multiple_of(b * bm, bm)
        n0 = pl.multiple_of(j * kt.bn, kt.bn)

        def step(i, acc):
            k0 = pl.multiple_of(i * kt.bk, kt.bk)
            return _mac(acc, a_ref, pl.ds(row0, m), k0, w_refs, slot, n0, fmt=fmt, bn=kt.bn, bk=kt.bk,
                        mx_mode=mx_mode, mx_rows=mx_rows)

        acc = jax.lax.fori_loop(*_k_steps(a_ref.shape[1], kt, ks), step, jnp.zeros((m, kt.bn), jnp.float32))
        if kt.split == 1:
            o_ref[pl.ds(row0, m), pl.ds(n0, kt.bn)] = acc.astype(o_ref.dtype)
        else:  # fp32 partials [split, M, D], summed by the combine
            o_ref[ks, pl.ds(row0, m), pl.ds(n0, kt.bn)] = acc

    _for_used_block(slot, rows_ref, b, bm, tail_heights, block)


def _mode(tiles: MoeTiles, interpret: bool) -> str:
    """The MX mode a kernel runs: inline PTX cannot run in the interpreter, where "expand_asm" computes the same
    values the plain "expand" way."""
    return "expand" if interpret and tiles.mx_mode == "expand_asm" else tiles.mx_mode


def _check_offsets(*arrays: jax.Array) -> None:
    """Pallas' Triton lowering indexes an array of at most 4 GiB with 32-bit element offsets, which wrap past
    2^31 elements: reads land outside the array (seen on the H200 with a 2.4e9-element fp8 array: NaNs).
    Refuse such arrays rather than compute garbage."""
    for a in arrays:
        if a.size >= 2**31 and a.size * a.dtype.itemsize <= 2**32:
            raise ValueError(f"array {a.shape} {a.dtype}: {a.size} elements overflow Pallas' 32-bit offsets")


def _check_tiles(bm: int, kt: KernelTiles, k: int, n: int, fmt: str) -> None:
    assert k % kt.bk == 0 and n % kt.bn == 0, f"tiles bk={kt.bk}, bn={kt.bn} must divide K={k}, N={n}"
    assert kt.bk % layout.MX_GROUP == 0 or fmt == "dense", "MX tiles need bk a multiple of 128 (pair packing)"


def gate_up(h_TD: jax.Array, row_token_M: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict,
            tiles: MoeTiles, *, alpha: float, limit: float, interpret: bool = False) -> jax.Array:
    """act [M, F] = SwiGLU-OAI(x @ gate[slot], x @ up[slot]) per row block, x = h[row_token] (gathered in the
    kernel). Padding rows are garbage where tiles.tail_heights leave them unwritten."""
    fmt = layout.weight_format(experts)
    g_arrays, u_arrays = layout.weight_arrays(experts, "gate"), layout.weight_arrays(experts, "up")
    M, D = row_token_M.shape[0], h_TD.shape[1]
    F = g_arrays[0].shape[-1]
    kt, nb = tiles.gu, slot_B.shape[0]
    _check_tiles(tiles.bm, kt, D, F, fmt)
    _check_offsets(h_TD, *g_arrays, *u_arrays)
    nt = F // kt.bn
    kernel = functools.partial(_gate_up_kernel, n_w=len(g_arrays), fmt=fmt, bm=tiles.bm, kt=kt, nb=nb, nt=nt,
                               group=min(tiles.group, nb), mx_mode=_mode(tiles, interpret),
                               mx_rows=tiles.mx_rows, tail_heights=tiles.tail_heights, alpha=alpha, limit=limit,
                               interpret=interpret)
    args = (slot_B, rows_B, row_token_M.astype(jnp.int32), h_TD, *g_arrays, *u_arrays)
    out_shape = jax.ShapeDtypeStruct((M, F), h_TD.dtype)
    extra = {}
    if kt.split > 1:  # fp32 partials of each split, and per output tile the programs done (zeros, aliased)
        args = (*args, jnp.zeros((nb * nt,), jnp.int32))
        out_shape = (out_shape, jax.ShapeDtypeStruct((kt.split, M, 2 * F), jnp.float32),
                     jax.ShapeDtypeStruct((nb * nt,), jnp.int32))
        extra = {"input_output_aliases": {len(args) - 1: 2}}
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nb * nt * kt.split,),
        compiler_params=pltriton.CompilerParams(num_warps=kt.warps, num_stages=kt.stages),
        interpret=interpret,
        name=f"moe_gate_up_{fmt}" + (f"_split{kt.split}" if kt.split > 1 else ""),
        **extra,
    )(*args)
    return out if kt.split == 1 else out[0]


def down(act_MF: jax.Array, slot_B: jax.Array, rows_B: jax.Array, experts: dict, tiles: MoeTiles, *,
         interpret: bool = False) -> jax.Array:
    """y [M, D] = act @ down[slot] per row block; with a split K (tiles.dn.split > 1) the fp32
    partials y [split, M, D], whose sum is y."""
    fmt = layout.weight_format(experts)
    w_arrays = layout.weight_arrays(experts, "down")
    M, F = act_MF.shape
    D = w_arrays[0].shape[-1]
    kt, nb = tiles.dn, slot_B.shape[0]
    _check_tiles(tiles.bm, kt, F, D, fmt)
    _check_offsets(act_MF, *w_arrays)
    nt = D // kt.bn
    kernel = functools.partial(_down_kernel, fmt=fmt, bm=tiles.bm, kt=kt, nb=nb, nt=nt,
                               group=min(tiles.group, nb), mx_mode=_mode(tiles, interpret),
                               mx_rows=tiles.mx_rows, tail_heights=tiles.tail_heights)
    shape = (M, D) if kt.split == 1 else (kt.split, M, D)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(shape, act_MF.dtype if kt.split == 1 else jnp.float32),
        grid=(nb * nt * kt.split,),
        compiler_params=pltriton.CompilerParams(num_warps=kt.warps, num_stages=kt.stages),
        interpret=interpret,
        name=f"moe_down_{fmt}" + (f"_split{kt.split}" if kt.split > 1 else ""),
    )(slot_B, rows_B, act_MF, *w_arrays)


def experts_of(p: dict) -> tuple[dict, bool]:
    """(the expert arrays the kernels read, whether the shared expert is their last slot)."""
    if "experts" in p:
        return p["experts"], layout.has_shared_slot(p)
    # Unprepared params: the routed experts read in place (no copies); the shared expert stays a dense MLP.
    return {"gate": p["w_gate"], "up": p["w_up"], "down": p["w_down"]}, False


def kernel_tiles(num_tokens: int, experts: dict, *, tiles: MoeTiles | None = None,
                 interpret: bool = False) -> MoeTiles | None:
    """The tiles for this call (the table's, fitted to the shapes), or None when the kernels cannot run it."""
    fmt = layout.weight_format(experts)
    gate = layout.weight_arrays(experts, "gate")
    d_model = gate[1].shape[-2] * layout.MX_GROUP if fmt != "dense" else gate[0].shape[-2]
    d_ff = gate[0].shape[-1]
    if tiles is None and not interpret and wgmma_device() and layout.WIDE_SCALES not in experts:
        mosaic = pick_tiles(num_tokens, fmt, mosaic=True)
        if mosaic.backend == "mosaic" and fit_tiles(mosaic, d_model, d_ff, fmt) == mosaic:
            return mosaic  # its entry takes the layer's shapes as they stand (the Mosaic tiles are not resized)
    tiles = tiles or pick_tiles(num_tokens, fmt, interpret=interpret)
    if tiles.backend == "mosaic" and fmt not in ("dense", "mxfp8"):
        raise ValueError(f"the Mosaic GPU MoE kernels take bf16 or MXFP8 experts, not {fmt}")
    if tiles.mx_mode == "expand_asm" and layout.WIDE_SCALES in experts:
        tiles = tiles.replace(mx_mode="expand")  # scales the folded bf16 scale cannot hold (layout.py)
    if not interpret:  # a dot under 16 rows is below Triton's smallest
        tiles = tiles.replace(tail_heights=tuple(h for h in tiles.tail_heights if h >= 16))
    return fit_tiles(tiles, d_model, d_ff, fmt)


def _fitted_tiles(T: int, J: int, experts: dict, tiles: MoeTiles | None, interpret: bool) -> MoeTiles:
    """The call's tiles; the table's (tiles=None) filled for a narrow shard's width (`tiles.fill_shard`, from the
    static bound on the row blocks of T tokens' J pairs each)."""
    given = tiles
    tiles = kernel_tiles(T, experts, tiles=tiles, interpret=interpret)
    if tiles is None:
        raise ValueError(f"no MoE tile fits these expert shapes ({layout.weight_format(experts)}); use the reference")
    if given is None and not interpret:
        gate = layout.weight_arrays(experts, "gate")
        d_model = gate[1].shape[-2] * layout.MX_GROUP if len(gate) > 1 else gate[0].shape[-2]
        nb = max_row_blocks(T * J, layout.num_slots(experts), tiles.bm)
        tiles = fill_shard(tiles, nb, d_model, gate[0].shape[-1])
    return tiles


def routed_experts_pallas(h_TD: jax.Array, idx_TK: jax.Array, w_TK: jax.Array, experts: dict, *,
                          shared_slot: bool, routed_scaling: float, alpha: float, limit: float,
                          tiles: MoeTiles | None = None, layout_method: str | None = None,
                          interpret: bool = False, layer: jax.Array | int | None = None,
                          num_valid: jax.Array | None = None) -> jax.Array:
    """fp32 [T, D]: routed_scaling * sum_k w[t,k] Expert_idx(h[t]) (+ the shared slot's output, weight 1).
    `layout_method`: sort_and_pad's (None: by size; benchmarks time both). `layer`: `experts` is a run's stack
    [layers, S, ...] and this is layer `layer` of it. `num_valid`: the rows from it on are a bucket's padding,
    computed nowhere (`pairs_layout`; their outputs are 0): no expert streams or computes rows for them, where
    a prefill padded to its bucket would otherwise add up to bucket - tokens rows to some experts."""
    if num_valid is not None:
        S = layout.num_slots(experts)
        e_TJ, w_TJ = routed_pairs(idx_TK, w_TK, num_slots=S, shared_slot=shared_slot, routed_scaling=routed_scaling)
        pad_T = jnp.arange(h_TD.shape[0]) >= num_valid
        return pairs_pallas(h_TD, jnp.where(pad_T[:, None], S, e_TJ), w_TJ, experts, alpha=alpha, limit=limit,
                            tiles=tiles, layout_method=layout_method, interpret=interpret, layer=layer)
    tiles = _fitted_tiles(h_TD.shape[0], idx_TK.shape[1] + int(shared_slot), experts, tiles, interpret)
    lay = sort_and_pad(idx_TK, w_TK, num_slots=layout.num_slots(experts), shared_slot=shared_slot, bm=tiles.bm,
                       routed_scaling=routed_scaling, method=layout_method)
    return _grouped_gemms(h_TD, lay, experts, tiles, alpha=alpha, limit=limit, interpret=interpret, layer=layer)


def pairs_pallas(h_TD: jax.Array, e_TJ: jax.Array, w_TJ: jax.Array, experts: dict, *, alpha: float, limit: float,
                 tiles: MoeTiles | None = None, layout_method: str | None = None, interpret: bool = False,
                 layer: jax.Array | int | None = None) -> jax.Array:
    """fp32 [T, D]: sum_j w[t, j] Slot_e[t, j](h[t]) over explicit (token, slot) pairs with their combine weights;
    a pair whose slot is `num_slots(experts)` is computed nowhere and adds nothing (`pairs_layout`). What one
    expert-parallel device runs on its own slots (pallas_kernels/sharded.py)."""
    tiles = _fitted_tiles(h_TD.shape[0], e_TJ.shape[1], experts, tiles, interpret)
    S = layout.num_slots(experts)
    lay = pairs_layout(e_TJ, w_TJ, num_slots=S, bm=tiles.bm, method=layout_method)
    return _grouped_gemms(h_TD, lay, experts, tiles, alpha=alpha, limit=limit, interpret=interpret, layer=layer,
                          valid_TJ=e_TJ < S)


def _grouped_gemms(h_TD: jax.Array, lay: RowLayout, experts: dict, tiles: MoeTiles, *, alpha: float,
                   limit: float, interpret: bool, layer: jax.Array | int | None,
                   valid_TJ: jax.Array | None = None) -> jax.Array:
    """gate_up -> down -> combine over a row layout."""
    if layer is not None:
        # The kernels read the whole stack, as one flat slot axis, at this layer's slots: a slice of the stack
        # would be copied into a buffer of its own for the custom call (a layer's experts every layer).
        S = layout.num_slots(experts)
        experts = {k: v.reshape(-1, *v.shape[2:]) if k != layout.WIDE_SCALES else v for k, v in experts.items()}
        lay = dataclasses.replace(lay, slot_B=jnp.where(lay.slot_B >= 0, lay.slot_B + layer * S, -1))
    if tiles.backend == "mosaic":
        y_MD = kernel_mgpu.grouped_gemms(h_TD, lay.row_token_M, lay.slot_B, lay.rows_B, experts, tiles,
                                         group=min(tiles.group, lay.slot_B.shape[0]), alpha=alpha, limit=limit,
                                         interpret=interpret)
        return combine(y_MD, lay.dest_TJ, lay.w_TJ, valid_TJ)
    act_MF = gate_up(h_TD, lay.row_token_M, lay.slot_B, lay.rows_B, experts, tiles, alpha=alpha, limit=limit,
                     interpret=interpret)
    y_MD = down(act_MF, lay.slot_B, lay.rows_B, experts, tiles, interpret=interpret)
    return combine(y_MD, lay.dest_TJ, lay.w_TJ, valid_TJ)


def combine(y_MD: jax.Array, dest_TJ: jax.Array, w_TJ: jax.Array, valid_TJ: jax.Array | None = None) -> jax.Array:
    """fp32 [T, D]: each token's k (+1) rows of down's output (or of its split-K partials [split, M, D]),
    gathered, weighted by their routing weights and summed in fp32. Rows are owned by one program each, so
    this needs no atomics and is deterministic. `valid_TJ`: pairs to count (the others' rows were never
    written and may hold anything, NaN included: selected away, not multiplied by 0)."""
    # Gathers, multiplies and adds (one XLA loop fusion), not an einsum, which could become a GEMM launch. The adds
    # go in choice order (a split's partials first, in split order) whatever T is (ordered.py: a token's sum must
    # not change with the batch), and each choice gathers its own rows, so no [T, k, D] array of terms is ever
    # a producer shared by k consumers that XLA might write out.
    def term(j: int) -> jax.Array:
        rows = y_MD[..., dest_TJ[:, j], :].astype(jnp.float32) * w_TJ[:, j, None]  # [(split,) T, D]
        if y_MD.ndim == 3:
            rows = ordered_sum(rows, axis=0)
        return rows if valid_TJ is None else jnp.where(valid_TJ[:, j, None], rows, 0.0)

    return functools.reduce(lambda acc, j: acc + term(j), range(1, dest_TJ.shape[1]), term(0))


def moe_pallas(h_TD: jax.Array, p: dict, *, top_k: int, routed_scaling: float, alpha: float, limit: float,
               tiles: MoeTiles | None = None, interpret: bool = False, layer: jax.Array | int | None = None,
               num_valid: jax.Array | None = None, router_logits: jax.Array | None = None,
               shared_mlp: Callable[..., jax.Array] = dense_mlp) -> jax.Array:
    """Same function as `reference.moe`. Uses `p["experts"]` (checkpoints/prepare.py) when present, a run's
    whole stack with `layer`; otherwise reads the params' own w_gate/w_up/w_down (no copies) and runs the shared
    expert through `dense_mlp`. Rows from `num_valid` on (a bucket's padding) are computed nowhere: their outputs
    are never read, and routed on their own they would stream up to k more experts each (a batch-1 decode padded
    to 8 tokens: up to 8 times the weight bytes). `router_logits`: computed by the caller
    (the batch-invariant path), else by XLA in `route`. `shared_mlp`: what runs a shared expert that is not a slot
    (its width differs from the routed experts'): `dense_mlp`'s signature (the batch-invariant path passes the
    linear kernel's)."""
    experts, shared_slot = experts_of(p)
    idx_TK, w_TK = route(h_TD, p["router"], p["router_bias"], top_k, router_logits)
    out = routed_experts_pallas(h_TD, idx_TK, w_TK, experts, shared_slot=shared_slot,
                                routed_scaling=routed_scaling, alpha=alpha, limit=limit, tiles=tiles,
                                interpret=interpret, layer=layer if "experts" in p else None, num_valid=num_valid)
    if "shared" in p and not shared_slot:
        s = p["shared"]
        out = out + shared_mlp(h_TD, s["w_gate"], s["w_up"], s["w_down"], alpha=alpha, limit=limit)
    return out.astype(h_TD.dtype)
