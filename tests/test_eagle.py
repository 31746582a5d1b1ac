"""The EAGLE-3 draft (m3jax/eagle.py), its checkpoints (checkpoints/eagle.py) and the shipped embedded draft
(checkpoints/tiny_eagle3/): config parsing of both published M3 draft shapes, writer/loader round trips and every
loader error naming its tensor, the paged step equal to the dense reference on ragged batches (prefill chunks,
decode rows, chained passes), d2t mapping, embedding / lm_head sharing, and the shipped draft's acceptance."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints.eagle import (
    inferact_config,
    inferact_draft_config,
    load_draft,
    random_draft_params,
    read_draft_config,
    tensor_table,
    write_draft,
)
from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import LazyTensor, SafetensorsFile, write_file
from m3jax.batch import RowPlan, build_batch
from m3jax.config import ConfigError
from m3jax.eagle import (
    DraftConfig,
    DraftPages,
    draft_abstract,
    draft_param_specs,
    draft_step,
    draft_vocab_logits,
    fuse_aux,
    inv_frequencies,
    reference_forward,
    rms_norm,
    to_target_vocab,
    ttt_forward,
)

PS = 16  # the target's page size (MSA block) in these tests
V, D = 100, 32


def _dcfg(**kw) -> DraftConfig:
    base = dict(hidden_size=D, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, vocab_size=V,
                draft_vocab_size=60, target_hidden_size=D, aux_layer_ids=(1, 2, 3), rms_norm_eps=1e-6,
                rope_theta=10000.0, fc_norm=True, norm_output=True, vocab_map=True)
    return DraftConfig(**(base | kw))


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _target_weights(seed: int = 9) -> tuple[jax.Array, jax.Array]:
    r = _rng(seed)
    return (jnp.asarray(r.normal(size=(V, D)), jnp.float32),
            jnp.asarray(r.normal(size=(D, V)) / np.sqrt(D), jnp.float32))


# ---- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gqa", [True, False])
def test_published_draft_shapes(gqa: bool) -> None:
    d = DraftConfig.from_hf_dict(inferact_config(gqa))
    assert (d.hidden_size, d.vocab_size, d.draft_vocab_size, d.target_hidden_size) == (6144, 200064, 200064, 6144)
    assert d.num_kv_heads == (4 if gqa else 64) and d.num_heads == 64 and d.head_dim == 128
    assert d.aux_layer_ids == (2, 30, 57)
    assert d.fc_norm and d.norm_output and not d.norm_before_fc and not d.norm_before_residual
    assert not d.vocab_map and d.own_lm_head and not d.own_embed
    full = inferact_draft_config(gqa)
    if gqa:
        # The published GQA file is 6,149,993,396 bytes of bf16: what the assumed shapes hold, plus its header.
        assert 0 < 6_149_993_396 - 2 * full.param_count() < 64 << 10
    else:
        assert 3.2e9 < full.param_count() < 3.35e9  # the MHA card's "~3.3B"


@pytest.mark.parametrize("gqa", [True, False])
def test_full_scale_step_shapes(gqa: bool) -> None:
    """The full-size draft traces (shapes only: jax.eval_shape, nothing allocated)."""
    d = inferact_draft_config(gqa)
    params = draft_abstract(d, jnp.bfloat16)
    assert params["layer"]["attn"]["wk"].shape == (2 * 6144, d.num_kv_heads, 128)
    assert params["fc"].shape == (3, 6144, 6144) and params["fc_norm"].shape == (3, 6144)
    T, R, P, pages = 24, 4, 8, 33
    sds = jax.ShapeDtypeStruct
    batch, _ = build_batch([RowPlan([1] * 6, 0, range(1 + 8 * r, 1 + 8 * r + 1)) for r in range(R)], 128, T, R, P)
    pool = DraftPages(sds((pages, 128, d.num_kv_heads, 128), jnp.bfloat16),
                      sds((pages, 128, d.num_kv_heads, 128), jnp.bfloat16))

    def step(p, pool, aux):
        return draft_step(p, d, p["embed"], None, pool, batch, fuse_aux(p, d, aux), "reference")

    out = jax.eval_shape(step, params, pool, sds((3, T, 6144), jnp.bfloat16))
    assert out.logits.shape == (R, 200064) and out.logits.dtype == jnp.float32
    assert out.hidden.shape == (R, 6144) and out.pages.k.shape == (pages, 128, d.num_kv_heads, 128)


def test_config_keys_and_defaults() -> None:
    raw = _dcfg().to_hf_dict()
    present = list(tensor_table(_dcfg()))
    assert DraftConfig.from_hf_dict(raw, present=present) == _dcfg()
    # Aux layers: top level, in eagle_config, or vLLM's default from the target's depth.
    bare = {k: v for k, v in raw.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")}
    assert DraftConfig.from_hf_dict(bare, target_num_layers=60).aux_layer_ids == (2, 30, 57)
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        DraftConfig.from_hf_dict(bare)
    # norm_before_fc may sit in eagle_config (NVIDIA's checkpoints); a contradiction is refused.
    nbf = {k: v for k, v in raw.items() if k != "norm_before_fc"}
    nbf |= {"fc_norm": False, "eagle_config": {**raw["eagle_config"], "norm_before_fc": True}}
    assert DraftConfig.from_hf_dict(nbf).norm_before_fc
    with pytest.raises(ConfigError, match="norm_before_fc"):
        DraftConfig.from_hf_dict(nbf | {"norm_before_fc": False})
    # A flag whose key is absent follows the tensors.
    nokey = {k: v for k, v in raw.items() if k not in ("fc_norm", "norm_output")}
    assert DraftConfig.from_hf_dict(nokey, present=present).fc_norm
    assert not DraftConfig.from_hf_dict(nokey, present=[n for n in present if "fc_norm" not in n]).fc_norm
    assert not DraftConfig.from_hf_dict(nokey, present=present).norm_output
    # Defaults: draft vocabulary = target's, KV heads = heads, head_dim = hidden / heads.
    minimal = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 8,
               "intermediate_size": 128, "vocab_size": 300, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    m = DraftConfig.from_hf_dict(minimal)
    assert (m.draft_vocab_size, m.num_kv_heads, m.head_dim, m.vocab_map) == (300, 8, 8, False)
    assert DraftConfig.from_hf_dict(minimal | {"architectures": ["Eagle3LlamaForCausalLM"]}) == m


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"architectures": ["DeepseekV3ForCausalLMEagle3"]}, "architectures"),
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"norm_before_fc": True}, "mutually exclusive"),
    ({"norm_output": "yes"}, "norm_output"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
    ({"draft_vocab_size": 200}, "draft_vocab_size"),
    ({"num_key_value_heads": 3}, "num_attention_heads"),
])
def test_unsupported_configs_are_refused_by_name(change: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DraftConfig.from_hf_dict(_dcfg().to_hf_dict() | change)


def test_rope_scaling() -> None:
    base = inv_frequencies(_dcfg())
    np.testing.assert_allclose(base, 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8), rtol=1e-6)
    raw = _dcfg().to_hf_dict()
    lin = DraftConfig.from_hf_dict(raw | {"rope_scaling": {"type": "linear", "factor": 4.0}})
    np.testing.assert_allclose(inv_frequencies(lin), base / 4, rtol=1e-6)
    l3 = DraftConfig.from_hf_dict(raw | {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    f = inv_frequencies(l3)
    wavelen = 2 * np.pi / base
    assert f[0] == pytest.approx(base[0])  # short wavelengths keep their frequency
    assert f[-1] == pytest.approx(base[-1] / 8) and wavelen[-1] > 64  # long ones are divided by the factor
    assert DraftConfig.from_hf_dict(l3.to_hf_dict()).rope_type == "llama3"


# ---- writer / loader ---------------------------------------------------------------------------------------

def _params(dcfg: DraftConfig, seed: int = 0) -> dict:
    return jax.tree.map(np.asarray, random_draft_params(dcfg, seed))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_round_trip(tmp_path: Path, dtype: str, prefix: str) -> None:
    dcfg = _dcfg()
    params = _params(dcfg)
    write_draft(tmp_path, dcfg, params, dtype=dtype, prefix=prefix)
    with SafetensorsFile(tmp_path / "model.safetensors") as f:
        names = set(f.tensors)
        assert f.tensors["d2t"].dtype == "I64" and f.tensors["t2d"].dtype == "BOOL"
        assert f.tensors["fc.weight"].dtype == ("F32" if dtype == "float32" else "BF16")
    assert f"{prefix}self_attn.q_proj.weight" in names and "fc_norm.2.weight" in names
    assert "embed_tokens.weight" not in names
    got_cfg, got = load_draft(tmp_path)
    assert got_cfg == dcfg
    assert read_draft_config(tmp_path) == dcfg
    for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(got), strict=True):
        if dtype == "float32" or want.dtype.kind != "f":
            np.testing.assert_array_equal(have, want, err_msg=str(path))
        else:
            np.testing.assert_array_equal(have, want.astype(ml_dtypes.bfloat16).astype(np.float32),
                                          err_msg=str(path))


def test_sharded_round_trip_with_own_embedding(tmp_path: Path) -> None:
    dcfg = _dcfg(own_embed=True, norm_before_fc=True, fc_norm=False, norm_before_residual=True)
    params = _params(dcfg, 3)
    write_draft(tmp_path, dcfg, params, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    got_cfg, got = load_draft(tmp_path, dtype="bfloat16")
    assert got_cfg == dcfg and got["embed"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["aux_norm"], params["aux_norm"].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(got["d2t"], params["d2t"])


def _rewrite(directory: Path, edit) -> None:
    """Rewrite model.safetensors with `edit(tensors)` applied to a {name: array} dict."""
    path = directory / "model.safetensors"
    with SafetensorsFile(path) as f:
        tensors = {n: np.array(f.get(n)) for n in f.tensors}
    edit(tensors)
    write_file(path, [LazyTensor(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("midlayer.mlp.up_proj.weight"), r"missing tensor 'midlayer\.mlp\.up_proj\.weight'"),
    (lambda t: t.pop("fc_norm.1.weight"), r"missing tensor 'fc_norm\.1\.weight'"),
    (lambda t: t.pop("d2t"), r"missing tensor 'd2t' in "),
    (lambda t: t.update(extra=np.zeros(3, np.float32)), r"unexpected tensor 'extra' in model\.safetensors"),
    (lambda t: t.update({"midlayer.mlp.up_proj.weight": np.zeros((48, 31), np.float32)}),
     r"tensor 'midlayer\.mlp\.up_proj\.weight' in model\.safetensors: expected shape \[48, 32\], found \[48, 31\]"),
    (lambda t: t.update(d2t=t["d2t"].astype(np.float32)), r"tensor 'd2t' in model\.safetensors: unsupported dtype F32"),
    (lambda t: t.update(t2d=~t["t2d"]), r"tensor 't2d' in model\.safetensors: does not mark"),
    (lambda t: t.update(d2t=t["d2t"] + 1000), r"tensor 'd2t' in model\.safetensors: .*outside the target vocab"),
    (lambda t: t.update({"layers.0.hidden_norm.weight": t["midlayer.hidden_norm.weight"]}), "mixes"),
    (lambda t: t.update({"embed_tokens.weight": np.zeros((V, D + 1), np.float32)}),
     r"tensor 'embed_tokens\.weight' in model\.safetensors: expected shape \[100, 32\]"),
])
def test_loader_errors_name_the_tensor_and_file(tmp_path: Path, edit, match: str) -> None:
    dcfg = _dcfg()
    write_draft(tmp_path, dcfg, _params(dcfg))
    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        load_draft(tmp_path)


def test_loader_errors_on_the_directory(tmp_path: Path) -> None:
    dcfg = _dcfg()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_draft(tmp_path)
    write_draft(tmp_path, dcfg, _params(dcfg))
    # Without d2t, a pruned draft vocabulary is a missing tensor, named.
    _rewrite(tmp_path, lambda t: (t.pop("d2t"), t.pop("t2d")))
    with pytest.raises(CheckpointError, match=r"missing tensor 'd2t'"):
        load_draft(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quantization_config 'fp8'"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"config\.json: architectures"):
        load_draft(tmp_path)


def test_t2d_is_derived_when_absent(tmp_path: Path) -> None:
    dcfg = _dcfg()
    params = _params(dcfg)
    write_draft(tmp_path, dcfg, params)
    _rewrite(tmp_path, lambda t: t.pop("t2d"))  # vLLM never reads it; some exports drop it
    _, got = load_draft(tmp_path)
    np.testing.assert_array_equal(got["t2d"], params["t2d"])
    assert got["t2d"].sum() == dcfg.draft_vocab_size


def test_writer_refuses_params_that_do_not_match(tmp_path: Path) -> None:
    dcfg = _dcfg()
    params = _params(dcfg)
    params["layer"]["attn"]["wq"] = params["layer"]["attn"]["wq"][:-1]
    with pytest.raises(CheckpointError, match=r"param layer\.attn\.wq: shape"):
        write_draft(tmp_path, dcfg, params)
    params = _params(dcfg)
    del params["fc_norm"]
    with pytest.raises(CheckpointError, match="keys"):
        write_draft(tmp_path, dcfg, params)


def test_random_params_follow_the_specs() -> None:
    dcfg = _dcfg()
    params = random_draft_params(dcfg, 1, jnp.bfloat16)
    specs = draft_param_specs(dcfg)
    assert jax.tree.structure(params) == jax.tree.structure(jax.tree.map(lambda s: 0, specs,
                                                                         is_leaf=lambda x: hasattr(x, "axes")))
    assert params["fc"].dtype == jnp.bfloat16 and params["d2t"].dtype == jnp.int32 and params["t2d"].dtype == bool
    ids = np.arange(dcfg.draft_vocab_size) + np.asarray(params["d2t"])
    assert np.all(np.diff(ids) > 0) and np.asarray(params["t2d"])[ids].all()


# ---- the forward -------------------------------------------------------------------------------------------

def test_norms_are_llama_style() -> None:
    x = jnp.asarray(_rng(0).normal(size=(5, 16)), jnp.float32)
    unit = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rms_norm(x, jnp.ones(16), 1e-6), unit, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rms_norm(x, jnp.zeros(16), 1e-6), 0.0)  # weight * x̂, not (1 + w) * x̂


@pytest.mark.parametrize("kind", ["fc_norm", "norm_before_fc", "plain"])
def test_fuse_aux(kind: str) -> None:
    dcfg = _dcfg(fc_norm=kind == "fc_norm", norm_before_fc=kind == "norm_before_fc")
    p = _params(dcfg, 2)
    aux = _rng(1).normal(size=(3, 7, D)).astype(np.float32) * np.array([1.0, 5.0, 30.0])[:, None, None]

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)

    if kind == "fc_norm":
        x = np.concatenate([norm(aux[a], p["fc_norm"][a]) for a in range(3)], -1)
    elif kind == "norm_before_fc":
        x = norm(np.concatenate(list(aux), -1), p["aux_norm"])
    else:
        x = np.concatenate(list(aux), -1)
    want = x @ p["fc"].reshape(3 * D, D)  # fc.weight^T: the concatenation order is the aux order
    np.testing.assert_allclose(fuse_aux(p, dcfg, jnp.asarray(aux)), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="captured layers"):
        fuse_aux(p, dcfg, jnp.asarray(aux[:2]))


_step = jax.jit(draft_step, static_argnums=(1, 7))
_reference = jax.jit(reference_forward, static_argnums=(1, 6))


@pytest.mark.parametrize("dcfg", [
    _dcfg(),
    _dcfg(norm_output=False, fc_norm=False, norm_before_fc=True, norm_before_residual=True, vocab_map=False,
          draft_vocab_size=V, num_kv_heads=4),
], ids=["eagle3.1-gqa-pruned", "eagle3-mha-fullvocab"])
def test_paged_step_equals_reference_on_ragged_batches(dcfg: DraftConfig) -> None:
    """Two requests of different lengths: A prefilled in chunks that share steps with B's prefill and then B's
    decode rows (scattered pages); every token's hidden and logits equal the dense reference over each whole
    sequence."""
    params = _params(dcfg, 4)
    embed, lm_head = _target_weights()
    r = _rng(5)
    lens = [70, 40]
    toks = [r.integers(0, V, n).astype(np.int32) for n in lens]
    hid = [r.normal(size=(n, D)).astype(np.float32) for n in lens]
    refs = [_reference(params, dcfg, embed, lm_head, jnp.asarray(t[None]), jnp.asarray(h[None]))
            for t, h in zip(toks, hid, strict=True)]
    width = -(-max(lens) // PS)
    pages = [list(range(1, 1 + width))[::-1], list(range(1 + width, 1 + 2 * width))]
    pool = DraftPages.empty(dcfg, 1 + 2 * width, PS)
    # (A chunk, B tokens) per step: B prefills 30 tokens, then decodes one token per step.
    plan = [((0, 25), (0, 30)), ((25, 52), (30, 31)), ((52, 70), (31, 32)), ((70, 70), (32, 33))]
    got = {0: ([], []), 1: ([], [])}
    for (a0, a1), (b0, b1) in plan:
        rows, spans = [], []
        for b, (s, e) in ((0, (a0, a1)), (1, (b0, b1))):
            if e > s:
                rows.append(RowPlan(toks[b][s:e].tolist(), s, pages[b]))
                spans.append((b, s, e))
        n = sum(e - s for _, s, e in spans)
        batch, _ = build_batch(rows, PS, 64, 2, width)
        batch.logit_rows = np.arange(64, dtype=np.int32)
        h_in = np.zeros((64, D), np.float32)
        h_in[:n] = np.concatenate([hid[b][s:e] for b, s, e in spans])
        out = _step(params, dcfg, embed, lm_head, pool, batch, jnp.asarray(h_in), "reference")
        pool = out.pages
        off = 0
        for b, s, e in spans:
            got[b][0].append(np.asarray(out.logits[off:off + e - s]))
            got[b][1].append(np.asarray(out.hidden[off:off + e - s]))
            off += e - s
    for b in range(2):
        n = sum(len(x) for x in got[b][1])
        logits, hidden = np.concatenate(got[b][0]), np.concatenate(got[b][1])
        want_logits, want_hidden = np.asarray(refs[b][0][0, :n]), np.asarray(refs[b][1][0, :n])
        np.testing.assert_allclose(hidden, want_hidden, rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.isfinite(logits), np.isfinite(want_logits))
        fin = np.isfinite(want_logits)
        np.testing.assert_allclose(logits[fin], want_logits[fin], rtol=1e-5, atol=1e-5)


def test_chained_passes_equal_the_ttt_reference() -> None:
    """The engine's chain: a first pass over a prompt, then passes at positions n, n + 1, ... each fed the draft's
    own hidden and written to the next slot, equals `ttt_forward`'s pass i at index n - 1 (teacher-forced tokens),
    for two rows at once."""
    dcfg = _dcfg()
    params = _params(dcfg, 6)
    embed, lm_head = _target_weights()
    r = _rng(7)
    S, steps, n = [40, 23], 3, [30, 17]
    toks = [r.integers(0, V, s).astype(np.int32) for s in S]
    g = [r.normal(size=(s, D)).astype(np.float32) for s in S]
    width = -(-max(S) // PS)
    pages = [list(range(1, 1 + width)), list(range(1 + width, 1 + 2 * width))[::-1]]
    pool = DraftPages.empty(dcfg, 1 + 2 * width, PS)
    batch, idx = build_batch([RowPlan(toks[b][:n[b]].tolist(), 0, pages[b]) for b in range(2)], PS, 64, 2, width)
    h_in = np.zeros((64, D), np.float32)
    h_in[:sum(n)] = np.concatenate([g[0][:n[0]], g[1][:n[1]]])
    out = _step(params, dcfg, embed, lm_head, pool, batch, jnp.asarray(h_in), "reference")
    chain_logits = [[np.asarray(out.logits[idx[b]])] for b in range(2)]
    h = np.asarray(out.hidden)[idx]  # (each row's last token)
    for i in range(1, steps):
        batch, idx = build_batch([RowPlan([int(toks[b][n[b] - 1 + i])], n[b] - 1 + i, pages[b]) for b in range(2)],
                                 PS, 2, 2, width)
        out = _step(params, dcfg, embed, lm_head, out.pages, batch, jnp.asarray(h), "reference")
        h = np.asarray(out.hidden)
        for b in range(2):
            chain_logits[b].append(np.asarray(out.logits[idx[b]]))
    @jax.jit
    def chain(tok, hid):
        outs, _ = ttt_forward(params, dcfg, embed, tok, hid, steps)
        return to_target_vocab(params, dcfg, draft_vocab_logits(params, dcfg, lm_head, outs))

    for b in range(2):
        want = chain(jnp.asarray(toks[b][None]), jnp.asarray(g[b][None]))[:, 0, n[b] - 1]
        fin = np.isfinite(np.asarray(want))
        np.testing.assert_allclose(np.stack(chain_logits[b])[fin], np.asarray(want)[fin], rtol=1e-5, atol=1e-5)


def test_paged_step_through_the_kernels_in_interpret_mode() -> None:
    """The same step through the Pallas attention and KV-write kernels (interpreted on the CPU)."""
    dcfg = _dcfg()
    params = _params(dcfg, 8)
    embed, lm_head = _target_weights()
    r = _rng(9)
    toks, hid = r.integers(0, V, 20).astype(np.int32), r.normal(size=(20, D)).astype(np.float32)
    batch, _ = build_batch([RowPlan(toks[:12].tolist(), 0, [2, 1]), RowPlan(toks[12:].tolist(), 0, [3])],
                           PS, 24, 2, 2)
    h_in = np.zeros((24, D), np.float32)
    h_in[:20] = hid
    outs = [draft_step(params, dcfg, embed, lm_head, DraftPages.empty(dcfg, 4, PS), batch, jnp.asarray(h_in), impl)
            for impl in ("reference", "interpret")]
    np.testing.assert_allclose(outs[1].hidden, outs[0].hidden, rtol=1e-5, atol=1e-5)
    # Page 0 is the padding sink: which padding token's row lands there differs between the writers.
    np.testing.assert_allclose(outs[1].pages.k[1:], outs[0].pages.k[1:], rtol=1e-6, atol=1e-6)


def test_shift_tokens_for_a_first_pass() -> None:
    from m3jax.eagle import shift_tokens

    batch, _ = build_batch([RowPlan([5, 6, 7], 4, [1]), RowPlan([8], 9, [2]), RowPlan([9, 10], 0, [3])], PS, 8, 4, 1)
    got = np.asarray(shift_tokens(batch, jnp.asarray([70, 80, 90, 0])))
    assert got[:6].tolist() == [6, 7, 70, 80, 10, 90]


def test_d2t_maps_draft_ids_and_the_rest_is_minus_inf() -> None:
    dcfg = _dcfg()
    params = _params(dcfg, 10)
    lg = jnp.asarray(_rng(11).normal(size=(4, dcfg.draft_vocab_size)), jnp.float32)
    full = np.asarray(to_target_vocab(params, dcfg, lg))
    ids = np.arange(dcfg.draft_vocab_size) + params["d2t"]
    assert full.shape == (4, V)
    np.testing.assert_array_equal(full[:, ids], np.asarray(lg))
    outside = np.setdiff1d(np.arange(V), ids)
    assert len(outside) == V - dcfg.draft_vocab_size and np.all(full[:, outside] == -np.inf)
    np.testing.assert_array_equal(full.argmax(-1), ids[np.asarray(lg).argmax(-1)])
    full_vocab = _dcfg(vocab_map=False, draft_vocab_size=V)
    assert to_target_vocab({}, full_vocab, jnp.ones((2, V))).shape == (2, V)


def test_embedding_and_lm_head_come_from_the_target_when_the_draft_has_none() -> None:
    shared = _dcfg(vocab_map=False, draft_vocab_size=V, own_lm_head=False)
    own = shared.replace(own_embed=True, own_lm_head=True)
    params = _params(shared, 12)
    embed, lm_head = _target_weights()
    toks = jnp.asarray(_rng(13).integers(0, V, (1, 9)), jnp.int32)
    hid = jnp.asarray(_rng(14).normal(size=(1, 9, D)), jnp.float32)
    a = reference_forward(params, shared, embed, lm_head, toks, hid)
    b = reference_forward(params | {"embed": embed, "lm_head": lm_head}, own, None, None, toks, hid)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no embedding"):
        reference_forward(params, shared, None, lm_head, toks, hid)
    with pytest.raises(ValueError, match="no lm_head"):
        reference_forward(params, shared, embed, None, toks, hid)
    assert "embed" not in draft_param_specs(shared) and "lm_head" not in draft_param_specs(shared)
    with pytest.raises(ConfigError, match="own lm_head"):
        _dcfg(own_lm_head=False)  # a pruned draft vocabulary cannot borrow the target's lm_head
    with pytest.raises(ConfigError, match="target_hidden_size"):
        _dcfg(target_hidden_size=48)  # nor a draft of another width its embedding


# ---- the shipped draft -------------------------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny_eagle3"


def test_shipped_draft_files() -> None:
    for name in ("config.json", "model.safetensors", "training.json"):
        assert (SHIPPED / name).is_file(), name
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) < 2_000_000
    dcfg, params = load_draft(SHIPPED)
    assert not dcfg.own_embed and dcfg.own_lm_head and dcfg.vocab_map and dcfg.fc_norm and dcfg.norm_output
    assert dcfg.aux_layer_ids == (1, 2, 3) and dcfg.hidden_size == 128
    record = json.loads((SHIPPED / "training.json").read_text())
    assert record["acceptance"]["k"] == 3 and record["acceptance"]["mean_length"] >= 2.0


@pytest.fixture(scope="module")
def target():
    from m3jax import load_model

    return load_model()


def test_shipped_draft_accepts_at_least_two_tokens_per_step(target) -> None:
    """Chain drafting of 3 tokens on a few held-out sequences, the target verifying greedily (bf16-stored draft
    loaded as fp32): at least 2 tokens per verification on average."""
    from checkpoints.train_eagle import evaluate_acceptance

    t0 = time.perf_counter()
    dcfg, params = load_draft(SHIPPED, target_num_layers=target.cfg.num_layers)
    acc = evaluate_acceptance(target, params, dcfg, num_sequences=4, prompt_len=48, new_tokens=40, k=3)
    assert acc.chains > 100
    assert acc.mean_length >= 2.0, acc.summary()
    assert time.perf_counter() - t0 < 60


def test_engine_form_with_the_shipped_draft(target) -> None:
    """What the engine will do: a paged target prefill with `capture=` the draft's aux layers, the draft's first
    pass over the same batch (tokens shifted by `shift_tokens`, the target's greedy token last) on its own pages
    with the target's page table, then chained passes; the proposals equal the dense teacher-forced chain."""
    from checkpoints.train_eagle import target_features
    from m3jax.eagle import propose_chain, shift_tokens
    from m3jax.model import forward

    dcfg, dp = load_draft(SHIPPED)
    cfg, tp = target.cfg, target.params
    ps, n, k = target.page_size, 37, 3
    prompt = _rng(15).integers(0, cfg.vocab_size, n).tolist()
    pages = [1, 2, 3]
    batch, idx = build_batch([RowPlan(prompt, 0, pages)], ps, 40, 1, 3)
    fwd = jax.jit(forward, static_argnums=(1, 4, 5, 6))
    out = fwd(tp, cfg, target.new_pages(4), batch, target.kernels, False, dcfg.aux_layer_ids)
    g1 = int(jnp.argmax(out.logits[idx[0]]))
    pool = DraftPages.empty(dcfg, 4, ps)
    hidden = fuse_aux(dp, dcfg, out.aux_hidden)
    draft_batch = dataclasses.replace(batch, token_ids=shift_tokens(batch, jnp.asarray([g1])))
    assert draft_batch.token_ids[n - 2] == prompt[n - 1] and draft_batch.token_ids[n - 1] == g1
    proposed, pos = [], n - 1
    for _ in range(k):
        d = _step(dp, dcfg, tp["embed"], tp["lm_head"], pool, draft_batch, hidden, "reference")
        pool = d.pages
        tok = int(jnp.argmax(d.logits[0]))
        proposed.append(tok)
        hidden = d.hidden  # at the row's logit position: the chain continues from its last token
        pos += 1
        draft_batch, _ = build_batch([RowPlan([tok], pos, pages)], ps, 1, 1, 3)
    seq = np.asarray([prompt + [g1] + proposed[:-1]], np.int32)

    @jax.jit
    def dense_chain(tp, dp, seq):
        aux, _ = target_features(tp, cfg, seq, dcfg.aux_layer_ids)
        g = fuse_aux(dp, dcfg, aux.reshape(3, seq.size, -1)).reshape(1, seq.shape[1], -1)
        return propose_chain(dp, dcfg, tp["embed"], tp["lm_head"], seq[:, 1:], g[:, :-1], k)

    want = dense_chain(tp, dp, jnp.asarray(seq))
    assert np.asarray(want[:, 0, n - 1]).tolist() == proposed
