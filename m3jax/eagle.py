"""The EAGLE-3 draft model: one Llama decoder layer that reads the target's hidden states and proposes tokens.

A draft step, read top to bottom (vLLM `llama_eagle3.py`, TorchSpec / SpecForge `LlamaForCausalLMEagle3`, with
the EAGLE-3.1 extensions):

    g = fc(fc_norm_a(aux_a) for each captured target layer a)        only the first pass of a target step
    e = input_layernorm(embed(next token));  h = hidden_norm(g or the draft's own previous hidden)
    x = residual + o_proj(attention(q/k/v_proj(cat[e, h]), RoPE, causal over the draft's own KV pages))
    x = x + mlp(post_attention_layernorm(x));  out = norm(x)
    logits = lm_head(out) over the draft vocabulary, placed at target ids i + d2t[i] (-inf elsewhere)
    next hidden = x (EAGLE-3) or out (EAGLE-3.1 `norm_output`)

`residual` is g, or hidden_norm(g) with `norm_before_residual`. Norms are standard Llama RMSNorm (weight times the
normalised input), not M3's Gemma (1 + w) form. The token embedding and, for a full-vocabulary draft, the lm_head
are the target's unless the draft stores its own.

Alignment (as in vLLM's proposer): the draft's query at position p carries the token that FOLLOWS position p (the
target's sampled token for the last position of a row, the next prompt token elsewhere) and the hidden state of
position p; its K/V goes to position p's slot, the same (page, offset) as the target's, and it predicts the token at
p + 2. A chained pass at p + 1 feeds the draft's own proposal and its own hidden state from p.

Three forms of one computation, sharing the projection and output code:
- `draft_step`: paged, over the target's flat ragged `Batch` (the engine's form; pure, jit-able, kernels static);
- `reference_forward`: dense causal attention over whole sequences (tests);
- `ttt_forward`: the training-time-test unroll over whole sequences (training, offline acceptance): pass i at index
  t sits at position t + i and attends to pass 0's keys at positions <= t plus its own chain's keys from passes
  1..i, exactly what chained drafting from position t sees.

Shape letters: A captured target layers, B sequences, S sequence, T tokens, D draft hidden, Dt target hidden,
H query heads, K KV heads, hd head dim, F MLP width, V target vocabulary, Vd draft vocabulary, L logit rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.batch import Batch
from m3jax.config import ConfigError
from m3jax.model import apply_rope
from m3jax.params import ParamSpec, map_specs
from pallas_kernels import ops

Params = dict[str, Any]

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # vLLM registers both names for one class
ROPE_TYPES = ("default", "linear", "llama3")

# The EAGLE-3.1 flags and where they are read. Established from the code that loads such drafts (2026):
# - `fc_norm`, `norm_output`: top-level booleans (vLLM llama_eagle3 `getattr(config, ...)`, tokenspeed PR #751,
#   TorchSpec `LlamaForCausalLMEagle3`, NeMo Automodel PR #2322, speculators PR #670); weights `fc_norm.{a}.weight`.
# - `norm_before_fc`: top-level, and inside `eagle_config` in NVIDIA's checkpoints (vLLM PR #42143 reads both);
#   weight `input_norm.weight` over the concatenated aux states (vLLM, tokenspeed).
# - `norm_before_residual`: top-level (vLLM, speculators); no weight of its own.
# When a flag's key is absent, the norm flags follow the checkpoint's tensors (a draft with `fc_norm.0.weight` has
# per-aux norms); `norm_output` and `norm_before_residual` leave no trace in the tensors and default to False, as
# every loader above does.
FLAG_KEYS = ("norm_output", "fc_norm", "norm_before_fc", "norm_before_residual")


# ---- config ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-3 draft: shapes, RoPE, EAGLE-3.1 flags, and which optional tensors it stores."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary: logits come back over it
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose input residual stream the draft reads, in fc order
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 scaling
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 2048
    norm_output: bool = False  # EAGLE-3.1: feed the post-norm hidden to the next chained pass
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux chunk before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    norm_before_residual: bool = False  # the residual is hidden_norm(g), not g
    own_embed: bool = False  # stores embed_tokens (else the target's embedding)
    own_lm_head: bool = True  # stores lm_head (else the target's; full vocabulary only)
    vocab_map: bool = False  # stores d2t / t2d (a draft vocabulary smaller than the target's)

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        for key in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                    "draft_vocab_size", "target_hidden_size"):
            need(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        need(self.num_heads % self.num_kv_heads == 0, "num_attention_heads",
             f"{self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        need(self.head_dim % 2 == 0, "head_dim", f"{self.head_dim} must be even (rotate-half RoPE)")
        need(self.draft_vocab_size <= self.vocab_size, "draft_vocab_size",
             f"{self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        need(len(self.aux_layer_ids) > 0, "eagle_aux_hidden_state_layer_ids", "must not be empty")
        need(self.rope_type in ROPE_TYPES, "rope_scaling", f"type {self.rope_type!r} is not supported "
             f"(supported: {ROPE_TYPES})")
        need(not (self.fc_norm and self.norm_before_fc), "fc_norm",
             "and norm_before_fc are mutually exclusive (both would normalise the aux states twice)")
        need(self.own_lm_head or self.draft_vocab_size == self.vocab_size, "draft_vocab_size",
             f"{self.draft_vocab_size} < vocab_size={self.vocab_size} needs the draft's own lm_head")
        need(self.vocab_map or self.draft_vocab_size == self.vocab_size, "draft_vocab_size",
             f"{self.draft_vocab_size} < vocab_size={self.vocab_size} needs a d2t mapping")
        need(self.own_embed or self.target_hidden_size == self.hidden_size, "target_hidden_size",
             f"{self.target_hidden_size} != hidden_size={self.hidden_size}: the draft cannot share the target's "
             "embedding and stores none")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def replace(self, **changes: Any) -> DraftConfig:
        return dataclasses.replace(self, **changes)

    def param_count(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(draft_param_specs(self), is_leaf=_is_spec)
                   if s.dtype_class == "compute")

    # ---- config.json -----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], target_num_layers: int | None = None,
                     present: Collection[str] | None = None) -> DraftConfig:
        """Parse a draft's config.json (SpecForge / TorchSpec / vLLM layout).

        `target_num_layers`: the target's depth, for the default aux layers (2, L // 2, L - 3) when the config
        names none. `present`: the checkpoint's tensor names; they decide which optional tensors the draft has and
        any norm flag whose key is absent. Without them: an own embedding only when the draft is narrower or wider
        than its target, an own lm_head, d2t iff the draft vocabulary is smaller.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError("config.json: must be an object")
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise ConfigError("eagle_config: must be an object")

        def get(key: str, default: Any = None, *, required: bool = False) -> Any:
            if raw.get(key) is not None:
                return raw[key]
            if required:
                raise ConfigError(f"{key}: missing from config.json")
            return default

        def either(key: str) -> Any:
            """A key that may sit at the top level or in eagle_config (NVIDIA writes both)."""
            top, inner = raw.get(key), eagle.get(key)
            if top is not None and inner is not None and top != inner:
                raise ConfigError(f"{key}: {top!r} at the top level but {inner!r} in eagle_config")
            return top if top is not None else inner

        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not any(a in ARCHITECTURES for a in archs):
            raise ConfigError(f"architectures: {archs!r} is not an EAGLE-3 Llama draft (expected one of "
                              f"{ARCHITECTURES})")
        if int(get("num_hidden_layers", 1)) != 1:
            raise ConfigError(f"num_hidden_layers: {raw['num_hidden_layers']} draft layers are not supported "
                              "(EAGLE-3 drafts have 1)")
        if get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: {raw['hidden_act']!r} is not supported (only 'silu')")
        for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if get(key, False):
                raise ConfigError(f"{key}: true is not supported")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ConfigError("eagle_config.use_aux_hidden_state: false (an EAGLE-1 style draft) is not supported")

        hidden = int(get("hidden_size", required=True))
        num_heads = int(get("num_attention_heads", required=True))
        vocab = int(get("vocab_size", required=True))
        draft_vocab = int(get("draft_vocab_size", vocab))

        ids = either("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            if target_num_layers is None:
                raise ConfigError("eagle_aux_hidden_state_layer_ids: missing from config.json, and no target depth "
                                  "was given for the default (2, L // 2, L - 3)")
            L = int(target_num_layers)
            ids = (2, L // 2, L - 3)
        if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids: {ids!r} must be a list of layer indices")

        rope = get("rope_scaling", None)
        rope_kw: dict[str, Any] = {}
        if rope is not None:
            if not isinstance(rope, Mapping):
                raise ConfigError("rope_scaling: must be an object or null")
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ConfigError(f"rope_scaling: type {kind!r} is not supported (supported: {ROPE_TYPES})")
            rope_kw["rope_type"] = kind
            if kind in ("linear", "llama3"):
                if "factor" not in rope:
                    raise ConfigError(f"rope_scaling: {kind} scaling needs 'factor'")
                rope_kw["rope_factor"] = float(rope["factor"])
            if kind == "llama3":
                try:
                    rope_kw.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                                   rope_original_max_position=int(rope["original_max_position_embeddings"]))
                except KeyError as e:
                    raise ConfigError(f"rope_scaling: llama3 scaling needs {e.args[0]!r}") from None

        names = set(present) if present is not None else None

        def flag(key: str, tensor: str | None) -> bool:
            value = either(key)
            if value is not None:
                if not isinstance(value, bool):
                    raise ConfigError(f"{key}: {value!r} must be true or false")
                return value
            return bool(names is not None and tensor is not None and any(n.startswith(tensor) for n in names))

        own_lm_head = (names is None or "lm_head.weight" in names) or draft_vocab < vocab
        vocab_map = (names is not None and ("d2t" in names or "t2d" in names)) or draft_vocab < vocab
        return cls(
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads", num_heads)),
            head_dim=int(get("head_dim", hidden // num_heads)),
            intermediate_size=int(get("intermediate_size", required=True)),
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=int(get("target_hidden_size", hidden)),
            aux_layer_ids=tuple(int(i) for i in ids),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(get("rope_theta", 10000.0)),
            max_position_embeddings=int(get("max_position_embeddings", 2048)),
            norm_output=flag("norm_output", None),
            fc_norm=flag("fc_norm", "fc_norm."),
            norm_before_fc=flag("norm_before_fc", "input_norm."),
            norm_before_residual=flag("norm_before_residual", None),
            # Without tensor names: a draft of another width than its target cannot share its embedding.
            own_embed=("embed_tokens.weight" in names) if names is not None else
            int(get("target_hidden_size", hidden)) != hidden,
            own_lm_head=own_lm_head,
            vocab_map=vocab_map,
            **rope_kw,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the SpecForge / vLLM layout (the aux layer ids both at the top level and in eagle_config,
        as NVIDIA writes them, so every loader finds them)."""
        rope: dict[str, Any] | None = None
        if self.rope_type == "linear":
            rope = {"rope_type": "linear", "factor": self.rope_factor}
        elif self.rope_type == "llama3":
            rope = {"rope_type": "llama3", "factor": self.rope_factor, "low_freq_factor": self.rope_low_freq_factor,
                    "high_freq_factor": self.rope_high_freq_factor,
                    "original_max_position_embeddings": self.rope_original_max_position}
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
            "norm_output": self.norm_output,
            "fc_norm": self.fc_norm,
            "norm_before_fc": self.norm_before_fc,
            "norm_before_residual": self.norm_before_residual,
        }


# ---- parameters --------------------------------------------------------------------------------------------

def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def _mat(shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int) -> ParamSpec:
    return ParamSpec(tuple(shape), axes, "compute", "matrix", fan_in)


def _norm(n: int) -> ParamSpec:
    # "norm" here is a Llama weight (scale 1 at init), unlike the target's Gemma (1 + w) weights.
    return ParamSpec((n,), ("norm",), "compute", "norm")


def draft_param_specs(dcfg: DraftConfig) -> dict[str, Any]:
    """Every draft weight, declared once: shape `[in, out]` with head axes split, dtype class, logical axes.

    dtype classes beyond m3jax.params: "int32" (d2t offsets; stored int64 on disk) and "bool" (t2d)."""
    d, h, k, hd, f = dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size
    a, dt = dcfg.num_aux, dcfg.target_hidden_size
    specs: dict[str, Any] = {
        "fc": _mat((a, dt, d), ("aux", "target_embed", "embed"), a * dt),
        "layer": {
            "input_norm": _norm(d),
            "hidden_norm": _norm(d),
            "post_attn_norm": _norm(d),
            "attn": {
                "wq": _mat((2 * d, h, hd), ("embed", "q_heads", "head_dim"), 2 * d),
                "wk": _mat((2 * d, k, hd), ("embed", "kv_heads", "head_dim"), 2 * d),
                "wv": _mat((2 * d, k, hd), ("embed", "kv_heads", "head_dim"), 2 * d),
                "wo": _mat((h, hd, d), ("q_heads", "head_dim", "embed"), h * hd),
            },
            "mlp": {
                "w_gate": _mat((d, f), ("embed", "mlp"), d),
                "w_up": _mat((d, f), ("embed", "mlp"), d),
                "w_down": _mat((f, d), ("mlp", "embed"), f),
            },
        },
        "final_norm": _norm(d),
    }
    if dcfg.fc_norm:
        specs["fc_norm"] = ParamSpec((a, dt), ("aux", "norm"), "compute", "norm")
    if dcfg.norm_before_fc:
        specs["aux_norm"] = _norm(a * dt)
    if dcfg.own_lm_head:
        specs["lm_head"] = _mat((d, dcfg.draft_vocab_size), ("embed", "vocab"), d)
    if dcfg.own_embed:
        specs["embed"] = ParamSpec((dcfg.vocab_size, d), ("vocab", "embed"), "compute", "matrix", 1)
    if dcfg.vocab_map:
        specs["d2t"] = ParamSpec((dcfg.draft_vocab_size,), ("draft_vocab",), "int32", "index")
        specs["t2d"] = ParamSpec((dcfg.vocab_size,), ("vocab_mask",), "bool", "index")
    return specs


def draft_spec_dtype(spec: ParamSpec, dtype: Any) -> np.dtype:
    """The array dtype of a declared draft weight when the compute dtype is `dtype`."""
    if spec.dtype_class == "int32":
        return np.dtype(np.int32)
    if spec.dtype_class == "bool":
        return np.dtype(np.bool_)
    return np.dtype(jnp.dtype(dtype))


def draft_abstract(dcfg: DraftConfig, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """ShapeDtypeStructs of the params tree: what `jax.eval_shape` needs to trace a full-size draft."""
    return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, draft_spec_dtype(s, dtype)), draft_param_specs(dcfg))


def vocab_mapping(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """t2d from d2t: True at every target id some draft id maps to. Raises on ids outside the target vocabulary
    or two draft ids mapping to one target id."""
    ids = np.arange(len(d2t), dtype=np.int64) + np.asarray(d2t, np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
    t2d = np.zeros(vocab_size, np.bool_)
    t2d[ids] = True
    if int(t2d.sum()) != len(ids):
        raise ValueError("d2t maps two draft ids to the same target id")
    return t2d


# ---- norms, RoPE, the shared layer -------------------------------------------------------------------------

def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Llama RMSNorm: normalise in fp32, cast back, scale by w (not M3's 1 + w)."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * v.astype(x.dtype)


def inv_frequencies(dcfg: DraftConfig) -> np.ndarray:
    """RoPE inverse frequencies [hd / 2] with the config's scaling (HF's default / linear / llama3 rules)."""
    hd = dcfg.head_dim
    inv = 1.0 / (dcfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if dcfg.rope_type == "linear":
        return (inv / dcfg.rope_factor).astype(np.float32)
    if dcfg.rope_type == "llama3":
        old, lo, hi, factor = (dcfg.rope_original_max_position, dcfg.rope_low_freq_factor,
                               dcfg.rope_high_freq_factor, dcfg.rope_factor)
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.astype(np.float32)


def rope_tables(dcfg: DraftConfig, pos: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[..., hd]` (frequencies repeated twice: rotate-half over the whole head), fp32 then cast."""
    f = pos.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(dcfg))
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def fuse_aux(params: Params, dcfg: DraftConfig, aux_ATD: jax.Array) -> jax.Array:
    """The target's captured hidden states [A, T, Dt] -> the draft's first-pass hidden input g [T, D]:
    per-aux fc_norm (EAGLE-3.1) or one norm over the concatenation, then fc (accumulated in fp32)."""
    if aux_ATD.shape[0] != dcfg.num_aux:
        raise ValueError(f"aux_ATD has {aux_ATD.shape[0]} captured layers, the draft reads {dcfg.num_aux} "
                         f"({dcfg.aux_layer_ids})")
    x = aux_ATD
    if dcfg.norm_before_fc:
        A, T, Dt = x.shape
        flat = rms_norm(jnp.moveaxis(x, 0, 1).reshape(T, A * Dt), params["aux_norm"], dcfg.rms_norm_eps)
        x = jnp.moveaxis(flat.reshape(T, A, Dt), 1, 0)
    elif dcfg.fc_norm:
        x = rms_norm(x, params["fc_norm"][:, None, :], dcfg.rms_norm_eps)
    g = jnp.einsum("atd,adh->th", x, params["fc"], preferred_element_type=jnp.float32)
    return g.astype(params["fc"].dtype)


def _embed(params: Params, dcfg: DraftConfig, target_embed: jax.Array | None) -> jax.Array:
    if dcfg.own_embed:
        return params["embed"]
    if target_embed is None:
        raise ValueError("this draft stores no embedding: pass the target's")
    return target_embed


def _project(params: Params, dcfg: DraftConfig, e_TD: jax.Array, h_TD: jax.Array, cos: jax.Array,
             sin: jax.Array, rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The layer up to attention: (q [.., H, hd], k, v [.., K, hd] after RoPE, residual [.., D]); with `rows`
    (indices into the leading axis), q and the residual at those rows only (k and v at every one)."""
    lp = params["layer"]
    e = rms_norm(e_TD.astype(h_TD.dtype), lp["input_norm"], dcfg.rms_norm_eps)
    hn = rms_norm(h_TD, lp["hidden_norm"], dcfg.rms_norm_eps)
    residual = hn if dcfg.norm_before_residual else h_TD
    x = jnp.concatenate([e, hn], axis=-1)  # [.., 2D]: embedding first, as every EAGLE-3 implementation
    a = lp["attn"]
    k = _rope(jnp.einsum("...c,chk->...hk", x, a["wk"]), cos, sin)
    v = jnp.einsum("...c,chk->...hk", x, a["wv"])
    if rows is not None:
        x, cos, sin, residual = x[rows], cos[rows], sin[rows], residual[rows]
    q = _rope(jnp.einsum("...c,chk->...hk", x, a["wq"]), cos, sin)
    return q, k, v, residual


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE over the whole head for any leading axes ([.., heads, hd] with cos/sin [.., hd])."""
    lead = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    out = apply_rope(flat, cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1]))
    return out.reshape(*lead, *x.shape[-2:])


def _finish(params: Params, dcfg: DraftConfig, o: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Attention output [.., H, hd] -> (next hidden, post-norm output), both [.., D]."""
    lp = params["layer"]
    x = residual + jnp.einsum("...hk,hkd->...d", o, lp["attn"]["wo"])
    m = lp["mlp"]
    hm = rms_norm(x, lp["post_attn_norm"], dcfg.rms_norm_eps)
    x = x + jnp.einsum("...f,fd->...d", jax.nn.silu(hm @ m["w_gate"]) * (hm @ m["w_up"]), m["w_down"])
    out = rms_norm(x, params["final_norm"], dcfg.rms_norm_eps)
    return (out if dcfg.norm_output else x), out


def draft_vocab_logits(params: Params, dcfg: DraftConfig, target_lm_head: jax.Array | None,
                       out_LD: jax.Array) -> jax.Array:
    """fp32 logits over the draft vocabulary [.., Vd] (what training compares with the target)."""
    if dcfg.own_lm_head:
        w = params["lm_head"]
    elif target_lm_head is None:
        raise ValueError("this draft stores no lm_head: pass the target's")
    else:
        w = target_lm_head
    return jnp.einsum("...d,dv->...v", out_LD, w, preferred_element_type=jnp.float32)


def to_target_vocab(params: Params, dcfg: DraftConfig, logits_LVd: jax.Array) -> jax.Array:
    """Draft-vocabulary logits -> target-vocabulary logits [.., V]: draft id i lands on target id i + d2t[i], every
    other target id gets -inf (so an argmax or a sampler never proposes a token the draft cannot score)."""
    if not dcfg.vocab_map:
        return logits_LVd
    ids = jnp.arange(dcfg.draft_vocab_size, dtype=jnp.int32) + params["d2t"].astype(jnp.int32)
    full = jnp.full((*logits_LVd.shape[:-1], dcfg.vocab_size), -jnp.inf, logits_LVd.dtype)
    return full.at[..., ids].set(logits_LVd)


# ---- the paged step (the engine's form) ----------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftPages:
    """The draft's own KV pool: k, v [pages, page_size, K, hd]. Page ids are the target's (allocated and freed in
    lockstep), so a draft step reads the target's page table and writes each token to the target's slot; page 0
    is the padding sink. K is post-RoPE."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def empty(cls, dcfg: DraftConfig, num_pages: int, page_size: int, dtype: Any = jnp.float32) -> DraftPages:
        shape = (num_pages, page_size, dcfg.num_kv_heads, dcfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def bytes_per_page(dcfg: DraftConfig, page_size: int, dtype: Any) -> int:
        return 2 * page_size * dcfg.num_kv_heads * dcfg.head_dim * jnp.dtype(dtype).itemsize


class DraftStepOutput(NamedTuple):
    logits: jax.Array  # [L, V] fp32 over the target vocabulary for batch.logit_rows (-inf outside the draft's)
    hidden: jax.Array  # [L, D] the hidden state at batch.logit_rows, for the next chained pass
    pages: DraftPages


def shift_tokens(batch: Batch, row_next_R: jax.Array) -> jax.Array:
    """The draft's token ids for a first pass over a target step's batch: each query token's successor in its
    row, and for a row's last token `row_next_R[row]` (the target's sampled token for a sampled row, the next
    prompt token for a prefill chunk that stops short of the prompt's end). Padding tokens get garbage; they
    write to the sink page."""
    t = jnp.arange(batch.num_tokens, dtype=jnp.int32)
    last = batch.query_start[batch.token_row + 1] - 1
    successor = jnp.concatenate([batch.token_ids[1:], batch.token_ids[:1]])
    return jnp.where(t == last, jnp.asarray(row_next_R, jnp.int32)[batch.token_row], successor).astype(jnp.int32)


def draft_step(params: Params, dcfg: DraftConfig, target_embed: jax.Array | None,
               target_lm_head: jax.Array | None, pages: DraftPages, batch: Batch, hidden_TD: jax.Array,
               kernels_impl: str) -> DraftStepOutput:
    """One draft pass over a flat ragged batch (prefill chunks, decodes and chained draft rows alike).

    `batch.token_ids[t]` is the token that follows position `batch.positions[t]` (the module docstring;
    `shift_tokens` makes them from a target step's batch);
    `hidden_TD` is `fuse_aux(aux)` on the first pass of a target step, the previous pass's `hidden` after.
    K/V go to `batch.slot_mapping` (the target's slots); attention is causal over the row's draft pages through
    `ops.paged_dense_attention`. `kernels_impl` is the attention family's static choice ("reference", "pallas",
    "interpret"). `target_embed [V, D]` / `target_lm_head [D, V]`: the target's, used when the draft has none.
    Every token's K and V are written; the rest of the layer (q, attention, MLP, lm_head) runs only at
    `batch.logit_rows`, the positions whose proposal or hidden state is used: a first pass over a prefill chunk
    then costs the chunk's K/V projections, not its whole layer.
    """
    embed = _embed(params, dcfg, target_embed)
    e = embed[batch.token_ids]
    cos, sin = rope_tables(dcfg, batch.positions, hidden_TD.dtype)
    rows = batch.logit_rows
    with jax.named_scope("eagle_attention"):
        q, k, v, residual = _project(params, dcfg, e, hidden_TD, cos, sin, rows)
        k_pages = ops.write_kv_pages(pages.k, k, batch.slot_mapping, impl=kernels_impl)
        v_pages = ops.write_kv_pages(pages.v, v, batch.slot_mapping, impl=kernels_impl)
        o = ops.paged_dense_attention(q, k_pages, v_pages, batch.page_table, batch.token_row[rows],
                                      batch.positions[rows], dcfg.head_dim ** -0.5, impl=kernels_impl)
    with jax.named_scope("eagle_mlp"):
        hidden, out = _finish(params, dcfg, o, residual)
    with jax.named_scope("eagle_lm_head"):
        logits = draft_vocab_logits(params, dcfg, target_lm_head, out)
        logits = to_target_vocab(params, dcfg, logits)
    return DraftStepOutput(logits, hidden, DraftPages(k_pages, v_pages))


# ---- dense references: whole sequences, and the training-time-test unroll --------------------------------------

def _attend_ttt(q_BSHd: jax.Array, ks: list[jax.Array], vs: list[jax.Array], scale: float) -> jax.Array:
    """Pass i's attention: query t reads pass 0's keys at s <= t and passes 1..i's keys at t (its own chain).
    fp32 scores and softmax."""
    B, S, H, hd = q_BSHd.shape
    K = ks[0].shape[2]
    q = q_BSHd.reshape(B, S, K, H // K, hd).astype(jnp.float32)
    s0 = jnp.einsum("btkgd,bskd->bkgts", q, ks[0].astype(jnp.float32)) * scale
    causal = jnp.arange(S)[None, :] <= jnp.arange(S)[:, None]  # [t, s]
    s0 = jnp.where(causal, s0, -jnp.inf)
    own = [jnp.einsum("btkgd,btkd->bkgt", q, kj.astype(jnp.float32))[..., None] * scale for kj in ks[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0, *own], axis=-1), axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p[..., :S], vs[0].astype(jnp.float32))
    for j, vj in enumerate(vs[1:]):
        o = o + jnp.einsum("bkgt,btkd->btkgd", p[..., S + j], vj.astype(jnp.float32))
    return o.reshape(B, S, H, hd).astype(q_BSHd.dtype)


def ttt_forward(params: Params, dcfg: DraftConfig, target_embed: jax.Array | None, next_tokens_BS: jax.Array,
                hidden_BSD: jax.Array, steps: int, start_pos: int = 0) -> tuple[jax.Array, jax.Array]:
    """The training-time-test unroll over whole sequences: `steps` chained passes at once.

    Pass 0 reads `hidden_BSD` (g for a target's hidden states) and token `next_tokens_BS[:, t]` at position
    `start_pos + t`; pass i reads pass i-1's hidden at index t and token `next_tokens_BS[:, t + i]` (the chain's
    i-th proposal, teacher-forced) at position t + i, and attends to pass 0's keys at s <= t plus its own chain's
    keys from passes 1..i: what a chain started at t sees at inference. Indices whose token runs off the end read
    the last token (their outputs are meaningless; callers mask them). Returns (post-norm outputs, next hiddens),
    both [steps, B, S, D]."""
    embed = _embed(params, dcfg, target_embed)
    B, S = next_tokens_BS.shape
    scale = dcfg.head_dim ** -0.5
    ks: list[jax.Array] = []
    vs: list[jax.Array] = []
    outs, hiddens = [], []
    h = hidden_BSD
    for i in range(steps):
        idx = jnp.minimum(jnp.arange(S) + i, S - 1)
        e = embed[next_tokens_BS[:, idx]]
        pos = jnp.broadcast_to(start_pos + jnp.arange(S, dtype=jnp.int32) + i, (B, S))
        cos, sin = rope_tables(dcfg, pos, h.dtype)
        q, k, v, residual = _project(params, dcfg, e, h, cos, sin)
        ks.append(k)
        vs.append(v)
        h, out = _finish(params, dcfg, _attend_ttt(q, ks, vs, scale), residual)
        outs.append(out)
        hiddens.append(h)
    return jnp.stack(outs), jnp.stack(hiddens)


def reference_forward(params: Params, dcfg: DraftConfig, target_embed: jax.Array | None,
                      target_lm_head: jax.Array | None, tokens_BS: jax.Array, hidden_BSD: jax.Array,
                      start_pos: int = 0) -> tuple[jax.Array, jax.Array]:
    """One draft pass over whole sequences with dense causal attention (each row its own sequence from position
    `start_pos`): (logits over the target vocabulary [B, S, V], next hidden [B, S, D]). The definition the paged
    `draft_step` must equal."""
    outs, hiddens = ttt_forward(params, dcfg, target_embed, tokens_BS, hidden_BSD, 1, start_pos)
    logits = to_target_vocab(params, dcfg, draft_vocab_logits(params, dcfg, target_lm_head, outs[0]))
    return logits, hiddens[0]


def propose_chain(params: Params, dcfg: DraftConfig, target_embed: jax.Array | None,
                  target_lm_head: jax.Array | None, next_tokens_BS: jax.Array, g_BSD: jax.Array,
                  k: int) -> jax.Array:
    """Greedy chain proposals for every position at once, teacher-forced: [k, B, S] where entry (i, b, t) is the
    draft's argmax target token for position t + 2 + i given the chain's earlier tokens were the sequence's own.
    Exact for acceptance: a chain is only scored while its proposals equal the sequence."""
    outs, _ = ttt_forward(params, dcfg, target_embed, next_tokens_BS, g_BSD, k)
    logits = to_target_vocab(params, dcfg, draft_vocab_logits(params, dcfg, target_lm_head, outs))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
