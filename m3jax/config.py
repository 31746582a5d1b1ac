"""`M3Config`: the one description of an M3 model's shapes and numerics.

Built from a checkpoint's `config.json` in either spelling that exists in the wild:
- the released checkpoint (VL wrapper with `text_config`, legacy `sparse_attention_config`, `moe_layer_freq`,
  `rotary_dim` / `partial_rotary_factor`, `rope_theta`), and
- transformers' `MiniMaxM3VLTextConfig` (`layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`).

No M3 number is hard-coded outside the named presets at the bottom of this file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

AttnType = Literal["dense", "sparse"]
MlpType = Literal["dense", "moe"]


class ConfigError(ValueError):
    """A config.json value this implementation does not understand or that contradicts another one."""


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Consecutive layers of one (attention kind, MLP kind): their weights are stacked and the decoder runs
    them as one `lax.scan`, so tracing and compiling cost one layer per run, not one per layer."""

    start: int
    count: int
    attn: AttnType
    mlp: MlpType

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.count)


@dataclasses.dataclass(frozen=True)
class M3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Attention kind and MLP kind are separate per-layer lists: nothing ties the dense-MLP layers to the
    # dense-attention layers.
    attn_types: tuple[AttnType, ...]
    mlp_types: tuple[MlpType, ...]
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.0
    use_routing_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    rotary_dim: int = 64
    max_position_embeddings: int = 1048576
    # MSA (MiniMax Sparse Attention) index branch and block selection.
    index_num_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    # Opt-in cross-layer top-k reuse (not part of the model; 1 = every sparse layer selects).
    index_topk_freq: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200034
    eos_token_ids: tuple[int, ...] = (200020,)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            need(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        need(len(self.attn_types) == self.num_layers, "layer_types",
             f"has {len(self.attn_types)} entries for {self.num_layers} layers")
        need(len(self.mlp_types) == self.num_layers, "mlp_layer_types",
             f"has {len(self.mlp_types)} entries for {self.num_layers} layers")
        for t in self.attn_types:
            need(t in ("dense", "sparse"), "layer_types", f"unknown attention type {t!r}")
        for t in self.mlp_types:
            need(t in ("dense", "moe"), "mlp_layer_types", f"unknown MLP type {t!r}")
        need(self.num_heads % self.num_kv_heads == 0, "num_attention_heads",
             f"{self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        need(0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
             f"{self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if "moe" in self.mlp_types:
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 f"{self.num_experts_per_tok} must be in [1, num_local_experts={self.num_experts}]")
            need(self.num_shared_experts in (0, 1), "n_shared_experts",
                 f"{self.num_shared_experts} unsupported (M3 has 1)")
        if "sparse" in self.attn_types:
            # MSA selects per KV group: one index head per KV head.
            need(self.index_num_heads == self.num_kv_heads, "index_n_heads",
                 f"{self.index_num_heads} must equal num_key_value_heads={self.num_kv_heads} (per-group selection)")
            need(self.index_block_size > 0, "index_block_size", "must be positive")
            need(self.index_topk_blocks > 0, "index_topk_blocks", "must be positive")
            need(self.index_local_blocks >= 0, "index_local_blocks", "must be >= 0")
            need(self.index_init_blocks >= 0, "sparse_init_block", "must be >= 0")
            need(self.index_topk_freq >= 1, "index_topk_freq", "must be >= 1")
            need(self.index_head_dim % 2 == 0, "index_head_dim", "must be even")

    # ---- derived -----------------------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attn_types) if t == "sparse")

    @property
    def layer_runs(self) -> tuple[LayerRun, ...]:
        """Maximal runs of consecutive layers of the same (attention kind, MLP kind): m3-full has two."""
        runs: list[LayerRun] = []
        for i, kinds in enumerate(zip(self.attn_types, self.mlp_types, strict=True)):
            if runs and (runs[-1].attn, runs[-1].mlp) == kinds:
                runs[-1] = dataclasses.replace(runs[-1], count=runs[-1].count + 1)
            else:
                runs.append(LayerRun(i, 1, *kinds))
        return tuple(runs)

    def run_of(self, layer: int) -> tuple[int, int]:
        """(run index, index inside the run) of a layer."""
        for r, run in enumerate(self.layer_runs):
            if layer in run.layers:
                return r, layer - run.start
        raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")

    def index_recomputes(self, layer: int) -> bool:
        """With cross-layer top-k reuse, does this sparse layer compute its own selection?"""
        return self.sparse_layers.index(layer) % self.index_topk_freq == 0

    def replace(self, **changes: Any) -> M3Config:
        return dataclasses.replace(self, **changes)

    # ---- checkpoint config.json ----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> M3Config:
        """Build from a parsed config.json: the VL wrapper (`text_config`) or a text-only config."""
        d = dict(raw["text_config"]) if "text_config" in raw else dict(raw)
        if not isinstance(d, dict):
            raise ConfigError("text_config: must be an object")
        # A few keys are only written at the top level of the VL wrapper.
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if key not in d and key in raw:
                d[key] = raw[key]

        def get(key: str, default: Any = None, *, required: bool = False) -> Any:
            if key in d and d[key] is not None:
                return d[key]
            if required:
                raise ConfigError(f"{key}: missing from config.json")
            return default

        def check(key: str, allowed: tuple[Any, ...]) -> None:
            if key in d and d[key] not in allowed:
                raise ConfigError(f"{key}: unsupported value {d[key]!r} (expected one of {allowed})")

        check("hidden_act", ("swigluoai", "silu"))  # transformers rewrites swigluoai to silu
        check("scoring_func", ("sigmoid",))
        check("use_gemma_norm", (True,))
        check("use_qk_norm", (True,))
        check("qk_norm_type", ("per_head",))
        check("attention_output_gate", (False,))
        check("tie_word_embeddings", (True, False))

        num_layers = int(get("num_hidden_layers", required=True))
        num_heads = int(get("num_attention_heads", required=True))
        hidden = int(get("hidden_size", required=True))
        head_dim = int(get("head_dim", hidden // num_heads))

        # Attention types: transformers' `layer_types`, else the legacy sparse_attention_config.
        sparse_cfg = get("sparse_attention_config", {}) or {}
        if not isinstance(sparse_cfg, dict):
            raise ConfigError("sparse_attention_config: must be an object")
        if "sparse_score_type" in sparse_cfg and sparse_cfg["sparse_score_type"] != "max":
            raise ConfigError(f"sparse_attention_config.sparse_score_type: unsupported "
                              f"{sparse_cfg['sparse_score_type']!r} (only 'max')")
        legacy_attn = None
        if "sparse_attention_freq" in sparse_cfg:
            on = sparse_cfg.get("use_sparse_attention", True)
            legacy_attn = tuple("sparse" if (f and on) else "dense" for f in sparse_cfg["sparse_attention_freq"])
        attn_types = _per_layer_kinds(d, "layer_types", {"full_attention": "dense", "minimax_m3_sparse": "sparse"},
                                      legacy_attn, "sparse_attention_config.sparse_attention_freq", "dense",
                                      num_layers)
        legacy_mlp = None
        if d.get("moe_layer_freq") is not None:
            legacy_mlp = tuple("moe" if f else "dense" for f in d["moe_layer_freq"])
        mlp_types = _per_layer_kinds(d, "mlp_layer_types", {"dense": "dense", "sparse": "moe"}, legacy_mlp,
                                     "moe_layer_freq", "moe", num_layers)

        # RoPE: theta and the rotated width can come from three places; they must agree.
        rope = get("rope_parameters", {}) or {}
        if not isinstance(rope, dict):
            raise ConfigError("rope_parameters: must be an object")
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.rope_type: unsupported {rope['rope_type']!r} (only 'default')")
        thetas = {k: float(v) for k, v in (("rope_theta", d.get("rope_theta")),
                                            ("rope_parameters.rope_theta", rope.get("rope_theta"))) if v is not None}
        if len(set(thetas.values())) > 1:
            raise ConfigError(f"rope_theta: inconsistent values {thetas}")
        rope_theta = next(iter(thetas.values()), 5e6)
        widths: dict[str, int] = {}
        for key, factor in (("partial_rotary_factor", d.get("partial_rotary_factor")),
                            ("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor"))):
            if factor is not None:
                if not 0 < float(factor) <= 1:
                    raise ConfigError(f"{key}: {factor} must be in (0, 1]")
                widths[key] = int(head_dim * float(factor))
        # transformers writes a `rotary_dim` field (default 64) that it never reads; only the released
        # spelling (no rope_parameters) means it.
        if d.get("rotary_dim") is not None and "rope_parameters" not in d:
            widths["rotary_dim"] = int(d["rotary_dim"])
        if len(set(widths.values())) > 1:
            raise ConfigError(f"rotary_dim: inconsistent rotary widths {widths}")
        rotary_dim = next(iter(widths.values()), head_dim)

        def legacy_or_flat(flat: str, legacy: str, default: Any) -> Any:
            vals = {k: v for k, v in ((flat, d.get(flat)), (f"sparse_attention_config.{legacy}",
                                                             sparse_cfg.get(legacy))) if v is not None}
            if len(set(vals.values())) > 1:
                raise ConfigError(f"{flat}: inconsistent values {vals}")
            return next(iter(vals.values()), default)

        num_kv_heads = int(get("num_key_value_heads", num_heads))
        eos = get("eos_token_id", 200020)
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
        num_experts = int(get("num_local_experts", get("num_experts", 0)))
        moe_inter = int(get("intermediate_size", 0))
        if d.get("use_routing_bias") is False:
            raise ConfigError("use_routing_bias: false is not an M3 configuration")
        return cls(
            vocab_size=int(get("vocab_size", required=True)),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            attn_types=attn_types,  # type: ignore[arg-type]
            mlp_types=mlp_types,  # type: ignore[arg-type]
            dense_intermediate_size=int(get("dense_intermediate_size", moe_inter)),
            moe_intermediate_size=moe_inter,
            shared_intermediate_size=int(get("shared_intermediate_size", moe_inter)),
            num_experts=num_experts,
            num_experts_per_tok=int(get("num_experts_per_tok", 1)),
            num_shared_experts=int(get("n_shared_experts", 1)),
            routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
            swiglu_alpha=float(get("swiglu_alpha", 1.702)),
            swiglu_limit=float(get("swiglu_limit", 7.0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
            max_position_embeddings=int(get("max_position_embeddings", 524288)),
            index_num_heads=int(legacy_or_flat("index_n_heads", "sparse_num_index_heads", num_kv_heads)),
            index_head_dim=int(legacy_or_flat("index_head_dim", "sparse_index_dim", head_dim)),
            index_block_size=int(legacy_or_flat("index_block_size", "sparse_block_size", 128)),
            index_topk_blocks=int(legacy_or_flat("index_topk_blocks", "sparse_topk_blocks", 16)),
            index_local_blocks=int(legacy_or_flat("index_local_blocks", "sparse_local_block", 1)),
            index_init_blocks=int(sparse_cfg.get("sparse_init_block", 0) or 0),
            index_topk_freq=int(d.get("index_topk_freq") or 1) if d.get("use_index_cache") else 1,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=get("bos_token_id", None),
            eos_token_ids=eos_ids,
            pad_token_id=get("pad_token_id", None),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> M3Config:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf_dict(raw)

    def to_hf_text_dict(self) -> dict[str, Any]:
        """The transformers `MiniMaxM3VLTextConfig` spelling (model_type minimax_m3_vl_text)."""
        return {
            "architectures": ["MiniMaxM3VLForCausalLM"],
            "model_type": "minimax_m3_vl_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "layer_types": ["minimax_m3_sparse" if t == "sparse" else "full_attention" for t in self.attn_types],
            "mlp_layer_types": ["sparse" if t == "moe" else "dense" for t in self.mlp_types],
            "intermediate_size": self.moe_intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_num_heads,
            "index_head_dim": self.index_head_dim,
            "index_block_size": self.index_block_size,
            "index_topk_blocks": self.index_topk_blocks,
            "index_local_blocks": self.index_local_blocks,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
        }

    def to_released_dict(self) -> dict[str, Any]:
        """The released checkpoint's spelling: VL wrapper, legacy sparse_attention_config and moe_layer_freq."""
        if self.index_init_blocks:
            raise ConfigError("sparse_init_block: non-zero init blocks are not written by this exporter")
        text = {
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.moe_intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.num_shared_experts,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "hidden_act": "swigluoai",
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "use_gemma_norm": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "attention_output_gate": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "moe_layer_freq": [int(t == "moe") for t in self.mlp_types],
            "sparse_attention_config": {
                "use_sparse_attention": "sparse" in self.attn_types,
                "sparse_num_index_heads": self.index_num_heads,
                "sparse_index_dim": self.index_head_dim,
                "sparse_block_size": self.index_block_size,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_score_type": "max",
                "sparse_init_block": self.index_init_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_attention_freq": [int(t == "sparse") for t in self.attn_types],
                "sparse_disable_index_value": [int(t == "sparse") for t in self.attn_types],
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
        }
        return {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "bfloat16",
        }

    def param_count(self) -> int:
        """Parameters of the text backbone (for reports)."""
        d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        n = 2 * self.vocab_size * d + d
        for a, m in zip(self.attn_types, self.mlp_types, strict=True):
            n += 2 * d + d * (h + 2 * kv) * hd + h * hd * d + 2 * hd
            if a == "sparse":
                n += d * (self.index_num_heads + 1) * self.index_head_dim + 2 * self.index_head_dim
            if m == "dense":
                n += 3 * d * self.dense_intermediate_size
            else:
                n += d * self.num_experts + self.num_experts
                n += 3 * d * (self.num_experts * self.moe_intermediate_size
                              + self.num_shared_experts * self.shared_intermediate_size)
        return n


def _per_layer_kinds(d: dict[str, Any], key: str, names: dict[str, str], legacy: tuple[str, ...] | None,
                     legacy_key: str, default: str, num_layers: int) -> tuple[str, ...]:
    """A per-layer kind list from transformers' spelling (`key`), the legacy one, or the default; both spellings
    present must agree."""
    if d.get(key) is None:
        return legacy if legacy is not None else (default,) * num_layers
    kinds = []
    for t in d[key]:
        if t not in names:
            raise ConfigError(f"{key}: unknown type {t!r} (expected one of {tuple(names)})")
        kinds.append(names[t])
    if legacy is not None and legacy != tuple(kinds):
        raise ConfigError(f"{key}: disagrees with {legacy_key}")
    return tuple(kinds)


def _preset(num_dense: int, num_sparse: int, **kw: Any) -> M3Config:
    n = num_dense + num_sparse
    return M3Config(
        num_layers=n,
        attn_types=("dense",) * num_dense + ("sparse",) * num_sparse,
        mlp_types=("dense",) * num_dense + ("moe",) * num_sparse,
        **kw,
    )


_M3_WIDTHS: dict[str, Any] = dict(
    vocab_size=200064, hidden_size=6144, num_heads=64, num_kv_heads=4, head_dim=128,
    dense_intermediate_size=12288, moe_intermediate_size=3072, shared_intermediate_size=3072,
    num_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0, rope_theta=5e6, rotary_dim=64,
    max_position_embeddings=1048576, index_num_heads=4, index_head_dim=128, index_block_size=128,
    index_topk_blocks=16, index_local_blocks=1, bos_token_id=200034, eos_token_ids=(200020,),
)

PRESETS: dict[str, M3Config] = {
    # The released MiniMax-M3 text backbone: 3 dense layers then 57 MSA + MoE layers.
    "m3-full": _preset(3, 57, **_M3_WIDTHS),
    # Real widths, few layers: what one GPU can hold for per-layer measurements.
    "m3-slice": _preset(1, 3, **_M3_WIDTHS),
    # Real widths, one dense and one MSA + MoE layer: every kernel family at M3's shapes in what an 80 GB card
    # holds with room for the KV cache (m3-slice's 50 GB of bf16 weights, prepared at load, need an H200).
    "m3-slice-1moe": _preset(1, 1, **_M3_WIDTHS),
    # A second depth an 80 GB card holds (36 GB of bf16 weights): with m3-slice-1moe, a per-layer fit of a step
    # carried to m3-full's depth on an H100 (`benchmarks/bench_spec.py --models m3-slice-1moe m3-slice-2moe`).
    "m3-slice-2moe": _preset(1, 2, **_M3_WIDTHS),
    # Everything M3 has, at a size that runs in milliseconds on a CPU. Attention and MLP kinds are
    # deliberately misaligned on one layer so code cannot confuse the two lists.
    "m3-tiny": M3Config(
        vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        attn_types=("dense", "sparse", "sparse", "sparse"), mlp_types=("dense", "dense", "moe", "moe"),
        dense_intermediate_size=96, moe_intermediate_size=32, shared_intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.0, rope_theta=10000.0, rotary_dim=8,
        max_position_embeddings=4096, index_num_heads=2, index_head_dim=16, index_block_size=16,
        index_topk_blocks=4, index_local_blocks=1, bos_token_id=None, eos_token_ids=(0,),
    ),
}


def preset(name: str) -> M3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None

