"""The batch-invariant kernel mode (`KernelChoice.batch_invariant`, `--batch-invariant`): every op family runs one
tile configuration whatever the step's token and row counts, so a row's arithmetic never depends on the batch.
What CI can check: the tile tables ignore the batch, the multi-block linear kernel and the whole forward in this
mode equal the references, and the engine serves with it exactly. Whether the GPU then gives bitwise-equal greedy
tokens is measured on the GPU (benchmarks/bench_invariance.py, docs/benchmarks.md)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.api import M3Model
from m3jax.config import preset
from m3jax.params import random_params
from pallas_kernels.attention import tuning
from pallas_kernels.choice import KernelChoice
from pallas_kernels.linear import dispatch as linear_dispatch
from pallas_kernels.linear.tiles import pick_tiles
from pallas_kernels.moe.tiles import fill_shard, invariant_tiles

# (tokens, rows) of steps an engine runs: pure decode at several batch sizes, prefill chunks, mixed steps.
STEPS = [(1, 1), (8, 8), (32, 32), (128, 128), (64, 2), (256, 16), (2048, 32), (8192, 1), (8192, 128)]


def test_invariant_tiles_ignore_the_batch():
    for pages, heads in [(8, 4), (64, 16), (1024, 16)]:
        dense = {tuning.dense_tiles(t, r, pages, 4, heads, invariant=True) for t, r in STEPS}
        index = {tuning.index_tiles(t, r, pages, 4, invariant=True) for t, r in STEPS}
        sparse = {tuning.sparse_tiles(t, r, 16, heads, invariant=True) for t, r in STEPS}
        assert len(dense) == len(index) == len(sparse) == 1
        assert next(iter(dense)).pages_per_split >= pages  # never split: one program walks a row's keys in order
        assert next(iter(index)).topk == "pallas"
        # Which loop body scores a page must not depend on the query block's other tokens (padding joins the
        # last request's run at position 0): every page through the masked one.
        assert next(iter(dense)).mask_every_page and next(iter(index)).mask_every_page
    # The tables without the flag do change with the batch: what the mode exists to avoid.
    assert len({tuning.dense_tiles(t, r, 64, 4, 16) for t, r in STEPS}) > 1
    for k, n in [(6144, 8192), (8192, 6144), (6144, 128), (6144, 200064), (6144, 16), (128, 16)]:
        tiles = [pick_tiles(m, k, n, invariant=True) for m in (1, 3, 64, 65, 255, 256, 4096, 8192)]
        # Each element's K order (the K step and the split) comes from K and N alone; only the output tile may
        # widen with M (INVARIANT_WIDE_M), and never for the narrow fp32 sums (router, norms).
        assert len({(t.bk, t.split) for t in tiles}) == 1
        assert len(set(tiles)) == (2 if n > 128 else 1)
    for k, n in [(128, 16), (256, 16), (6144, 16), (6144, 8192)]:  # a split runs two K steps or more (tiles.py)
        t = pick_tiles(1, k, n, invariant=True)
        assert t.split == 1 or k // t.bk // t.split >= 2
    assert pick_tiles(4096, 6144, 8192) is None  # without the flag, prefill sizes are XLA's
    for fmt in ("dense", "mxfp8", "mxfp4"):
        tiles = [invariant_tiles(fmt, t) for t, _ in STEPS]
        # The tiles may change with the token count only in what leaves a row's sum alone on the device (one
        # Triton MMA sequence per element, checked by benchmarks/check_moe_invariance.py): block height, N tile,
        # K step. No K split, one MX widening, 32-row MX pieces.
        assert len({(t.mx_mode, t.mx_rows, t.backend) for t in tiles}) == 1
        assert all(t.gu.split == t.dn.split == 1 and t.mx_rows == 32 for t in tiles)
        assert invariant_tiles(fmt, 1).bm == 16  # decode's blocks, not the mid entry's taller ones
        for t in tiles:
            assert fill_shard(t, 5, 6144, 384) == t  # a narrow shard's fill would split K by the block count


@pytest.mark.parametrize("m", [1, 17, 64, 65, 130, 300])
def test_linear_kernel_any_rows(m):
    """The invariant tiles take any M in row blocks (grouped launch order), equal to XLA's dot, and a row's result
    is bitwise the same whatever M is, the wide tiles of M >= INVARIANT_WIDE_M included."""
    key = jax.random.key(m)
    x = jax.random.normal(key, (300, 256), jnp.float32)
    w = jax.random.normal(jax.random.fold_in(key, 1), (256, 256), jnp.float32)
    assert (pick_tiles(m, 256, 256, invariant=True).bm == 128) == (m >= 256)
    got = linear_dispatch.linear(x[:m], w, impl="interpret", invariant=True)
    np.testing.assert_allclose(got, x[:m] @ w, rtol=1e-5, atol=1e-4)
    one = linear_dispatch.linear(x[:1], w, impl="interpret", invariant=True)
    np.testing.assert_array_equal(np.asarray(got[:1]), np.asarray(one))


def test_linear_split_inside_or_across_programs_is_the_same_sum(monkeypatch):
    """The invariant tiles' K split runs across programs at few rows and inside each program at many (where the
    grid is full without it): the same partials added in the same order, so a row's bits do not move between
    the two. (Fewer multiprocessors make 130 rows count as many.)"""
    from pallas_kernels.linear import kernel as linear_kernel
    monkeypatch.setattr(linear_kernel, "NUM_SMS", 4)
    key = jax.random.key(3)
    x = jax.random.normal(key, (130, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (256, 192), jnp.bfloat16)
    tiles = pick_tiles(130, 256, 192, invariant=True)
    assert tiles.split > 1
    assert linear_kernel._in_program(tiles, 3, 192 // tiles.bn) and not linear_kernel._in_program(tiles, 1, 1)
    many = linear_dispatch.linear(x, w, impl="interpret", invariant=True)
    one = linear_dispatch.linear(x[:1], w[:, :64], impl="interpret", invariant=True)
    np.testing.assert_array_equal(np.asarray(many[:1, :64]), np.asarray(one))
    np.testing.assert_allclose(np.asarray(many, np.float32), np.asarray(x @ w, np.float32), rtol=2e-2, atol=0.1)


@pytest.mark.parametrize("x_dtype,w_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16),
                                             (jnp.float32, jnp.float32)])
def test_fp32_linear_through_bf16_pieces(x_dtype, w_dtype):
    """The router and the norms' sums (`linear_fp32`): fp32 operands as bf16 pieces whose sum is exact, one bf16
    GEMM on the invariant tiles. As close to full-fp32 products as fp32 accumulation allows (XLA's default fp32
    GEMM on the GPU, TF32, is a thousand times coarser), and a row's bits do not move with M."""
    key = jax.random.key(7)
    w32 = jax.random.normal(jax.random.fold_in(key, 1), (256, 128), jnp.float32) / 16
    assert all(p.dtype == jnp.bfloat16 for p in linear_dispatch.bf16_pieces(w32))
    assert bool(jnp.all(sum(p.astype(jnp.float32) for p in linear_dispatch.bf16_pieces(w32)) == w32))
    x = jax.random.normal(key, (70, 256), jnp.float32).astype(x_dtype)
    w = w32.astype(w_dtype)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    rows = {m: np.asarray(linear_dispatch.linear_fp32(x[:m], w, impl="interpret")) for m in (1, 3, 70)}
    assert rows[70].dtype == np.float32
    np.testing.assert_allclose(rows[70], exact, rtol=0, atol=2e-6 * np.abs(exact).max())
    for m in (3, 70):
        np.testing.assert_array_equal(rows[m][:1], rows[1])
    # Where no tile fits, XLA's full-precision GEMM.
    narrow = np.asarray(x[:2, :100], np.float64) @ np.asarray(w[:100], np.float64)
    np.testing.assert_allclose(linear_dispatch.linear_fp32(x[:2, :100], w[:100], impl="interpret"), narrow,
                               rtol=1e-6, atol=1e-6)


def test_ordered_sum_adds_in_index_order_at_every_shape():
    """ordered_sum is ((x0 + x1) + x2) + ... per element, however many rows share the call: 1e8 + 1 rounds back
    to 1e8 in fp32, so this row sums to 0 in index order and to 1 in any order that adds 1e8 - 1e8 first."""
    from pallas_kernels.ordered import ordered_sum
    row = jnp.array([1e8, 1.0, -1e8, 0.5], jnp.float32)
    for rows in (1, 3, 1000):
        got = jax.jit(lambda x: ordered_sum(x, axis=1))(jnp.tile(row, (rows, 1)))
        np.testing.assert_array_equal(np.asarray(got), np.full(rows, 0.5, np.float32))
    x = jnp.tile(row[:, None, None], (1, 5, 2))  # a leading axis, as the linear kernel's split partials
    np.testing.assert_array_equal(np.asarray(ordered_sum(x, axis=0)), np.full((5, 2), 0.5, np.float32))


# m3-tiny widened so that the kernels' tiles divide it (as tests/test_sharding.py does).
CFG = preset("m3-tiny").replace(num_heads=8, num_kv_heads=4, index_num_heads=4, moe_intermediate_size=128,
                                shared_intermediate_size=128)
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 48)).astype(np.int32)


def test_invariant_forward_equals_reference():
    host = random_params(CFG, seed=7, scale=1.5)
    want = M3Model.create(CFG, host).logits(TOKENS)
    choice = KernelChoice("interpret", "interpret", batch_invariant=True)
    model = M3Model.create(CFG, host, kernels=choice)
    assert model.kernels.batch_invariant
    got = model.logits(TOKENS)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_engine_serves_batch_invariant_exactly(monkeypatch):
    """`batch_invariant=True` through the whole engine (interpret kernels): greedy tokens batched and chunked equal
    each request alone, and the setting reaches the compiled step, with XLA's excess precision off (the source
    the H100 bisection found last: KernelChoice.compiler_options)."""
    from serving import LLM, SamplingParams

    assert KernelChoice("pallas", "pallas").compiler_options is None
    options, jit = [], jax.jit

    def recording_jit(fun, *args, **kwargs):
        options.append((getattr(getattr(fun, "func", fun), "__name__", ""), kwargs.get("compiler_options")))
        return jit(fun, *args, **kwargs)

    monkeypatch.setattr(jax, "jit", recording_jit)

    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(10, 40, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    with LLM(model="m3-tiny", dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
             attention_kernels="interpret", moe_kernels="interpret", batch_invariant=True, progress=False,
             enable_compilation_cache=False) as llm:
        assert llm.core.runner.model.kernels.batch_invariant
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone and all(len(t) == 6 for t in batched)
    steps = [o for name, o in options if name in ("forward", "_forward")]
    assert steps and all(o == {"xla_allow_excess_precision": False} for o in steps), options


def test_speculation_under_the_flag_is_exact():
    """Speculative steps verify 1 + k rows per request through the same invariant tiles: with the embedded draft,
    ragged batches, chunked prefill and a pool small enough to preempt, greedy tokens equal those without
    speculation (interpret-mode kernels)."""
    import json

    from serving import LLM, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 2000, int(n)).tolist() for n in rng.integers(8, 40, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(n)) for n in rng.integers(8, 20, 5)]
    kw = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_pages=9,
              attention_kernels="interpret", moe_kernels="interpret", batch_invariant=True, progress=False,
              enable_compilation_cache=False, warmup=False)
    with LLM(**kw) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(**kw, speculative_config=json.dumps({"method": "eagle3", "num_speculative_tokens": 2})) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = dict(llm.core.stats)
    assert got == want
    assert stats["preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0


def test_flag_is_part_of_the_step_identity():
    """Two choices that differ only in the flag are different static arguments (different executables)."""
    a, b = KernelChoice("pallas", "pallas"), KernelChoice("pallas", "pallas", batch_invariant=True)
    assert a != b and hash(a) != hash(b)
    assert len(set(itertools.chain([a, b, a]))) == 2


def test_forward_rows_bitwise_invariant_with_the_flag():
    """The whole forward with the flag (interpret-mode kernels on the CPU): a request's residual stream at every
    layer, its final hidden state and its MSA selections are bitwise the same alone, next to another prompt,
    cut into chunks, padded as the engine pads, and as a decode row among others or beside a prefill chunk
    (benchmarks/bisect_invariance.py, which found the RMS norms' XLA reduction, the unmasked-page loop, the
    unstacked shared expert and an untileable router regrouping rows with the batch)."""
    from benchmarks.bisect_invariance import bisect
    from checkpoints.prepare import prepare_params
    from m3jax.params import init_params

    cfg = preset("m3-tiny")
    params = prepare_params(init_params(cfg, dtype=jnp.float32), "bf16", keep_reference=False)
    choice = KernelChoice("interpret", "interpret", batch_invariant=True)
    results = bisect(cfg, params, choice, jnp.float32, prompt_len=40, other_len=30, decode_rows=4,
                     big_bucket=128)
    for name, r in results.items():
        assert r["first_layer_whose_input_differs"] is None and r["hidden_max_abs_diff"] == 0.0, (name, r)
        assert not any(r["selection_rows_differing_by_layer"].values()), (name, r)
        assert all(d["max_abs_diff"] == 0.0 for d in r.get("last_layer", {}).values()), (name, r)
    pieces = set(results["decode_beside_prefill"]["last_layer"])
    assert {"attn", "block_scores", "mlp", "expert_rows", "combined"} <= pieces
