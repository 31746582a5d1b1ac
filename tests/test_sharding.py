"""TP2 / TP4 (and expert parallelism) give the TP1 logits on 4 virtual CPU devices (see conftest.py)."""

import jax
import numpy as np
import pytest

from m3jax.api import M3Model
from m3jax.config import preset
from m3jax.params import random_params
from m3jax.sharding import make_rules, shard_params

# Widen the tiny preset so that every sharded axis divides by 4 (kv heads included).
CFG = preset("m3-tiny").replace(num_heads=8, num_kv_heads=4, index_num_heads=4)


@pytest.fixture(scope="module")
def setup():
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    host = random_params(CFG, seed=7, scale=1.5)
    toks = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 80)).astype(np.int32)
    ref = M3Model.create(CFG, host).logits(toks)
    return host, toks, ref


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (4, True)])
def test_tensor_parallel_equals_tp1(setup, tp, ep):
    host, toks, ref = setup
    rules = make_rules(tp, expert_parallel=ep)
    params = shard_params(host, CFG, rules)
    wq = params["runs"][0]["attn"]["wq"]
    assert len(wq.sharding.device_set) == tp and wq.addressable_shards[0].data.shape[2] == CFG.num_heads // tp
    experts = params["runs"][CFG.run_of(2)[0]]["moe"]["w_gate"]
    shard_shape = experts.addressable_shards[0].data.shape
    n = CFG.layer_runs[CFG.run_of(2)[0]].count  # the run's stacked layers
    assert shard_shape == ((n, CFG.num_experts // tp, CFG.hidden_size, CFG.moe_intermediate_size) if ep
                           else (n, CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size // tp))
    got = M3Model.create(CFG, host, tensor_parallel_size=tp, expert_parallel=ep).logits(toks)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_unshardable_axis_is_replicated_and_bad_tp_is_refused():
    rules = make_rules(4)
    spec = rules.spec_for((2, 16), ("kv_heads", "head_dim"))
    assert spec == jax.sharding.PartitionSpec()
    assert make_rules(1).spec_for((4, 16), ("kv_heads", "head_dim")) == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_rules(64)
    with pytest.raises(ValueError, match="two dimensions"):
        rules.spec_for((8, 8), ("q_heads", "kv_heads"))
