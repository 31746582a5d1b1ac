"""The model against itself: prefill + decode = full forward on the paged ragged batch, chunked prefill, MSA
degenerating to dense attention when every block fits in the top-k, selection dropping blocks on long inputs,
cross-layer top-k reuse."""

import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.api import M3Model
from m3jax.batch import RowPlan, build_batch
from m3jax.config import preset
from m3jax.params import random_params
from pallas_kernels.attention.reference import dense_causal_attention
from pallas_kernels.msa.reference import block_sparse_attention, select_blocks

CFG = preset("m3-tiny")
PS = CFG.index_block_size


@pytest.fixture(scope="module")
def model():
    return M3Model.create(CFG, random_params(CFG, seed=1, scale=1.5))


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, shape).astype(np.int32)


def test_ragged_prefill_then_decode_equals_full_forward(model):
    """Two requests of different prompt lengths prefilled in one batch, then decoded side by side."""
    lens, total = [90, 57], 100
    toks = _tokens(0, (2, total))
    full = [model.logits(toks[b:b + 1])[0] for b in range(2)]
    width = -(-total // PS)
    pages = [list(range(1 + width * b, 1 + width * (b + 1)))[::-1] for b in range(2)]  # scattered pages
    kv = model.new_pages(1 + 2 * width)
    batch, idx = build_batch([RowPlan(toks[b, :n].tolist(), 0, pages[b]) for b, n in enumerate(lens)],
                             PS, 160, 2, width)
    out = model.step(kv, batch)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(out.logits[idx[b]]), full[b][n - 1], rtol=1e-4, atol=1e-4)
    for i in range(total - max(lens)):
        rows = [RowPlan([int(toks[b, n + i])], n + i, pages[b]) for b, n in enumerate(lens)]
        batch, idx = build_batch(rows, PS, 2, 2, width)
        out = model.step(out.kv, batch)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(out.logits[idx[b]]), full[b][n + i], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_mixed_with_decode(model):
    """A prefill split into chunks that share steps with another request's decode tokens."""
    a, b = _tokens(1, (1, 120))[0], _tokens(2, (1, 40))[0]
    full_a, full_b = model.logits(a[None])[0], model.logits(b[None])[0]
    width = -(-120 // PS)
    pa, pb = list(range(1, 1 + width)), list(range(1 + width, 1 + 2 * width))
    kv = model.new_pages(1 + 2 * width)
    batch, _ = build_batch([RowPlan(b[:30].tolist(), 0, pb)], PS, 64, 2, width)
    kv = model.step(kv, batch).kv
    got_a = []
    for step, (s, e) in enumerate(((0, 33), (33, 80), (80, 120))):
        rows = [RowPlan(a[s:e].tolist(), s, pa, sample=e == 120), RowPlan([int(b[30 + step])], 30 + step, pb)]
        batch, idx = build_batch(rows, PS, 64, 2, width)
        batch.logit_rows = jnp.arange(64, dtype=jnp.int32)  # every row's logits, to compare the whole chunk
        out = model.step(kv, batch)
        kv = out.kv
        got_a.append(np.asarray(out.logits[: e - s]))
        np.testing.assert_allclose(np.asarray(out.logits[e - s]), full_b[30 + step], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(got_a), full_a, rtol=1e-4, atol=1e-4)


def test_selection_drops_blocks_on_long_inputs(model):
    sel = model.block_selections(_tokens(3, (1, 200)))
    assert set(sel) == set(CFG.sparse_layers)
    for blocks in sel.values():
        b = blocks[0]  # [K, T, N]
        last = b[:, -1]
        assert (last >= 0).all(), "a query 12 blocks deep must fill all top-k slots"
        assert len(set(last[0])) == CFG.index_topk_blocks
        assert (last == 199 // PS).any(axis=-1).all(), "the local block is always kept"
        assert (b[:, 0] == -1).sum(axis=-1).tolist() == [CFG.index_topk_blocks - 1] * CFG.num_kv_heads


def test_msa_equals_dense_when_everything_fits():
    rng = np.random.default_rng(3)
    B, T, H, K, D, S = 2, 24, 4, 2, 16, 24
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, S, K, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, S, K, D)), jnp.float32)
    iq = jnp.asarray(rng.normal(size=(B, T, K, D)), jnp.float32)
    ik = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    blocks = select_blocks(iq, ik, pos, block_size=8, topk=3, local_blocks=1)
    sparse = block_sparse_attention(q, k, v, pos, blocks, block_size=8, scale=0.25)
    dense = dense_causal_attention(q, k, v, pos, scale=0.25)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), rtol=1e-6, atol=1e-6)
    blocks2 = select_blocks(iq, ik, pos, block_size=4, topk=2, local_blocks=1)
    sparse2 = block_sparse_attention(q, k, v, pos, blocks2, block_size=4, scale=0.25)
    assert not np.allclose(np.asarray(sparse2), np.asarray(dense), atol=1e-3)


def test_select_blocks_matches_bruteforce():
    rng = np.random.default_rng(4)
    B, T, K, D, S, bs, topk = 1, 40, 2, 8, 40, 4, 3
    iq = rng.normal(size=(B, T, K, D)).astype(np.float32)
    ik = rng.normal(size=(B, S, D)).astype(np.float32)
    pos = np.arange(T, dtype=np.int32)[None]
    got = np.asarray(select_blocks(jnp.asarray(iq), jnp.asarray(ik), jnp.asarray(pos), block_size=bs, topk=topk,
                                   local_blocks=1))
    for g in range(K):
        for t in range(T):
            nvis = t // bs + 1
            scores = [max(float(iq[0, t, g] @ ik[0, s]) for s in range(b * bs, min((b + 1) * bs, t + 1)))
                      for b in range(nvis)]
            scores[nvis - 1] = np.inf
            want = sorted(np.argsort(scores)[::-1][:min(topk, nvis)].tolist())
            row = got[0, g, t]
            assert sorted(row[row >= 0].tolist()) == want
            assert (row[min(topk, nvis):] == -1).all()


def test_cross_layer_topk_reuse():
    host = random_params(CFG, seed=1, scale=1.5)
    toks = _tokens(5, (1, 150))
    base = M3Model.create(CFG, host).block_selections(toks)
    reused_model = M3Model.create(CFG.replace(index_topk_freq=2), host)
    reused = reused_model.block_selections(toks)
    s0, s1, s2 = CFG.sparse_layers
    # Sparse ordinals 0 and 2 select; ordinal 1 reuses ordinal 0's selection.
    np.testing.assert_array_equal(reused[s1], reused[s0])
    np.testing.assert_array_equal(reused[s0], base[s0])
    assert not np.array_equal(base[s1], base[s0])
    assert np.isfinite(reused_model.logits(toks)).all()


def test_bad_token_ids_are_refused(model):
    with pytest.raises(ValueError, match="token ids must lie"):
        model.logits([[0, CFG.vocab_size]])
    with pytest.raises(ValueError, match="non-empty"):
        model.logits(np.zeros((1, 0), np.int32))
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(model.generate_greedy([1, 2], 0))


def test_generate_greedy_matches_argmax_of_full_forward(model):
    prompt = _tokens(6, (20,)).tolist()
    got = list(model.generate_greedy(prompt, 12))
    full = model.logits([prompt + got])[0]  # teacher-forced: each generated token is the argmax before it
    assert got == np.argmax(full[len(prompt) - 1:-1], axis=-1).tolist()


def test_scanned_layers_equal_unrolled_ones_and_capture_layer_inputs(model):
    """The scans over stacked layers compute what a Python loop over the same layers computes, and `capture`
    returns each named layer's input residual stream (layer 0's is the embedding)."""
    import jax

    from m3jax.model import forward

    toks = _tokens(7, (1, 70))[0]
    batch, _ = build_batch([RowPlan(toks.tolist(), 0, range(1, 6), sample=False)], PS, 72, 1, 5)
    batch.logit_rows = np.arange(70, dtype=np.int32)
    step = jax.jit(forward, static_argnums=(1, 4, 5, 6))
    scanned = step(model.params, CFG, model.new_pages(6), batch, model.kernels, False, (0, 2, 3))
    unrolled = step(model.params, CFG, model.new_pages(6), batch, model.kernels, True, (0, 2, 3))
    np.testing.assert_allclose(np.asarray(scanned.logits), np.asarray(unrolled.logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(scanned.aux_hidden), np.asarray(unrolled.aux_hidden), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(scanned.aux_hidden[0, :70]), np.asarray(model.params["embed"])[toks])
    np.testing.assert_allclose(np.asarray(scanned.logits), model.logits(toks[None])[0], rtol=1e-5, atol=1e-5)


def test_query_blocks_are_computed_once_per_step(model, monkeypatch, query_blocks_computed):
    """The attention ops' query-block metadata (a function of token_row and positions alone) is computed once per
    step, before the layer scans, never inside a layer: on the GPU XLA does not hoist it out of a scan, and every
    attention layer would pay ~20 small kernels for it (benchmarks/check_hoisting.py)."""
    import contextlib

    import jax

    from m3jax.model import forward
    from pallas_kernels import ops
    from pallas_kernels.attention import ragged
    from pallas_kernels.choice import KernelChoice

    kernels = KernelChoice("interpret", "reference").resolve()
    toks = _tokens(8, (1, 40))[0]  # a prefill chunk beside a decode row: query blocks of several tokens
    batch, _ = build_batch([RowPlan(toks.tolist(), 0, range(1, 4)), RowPlan([5], 60, range(4, 9))], PS, 48, 2, 5)
    computed = query_blocks_computed

    def trace() -> list[int]:
        computed.clear()
        # A new function each time: jax caches a function's trace.
        jax.make_jaxpr(lambda p, kv, b: forward(p, CFG, kv, b, kernels))(model.params, model.new_pages(9), batch)
        return list(computed)

    # The step's copies, one per block size, and nothing from the ops.
    assert sorted(trace()) == sorted(ragged.STEP_BLOCK_SIZES)
    # Without them the ops compute their own, in every attention layer (once per scan body as traced).
    monkeypatch.setattr(ops, "step_query_blocks", lambda *a, **k: contextlib.nullcontext())
    per_layer = trace()
    assert len(per_layer) >= len(CFG.layer_runs), per_layer
