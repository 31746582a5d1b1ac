"""checkpoints/: safetensors I/O, the HF name table in 3 spellings, MXFP8, errors, tiny checkpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jinja2.sandbox
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from tokenizers import Tokenizer

from checkpoints import (
    CheckpointError,
    dequantize_mxfp8,
    load_params,
    make_tiny_checkpoint,
    quantize_mxfp8,
    read_config,
    write_checkpoint,
)
from checkpoints.names import LAYOUTS, hf_view, param_slot, tensor_rules
from checkpoints.safetensors_io import LazyTensor, SafetensorsFile, write_file
from checkpoints.shards import INDEX_NAME
from m3jax.config import M3Config, preset
from m3jax.params import layer_view, map_specs, param_specs, random_params, spec_dtype

LAYOUT_NAMES = tuple(LAYOUTS)
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3JAX_NO_PROGRESS", "1")


@pytest.fixture(scope="module")
def cfg() -> M3Config:
    return preset("m3-tiny")


@pytest.fixture(scope="module")
def params(cfg: M3Config) -> dict[str, Any]:
    return random_params(cfg, seed=1)


def _leaves(tree: Any) -> list[tuple[str, np.ndarray]]:
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_tree_equal(got: Any, want: Any) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), (_, b) in zip(_leaves(got), _leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (path, a.shape, a.dtype, b.shape, b.dtype)
        np.testing.assert_array_equal(a, b, err_msg=path)


def _assert_matches_specs(cfg: M3Config, params: Any, dtype: str) -> None:
    specs = param_specs(cfg)
    expected = map_specs(lambda s: (s.shape, spec_dtype(s, dtype)), specs)
    got = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert jax.tree.structure(params) == jax.tree.structure(map_specs(lambda s: 0, specs))
    assert jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, tuple))


def _header(directory: Path) -> dict[str, Any]:
    """name -> TensorInfo over all shards."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with SafetensorsFile(f) as st:
            out.update(st.tensors)
    return out


def _rewrite(directory: Path, edit: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
    """Apply `edit` to the tensors of a single-file checkpoint and write it back."""
    path = directory / "model.safetensors"
    with SafetensorsFile(path) as st:
        tensors = {n: np.array(st.get(n)) for n in st.tensors}
    tensors = edit(tensors)
    write_file(path, [LazyTensor(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])


# ---- the name table --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("fused", [False, True])
def test_table_covers_every_param_element_exactly_once(cfg: M3Config, layout: str, fused: bool) -> None:
    lay = LAYOUTS[layout]
    rules = tensor_rules(cfg, lay, present=None)
    if fused != lay.fused_mlp:  # the other MLP spelling, as a loader would pick it from the names present
        names = {n.replace(".gate_proj.", ".gate_up_proj.") for n in rules} if fused else set()
        rules = tensor_rules(cfg, lay, present=names)
    counts = map_specs(lambda s: np.zeros(s.shape, np.int32), param_specs(cfg))
    for rule in rules.values():
        hf = np.zeros(rule.shape, np.int8)
        for e in range(rule.shape[0]) if rule.stacked else [None]:
            for piece in rule.pieces:
                view = hf_view(hf if e is None else hf[e], piece)
                slot = param_slot(counts, piece, e)
                assert slot.size == view.size, (rule.name, slot.shape, view.shape)
                slot += 1
    for path, c in _leaves(counts):
        assert (c == 1).all(), path


def test_transformers_names_match_reference_save_layout(cfg: M3Config) -> None:
    # Spot-check of names seen in MiniMaxM3VLForCausalLM.save_pretrained (transformers 5.24) output.
    names = set(tensor_rules(cfg, LAYOUTS["transformers"]))
    for n in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.1.self_attn.indexer.q_proj.weight",
              "model.layers.1.self_attn.indexer.k_norm.weight",
              "model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
              "model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj",
              "model.layers.2.mlp.shared_experts.gate_up_proj.weight"]:
        assert n in names, n
    released = set(tensor_rules(cfg, LAYOUTS["released"]))
    for n in ["language_model.model.layers.2.block_sparse_moe.experts.7.w3.weight",
              "language_model.model.layers.2.block_sparse_moe.e_score_correction_bias",
              "language_model.model.layers.1.self_attn.index_k_proj.weight", "language_model.lm_head.weight"]:
        assert n in released, n


# ---- round trips -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("sharded", [False, True])
def test_round_trip_float32(tmp_path: Path, cfg: M3Config, params: dict, layout: str, sharded: bool) -> None:
    write_checkpoint(tmp_path, cfg, params, layout=layout, max_shard_bytes=40_000 if sharded else None)
    if sharded:
        index = json.loads((tmp_path / INDEX_NAME).read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 3 and all((tmp_path / s).is_file() for s in shards)
        assert index["metadata"]["total_size"] == sum(i.end - i.start for i in _header(tmp_path).values())
    else:
        assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    got_cfg, got = load_params(tmp_path)
    assert got_cfg == cfg == read_config(tmp_path)
    _assert_matches_specs(cfg, got, "float32")
    _assert_tree_equal(got, params)


@pytest.mark.parametrize("mxfp8", [False, True])
def test_threaded_copy_path(tmp_path: Path, cfg: M3Config, params: dict, monkeypatch: pytest.MonkeyPatch,
                            mxfp8: bool) -> None:
    """Big Linears are copied by several threads in row blocks; force that path on the tiny model."""
    import checkpoints.loader

    write_checkpoint(tmp_path, cfg, params, layout="transformers", mxfp8=mxfp8)
    _, serial = load_params(tmp_path)
    monkeypatch.setattr(checkpoints.loader, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(checkpoints.loader, "_ROW_BLOCK", 8)
    monkeypatch.setattr(checkpoints.loader.os, "cpu_count", lambda: 3)
    _, threaded = load_params(tmp_path)
    _assert_tree_equal(threaded, serial)
    if not mxfp8:
        _assert_tree_equal(threaded, params)


def test_rewrite_replaces_stale_shards(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    write_checkpoint(tmp_path, cfg, params, max_shard_bytes=40_000)
    write_checkpoint(tmp_path, cfg, params)  # a stale index would otherwise shadow the new single file
    assert not (tmp_path / INDEX_NAME).exists() and len(list(tmp_path.glob("*.safetensors"))) == 1
    _assert_tree_equal(load_params(tmp_path)[1], params)


@pytest.mark.parametrize("layout", ["released", "transformers"])
def test_round_trip_bfloat16(tmp_path: Path, cfg: M3Config, params: dict, layout: str) -> None:
    write_checkpoint(tmp_path, cfg, params, layout=layout, dtype="bfloat16")
    header = _header(tmp_path)
    prefix = LAYOUTS[layout].prefix
    assert header[f"{prefix}layers.0.self_attn.q_proj.weight"].dtype == "BF16"
    assert header[f"{prefix}norm.weight"].dtype == "BF16"
    router = "block_sparse_moe.gate.weight" if layout == "released" else "mlp.gate.weight"
    assert header[f"{prefix}layers.2.{router}"].dtype == "F32"  # the router stays fp32, as released

    _, got = load_params(tmp_path, dtype="bfloat16")
    _assert_matches_specs(cfg, got, "bfloat16")
    want = map_specs(lambda s: s, param_specs(cfg))
    want = jax.tree.map(lambda spec, p: p.astype(spec_dtype(spec, "bfloat16")), want, params,
                        is_leaf=lambda x: not isinstance(x, dict | list))
    _assert_tree_equal(got, want)
    np.testing.assert_array_equal(layer_view(got, cfg, 2)["moe"]["router"], layer_view(params, cfg, 2)["moe"]["router"])

    _, got32 = load_params(tmp_path, dtype="float32")  # bf16 on disk, fp32 compute
    _assert_tree_equal(got32, jax.tree.map(lambda a: a.astype(np.float32), want))


def test_tied_embeddings(tmp_path: Path, cfg: M3Config) -> None:
    tied = cfg.replace(tie_word_embeddings=True)
    p = random_params(tied, seed=2)
    p["lm_head"] = p["embed"].T.copy()
    write_checkpoint(tmp_path, tied, p, layout="transformers")
    assert "lm_head.weight" not in _header(tmp_path)
    got_cfg, got = load_params(tmp_path)
    assert got_cfg.tie_word_embeddings
    _assert_tree_equal(got, p)


def test_transformers_split_mlp_spelling_loads(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    """transformers may save dense/shared MLPs as separate gate_proj/up_proj: both spellings load."""
    write_checkpoint(tmp_path, cfg, params, layout="transformers")

    def split(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for n, a in t.items():
            if n.endswith(".gate_up_proj.weight"):
                f = a.shape[0] // 2
                out[n.replace("gate_up_proj", "gate_proj")] = a[:f]
                out[n.replace("gate_up_proj", "up_proj")] = a[f:]
            else:
                out[n] = a
        return out

    _rewrite(tmp_path, split)
    assert "model.layers.0.mlp.gate_proj.weight" in _header(tmp_path)
    _assert_tree_equal(load_params(tmp_path)[1], params)


def test_vision_and_mtp_tensors_are_skipped(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    write_checkpoint(tmp_path, cfg, params, layout="released")
    extra = {"vision_tower.vision_model.pre_layrnorm.weight": np.ones(4, np.float32),
             "multi_modal_projector.linear_1.bias": np.ones(4, np.float32),
             "patch_merge_mlp.linear_2.weight": np.ones((4, 4), np.float32),
             "language_model.model.mtp.0.norm.weight": np.ones(4, np.float32)}
    _rewrite(tmp_path, lambda t: {**t, **extra})
    _assert_tree_equal(load_params(tmp_path)[1], params)


def test_safetensors_interop(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    # Our files read with the reference reader, and a reference-written file of every plain dtype with ours.
    write_checkpoint(tmp_path, cfg, params, layout="transformers")
    ref = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(ref["model.embed_tokens.weight"], params["embed"])
    arrays = {"f16": np.arange(6, dtype=np.float16).reshape(2, 3), "i64": np.arange(5, dtype=np.int64) - 2,
              "u8": np.arange(7, dtype=np.uint8), "f64": np.linspace(0, 1, 4), "b": np.array([True, False])}
    safetensors.numpy.save_file(arrays, tmp_path / "ref.safetensors")
    with SafetensorsFile(tmp_path / "ref.safetensors") as st:
        for n, a in arrays.items():
            np.testing.assert_array_equal(st.get(n), a)
            assert st.get(n).dtype == a.dtype


def test_own_writer_handles_ml_dtypes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    arrays = {"bf16": x.astype(BF16), "fp8": x.astype(ml_dtypes.float8_e4m3fn),
              "e8m0": np.array([1.0, 0.5, 4.0], dtype=ml_dtypes.float8_e8m0fnu), "empty": np.zeros((0, 4))}
    write_file(tmp_path / "x.safetensors", [LazyTensor(n, a.shape, a.dtype, lambda a=a: a)
                                            for n, a in arrays.items()])
    with SafetensorsFile(tmp_path / "x.safetensors") as st:
        assert {n: i.dtype for n, i in st.tensors.items()} == {"bf16": "BF16", "fp8": "F8_E4M3",
                                                              "e8m0": "F8_E8M0", "empty": "F64"}
        for n, a in arrays.items():
            np.testing.assert_array_equal(st.get(n).astype(np.float32), a.astype(np.float32))


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize(("fixture", "layout"), [("text_tiny", "transformers"), ("vl_tiny", "released")])
def test_transformers_saved_checkpoints(tmp_path: Path, fixture: str, layout: str) -> None:
    """Checkpoints saved by transformers' save_pretrained (tests/fixtures) load, and writing them back in the
    same layout reproduces every text-backbone tensor: same names, shapes and values."""
    src = FIXTURES / fixture
    if not (src / "config.json").is_file():
        pytest.skip(f"{src} not present")
    cfg, got = load_params(src)
    _assert_matches_specs(cfg, got, "float32")
    write_checkpoint(tmp_path, cfg, got, layout=layout)
    ours = _header(tmp_path)
    theirs = {n: i for n, i in _header(src).items() if not n.startswith(("vision_tower.", "multi_modal_",
                                                                          "patch_merge_mlp."))}
    assert set(ours) == set(theirs)
    for name, info in theirs.items():
        with SafetensorsFile(info.file) as a, SafetensorsFile(ours[name].file) as b:
            np.testing.assert_array_equal(b.get(name), a.get(name), err_msg=name)


# ---- MXFP8 -----------------------------------------------------------------------------------------------


def test_quantize_mxfp8_rule() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 80)).astype(np.float32)  # 80 = 2 full blocks + a partial one
    w[1, :32] = 0.0  # an all-zero block
    w[2, 5] = 1000.0  # a block whose max lands on e4m3's saturation edge
    fp8, scale = quantize_mxfp8(w)
    assert fp8.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and fp8.shape == w.shape
    assert scale.dtype == np.uint8 and scale.shape == (8, 3)
    amax = np.abs(np.pad(w, [(0, 0), (0, 16)]).reshape(8, 3, 32)).max(-1)
    nz = amax > 0
    # Shared exponent = floor(log2 amax) - 8 (e4m3's emax), biased by 127.
    np.testing.assert_array_equal(scale[nz].astype(int) - 127, np.floor(np.log2(amax[nz])).astype(int) - 8)
    assert scale[1, 0] == 0 and not np.any(fp8[1, :32].astype(np.float32))
    back = dequantize_mxfp8(fp8, scale)
    assert np.isfinite(back).all()
    step = np.repeat(np.exp2(scale.astype(np.float64) - 127), 32, axis=1)[:, :80]
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 when rounding, <= 2^-3 at saturation (>448 -> 448);
    # values in e4m3's subnormal range carry an absolute error of half the subnormal step
    # (2^-10 * block scale).
    assert np.all(np.abs(back - w) <= 2.0**-3 * np.abs(w) + 2.0**-10 * step)
    # Re-quantising the dequantised weights is exact (idempotent).
    fp8_2, scale_2 = quantize_mxfp8(back)
    np.testing.assert_array_equal(scale_2, scale)
    np.testing.assert_array_equal(fp8_2.view(np.uint8), fp8.view(np.uint8))
    # Scales stored as float8_e8m0fnu (torch's dtype for them) mean the same bits.
    e8m0 = scale.view(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(dequantize_mxfp8(fp8, e8m0), back)


def test_dequantize_mxfp8_stacked_leading_dims() -> None:
    w = np.random.default_rng(1).normal(size=(3, 4, 64)).astype(np.float32)
    fp8, scale = quantize_mxfp8(w)
    assert scale.shape == (3, 4, 2)
    np.testing.assert_array_equal(dequantize_mxfp8(fp8, scale)[1], dequantize_mxfp8(fp8[1], scale[1]))


@pytest.mark.parametrize("layout", ["released", "transformers"])
def test_mxfp8_checkpoint(tmp_path: Path, cfg: M3Config, layout: str) -> None:
    cfg_w, params = make_tiny_checkpoint(tmp_path, cfg, seed=3, layout=layout, dtype="bfloat16", mxfp8=True,
                                         max_shard_bytes=30_000)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp8"
    assert config["quantization_config"]["weight_block_size"] == [1, 32]
    header = _header(tmp_path)
    lay = LAYOUTS[layout]
    p = lay.prefix
    released = layout == "released"
    moe = f"{p}layers.2.block_sparse_moe." if released else f"{p}layers.2.mlp."
    quantised = [f"{p}layers.1.self_attn.q_proj.weight", f"{p}layers.1.self_attn.o_proj.weight",
                 f"{p}layers.1.self_attn.index_q_proj.weight" if released
                 else f"{p}layers.1.self_attn.indexer.q_proj.weight",
                 f"{moe}experts.3.w1.weight" if released else f"{moe}experts.gate_up_proj",
                 f"{moe}shared_experts.down_proj.weight",
                 f"{p}layers.0.mlp.gate_proj.weight" if released else f"{p}layers.0.mlp.gate_up_proj.weight"]
    for n in quantised:
        assert header[n].dtype == "F8_E4M3", n
        assert header[n + "_scale_inv"].dtype == "U8", n
    assert header[f"{moe}gate.weight"].dtype == "F32" and f"{moe}gate.weight_scale_inv" not in header
    for n in [f"{p}embed_tokens.weight", lay.lm_head, f"{p}norm.weight"]:
        assert header[n].dtype == "BF16", n

    got_cfg, got = load_params(tmp_path)
    assert got_cfg == cfg_w
    _assert_matches_specs(cfg_w, got, "float32")
    # Router weight and bias: fp32 on disk, bit-exact.
    for layer in (2, 3):
        for key in ("router", "router_bias"):
            want = layer_view(params, cfg_w, layer)["moe"][key]
            np.testing.assert_array_equal(layer_view(got, cfg_w, layer)["moe"][key], want)
    # Unquantised bf16 tensors: bf16 rounding only.
    np.testing.assert_array_equal(got["embed"], params["embed"].astype(BF16).astype(np.float32))
    # Quantised tensors: within MXFP8 rounding of the original weights: relative 2^-3 (e4m3's step), plus
    # half a subnormal step (2^-10 * block scale) for elements tiny next to their block's max. The block
    # scale is at most 2^(floor(log2(tensor amax)) - 8).
    originals = dict(_leaves(params))
    for path, a in _leaves(got):
        if "norm" in path or "router" in path or path in ("['embed']", "['lm_head']"):
            continue
        w = originals[path]
        max_scale = 2.0 ** (np.floor(np.log2(np.abs(w).max())) - 8)
        assert np.all(np.abs(a - w) <= 2.0**-3 * np.abs(w) + 2.0**-10 * max_scale), path
        assert not np.array_equal(a, w), path  # it really went through fp8

    # Exact equality with dequantize_mxfp8 of the stored data, mapped by hand ([out, in] -> [in, out]).
    def stored(name: str) -> np.ndarray:
        info = header[name]
        scale_info = header[name + "_scale_inv"]
        with SafetensorsFile(info.file) as a, SafetensorsFile(scale_info.file) as b:
            return dequantize_mxfp8(np.array(a.get(name)), np.array(b.get(scale_info.name)))

    d, h, hd = cfg_w.hidden_size, cfg_w.num_heads, cfg_w.head_dim
    np.testing.assert_array_equal(layer_view(got, cfg_w, 1)["attn"]["wq"],
                                  stored(quantised[0]).T.reshape(d, h, hd))
    f = cfg_w.moe_intermediate_size
    if released:
        np.testing.assert_array_equal(layer_view(got, cfg_w, 2)["moe"]["w_gate"][3], stored(quantised[3]).T)
    else:
        gate_up = stored(quantised[3])  # [E, 2F, D], gate rows first
        np.testing.assert_array_equal(layer_view(got, cfg_w, 2)["moe"]["w_gate"], gate_up[:, :f].transpose(0, 2, 1))
        np.testing.assert_array_equal(layer_view(got, cfg_w, 2)["moe"]["w_up"], gate_up[:, f:].transpose(0, 2, 1))
    np.testing.assert_array_equal(layer_view(got, cfg_w, 2)["moe"]["shared"]["w_down"], stored(quantised[4]).T)


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path, cfg: M3Config, params: dict) -> Path:
    write_checkpoint(tmp_path, cfg, params, layout="released")
    return tmp_path


def test_error_missing_tensor(ckpt: Path) -> None:
    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight"
    _rewrite(ckpt, lambda t: {n: a for n, a in t.items() if n != name})
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_params(ckpt)


def test_error_unexpected_tensor(ckpt: Path) -> None:
    name = "language_model.model.layers.0.self_attn.gate_proj.weight"
    _rewrite(ckpt, lambda t: {**t, name: np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match=rf"unexpected tensor '{name}' in model\.safetensors"):
        load_params(ckpt)


def test_error_wrong_shape(ckpt: Path) -> None:
    name = "language_model.model.layers.1.self_attn.index_k_proj.weight"
    _rewrite(ckpt, lambda t: {**t, name: t[name][:8]})
    with pytest.raises(CheckpointError, match=rf"'{name}' in model\.safetensors: expected shape \[16, 64\], "
                                              r"found \[8, 64\]"):
        load_params(ckpt)


def test_error_config_disagrees_with_tensors(ckpt: Path, cfg: M3Config) -> None:
    with pytest.raises(CheckpointError, match=r"expected shape \[1024, 64\], found \[512, 64\]"):
        load_params(ckpt, cfg=cfg.replace(vocab_size=1024))


def test_error_unsupported_dtype(ckpt: Path) -> None:
    name = "language_model.model.norm.weight"
    _rewrite(ckpt, lambda t: {**t, name: t[name].astype(np.int32)})
    with pytest.raises(CheckpointError, match=f"'{name}'.*unsupported dtype I32"):
        load_params(ckpt)


def test_error_fp8_without_scale(ckpt: Path) -> None:
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    _rewrite(ckpt, lambda t: {**t, name: t[name].astype(ml_dtypes.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=f"'{name}'.*F8_E4M3 without its scale '{name}_scale_inv'"):
        load_params(ckpt)


def test_error_missing_shard_file(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    write_checkpoint(tmp_path, cfg, params, max_shard_bytes=40_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file '{victim.name}' \(listed for tensor '[^']+'\) "
                                              "does not exist"):
        load_params(tmp_path)


def test_error_not_a_checkpoint(tmp_path: Path, cfg: M3Config, params: dict) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        load_params(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_released_dict()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        load_params(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors: header length"):
        load_params(tmp_path)


def test_error_unsupported_quantization(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quant_method 'fp8' is not supported"):
        load_params(ckpt)


# ---- make_tiny_checkpoint --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, M3Config, dict]:
    path = tmp_path_factory.mktemp("tiny")
    cfg, params = make_tiny_checkpoint(path)
    return path, cfg, params


def test_tiny_checkpoint_files(tiny: tuple[Path, M3Config, dict]) -> None:
    path, cfg, params = tiny
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "generation_config.json"]:
        assert (path / name).is_file(), name
    assert read_config(path) == cfg
    _assert_tree_equal(load_params(path)[1], params)
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg["add_bos_token"] is False
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("]~!b[", "[e~[")
    assert tok_cfg["chat_template"] == (path / "chat_template.jinja").read_text()
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg.bos_token_id, cfg.eos_token_ids[0])


def test_tiny_tokenizer(tiny: tuple[Path, M3Config, dict]) -> None:
    path, cfg, _ = tiny
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg.vocab_size
    for text in ["def f(x):\n    return x + 1  # ok\n", "Héllo wörld — 你好, 12345!", "  spaces\t\ttabs\n\n"]:
        ids = tok.encode(text).ids
        assert max(ids) < cfg.vocab_size
        assert tok.decode(ids, skip_special_tokens=False) == text
    specials = {t: tok.token_to_id(t) for t in ["]~!b[", "]~b]", "[e~[", "<mm:think>", "</mm:think>"]}
    for t, i in specials.items():
        assert i is not None and tok.encode(t).ids == [i], t
    assert specials["]~!b["] == cfg.bos_token_id
    assert cfg.eos_token_ids == (specials["[e~["],)
    config = json.loads((path / "config.json").read_text())["text_config"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (specials["]~!b["], specials["[e~["])


def test_tiny_chat_template(tiny: tuple[Path, M3Config, dict]) -> None:
    path, cfg, _ = tiny
    # Rendered the way transformers renders chat templates.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string((path / "chat_template.jinja").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    text = template.render(messages=messages, add_generation_prompt=True)
    assert text == ("]~!b[]~b]system\nBe brief.[e~[\n]~b]user\nHi[e~[\n]~b]ai\nHello![e~[\n"
                    "]~b]user\nBye[e~[\n]~b]ai\n")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert ids[0] == cfg.bos_token_id and ids.count(cfg.bos_token_id) == 1
    assert ids.count(cfg.eos_token_ids[0]) == 4


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    from checkpoints.tokenizer import train_tokenizer

    assert train_tokenizer(600).to_str() == train_tokenizer(600).to_str()
