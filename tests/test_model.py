"""The model against itself: prefill + decode = full forward, MSA degenerates to dense attention when every
block fits in the top-k, selection really drops blocks on long inputs, cross-layer top-k reuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.config import preset
from m3jax.model import KVState, forward
from m3jax.params import random_params
from pallas_kernels.attention.reference import dense_causal_attention
from pallas_kernels.msa.reference import block_sparse_attention, select_blocks

CFG = preset("m3-tiny")


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(CFG, seed=1, scale=1.5))


def _full(params, cfg, toks):
    return forward(params, cfg, jnp.asarray(toks), KVState.empty(cfg, toks.shape[0], toks.shape[1], jnp.float32))


def test_prefill_then_decode_equals_full_forward_ragged(params):
    rng = np.random.default_rng(0)
    lens = [90, 57]  # ragged prompts, decoded side by side
    total = 100
    toks = rng.integers(0, CFG.vocab_size, (2, total)).astype(np.int32)
    full = [np.asarray(_full(params, CFG, toks[b:b + 1]).logits[0]) for b in range(2)]

    step = jax.jit(forward, static_argnums=(1,))
    prompt = np.zeros((2, max(lens)), np.int32)
    for b, n in enumerate(lens):
        prompt[b, :n] = toks[b, :n]
    out = step(params, CFG, jnp.asarray(prompt), KVState.empty(CFG, 2, 128, jnp.float32),
               jnp.asarray([n - 1 for n in lens]))
    kv = out.kv
    kv.lengths = jnp.asarray(lens, jnp.int32)  # padding slots are overwritten by the decoded tokens
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(out.logits[b, 0]), full[b][n - 1], rtol=1e-4, atol=1e-4)
    for i in range(total - max(lens)):
        nxt = np.array([[toks[b, n + i]] for b, n in enumerate(lens)], np.int32)
        out = step(params, CFG, jnp.asarray(nxt), kv)
        kv = out.kv
        for b, n in enumerate(lens):
            np.testing.assert_allclose(np.asarray(out.logits[b, 0]), full[b][n + i], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_full_forward(params):
    toks = np.random.default_rng(1).integers(0, CFG.vocab_size, (1, 120)).astype(np.int32)
    full = np.asarray(_full(params, CFG, toks).logits[0])
    kv = KVState.empty(CFG, 1, 128, jnp.float32)
    got = []
    for a, b in ((0, 33), (33, 80), (80, 120)):
        out = forward(params, CFG, jnp.asarray(toks[:, a:b]), kv)
        kv = out.kv
        got.append(np.asarray(out.logits[0]))
    np.testing.assert_allclose(np.concatenate(got), full, rtol=1e-4, atol=1e-4)


def test_selection_drops_blocks_on_long_inputs(params):
    toks = np.random.default_rng(2).integers(0, CFG.vocab_size, (1, 200)).astype(np.int32)
    sel = _full(params, CFG, toks).selections
    assert set(sel) == set(CFG.sparse_layers)
    for blocks in sel.values():
        b = np.asarray(blocks)[0]  # [K, T, N]
        last = b[:, -1]
        assert (last >= 0).all(), "a query 12 blocks deep must fill all top-k slots"
        assert len(set(last[0])) == CFG.index_topk_blocks
        assert ((199 // CFG.index_block_size) == last).any(axis=-1).all(), "the local block is always kept"
        # Early queries see fewer blocks than top-k: -1 padding.
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
    # With fewer top-k slots than visible blocks the outputs must differ.
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


def test_cross_layer_topk_reuse(params):
    toks = np.random.default_rng(5).integers(0, CFG.vocab_size, (1, 150)).astype(np.int32)
    base = _full(params, CFG, toks)
    reuse_cfg = CFG.replace(index_topk_freq=2)
    reused = _full(params, reuse_cfg, toks)
    s0, s1, s2 = CFG.sparse_layers
    # Sparse layer ordinals 0 and 2 select; ordinal 1 reuses ordinal 0's selection.
    np.testing.assert_array_equal(np.asarray(reused.selections[s1]), np.asarray(reused.selections[s0]))
    np.testing.assert_array_equal(np.asarray(reused.selections[s0]), np.asarray(base.selections[s0]))
    assert not np.array_equal(np.asarray(base.selections[s1]), np.asarray(base.selections[s0]))
    assert np.isfinite(np.asarray(reused.logits)).all()
