"""Every attention-family and MoE op lowers for the GPU (the Pallas Triton lowering, on the CPU) at any engine size.

The Triton lowering refuses an array inside a kernel whose size is not a power of two, and the engine's sizes
are whatever the deployment makes them: the page-table width P = ceil(max_model_len / page_size), token counts
T of any bucket, R request rows, the top-k. `pallas_kernels.gpu_lowering.lower_for_gpu` runs that lowering
for an abstract H200 on abstract inputs (nothing is compiled or run, so M3's real head shapes cost nothing to
lower), and each op must both lower and contain Triton custom calls: the kernel path, not a jnp fallback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from m3jax.config import preset
from pallas_kernels.attention import dispatch as attn
from pallas_kernels.attention import tuning
from pallas_kernels.attention.kv_write import write_pages_pallas
from pallas_kernels.gpu_lowering import count_triton_kernels, lower_for_gpu
from pallas_kernels.moe import dispatch as moe_dispatch
from pallas_kernels.moe import layout

CFG = preset("m3-full")
PS, HD, K = CFG.index_block_size, CFG.head_dim, CFG.num_kv_heads  # page size = MSA block size
H, DI, TOPK = CFG.num_heads, CFG.index_head_dim, CFG.index_topk_blocks
E, TOP_K, D, F = CFG.num_experts, CFG.num_experts_per_tok, CFG.hidden_size, CFG.moe_intermediate_size
NUM_PAGES = 4099  # the pool size never reaches a kernel's register tiles: any number
SCALE = HD ** -0.5


def _sds(shape: tuple[int, ...], dtype: jnp.dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _double(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def test_lowering_enforces_power_of_two_arrays():
    """The helper runs the real Triton lowering on the CPU: a (16,) kernel lowers to one Triton call, a (10,) one
    raises what the GPU would raise (so the tests below cannot pass vacuously). Jitted functions keep their
    static arguments; concrete arrays are taken for their shapes."""
    assert count_triton_kernels(lower_for_gpu(_double, jnp.zeros(16))) == 1
    with pytest.raises(ValueError, match="power of 2"):
        lower_for_gpu(_double, _sds((10,), jnp.float32))
    twice = jax.jit(lambda x, n: functools.reduce(lambda y, _: _double(y), range(n), x), static_argnums=1)
    assert count_triton_kernels(lower_for_gpu(twice, _sds((8, 32), jnp.bfloat16), 2)) == 2


def test_m3_shapes_take_the_kernel_path():
    """The dims `dispatch._kernel_mode` requires to be powers of two are, for M3: none of these ops may fall
    back to the reference, so a test that finds no Triton call is a real failure."""
    assert (PS, HD, DI, H // K, K, TOPK) == (128, 128, 128, 16, 4, 16)
    assert (E, TOP_K, D, F) == (128, 4, 6144, 3072)


# (T tokens, R request rows, P page-table width): decode (T == R), decode with draft rows (T = 4R; T = 3 < the
# 4-token query block), mixed batches, prefill chunks (few rows, many tokens; 16,500 tokens: block-sparse
# attention splits its partials over two calls). P = 10 is max_model_len 1280 at page size 128; 1, 3, 33, 63,
# 200, 1000 other odd widths; 130 is past the fused top-k's 64 pages; 8192 is M3's 1M-token context; 8 and 64
# are powers of two like the shapes the tiles were measured on.
ATTENTION_CASES = [
    (1, 1, 1), (1, 1, 8), (1, 1, 10), (3, 3, 33), (5, 5, 63), (32, 32, 10), (64, 64, 130), (64, 64, 8192),
    (3, 1, 3), (12, 3, 10), (20, 5, 63),
    (37, 5, 33), (100, 5, 10), (1000, 32, 63),
    (100, 1, 1), (100, 1, 3), (100, 1, 10), (1000, 3, 63), (2048, 1, 8), (2048, 2, 33), (2048, 1, 64),
    (2048, 1, 130), (2048, 1, 1000), (8192, 1, 8192), (16500, 2, 200),
]
_ids = [f"T{t}-R{r}-P{p}" for t, r, p in ATTENTION_CASES]


def _batch(T: int, R: int, P: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """page_table [R, P], token_row [T], positions [T]."""
    return _sds((R, P), jnp.int32), _sds((T,), jnp.int32), _sds((T,), jnp.int32)


def _kv_pages() -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16), _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16)


def _assert_kernels(text: str, at_least: int = 1) -> None:
    n = count_triton_kernels(text)
    assert n >= at_least, f"{n} Triton kernels: the op took a non-kernel path"


@pytest.mark.parametrize("T,R,P", ATTENTION_CASES, ids=_ids)
def test_dense_attention_lowers(T, R, P):
    fn = functools.partial(attn.paged_dense_attention, scale=SCALE, impl="pallas")
    _assert_kernels(lower_for_gpu(fn, _sds((T, H, HD), jnp.bfloat16), *_kv_pages(), *_batch(T, R, P)))


@pytest.mark.parametrize("T,R,P", ATTENTION_CASES, ids=_ids)
def test_select_blocks_lowers(T, R, P):
    fn = functools.partial(attn.paged_select_blocks, topk=TOPK, local_blocks=CFG.index_local_blocks,
                           init_blocks=1, impl="pallas")
    _assert_kernels(lower_for_gpu(fn, _sds((T, K, DI), jnp.bfloat16), _sds((NUM_PAGES, PS, DI), jnp.bfloat16),
                                  *_batch(T, R, P)))


@pytest.mark.parametrize("T,R,P", ATTENTION_CASES, ids=_ids)
def test_block_sparse_attention_lowers(T, R, P):
    fn = functools.partial(attn.paged_block_sparse_attention, scale=SCALE, impl="pallas")
    blocks = _sds((T, K, TOPK), jnp.int32)
    _assert_kernels(lower_for_gpu(fn, _sds((T, H, HD), jnp.bfloat16), *_kv_pages(), *_batch(T, R, P), blocks))


# Any top-k (a deployment may select fewer or more blocks than M3's 16): decode and prefill shapes.
@pytest.mark.parametrize("topk", [5, 12, 24])
@pytest.mark.parametrize("T,R,P", [(3, 3, 10), (12, 3, 33), (1000, 3, 63)], ids=["decode", "drafts", "prefill"])
def test_msa_any_topk_lowers(T, R, P, topk):
    select = functools.partial(attn.paged_select_blocks, topk=topk, local_blocks=1, impl="pallas")
    _assert_kernels(lower_for_gpu(select, _sds((T, K, DI), jnp.bfloat16), _sds((NUM_PAGES, PS, DI), jnp.bfloat16),
                                  *_batch(T, R, P)))
    sparse = functools.partial(attn.paged_block_sparse_attention, scale=SCALE, impl="pallas")
    _assert_kernels(lower_for_gpu(sparse, _sds((T, H, HD), jnp.bfloat16), *_kv_pages(), *_batch(T, R, P),
                                  _sds((T, K, topk), jnp.int32)))


@pytest.mark.parametrize("T", [1, 3, 100, 1000, 1024, 2047, 2048])
@pytest.mark.parametrize("pages", ["kv", "index"])
def test_kv_write_lowers(T, pages):
    """The Pallas row store lowers at any row count; the dispatch takes it from KV_WRITE_PALLAS_MIN_ROWS on."""
    row = (K, HD) if pages == "kv" else (DI,)
    args = _sds((NUM_PAGES, PS, *row), jnp.bfloat16), _sds((T, *row), jnp.bfloat16), _sds((T,), jnp.int32)
    _assert_kernels(lower_for_gpu(write_pages_pallas, *args))
    n = count_triton_kernels(lower_for_gpu(functools.partial(attn.write_kv_pages, impl="pallas"), *args))
    assert n == (1 if T >= tuning.KV_WRITE_PALLAS_MIN_ROWS else 0)


def _moe_params(fmt: str) -> dict:
    """Abstract MoE params with the prepared `experts` layout of `fmt` (routed + shared expert as slot E), built
    by the layout's own functions under eval_shape: the shapes and dtypes prepare_moe produces."""
    mlp = {"w_gate": _sds((D, F), jnp.bfloat16), "w_up": _sds((D, F), jnp.bfloat16),
           "w_down": _sds((F, D), jnp.bfloat16)}
    moe = {"w_gate": _sds((E, D, F), jnp.bfloat16), "w_up": _sds((E, D, F), jnp.bfloat16),
           "w_down": _sds((E, F, D), jnp.bfloat16), "shared": mlp}
    experts = jax.eval_shape(lambda m: layout.quantize_experts(layout.stack_dense(m), fmt), moe)
    return {"router": _sds((D, E), jnp.float32), "router_bias": _sds((E,), jnp.float32), "experts": experts}


@pytest.mark.parametrize("T", [1, 3, 100, 2048, 3001])
@pytest.mark.parametrize("fmt", ["dense", "mxfp8", "mxfp4"])
def test_moe_lowers(fmt, T):
    p = _moe_params(fmt)
    assert layout.has_shared_slot(p) and layout.weight_format(p["experts"]) == fmt
    fn = functools.partial(moe_dispatch.moe, top_k=TOP_K, routed_scaling=CFG.routed_scaling_factor,
                           alpha=CFG.swiglu_alpha, limit=CFG.swiglu_limit, impl="pallas")
    assert count_triton_kernels(lower_for_gpu(fn, _sds((T, D), jnp.bfloat16), p)) == 2  # gate_up and down


@pytest.mark.parametrize("top_k", [1, 3, 6])
@pytest.mark.parametrize("T", [1, 100])
def test_moe_any_top_k_lowers(T, top_k):
    fn = functools.partial(moe_dispatch.moe, top_k=top_k, routed_scaling=CFG.routed_scaling_factor,
                           alpha=CFG.swiglu_alpha, limit=CFG.swiglu_limit, impl="pallas")
    assert count_triton_kernels(lower_for_gpu(fn, _sds((T, D), jnp.bfloat16), _moe_params("mxfp8"))) == 2


@pytest.mark.parametrize("T", [921, 8192])
@pytest.mark.parametrize("fmt", ["dense", "mxfp8-split", "mxfp8-each", "mxfp8-swap"])
def test_mosaic_moe_lowers(fmt, T):
    """The Mosaic GPU MoE kernels (moe/kernel_mgpu.py) through jax's Pallas Mosaic GPU lowering at M3's shapes:
    what the GPU interpreter in tests/test_moe_kernels.py cannot see (primitives without a Mosaic GPU rule,
    refs and transforms the lowering refuses). Mosaic's own layout inference and compilation to PTX happen later,
    in the GPU runtime, so they are not checked here."""
    from pallas_kernels.moe import kernel
    from pallas_kernels.moe.tiles import KernelTiles, MoeTiles

    fmt, _, widen = fmt.partition("-")
    bk = 128 if fmt == "mxfp8" else 64
    gu_bn = 128 if fmt == "dense" or widen == "swap" else 64
    tiles = MoeTiles("prefill", bm=128, gu=KernelTiles(bn=gu_bn, bk=bk, warps=4, stages=2),
                     dn=KernelTiles(bn=128, bk=bk, warps=4, stages=2), group=2, backend="mosaic",
                     mx_widen=widen or "each")
    fn = functools.partial(kernel.moe_pallas, top_k=TOP_K, routed_scaling=CFG.routed_scaling_factor,
                           alpha=CFG.swiglu_alpha, limit=CFG.swiglu_limit, tiles=tiles)
    text = lower_for_gpu(fn, _sds((T, D), jnp.bfloat16), _moe_params(fmt))
    assert text.count("custom_call @mosaic_gpu") == 2 and count_triton_kernels(text) == 0  # gate_up and down


@pytest.mark.parametrize("key_tile,stages,T", [(128, 3, 8192), (64, 4, 8192), (128, 3, 921)])
def test_mosaic_dense_attention_lowers(key_tile, stages, T):
    """The Mosaic GPU dense attention (attention/kernel_mgpu.py) through jax's Mosaic GPU lowering for an 8k
    prefill chunk at M3's head shapes: its shared memory (a whole page's K and V at 3 stages is 224 KB of the
    H200's 227) and the refs, transforms and layouts the lowering takes."""
    from pallas_kernels.attention import kernel as attn_kernel

    tiles = tuning.AttentionTiles(bt=8, pages_per_split=64, key_tile=key_tile, num_stages=stages,
                                  backend="mosaic")
    fn = functools.partial(attn_kernel.paged_dense_attention, scale=SCALE, tiles=tiles)
    R, P = 4, 80
    text = lower_for_gpu(fn, _sds((T, H, HD), jnp.bfloat16), _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16),
                         _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16), _sds((R, P), jnp.int32), _sds((T,), jnp.int32),
                         _sds((T,), jnp.int32))
    assert text.count("custom_call @mosaic_gpu") == 1 and count_triton_kernels(text) == 0


@pytest.mark.parametrize("bp,stages,fused,T", [(32, 4, False, 8192), (64, 4, False, 8192), (96, 4, True, 8192),
                                               (64, 4, False, 921), (96, 4, True, 921)])
def test_mosaic_block_scores_lower(bp, stages, fused, T):
    """The Mosaic GPU index scoring (msa/kernel_mgpu.py) through jax's Mosaic GPU lowering for an 8k prefill
    chunk at M3's index shapes, its shared memory included; fused: with its top-k (M3's 16 blocks). At T = 921
    the query rows (T x 4 index heads) are no multiple of the TMA's 8-row tile unless padded: an engine step of a
    921-token prompt failed to compile on an H100."""
    from pallas_kernels.msa import kernel_mgpu

    G = CFG.index_num_heads
    select = {"topk": TOPK, "local_blocks": CFG.index_local_blocks, "init_blocks": 0} if fused else None

    def fn(iq, ik, pt, tr, pos):
        return kernel_mgpu.block_scores(iq, ik, pt, tr, pos, bp=bp, stages=stages, select=select)

    R, P = 4, 80
    text = lower_for_gpu(fn, _sds((T, G, DI), jnp.bfloat16), _sds((NUM_PAGES, PS, DI), jnp.bfloat16),
                         _sds((R, P), jnp.int32), _sds((T,), jnp.int32), _sds((T,), jnp.int32))
    assert text.count("custom_call @mosaic_gpu") == 1 and count_triton_kernels(text) == 0


@pytest.mark.parametrize("key_tile,stages,T,bt", [(128, 2, 8192, 4), (64, 4, 8192, 4), (64, 4, 921, 4),
                                                  (128, 3, 8192, 8), (64, 4, 921, 8)])
def test_mosaic_union_sparse_attention_lowers(key_tile, stages, T, bt):
    """The Mosaic GPU block-sparse attention (msa/sparse_mgpu.py) through jax's Mosaic GPU lowering for an 8k
    prefill chunk at M3's shapes (16 selected blocks a token), its union lists and shared memory included; bt 8:
    the shared-pages form."""
    from pallas_kernels.msa import kernel as msa_kernel

    tiles = tuning.AttentionTiles(bt=bt, pages_per_split=64, key_tile=key_tile, num_stages=stages, backend="mosaic")
    fn = functools.partial(msa_kernel.paged_block_sparse_attention, scale=SCALE, tiles=tiles)
    R, P = 4, 80
    text = lower_for_gpu(fn, _sds((T, H, HD), jnp.bfloat16), _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16),
                         _sds((NUM_PAGES, PS, K, HD), jnp.bfloat16), _sds((R, P), jnp.int32), _sds((T,), jnp.int32),
                         _sds((T,), jnp.int32), _sds((T, K, TOPK), jnp.int32))
    assert text.count("custom_call @mosaic_gpu") == 1 and count_triton_kernels(text) == 0
