"""EAGLE-3 draft checkpoints (SpecForge / TorchSpec / vLLM layout) <-> the params tree of `m3jax.eagle`.

A draft directory is config.json (`LlamaForCausalLMEagle3`) plus safetensors, one file or shards with an index,
weights bf16 / fp16 / fp32. Tensor names, HF orientation `[out, in]` for Linears:

    fc.weight [D, A*Dt]                         fc_norm.{a}.weight [Dt] (EAGLE-3.1)   input_norm.weight [A*Dt]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [D]
    midlayer.self_attn.{q,k,v}_proj.weight [heads*hd, 2D]   midlayer.self_attn.o_proj.weight [D, H*hd]
    midlayer.mlp.{gate,up}_proj.weight [F, D]   midlayer.mlp.down_proj.weight [D, F]
    norm.weight [D]   lm_head.weight [Vd, D]   embed_tokens.weight [V, D]   d2t [Vd] int64   t2d [V] bool

`midlayer.` is SpecForge's and TorchSpec's native prefix; TorchSpec's vLLM export writes `layers.0.` instead
(`tools/convert_to_hf.py`), and vLLM / tokenspeed accept both, so loading does too (writing picks one). `d2t` /
`t2d` exist only when the draft vocabulary is pruned; `embed_tokens` / `lm_head` may be absent (the target's are
shared). Same error standard as the target loader: a missing, unexpected, mis-shaped or mistyped tensor names itself
and its file, from the headers alone, before any data is read.

The published M3 drafts (`inferact_config`): only their widths (hidden 6144, vocab 200064, aux layers 2/30/57),
attention kinds (64 vs 4 KV heads), EAGLE-3.1 style (fc_norm + norm_output) and the GQA file's size are known; the
rest is derived and marked unverified there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from checkpoints.errors import CheckpointError
from checkpoints.safetensors_io import LazyTensor, SafetensorsFile, TensorInfo
from checkpoints.shards import open_checkpoint_files, write_checkpoint_files
from m3jax.config import ConfigError
from m3jax.eagle import DraftConfig, draft_param_specs, draft_spec_dtype, vocab_mapping
from m3jax.params import ParamSpec, map_specs

LAYER_PREFIXES = ("midlayer.", "layers.0.")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_INT_DTYPES = ("I64", "I32")
_LOAD_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}
_STORE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


# ---- the published M3 drafts -------------------------------------------------------------------------------

def inferact_config(gqa: bool = True) -> dict[str, Any]:
    """config.json of `Inferact/MiniMax-M3-EAGLE3-GQA` (gqa=True) or `Inferact/MiniMax-M3-EAGLE3` (MHA), as far as
    it is known. Known (model cards, m3-spec §5): LlamaForCausalLMEagle3, 1 layer, hidden 6144, vocab 200064, KV
    heads 64 (MHA) / 4 (GQA), aux layers (2, 30, 57), EAGLE-3.1 per-aux fc_norm and norm_output (tokenspeed PR #751
    needed both to load it), trained with TorchSpec; the GQA file is 6,149,993,396 bytes of bf16.

    Unverified, chosen to fit: 64 query heads x head_dim 128 (the target's attention shape) and intermediate_size
    18432 (= 3 x hidden, the ratio of TorchSpec's own MiniMax template `configs/draft_models/minimax_m25_eagle3.json`:
    3072 -> 9216). With a stored embedding, a full 200064-row lm_head and no d2t/t2d these give 3,074,992,128 bf16
    parameters = 6,149,984,256 bytes, 9,140 bytes short of the GQA file (its header), and MHA's extra 60 KV heads
    add 188.7M (the "~3.3B" of the MHA card). rms_norm_eps 1e-6, rope_theta 5e6 and max_position_embeddings are
    TorchSpec's copies of the target's values (`generate_draft_model_config`): unverified too."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 6144,
        "num_attention_heads": 64,  # unverified
        "num_key_value_heads": 4 if gqa else 64,
        "head_dim": 128,  # unverified
        "intermediate_size": 18432,  # unverified
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,  # unverified
        "rope_theta": 5_000_000.0,  # unverified
        "rope_scaling": None,  # unverified
        "max_position_embeddings": 1048576,  # unverified
        "vocab_size": 200064,
        "draft_vocab_size": 200064,  # unverified (a pruned vocabulary would not fit the file size)
        "target_hidden_size": 6144,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 57], "use_aux_hidden_state": True},
        "fc_norm": True,
        "norm_output": True,
        "torch_dtype": "bfloat16",
    }


def inferact_draft_config(gqa: bool = True) -> DraftConfig:
    """The DraftConfig the published file holds (by the size arithmetic above: own embedding and lm_head)."""
    return DraftConfig.from_hf_dict(inferact_config(gqa)).replace(own_embed=True)


# ---- the name table ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DraftTensor:
    """One checkpoint tensor: its name, its shape on disk, the param it fills and how."""

    name: str
    shape: tuple[int, ...]
    path: tuple[str | int, ...]  # into the params tree; a trailing int picks one row of a stacked param (fc_norm)
    linear: bool  # HF [out, in] -> ours [in, out] (then reshaped to split head / aux axes)
    kind: str  # "float", "int" (d2t) or "bool" (t2d)


def tensor_table(dcfg: DraftConfig, prefix: str = "midlayer.") -> dict[str, DraftTensor]:
    """Every tensor of `dcfg`'s checkpoint, by name, in file order."""
    d, h, k, hd, f = dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size
    a, dt = dcfg.num_aux, dcfg.target_hidden_size
    p = prefix

    def lin(name: str, shape: tuple[int, int], *path: str) -> DraftTensor:
        return DraftTensor(name, shape, path, True, "float")

    def copy(name: str, shape: tuple[int, ...], *path: str | int, kind: str = "float") -> DraftTensor:
        return DraftTensor(name, shape, path, False, kind)

    rules: list[DraftTensor] = []
    if dcfg.own_embed:
        rules.append(copy("embed_tokens.weight", (dcfg.vocab_size, d), "embed"))
    if dcfg.norm_before_fc:
        rules.append(copy("input_norm.weight", (a * dt,), "aux_norm"))
    if dcfg.fc_norm:
        rules += [copy(f"fc_norm.{i}.weight", (dt,), "fc_norm", i) for i in range(a)]
    rules += [
        lin("fc.weight", (d, a * dt), "fc"),
        copy(f"{p}input_layernorm.weight", (d,), "layer", "input_norm"),
        copy(f"{p}hidden_norm.weight", (d,), "layer", "hidden_norm"),
        copy(f"{p}post_attention_layernorm.weight", (d,), "layer", "post_attn_norm"),
        lin(f"{p}self_attn.q_proj.weight", (h * hd, 2 * d), "layer", "attn", "wq"),
        lin(f"{p}self_attn.k_proj.weight", (k * hd, 2 * d), "layer", "attn", "wk"),
        lin(f"{p}self_attn.v_proj.weight", (k * hd, 2 * d), "layer", "attn", "wv"),
        lin(f"{p}self_attn.o_proj.weight", (d, h * hd), "layer", "attn", "wo"),
        lin(f"{p}mlp.gate_proj.weight", (f, d), "layer", "mlp", "w_gate"),
        lin(f"{p}mlp.up_proj.weight", (f, d), "layer", "mlp", "w_up"),
        lin(f"{p}mlp.down_proj.weight", (d, f), "layer", "mlp", "w_down"),
        copy("norm.weight", (d,), "final_norm"),
    ]
    if dcfg.own_lm_head:
        rules.append(lin("lm_head.weight", (dcfg.draft_vocab_size, d), "lm_head"))
    if dcfg.vocab_map:
        rules += [copy("d2t", (dcfg.draft_vocab_size,), "d2t", kind="int"),
                  copy("t2d", (dcfg.vocab_size,), "t2d", kind="bool")]
    return {r.name: r for r in rules}


def _slot(params: dict[str, Any], rule: DraftTensor) -> np.ndarray:
    node: Any = params
    for key in rule.path:
        node = node[key]
    return node


def detect_prefix(names: list[str]) -> str:
    """`midlayer.` or `layers.0.`, from a checkpoint's tensor names (`midlayer.` when neither appears: the missing
    tensors are then reported under the native names)."""
    found = [p for p in LAYER_PREFIXES if any(n.startswith(p) for n in names)]
    if len(found) > 1:
        raise CheckpointError(f"checkpoint mixes {' and '.join(repr(p) for p in found)} decoder-layer tensor names")
    return found[0] if found else LAYER_PREFIXES[0]


# ---- loading -----------------------------------------------------------------------------------------------

def _read_raw_config(directory: Path) -> tuple[Path, dict[str, Any]]:
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (not a draft checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method") if isinstance(raw["quantization_config"], dict) \
            else raw["quantization_config"]
        raise CheckpointError(f"{path}: quantization_config {method!r} is not supported for drafts "
                              "(bf16 / fp16 / fp32 weights only)")
    return path, raw


def read_draft_config(path: str | os.PathLike[str], target_num_layers: int | None = None) -> DraftConfig:
    """The DraftConfig of a draft directory: its config.json, with the optional tensors and any norm flag whose key
    is absent decided by the tensors its safetensors headers list."""
    directory = Path(path)
    config_path, raw = _read_raw_config(directory)
    files = open_checkpoint_files(directory)
    try:
        return DraftConfig.from_hf_dict(raw, target_num_layers, present=list(files.tensors))
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from e


def _check(rule: DraftTensor, info: TensorInfo) -> None:
    where = f"tensor {rule.name!r} in {info.file.name}"
    if info.shape != rule.shape:
        raise CheckpointError(f"{where}: expected shape {list(rule.shape)}, found {list(info.shape)}")
    allowed = {"float": _FLOAT_DTYPES, "int": _INT_DTYPES, "bool": ("BOOL",)}[rule.kind]
    if info.dtype not in allowed:
        raise CheckpointError(f"{where}: unsupported dtype {info.dtype} (expected one of {allowed})")


def load_draft(path: str | os.PathLike[str], dtype: str = "float32",
               target_num_layers: int | None = None) -> tuple[DraftConfig, dict[str, Any]]:
    """Load a draft directory: (DraftConfig, host numpy params matching `draft_param_specs(dcfg)` exactly).

    `dtype` is the compute dtype of the float weights; d2t loads as int32 offsets, t2d as bool (derived from d2t
    when the file has none, checked against it when it has). Everything is validated from the headers first."""
    directory = Path(path)
    if dtype not in _LOAD_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_LOAD_DTYPES)}, got {dtype!r}")
    config_path, raw = _read_raw_config(directory)
    files = open_checkpoint_files(directory)
    present = files.tensors
    try:
        dcfg = DraftConfig.from_hf_dict(raw, target_num_layers, present=list(present))
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from e
    prefix = detect_prefix(list(present))
    table = tensor_table(dcfg, prefix)

    for name, info in present.items():
        if name not in table:
            raise CheckpointError(f"unexpected tensor {name!r} in {info.file.name} (not a tensor of this EAGLE-3 "
                                  f"draft config; decoder layer prefix {prefix!r})")
    optional = {"t2d"}  # derived from d2t when absent (vLLM never reads it)
    missing = [n for n in table if n not in present and n not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]!r}{more} in {directory} (EAGLE-3 draft, decoder layer "
                              f"prefix {prefix!r})")
    for name, rule in table.items():
        if name in present:
            _check(rule, present[name])

    params = map_specs(lambda s: np.empty(s.shape, draft_spec_dtype(s, _LOAD_DTYPES[dtype])),
                       draft_param_specs(dcfg))
    opened: dict[Path, SafetensorsFile] = {}
    try:
        for name, rule in table.items():
            if name not in present:
                continue
            info = present[name]
            if info.file not in opened:
                opened[info.file] = SafetensorsFile(info.file)
            data = opened[info.file].get(name)
            slot = _slot(params, rule)
            # Offsets are tiny; a value that does not fit int32 is a corrupt tensor, not a big vocabulary.
            if rule.kind == "int" and data.size and (data.min() < -(2 ** 31) or data.max() >= 2 ** 31):
                raise CheckpointError(f"tensor {name!r} in {info.file.name}: offsets outside int32")
            src = data.T if rule.linear else data
            np.copyto(slot, np.reshape(src, slot.shape), casting="unsafe")
    finally:
        for f in opened.values():
            f.close()

    if dcfg.vocab_map:
        d2t_where = f"tensor 'd2t' in {present['d2t'].file.name}"
        try:
            t2d = vocab_mapping(params["d2t"], dcfg.vocab_size)
        except ValueError as e:
            raise CheckpointError(f"{d2t_where}: {e}") from None
        if "t2d" in present:
            if not np.array_equal(params["t2d"], t2d):
                raise CheckpointError(f"tensor 't2d' in {present['t2d'].file.name}: does not mark exactly the "
                                      f"target ids that d2t maps to ({d2t_where})")
        else:
            params["t2d"][...] = t2d
    return dcfg, params


# ---- writing -----------------------------------------------------------------------------------------------

def _check_params(dcfg: DraftConfig, params: dict[str, Any]) -> None:
    specs = draft_param_specs(dcfg)

    def walk(spec: Any, node: Any, path: str) -> None:
        if isinstance(spec, ParamSpec):
            if tuple(np.shape(node)) != spec.shape:
                raise CheckpointError(f"param {path}: shape {list(np.shape(node))}, expected {list(spec.shape)}")
            return
        if not isinstance(node, dict) or set(node) != set(spec):
            got = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise CheckpointError(f"param {path or '<root>'}: keys {got} do not match draft_param_specs(dcfg) "
                                  f"{sorted(spec)}")
        for key in spec:
            walk(spec[key], node[key], f"{path}.{key}" if path else key)

    walk(specs, params, "")


def _assemble(rule: DraftTensor, params: dict[str, Any], store: np.dtype) -> np.ndarray:
    """One checkpoint tensor from its param (the loader's copy, run backwards)."""
    slot = np.asarray(_slot(params, rule))
    if rule.kind == "int":
        return slot.astype(np.int64).reshape(rule.shape)
    if rule.kind == "bool":
        return slot.astype(np.bool_).reshape(rule.shape)
    if rule.linear:
        out_dim, in_dim = rule.shape
        slot = slot.reshape(in_dim, out_dim).T
    return np.ascontiguousarray(slot.reshape(rule.shape)).astype(store)


def write_draft(out_dir: str | os.PathLike[str], dcfg: DraftConfig, params: dict[str, Any],
                dtype: str = "float32", max_shard_bytes: int | None = None, prefix: str = "midlayer.",
                extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json and the safetensors (sharded with an index when `max_shard_bytes` is given): the inverse
    of `load_draft`, driven by the same table. `dtype` is the float storage dtype; d2t is stored int64, t2d bool.
    `extra_config` keys are added to config.json (e.g. `torch_dtype`)."""
    if dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_STORE_DTYPES)}, got {dtype!r}")
    if prefix not in LAYER_PREFIXES:
        raise ValueError(f"prefix must be one of {LAYER_PREFIXES}, got {prefix!r}")
    _check_params(dcfg, params)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**dcfg.to_hf_dict(), "torch_dtype": dtype, **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    store = _STORE_DTYPES[dtype]
    tensors = []
    for rule in tensor_table(dcfg, prefix).values():
        dt = {"int": np.dtype(np.int64), "bool": np.dtype(np.bool_)}.get(rule.kind, store)
        tensors.append(LazyTensor(rule.name, rule.shape, dt, functools.partial(_assemble, rule, params, store)))
    write_checkpoint_files(out, tensors, max_shard_bytes)
    return out


# ---- random drafts (tests, GPU cost benchmarks) --------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _random_maker(dcfg: DraftConfig, dtype: str, scale: float) -> tuple[list[ParamSpec], Any, list[int], Any]:
    """The compiled draw of a config's float weights (cached: tests draw the same config many times)."""
    leaves, treedef = jax.tree.flatten(draft_param_specs(dcfg), is_leaf=lambda x: isinstance(x, ParamSpec))
    floats = [i for i, s in enumerate(leaves) if s.dtype_class == "compute"]
    sizes = [math.prod(leaves[i].shape) for i in floats]

    @jax.jit
    def make(key: jax.Array) -> list[jax.Array]:
        # One normal draw sliced per weight: a draw per weight would compile for seconds on a CPU.
        flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
        out, start = [], 0
        for i, n in zip(floats, sizes, strict=True):
            s = leaves[i]
            x = flat[start:start + n].reshape(s.shape)
            start += n
            x = 1.0 + 0.2 * x if s.init == "norm" else x * (scale / math.sqrt(s.fan_in))
            out.append(x.astype(draft_spec_dtype(s, dtype)))
        return out

    return leaves, treedef, floats, make


def random_draft_params(dcfg: DraftConfig, seed: int = 0, dtype: Any = jnp.float32,
                        scale: float = 1.0) -> dict[str, Any]:
    """Random weights drawn on the default device in one jitted call (seconds for a full-size draft on a GPU):
    matrices N(0, scale / fan_in), norm weights 1 + N(0, 0.2) (so a test sees a norm that is not the identity).
    A pruned vocabulary maps draft ids to a random sorted subset of the target's."""
    leaves, treedef, floats, make = _random_maker(dcfg, np.dtype(jnp.dtype(dtype)).name, scale)
    made = dict(zip(floats, make(jax.random.key(seed)), strict=True))
    if dcfg.vocab_map:
        rng = np.random.default_rng(seed)
        ids = np.sort(rng.choice(dcfg.vocab_size, dcfg.draft_vocab_size, replace=False))
        d2t = (ids - np.arange(dcfg.draft_vocab_size)).astype(np.int32)
        for i, s in enumerate(leaves):
            if s.axes == ("draft_vocab",):
                made[i] = jnp.asarray(d2t)
            elif s.axes == ("vocab_mask",):
                made[i] = jnp.asarray(vocab_mapping(d2t, dcfg.vocab_size))
    return jax.tree.unflatten(treedef, [made[i] for i in range(len(leaves))])
