"""The shipped default model (`checkpoints/tiny/`, made by `python -m checkpoints.train_tiny`): it loads, it is
an M3 in miniature, it has learned something, and its MSA really drops blocks."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from m3jax import load_model
from m3jax.api import M3Model, embedded_model_path
from m3jax.params import layer_view

TINY = embedded_model_path()


@pytest.fixture(scope="module")
def model() -> M3Model:
    return load_model()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


def _held_out_ids(tokenizer: Tokenizer, n: int) -> np.ndarray:
    """`n` tokens from the middle of a validation file (a stdlib module the model never trained on)."""
    record = json.loads((TINY / "training.json").read_text())
    path = Path(sysconfig.get_paths()["stdlib"]) / record["corpus"]["val_files"][0]
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine (the checkpoint was trained on another Python)")
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids
    assert len(ids) >= 2 * n
    start = len(ids) // 2
    return np.asarray([ids[start:start + n]], np.int32)


def _nll(m: M3Model, ids: np.ndarray) -> float:
    logits = m.logits(ids)[0, :-1].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-np.mean(logp[np.arange(len(logp)), ids[0, 1:]]))


def test_shipped_files_and_size() -> None:
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "generation_config.json", "training.json"]:
        assert (TINY / name).is_file(), name
    assert sum(f.stat().st_size for f in TINY.iterdir()) < 5_000_000
    assert json.loads((TINY / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_config_is_m3_in_miniature(model: M3Model, tokenizer: Tokenizer) -> None:
    cfg = model.cfg
    assert set(cfg.attn_types) == {"dense", "sparse"} and cfg.attn_types[0] == "dense"
    assert set(cfg.mlp_types) == {"dense", "moe"}
    assert any(a == "sparse" and m == "dense" for a, m in zip(cfg.attn_types, cfg.mlp_types, strict=True))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_shared_experts) == (8, 2, 1)
    assert cfg.rotary_dim == cfg.head_dim // 2
    assert cfg.index_block_size * cfg.index_topk_blocks == 64
    assert cfg.vocab_size == tokenizer.get_vocab_size()
    assert cfg.bos_token_id == tokenizer.token_to_id("]~!b[")
    assert cfg.eos_token_ids == (tokenizer.token_to_id("[e~["),)
    # The routing bias was trained by load balancing, so it is not zero.
    for i, kind in enumerate(cfg.mlp_types):
        if kind == "moe":
            assert np.abs(np.asarray(layer_view(model.params, cfg, i)["moe"]["router_bias"])).max() > 0


def test_held_out_loss_is_well_below_uniform(model: M3Model, tokenizer: Tokenizer) -> None:
    ids = _held_out_ids(tokenizer, 256)
    nll = _nll(model, ids)
    assert nll < 0.6 * math.log(model.cfg.vocab_size), nll
    # The shipped weights are bf16 on disk: computing in bf16 must not lose what was learned.
    assert abs(_nll(load_model(dtype="bfloat16"), ids) - nll) < 0.1


def test_msa_drops_blocks_on_200_tokens(model: M3Model, tokenizer: Tokenizer) -> None:
    cfg = model.cfg
    ids = _held_out_ids(tokenizer, 200)
    pos = np.arange(ids.shape[1])
    visible = pos // cfg.index_block_size + 1
    for layer, sel in model.block_selections(ids).items():  # [1, kv_heads, T, topk]
        chosen = (sel[0] >= 0).sum(-1)  # [kv_heads, T]
        np.testing.assert_array_equal(chosen, np.minimum(visible, cfg.index_topk_blocks)[None].repeat(
            cfg.num_kv_heads, 0))
        assert (visible > cfg.index_topk_blocks).sum() > 100  # most rows really drop blocks
        # Each row keeps its own (local) block and only blocks it can see.
        assert ((sel[0] == (pos // cfg.index_block_size)[None, :, None]).any(-1)).all(), layer
        assert (sel[0] <= (pos // cfg.index_block_size)[None, :, None]).all(), layer
