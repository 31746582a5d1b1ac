"""The small-M linear kernel (interpret mode) against its jnp reference, its tile table and dispatch, the
projections through `ops.project` (one device and sharded: column- and row-parallel) and several at once through
`ops.project_many`, and its GPU lowering at M3's per-shard projection shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.config import preset
from m3jax.params import layer_specs, param_specs
from m3jax.sharding import make_rules
from pallas_kernels import ops
from pallas_kernels.gpu_lowering import count_triton_kernels, lower_for_gpu
from pallas_kernels.linear import dispatch, kernel, reference
from pallas_kernels.linear.tiles import MAX_M, LinearTiles, pick_tiles


def _normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


@pytest.mark.parametrize("m,k,n,split", [(1, 256, 96, 1), (5, 256, 96, 2), (37, 512, 64, 4), (64, 128, 48, 1)])
def test_kernel_equals_reference(m, k, n, split):
    x, w = _normal(m, m, k), _normal(k, k, n)
    tiles = LinearTiles(bm=max(16, 1 << (m - 1).bit_length()), bn=16, bk=64, split=split)
    got = kernel.linear(x, w, tiles=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference.linear(x, w)), rtol=1e-5, atol=1e-4)
    # An N no tile divides is padded to whole tiles (a tiny model's router); a K none divides is refused.
    np.testing.assert_allclose(np.asarray(kernel.linear(x, w[:, :n - 8], tiles=tiles, interpret=True)),
                               np.asarray(reference.linear(x, w[:, :n - 8])), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.linear(x[:, :k - 8], w[:k - 8], tiles=tiles, interpret=True)


def test_tile_table():
    assert pick_tiles(MAX_M + 1, 6144, 1024) is None  # prefill sizes stay with XLA
    t = pick_tiles(1, 6144, 1024)  # q projection of one TP8 shard: 16 output tiles, split to fill the GPU
    assert (t.bm, t.bn, t.split) == (16, 64, 16) and 6144 % (t.bk * t.split) == 0
    assert pick_tiles(8, 3072, 6144).split == 4  # down-like: many output tiles, less split
    assert pick_tiles(3, 100, 64) is None  # no tile divides K
    assert dispatch.uses_kernel(8, 256, 64, "interpret") and not dispatch.uses_kernel(8, 256, 64, "reference")
    with pytest.raises(ValueError, match="resolve the KernelChoice"):
        dispatch.uses_kernel(8, 256, 64, "auto")


def test_projection_axes_are_the_params():
    """ops.PROJECTION_AXES, which places the kernel path's weights, says what m3jax/params.py declares."""
    cfg = preset("m3-tiny")
    spec = layer_specs(cfg, cfg.attn_types.index("sparse"))
    top = param_specs(cfg)
    for name, axes in ops.PROJECTION_AXES.items():
        if "." not in name:
            assert top[name].axes == axes, name
            continue
        group, key = name.split(".")
        assert spec[group][key].axes == axes, name


def test_project_and_dense_mlp_on_one_device():
    x, wq, wo = _normal(1, 6, 64), _normal(2, 64, 4, 16), _normal(3, 4, 16, 64)
    np.testing.assert_allclose(ops.project(x, wq, "attn.wq", impl="interpret"),
                               jnp.einsum("td,dhk->thk", x, wq), rtol=1e-5, atol=1e-4)
    o = _normal(4, 6, 4, 16)
    np.testing.assert_allclose(ops.project(o, wo, "attn.wo", impl="interpret"),
                               jnp.einsum("thk,hkd->td", o, wo), rtol=1e-5, atol=1e-4)
    g, u, d = _normal(5, 64, 96), _normal(6, 64, 96), _normal(7, 96, 64)
    want = ops.dense_mlp(x, g, u, d, alpha=1.702, limit=7.0)  # XLA
    got = ops.dense_mlp(x, g, u, d, alpha=1.702, limit=7.0, impl="interpret")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    big = _normal(8, MAX_M + 1, 64)  # XLA's GEMM: no kernel in the jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a: ops.project(a, wq, "attn.wq", impl="interpret"))(big))


def test_project_sharded_column_and_row_parallel():
    """Column-parallel q (heads split: each device its heads' columns) and row-parallel o (each device its
    heads' rows, partial outputs summed) and the dense MLP (F split) through the kernel per shard, under TP4."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    rules = make_rules(4)
    topo = rules.topology
    # On the mesh, as the model's operands are (the shard_maps bind to their devices).
    x, wq, wo, o = jax.device_put((_normal(1, 6, 64), _normal(2, 64, 8, 16), _normal(3, 8, 16, 64),
                                   _normal(4, 6, 8, 16)), rules.replicated())
    for name, a, w, eq in (("attn.wq", x, wq, "td,dhk->thk"), ("attn.wo", o, wo, "thk,hkd->td")):
        fn = jax.jit(lambda a, w, name=name: ops.project(a, w, name, impl="interpret", topology=topo))
        assert "pallas_call" in str(jax.make_jaxpr(fn)(a, w)) and "shard_map" in str(jax.make_jaxpr(fn)(a, w))
        np.testing.assert_allclose(fn(a, w), jnp.einsum(eq, a, w), rtol=1e-5, atol=1e-4)
    g, u, d = jax.device_put((_normal(5, 64, 128), _normal(6, 64, 128), _normal(7, 128, 64)), rules.replicated())
    got = jax.jit(lambda *a: ops.dense_mlp(*a, alpha=1.702, limit=7.0, impl="interpret", topology=topo))(x, g, u, d)
    np.testing.assert_allclose(got, ops.dense_mlp(x, g, u, d, alpha=1.702, limit=7.0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("split", [1, 2])
def test_weights_in_one_launch_equal_each_alone(split):
    """linear_many: every weight's columns in one grid, each output bitwise the single-weight kernel's at the
    same tiles (the same K order), an N no tile divides padded, a stacked weight read at its layer."""
    x = _normal(1, 3, 256)
    ws = [_normal(2, 256, 128), _normal(3, 256, 64), _normal(4, 256, 40)]
    tiles = LinearTiles(bm=16, bn=32, bk=64, split=split)
    for got, w in zip(kernel.linear_many(x, ws, tiles=tiles, interpret=True), ws, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(kernel.linear(x, w, tiles=tiles, interpret=True)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(reference.linear(x, w)), rtol=1e-5, atol=1e-4)
    stacks = [jnp.stack([w, 2 * w]) for w in ws]
    for got, w in zip(kernel.linear_many(x, stacks, tiles=tiles, interpret=True, layer=jnp.int32(1)), ws, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(reference.linear(x, 2 * w)), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.linear_many(x, [ws[0], _normal(5, 128, 64)], tiles=tiles, interpret=True)


def test_project_many_is_one_launch_where_one_tile_set_fits():
    """ops.project_many, as the attention layer calls it (q, k, v, index q, index k of one input): one kernel
    launch on one device and in one shard_map per device under TP4 (q's heads split, the 2 KV heads and the
    index's key replicated), equal to the einsums; a launch per weight where no tile set fits them all, and XLA
    above the small-M rows."""
    x = _normal(1, 6, 64)
    wq, wk, wv, iwq, iwk = _normal(2, 64, 8, 16), _normal(3, 64, 2, 16), _normal(4, 64, 2, 16), \
        _normal(5, 64, 2, 16), _normal(6, 64, 16)
    weights = [(wq, "attn.wq"), (wk, "attn.wk"), (wv, "attn.wv"), (iwq, "index.wq"), (iwk, "index.wk")]
    eqs = ["td,dhk->thk"] * 4 + ["td,dk->tk"]

    def check(fn, a, launches):
        ws = [w for w, _ in weights]
        assert str(jax.make_jaxpr(fn)(a, *ws)).count("pallas_call") == launches
        for got, w, eq in zip(fn(a, *ws), ws, eqs, strict=True):
            np.testing.assert_allclose(got, jnp.einsum(eq, a, w), rtol=1e-5, atol=1e-4)

    def many(**kw):
        return jax.jit(lambda a, *ws: ops.project_many(a, [(w, n) for w, (_, n) in zip(ws, weights, strict=True)],
                                                       impl="interpret", **kw))

    check(many(), x, 1)
    check(many(), _normal(7, MAX_M + 1, 64), 0)
    if len(jax.devices()) >= 4:
        rules = make_rules(4)
        x = jax.device_put(x, rules.replicated())
        weights = [(jax.device_put(w, rules.replicated()), n) for w, n in weights]
        fn = many(topology=rules.topology)
        assert "shard_map" in str(jax.make_jaxpr(fn)(x, *[w for w, _ in weights]))
        check(fn, x, 1)
    # A weight the kernel does not take (8 columns: no tile divides them): each as `project` runs it.
    narrow = _normal(8, 64, 8)
    fn = jax.jit(lambda a: ops.project_many(a, [(wq, "attn.wq"), (narrow, "index.wk")], impl="interpret"))
    assert str(jax.make_jaxpr(fn)(x)).count("pallas_call") == 1
    np.testing.assert_allclose(fn(x)[1], x @ narrow, rtol=1e-5, atol=1e-4)


def test_stacked_weights_read_in_place():
    """A layer scan hands the ops its whole weight stack and the layer (model.IN_PLACE): the kernel reads that
    layer's rows, equal to the sliced weight, with the layer traced (one executable for every layer), on one
    device and per shard under TP4."""
    x, o = _normal(1, 6, 64), _normal(4, 6, 8, 16)
    wq, wo = _normal(2, 3, 64, 8, 16), _normal(3, 3, 8, 16, 64)
    g, u, d = _normal(5, 3, 64, 128), _normal(6, 3, 64, 128), _normal(7, 3, 128, 64)
    topos = [None]
    if len(jax.devices()) >= 4:
        rules = make_rules(4)
        x, o, wq, wo, g, u, d = jax.device_put((x, o, wq, wo, g, u, d), rules.replicated())
        topos.append(rules.topology)
    for topo in topos:
        kw = {} if topo is None else {"topology": topo}
        q_fn = jax.jit(lambda a, w, j, kw=kw: ops.project(a, w, "attn.wq", impl="interpret", layer=j, **kw))
        o_fn = jax.jit(lambda a, w, j, kw=kw: ops.project(a, w, "attn.wo", impl="interpret", layer=j, **kw))
        mlp_fn = jax.jit(lambda *a, kw=kw: ops.dense_mlp(*a[:4], alpha=1.702, limit=7.0, impl="interpret",
                                                         layer=a[4], **kw))
        for j in range(3):
            j_ = jnp.int32(j)
            np.testing.assert_allclose(q_fn(x, wq, j_), jnp.einsum("td,dhk->thk", x, wq[j]), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(o_fn(o, wo, j_), jnp.einsum("thk,hkd->td", o, wo[j]), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(mlp_fn(x, g, u, d, j_), ops.dense_mlp(x, g[j], u[j], d[j], alpha=1.702,
                                                                            limit=7.0), rtol=1e-5, atol=1e-4)
        assert "pallas_call" in str(jax.make_jaxpr(q_fn)(x, wq, jnp.int32(0)))
    # XLA's GEMM (M > 64) takes the layer's slice.
    big = _normal(8, MAX_M + 1, 64)
    np.testing.assert_allclose(ops.project(big, wq, "attn.wq", impl="interpret", layer=2),
                               jnp.einsum("td,dhk->thk", big, wq[2]), rtol=1e-5, atol=1e-4)


def test_scanned_layers_do_not_copy_the_projection_weights():
    """Lowered for the GPU, a scan over stacked projection weights passes the stack to the kernel as it is: no
    copy of a layer's weight (a dynamic-slice feeding the custom call) in the compiled loop."""
    w = jnp.zeros((4, 1024, 512), jnp.bfloat16)
    x = jnp.zeros((1, 1024), jnp.bfloat16)

    def scanned(x, w):
        def body(h, j):
            return h, ops.project(h, w, "index.wk", impl="pallas", layer=j)
        return jax.lax.scan(body, x, jnp.arange(4, dtype=jnp.int32))[1]

    hlo = lower_for_gpu(scanned, x, w)
    assert count_triton_kernels(hlo) >= 1
    assert not [ln for ln in hlo.splitlines() if "dynamic_slice" in ln and "bf16" in ln]  # (the scan's own i32 slice)


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_m3_shard_projections_lower_for_the_gpu(tp):
    """Each of M3's projections at one device's shard of TP1 / TP4 / TP8, at decode sizes, lowers to the Triton
    kernel (bf16)."""
    cfg = preset("m3-full")
    D, H, K, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dense_intermediate_size
    shapes = [(D, H * hd // tp), (D, max(1, K // tp) * hd), (H * hd // tp, D), (D, F // tp), (F // tp, D),
              (D, max(1, K // tp) * cfg.index_head_dim), (D, cfg.index_head_dim)]
    for m in (1, 32, 64):
        for k, n in shapes:
            t = pick_tiles(m, k, n)
            assert t is not None, (m, k, n)
            text = lower_for_gpu(lambda x, w, t=t: kernel.linear(x, w, tiles=t),
                                 jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
            assert count_triton_kernels(text) == 1
        # The layer's projections of h in one launch, as ops.project_many runs them.
        ns = [shapes[0][1], shapes[1][1], shapes[1][1], shapes[5][1], shapes[6][1]]
        t = dispatch.tiles_for_many(m, D, ns, "pallas")
        assert t is not None, (m, ns)
        text = lower_for_gpu(lambda x, *ws, t=t: kernel.linear_many(x, list(ws), tiles=t),
                             jax.ShapeDtypeStruct((m, D), jnp.bfloat16),
                             *[jax.ShapeDtypeStruct((D, n), jnp.bfloat16) for n in ns])
        assert count_triton_kernels(text) == 1
