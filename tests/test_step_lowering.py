"""The serving step at the real model's shapes lowers for an H200 at engine sizes that are not powers of two: the
whole scanned forward (m3-slice, abstract weights, every kernel through the Pallas Triton lowering) and the
sampling, for the GPU smoke matrix's model lengths, row counts and step budgets. Nothing is compiled or run;
what would crash a GPU start-up at lowering time fails here (a model length of 1280 did)."""

import re

import jax
import pytest

from m3jax.api import M3Model
from m3jax.config import preset
from pallas_kernels.choice import KernelChoice
from pallas_kernels.gpu_lowering import count_triton_kernels, lower_for_gpu
from serving.runner import ModelRunner


@pytest.fixture(scope="module")
def model():
    return M3Model.abstract(preset("m3-slice"), "bfloat16", "bf16", KernelChoice("pallas", "pallas"))


@pytest.mark.parametrize("max_model_len", [1000, 1280, 4097])
@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(3, 100), (32, 2048)])
def test_step_lowers_at_odd_sizes(model, max_model_len, max_num_seqs, max_num_batched_tokens):
    runner = ModelRunner(model, num_pages=8, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    rows = runner.rows_for(runner.token_buckets[-1])
    for what, size in [("forward", runner.token_buckets[0]), ("forward", runner.token_buckets[-1]),
                       ("sample", rows), ("sample_draw", rows), ("sample_filter", rows)]:
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner._abstract_args(what, size))
        text = lower_for_gpu(runner.jitted(what, size), *args)
        if what == "forward":  # dense and block-sparse attention, index + top-k, both MoE GEMMs (and KV writes
            assert count_triton_kernels(text) >= 5, (what, size)  # from 1024 rows on)
        if what == "forward" or what != "sample" and what.startswith("sample"):
            # A decode step (its greedy tokens included), a prefill step and the plain samplings hold no
            # conditional: the GPU runtime reads a conditional's predicate back on the host, so dispatching it would
            # wait for the work queued before it.
            assert "stablehlo.case" not in text and "stablehlo.if" not in text, (what, size)


@pytest.mark.parametrize("sparse_prefill,kernel", [("block_major", "block_major_sparse_attention"),
                                                    ("union", "sparse_paged_attention_bt4")])
def test_prefill_step_lowers_with_the_chosen_sparse_kernel(sparse_prefill, kernel):
    """`--sparse-prefill-kernel`: the prefill step runs the operator's block-sparse kernel, a static choice (no
    conditional)."""
    model = M3Model.abstract(preset("m3-slice"), "bfloat16", "bf16",
                             KernelChoice("pallas", "pallas", sparse_prefill=sparse_prefill))
    runner = ModelRunner(model, num_pages=8, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1280)
    size = runner.token_buckets[-1]
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner._abstract_args("forward", size))
    text = lower_for_gpu(runner.jitted("forward", size), *args)
    other = {"block_major_sparse_attention", "sparse_paged_attention_bt4"} - {kernel}
    assert kernel in text and not any(k in text for k in other)
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_speculative_step_lowers_with_the_published_draft_shapes(model):
    """The whole speculative step (target over 1 + k rows, verification, the draft's k passes) for an H200, with
    a draft of `Inferact/MiniMax-M3-EAGLE3-GQA`'s shapes."""
    from checkpoints.eagle import inferact_draft_config
    from m3jax.eagle import draft_abstract
    from serving.runner import Draft

    dcfg = inferact_draft_config(gqa=True).replace(aux_layer_ids=(1, 2, 3))
    runner = ModelRunner(model, num_pages=8, max_num_seqs=32, max_num_batched_tokens=128, max_model_len=2100,
                         draft=Draft(dcfg, draft_abstract(dcfg, "bfloat16"), 3))
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner._abstract_args("spec", 128))
    # The target's kernels, plus the draft's paged attention and KV writes.
    assert count_triton_kernels(lower_for_gpu(runner.jitted("spec", 128), *args)) >= 7
    # A step with no penalty or grammar holds no conditional: dispatching it never waits for the device.
    for what in ("spec_greedy", "spec_draw", "spec_filter"):
        text = lower_for_gpu(runner.jitted(what, 128), *args)
        assert count_triton_kernels(text) >= 7, what
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, what


@pytest.mark.parametrize("moe_format", ["bf16", "mxfp8"])
def test_batch_invariant_step_lowers(moe_format):
    """--batch-invariant: every linear (the lm_head and the fp32 router included) through the Pallas linear kernel
    at decode and prefill sizes, the per-token sparse kernel at prefill, one MoE tile set: all of it lowers for
    an H200."""
    model = M3Model.abstract(preset("m3-slice"), "bfloat16", moe_format,
                             KernelChoice("pallas", "pallas", batch_invariant=True))
    runner = ModelRunner(model, num_pages=8, max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=1280)
    for size in (runner.token_buckets[0], runner.token_buckets[-1]):
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner._abstract_args("forward", size))
        text = lower_for_gpu(runner.jitted("forward", size), *args)
        # Attention (3), MoE (2), and the linears: q/k/v/o, index q/k, router, dense MLP's 3, lm_head.
        assert count_triton_kernels(text) >= 12, size
        # Outside the kernels XLA computes no float sum whose order it could choose by shape: no GEMM, and only
        # integer / boolean reductions (layout counts, masks) and (value, index) pairs: the greedy tokens' argmax,
        # exact in any order. Short float sums are chains of adds (ordered.py).
        assert "stablehlo.dot_general" not in text and '"stablehlo.reduce"' not in text, size
        reductions = re.findall(r"stablehlo\.reduce\(.*", text)
        argmax = re.compile(r": \(tensor<[0-9x]*xf32>, tensor<[0-9x]*xi32>, tensor<f32>, tensor<i32>\)")
        floats = [r for r in reductions if re.search(r"tensor<[0-9x]*(f16|bf16|f32|f64)>", r) and not argmax.search(r)]
        assert reductions and not floats, size


@pytest.mark.parametrize("moe_format", ["bf16", "mxfp8"])
@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens,max_model_len", [(3, 100, 1000), (5, 921, 4097),
                                                                                (6, 1500, 4097), (7, 3000, 4097)])
def test_step_lowers_with_the_mosaic_kernels_at_odd_sizes(monkeypatch, moe_format, max_num_seqs,
                                                          max_num_batched_tokens, max_model_len):
    """On a Hopper GPU the prefill step takes the Mosaic GPU kernels (dense, index scoring, block-sparse, and the
    MXFP8 MoE where its entry fits): the whole step lowers with them at engine sizes that are not powers of two.
    A served 921-token prompt once failed to compile in the index scoring (its TMA rows were no multiple of 8)."""
    from pallas_kernels.attention import dispatch as attn_dispatch
    from pallas_kernels.moe import kernel as moe_kernel
    from pallas_kernels.moe import tiles as moe_tiles

    for module in (attn_dispatch, moe_kernel):  # what `device.wgmma_device` says on an H100 / H200
        monkeypatch.setattr(module, "wgmma_device", lambda: True)
    model = M3Model.abstract(preset("m3-slice"), "bfloat16", moe_format, KernelChoice("pallas", "pallas"))
    runner = ModelRunner(model, num_pages=8, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len)
    size = runner.token_buckets[-1]
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner._abstract_args("forward", size))
    text = lower_for_gpu(runner.jitted("forward", size), *args)
    kernels = {"dense_paged_attention_mgpu", "msa_block_scores_mgpu", "sparse_shared_attention_mgpu"}
    assert all(k in text for k in kernels), (size, [k for k in kernels if k not in text])
    # The MXFP8 MoE's Mosaic entry takes steps from its smallest token count on (tiles.MOSAIC_TABLE); bf16 stays
    # on Triton.
    mosaic_moe = moe_format == "mxfp8" and size >= moe_tiles.MOSAIC_TABLE["mxfp8"][0]
    assert ("moe_gate_up_mxfp8_mgpu_swapped" in text) == mosaic_moe, size
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
