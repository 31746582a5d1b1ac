"""M3Config from both config.json spellings, presets, and errors that name the offending key."""

import json

import pytest

from m3jax.config import PRESETS, ConfigError, M3Config, preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_both_spellings(name):
    cfg = preset(name)
    assert M3Config.from_hf_dict(cfg.to_released_dict()) == cfg
    assert M3Config.from_hf_dict(cfg.to_hf_text_dict()) == cfg
    assert M3Config.from_hf_dict(json.loads(json.dumps(cfg.to_released_dict()))) == cfg


def test_full_preset_is_the_released_model():
    cfg = preset("m3-full")
    assert cfg.attn_types == ("dense",) * 3 + ("sparse",) * 57
    assert cfg.rotary_dim == 64 and cfg.index_topk_blocks == 16 and cfg.q_per_kv == 16
    assert 420e9 < cfg.param_count() < 430e9


def test_released_spelling_with_separate_attention_and_mlp_lists():
    d = preset("m3-full").to_released_dict()
    d["text_config"]["moe_layer_freq"] = [0, 0, 0, 0] + [1] * 56  # dense MLP on a sparse-attention layer
    cfg = M3Config.from_hf_dict(d)
    assert cfg.attn_types[3] == "sparse" and cfg.mlp_types[3] == "dense"


@pytest.mark.parametrize("mutate,key", [
    (lambda t: t.update(layer_types=["full_attention", "banana"] + ["full_attention"] * 2), "layer_types"),
    (lambda t: t.update(mlp_layer_types=["dense"] * 3), "mlp_layer_types"),
    (lambda t: t.update(rope_theta=1.0), "rope_theta"),
    (lambda t: t["rope_parameters"].update(rope_type="yarn"), "rope_parameters.rope_type"),
    (lambda t: t.update(index_n_heads=3), "index_n_heads"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(num_experts_per_tok=99), "num_experts_per_tok"),
    (lambda t: t.pop("hidden_size"), "hidden_size"),
])
def test_bad_values_name_the_key(mutate, key):
    d = preset("m3-tiny").to_hf_text_dict()
    mutate(d)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        M3Config.from_hf_dict(d)


def test_legacy_and_flat_keys_must_agree():
    d = preset("m3-tiny").to_released_dict()
    d["text_config"]["index_topk_blocks"] = 99
    with pytest.raises(ConfigError, match="index_topk_blocks"):
        M3Config.from_hf_dict(d)
    d = preset("m3-tiny").to_released_dict()
    d["text_config"]["rotary_dim"] = 4
    with pytest.raises(ConfigError, match="rotary_dim"):
        M3Config.from_hf_dict(d)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("m3-huge")
