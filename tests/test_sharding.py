"""TP2 / TP4 / TP8 and expert parallelism (EP4, EP8) give the TP1 logits, through the references and through the
kernels (interpret mode), on 4 virtual CPU devices (see conftest.py; the 8-device cases run in a subprocess of 8);
the sharded path is checked to be the one taken (every kernel inside a shard_map); the engine stays exact under
TP4; the sharded steps lower for 4 and 8 H200s."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.api import M3Model
from m3jax.batch import RowPlan, build_batch
from m3jax.config import preset
from m3jax.model import forward
from m3jax.params import random_params
from m3jax.sharding import make_rules, shard_params
from pallas_kernels.choice import INTERPRET, KernelChoice

# Widen the tiny preset so that every sharded axis divides by 4 (kv heads included), each expert's width splits
# 8 ways into kernel tiles (128 / 8 = 16 columns), and the shared expert has the routed width (one more slot).
CFG = preset("m3-tiny").replace(num_heads=8, num_kv_heads=4, index_num_heads=4, moe_intermediate_size=128,
                                shared_intermediate_size=128)
# 2 x 48 tokens over 3 pages of 16: MSA selects 4 of them, so blocks are dropped; prefill kernels throughout.
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 48)).astype(np.int32)


def _host():
    return random_params(CFG, seed=7, scale=1.5)


@pytest.fixture(scope="module")
def setup():
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    host = _host()
    return host, M3Model.create(CFG, host).logits(TOKENS)


@pytest.fixture(scope="module")
def tp1_kernels(setup):
    """TP1 through the kernels (interpret mode): what every sharded kernel configuration must equal."""
    host, ref = setup
    got = M3Model.create(CFG, host, kernels=INTERPRET).logits(TOKENS)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    return got


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (4, True)])
def test_tensor_parallel_equals_tp1(setup, tp, ep):
    host, ref = setup
    rules = make_rules(tp, expert_parallel=ep)
    params = shard_params(host, CFG, rules)
    wq = params["runs"][0]["attn"]["wq"]
    assert len(wq.sharding.device_set) == tp and wq.addressable_shards[0].data.shape[2] == CFG.num_heads // tp
    experts = params["runs"][CFG.run_of(2)[0]]["moe"]["w_gate"]
    shard_shape = experts.addressable_shards[0].data.shape
    n = CFG.layer_runs[CFG.run_of(2)[0]].count  # the run's stacked layers
    assert shard_shape == ((n, CFG.num_experts // tp, CFG.hidden_size, CFG.moe_intermediate_size) if ep
                           else (n, CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size // tp))
    got = M3Model.create(CFG, host, tensor_parallel_size=tp, expert_parallel=ep).logits(TOKENS)
    _close(got, ref)


def test_unshardable_axis_is_replicated_and_bad_tp_is_refused():
    rules = make_rules(4)
    spec = rules.spec_for((2, 16), ("kv_heads", "head_dim"))
    assert spec == jax.sharding.PartitionSpec()
    assert make_rules(1).spec_for((4, 16), ("kv_heads", "head_dim")) == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_rules(64)
    with pytest.raises(ValueError, match="two dimensions"):
        rules.spec_for((8, 8), ("q_heads", "kv_heads"))


def test_topology_modes_follow_the_rules():
    """What each device runs, from the rules and the shapes (pallas_kernels/topology.py)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    tp4, ep4 = make_rules(4).topology, make_rules(4, expert_parallel=True).topology
    assert tp4 == make_rules(4).topology and hash(tp4) == hash(make_rules(4).topology)  # static, hashable
    assert (tp4.attention_mode(64, 4), tp4.kv_heads(64, 4)) == ("split", 4)
    assert (tp4.attention_mode(64, 2), tp4.kv_heads(64, 2)) == ("replicate_kv", 4)  # one KV head per device
    assert tp4.attention_mode(6, 3) == "replicated" and tp4.kv_heads(6, 3) == 3
    assert (tp4.moe_mode(128, 3072), ep4.moe_mode(128, 3072)) == ("tp", "ep")
    assert tp4.moe_mode(128, 3070) == "replicated" and ep4.moe_mode(126, 3072) == "replicated"
    assert make_rules(1).topology.sharded is False
    assert KernelChoice("auto", "auto").resolve(4) == KernelChoice("auto", "auto").resolve(1)  # MoE kernels too


def test_moe_tiles_fill_a_narrow_shard():
    """The MoE tile table per shard: M3's decode tiles at full width (TP1, EP) are the measured ones; a TP shard's
    F / devices columns get gate_up's K split until the grid holds a program per multiprocessor."""
    from pallas_kernels.moe.tiles import fill_shard, pick_tiles

    D, F = 6144, 3072
    for fmt in ("dense", "mxfp8"):
        t = pick_tiles(1, fmt)
        assert fill_shard(t, 5, D, F) == t  # TP1 / EP, one token: 5 slots x 48 tiles
        assert fill_shard(t, 5, D, F // 4).gu.split == 4 and fill_shard(t, 5, D, F // 8).gu.split == 4
        assert fill_shard(t, 40, D, F // 8) == t  # 8 tokens: 40 row blocks x 6 tiles
        assert fill_shard(pick_tiles(512, fmt), 5, D, F // 8) == pick_tiles(512, fmt)  # mid / prefill: untouched


# ---- the kernels, sharded --------------------------------------------------------------------------------


def kernel_sites(model: M3Model, tokens: np.ndarray) -> tuple[list[str], list[str]]:
    """(Pallas kernels traced inside a shard_map, those outside one) in the model's full forward over `tokens`:
    the path the step actually takes."""
    B, S = tokens.shape
    per_row = -(-S // model.page_size)
    rows = [RowPlan(tokens[b].tolist(), 0, range(1 + b * per_row, 1 + (b + 1) * per_row), sample=False)
            for b in range(B)]
    batch, _ = build_batch(rows, model.page_size, B * S, B, per_row)
    jaxpr = jax.make_jaxpr(lambda p, kv, b: forward(p, model.cfg, kv, b, model.kernels))(
        model.params, model.page_shapes(1 + B * per_row), batch)
    inside, outside = [], []

    def walk(j, in_map: bool) -> None:
        for eqn in j.eqns:
            here = in_map or eqn.primitive.name == "shard_map"
            if eqn.primitive.name == "pallas_call":
                (inside if here else outside).append(str(eqn.params["name"]))
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple | list) else (v,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr, here)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, here)

    walk(jaxpr.jaxpr, False)
    return inside, outside


def check_kernel_path(model: M3Model) -> None:
    """Every kernel family inside a shard_map, in a prefill-shaped step (block-major sparse attention) and a
    decode-shaped one (the per-token sparse kernel)."""
    inside, outside = kernel_sites(model, TOKENS)
    decode_inside, decode_outside = kernel_sites(model, TOKENS[:, :1])
    assert not outside and not decode_outside, f"kernels outside any shard_map: {outside + decode_outside}"
    inside += decode_inside
    for kind in ("kv_write", "dense_paged_attention", "msa_block_scores", "sparse_paged_attention",
                 "block_major_sparse_attention", "moe_gate_up", "moe_down"):
        assert any(name.startswith(kind) for name in inside), (kind, sorted(set(inside)))


def test_sharded_union_prefill_kernel(setup):
    """`--sparse-prefill-kernel union` under TP2: the prefill-shaped step's block-sparse attention is the union
    kernel, inside the shard_map, and nothing runs outside one (traced only: the kernel equals the reference
    through the dispatch in tests/test_attention_kernels.py)."""
    host, _ = setup
    model = M3Model.create(CFG, host, tensor_parallel_size=2,
                           kernels=dataclasses.replace(INTERPRET, sparse_prefill="union"))
    inside, outside = kernel_sites(model, TOKENS)
    assert not outside, outside
    assert any(n.startswith("sparse_paged_attention_bt4") for n in inside), sorted(set(inside))
    assert not any(n.startswith("block_major") for n in inside), sorted(set(inside))


def test_sharded_ops_take_the_steps_query_blocks(setup, query_blocks_computed):
    """Under TP2 and TP4 the attention ops' shard_map bodies take the step's query blocks, handed in as
    replicated operands, and compute none of their own in any layer (`ragged.step_query_blocks`)."""
    from pallas_kernels.attention import ragged

    host, _ = setup
    computed = query_blocks_computed
    for tp in (2, 4):
        model = M3Model.create(CFG, host, tensor_parallel_size=tp, kernels=INTERPRET)
        for tokens in (TOKENS, TOKENS[:, :1]):  # prefill- and decode-shaped steps
            computed.clear()
            kernel_sites(model, tokens)
            assert sorted(computed) == sorted(ragged.STEP_BLOCK_SIZES), (tp, tokens.shape, computed)


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (4, True)])
def test_sharded_kernels_equal_tp1(setup, tp1_kernels, tp, ep):
    """The attention family and the MoE through their kernels, each device on its shard: TP2 / TP4 split the
    KV heads (one or two per device) and each expert's width; EP4 puts two experts and the whole shared expert
    (stacked as a slot, `checkpoints.prepare` per shard) on each device."""
    host, _ = setup
    model = M3Model.create(CFG, host, tensor_parallel_size=tp, expert_parallel=ep, kernels=INTERPRET)
    check_kernel_path(model)
    moe = model.params["runs"][CFG.run_of(2)[0]]["moe"]
    assert "w_gate" not in moe and "shared" not in moe  # prepared per shard; the shared expert is a slot
    gate = moe["experts"]["gate"]
    slots = CFG.num_experts // tp + 1 if ep else CFG.num_experts + 1
    width = CFG.moe_intermediate_size // (1 if ep else tp)
    assert gate.shape[1] == (tp * slots if ep else slots)
    assert gate.addressable_shards[0].data.shape[1:] == (slots, CFG.hidden_size, width)
    k_pool = model.new_pages(4).k[0]
    assert k_pool.addressable_shards[0].data.shape[3] == CFG.num_kv_heads // tp  # a per-shard page pool
    _close(model.logits(TOKENS), tp1_kernels)


@pytest.mark.parametrize("fmt,tp,ep", [("mxfp8", 2, False)])
def test_mx_experts_prepared_per_shard(fmt, tp, ep):
    """An MXFP8 stack prepared on each device from its own shard (TP2: down's K words and scale words split at a
    128-group boundary) reads as the whole stack prepared on one device: one MoE layer through the sharded kernels
    equals the single-device kernels on the same weights. (EP's per-shard preparation: the bf16 EP4 / EP8 model
    tests; an EP stack splits whole slots, which the MX packing never crosses.)"""
    from checkpoints.prepare import prepare_params
    from pallas_kernels import ops

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = CFG.replace(hidden_size=128, moe_intermediate_size=256, shared_intermediate_size=256)
    host = random_params(cfg, seed=3, scale=1.5)
    r, _ = cfg.run_of(2)
    kw = {"top_k": cfg.num_experts_per_tok, "routed_scaling": cfg.routed_scaling_factor, "alpha": cfg.swiglu_alpha,
          "limit": cfg.swiglu_limit, "impl": "interpret"}
    h = jnp.asarray(np.random.default_rng(1).normal(0, 1, (24, cfg.hidden_size)).astype(np.float32))

    def layer1(moe):  # what the scan hands layer 1: its own router, the run's whole expert stack
        return {k: v if k == "experts" else jax.tree.map(lambda a: a[1], v) for k, v in moe.items()}

    one = prepare_params(jax.tree.map(jnp.asarray, host), fmt, keep_reference=False)["runs"][r]["moe"]
    want = ops.moe(h, layer1(one), layer=1, num_valid=jnp.int32(20), **kw)
    rules = make_rules(tp, expert_parallel=ep)
    moe = prepare_params(shard_params(host, cfg, rules), fmt, keep_reference=False,
                         topology=rules.topology)["runs"][r]["moe"]
    gate = moe["experts"][f"gate_{'q8' if fmt == 'mxfp8' else 'q4'}"]
    assert len(gate.sharding.device_set) == tp
    got = jax.jit(lambda h, p: ops.moe(h, layer1(p), layer=1, num_valid=jnp.int32(20), **kw,
                                       topology=rules.topology))(h, moe)
    np.testing.assert_allclose(np.asarray(got)[:20], np.asarray(want)[:20], rtol=2e-5, atol=2e-5)


# ---- 8 devices (a subprocess: this process has 4) -------------------------------------------------------

_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_sharding import CFG, TOKENS, _host, _close, check_kernel_path
from m3jax.api import M3Model
from pallas_kernels.choice import INTERPRET
want = np.load({want!r})
for tp, ep in [(8, False), (8, True)]:
    model = M3Model.create(CFG, _host(), tensor_parallel_size=tp, expert_parallel=ep, kernels=INTERPRET)
    check_kernel_path(model)
    pool = model.new_pages(4).k[0]
    assert pool.shape[3] == 8 and pool.addressable_shards[0].data.shape[3] == 1  # 4 KV heads, each twice
    _close(model.logits(TOKENS), want)
    print(json.dumps({{"tp": tp, "ep": ep, "ok": True}}), flush=True)
"""


def test_eight_devices_tp8_replicated_kv_heads_and_ep8(tp1_kernels, tmp_path):
    """TP8 with 4 KV heads: the pool holds 8 KV heads (each replicated twice, one per device), each device
    scores its group's blocks and the selections are all-gathered; EP8: one expert and the shared slot per
    device. Both through the kernels, against TP1."""
    want = tmp_path / "tp1.npy"
    np.save(want, tp1_kernels)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(root=root, want=str(want))], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert done == [{"tp": 8, "ep": False, "ok": True}, {"tp": 8, "ep": True, "ok": True}]


# ---- the engine, and the GPU lowering -------------------------------------------------------------------


def test_engine_exact_under_tp4():
    """The engine's exactness (greedy tokens batched, chunked, preempted == each request alone) under TP4 with
    the experts over the same 4 devices, every op through its kernels: m3-tiny's 2 KV heads are replicated (one
    per device), its 8 experts two per device."""
    from serving import LLM, SamplingParams

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(20, 60, 6)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(m)) for m in rng.integers(6, 14, 6)]
    # 7 usable pages of 16 tokens for 4 running requests of 26 to 73 tokens: preemption is forced.
    with LLM(model="m3-tiny", dtype="float32", max_model_len=80, kv_cache_pages=8, max_num_seqs=4,
             max_num_batched_tokens=16, progress=False, tensor_parallel_size=4, expert_parallel=True,
             attention_kernels="interpret", moe_kernels="interpret", enable_compilation_cache=False) as llm:
        core = llm.core
        assert core.runner.model.kernels.topology.size == 4
        assert core.runner.model.kernels.topology.attention_mode(4, 2) == "replicate_kv"
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert core.stats["preemptions"] > 0
        alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids
                 for p, q in zip(prompts, params, strict=True)]
        assert batched == alone
        assert core.pages_in_use == 0


@pytest.mark.parametrize("tp,ep,fmt", [(4, False, "bf16"), (8, False, "mxfp8"), (8, True, "mxfp8")])
def test_sharded_step_lowers_for_h200s(tp, ep, fmt):
    """The whole forward at m3-slice's shapes for 4 and 8 H200s (abstract: no devices), every kernel through the
    Pallas Triton lowering inside the shard_maps, the expert stacks and the page pool placed per shard."""
    from pallas_kernels.gpu_lowering import count_triton_kernels, lower_for_gpu

    cfg = preset("m3-slice")
    model = M3Model.abstract(cfg, "bfloat16", fmt, KernelChoice("pallas", "pallas"), tensor_parallel_size=tp,
                             expert_parallel=ep)
    pages = model.page_shapes(9)
    assert pages.k[0].shape[3] == max(cfg.num_kv_heads, tp)
    for T, R in ((1, 1), (8, 8), (256, 2)):  # decode (one token: gate_up split to fill a narrow shard), prefill
        batch, _ = build_batch([], model.page_size, T, R, 10)
        text = lower_for_gpu(lambda p, kv, b: forward(p, cfg, kv, b, model.kernels), model.params, pages, batch,
                             num_devices=tp)
        assert count_triton_kernels(text) >= 5, (T, R)
        assert "sdy.manual_computation" in text and f"mhlo.num_partitions = {tp}" in text
