"""The Flax NNX module is the same model as the pure forward."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax.api import M3Model
from m3jax.batch import KVPages, RowPlan, build_batch
from m3jax.config import preset
from m3jax.flax_module import M3
from m3jax.params import random_params


def test_nnx_module_equals_pure_forward():
    cfg = preset("m3-tiny")
    host = random_params(cfg, seed=3)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 40)).astype(np.int32)
    want = M3Model.create(cfg, host).logits(toks)[0]
    module = M3(cfg, host)
    batch, _ = build_batch([RowPlan(toks[0].tolist(), 0, [1, 2, 3], sample=False)], 16, 40, 1, 3, num_logit_rows=0)
    batch.logit_rows = jnp.arange(40, dtype=jnp.int32)
    got = nnx.jit(lambda m, kv, b: m(kv, b).logits)(module, KVPages.empty(cfg, 4, jnp.float32), batch)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert ("layers", "embed", "q_heads", "head_dim") in module.logical_axes()
    assert sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param))) == cfg.param_count()
