"""The one table between Hugging Face tensor names and the m3jax params tree, used to load and to write.

Each checkpoint tensor is a `TensorRule`: its name, its HF shape, and the `Piece`s that say which param (or
which expert of a stacked param) each part of it fills. A piece's view of the HF tensor (`hf_view`) is already
in param orientation, so loading copies view -> param slot and writing copies param slot -> view; there is no
second table.

Three spellings exist (`Layout`):
  released         language_model.model.… + language_model.lm_head.weight, `block_sparse_moe`, `index_*_proj`,
                   per-expert `experts.{e}.w1/w3/w2.weight`, split gate_proj/up_proj.
  transformers     model.… + lm_head.weight (`MiniMaxM3VLForCausalLM.save_pretrained`), `mlp.gate`,
                   `indexer.*`, stacked `mlp.experts.gate_up_proj` [E, 2F, D] / `down_proj` [E, D, F] (no
                   `.weight`), fused `gate_up_proj.weight` [2F, D] (gate rows first) for dense and shared
                   MLPs.
  transformers_vl  model.language_model.… + lm_head.weight with the transformers sub-names (a VL model's state
                   dict saved without the reverse conversion).
Dense and shared MLPs are accepted fused or split in every layout (checked per site), since transformers' save
path decides that through its conversion mapping.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Container, Iterable
from typing import Literal

import numpy as np

from checkpoints.errors import CheckpointError
from m3jax.config import M3Config

SubNames = Literal["released", "transformers"]
PathKey = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    prefix: str  # in front of layers.{i}., embed_tokens.weight, norm.weight
    lm_head: str
    subnames: SubNames
    fused_mlp: bool  # how this layout writes dense/shared MLPs (loading accepts both)


LAYOUTS: dict[str, Layout] = {
    "released": Layout("released", "language_model.model.", "language_model.lm_head.weight", "released",
                       fused_mlp=False),
    "transformers": Layout("transformers", "model.", "lm_head.weight", "transformers", fused_mlp=True),
    "transformers_vl": Layout("transformers_vl", "model.language_model.", "lm_head.weight", "transformers",
                              fused_mlp=True),
}

# Text-backbone loading ignores the vision tower, the projectors (both spellings) and MTP heads.
_SKIP = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")


def is_skipped(name: str) -> bool:
    return _SKIP.search(name) is not None


@dataclasses.dataclass(frozen=True)
class Piece:
    path: PathKey  # into the params tree, e.g. ("runs", 1, "moe", "w_gate")
    linear: bool  # HF [out, in] -> ours [in, out]: swap the last two axes
    index: int | None = None  # fixed leading index into the param (one expert of a per-expert tensor)
    rows: tuple[int, int] | None = None  # rows of the HF (out) axis, for fused gate_up tensors
    layer: int | None = None  # the layer inside its run: the param's leading (stacked layer) axis


@dataclasses.dataclass(frozen=True)
class TensorRule:
    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    # The leading HF axis is the param's leading (expert) axis: handled one expert at a time.
    stacked: bool = False
    # Stored as MXFP8 (fp8 + UE8M0 scale) in the MXFP8 release: every Linear except router, embed and lm_head.
    quantizable: bool = False
    fp32: bool = False  # released as float32 whatever the checkpoint dtype (router weight and bias)

    @property
    def scale_name(self) -> str:
        # `X.weight` -> `X.weight_scale_inv`; the stacked `experts.gate_up_proj` ->
        # `experts.gate_up_proj_scale_inv` (transformers' spelling for quantized 3-D expert parameters).
        return f"{self.name}_scale_inv"


def hf_view(block: np.ndarray, piece: Piece) -> np.ndarray:
    """The part of one HF tensor block (one expert if stacked) that `piece` maps, in param orientation."""
    if piece.rows is not None:
        block = block[piece.rows[0]: piece.rows[1]]
    return block.swapaxes(-1, -2) if piece.linear else block


def param_slot(params: dict, piece: Piece, expert: int | None) -> np.ndarray:
    """The param array (or one expert of it) that `piece` fills: a view into the stacked run array, so loading
    writes straight into the stacked layout."""
    node = params
    for key in piece.path:
        node = node[key]
    if piece.layer is not None:
        node = node[piece.layer]
    index = expert if expert is not None else piece.index
    return node if index is None else node[index]


def _linear(name: str, shape: tuple[int, int], path: PathKey, *, quant: bool = True, fp32: bool = False,
            index: int | None = None) -> TensorRule:
    return TensorRule(name, shape, (Piece(path, True, index),), quantizable=quant, fp32=fp32)


def _copy(name: str, shape: tuple[int, ...], path: PathKey, *, fp32: bool = False) -> TensorRule:
    return TensorRule(name, shape, (Piece(path, False),), fp32=fp32)


def _mlp(prefix: str, d: int, f: int, path: PathKey, fused: bool) -> list[TensorRule]:
    """A SwiGLU MLP (dense layer or shared expert): split gate/up, or fused gate_up with gate rows first."""
    down = _linear(f"{prefix}.down_proj.weight", (d, f), (*path, "w_down"))
    if fused:
        pieces = (Piece((*path, "w_gate"), True, rows=(0, f)), Piece((*path, "w_up"), True, rows=(f, 2 * f)))
        return [TensorRule(f"{prefix}.gate_up_proj.weight", (2 * f, d), pieces, quantizable=True), down]
    return [_linear(f"{prefix}.gate_proj.weight", (f, d), (*path, "w_gate")),
            _linear(f"{prefix}.up_proj.weight", (f, d), (*path, "w_up")), down]


def _layer_rules(cfg: M3Config, i: int, layout: Layout, present: Container[str] | None) -> list[TensorRule]:
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = f"{layout.prefix}layers.{i}."
    run, in_run = cfg.run_of(i)
    me: PathKey = ("runs", run)
    hf = layout.subnames == "transformers"

    def is_fused(mlp_prefix: str) -> bool:
        # Writing: the layout's own habit. Loading: whatever the checkpoint has at this site.
        return layout.fused_mlp if present is None else f"{mlp_prefix}.gate_up_proj.weight" in present

    rules = [
        _copy(f"{p}input_layernorm.weight", (d,), (*me, "input_norm")),
        _copy(f"{p}post_attention_layernorm.weight", (d,), (*me, "post_attn_norm")),
        _linear(f"{p}self_attn.q_proj.weight", (h * hd, d), (*me, "attn", "wq")),
        _linear(f"{p}self_attn.k_proj.weight", (kv * hd, d), (*me, "attn", "wk")),
        _linear(f"{p}self_attn.v_proj.weight", (kv * hd, d), (*me, "attn", "wv")),
        _linear(f"{p}self_attn.o_proj.weight", (d, h * hd), (*me, "attn", "wo")),
        _copy(f"{p}self_attn.q_norm.weight", (hd,), (*me, "attn", "q_norm")),
        _copy(f"{p}self_attn.k_norm.weight", (hd,), (*me, "attn", "k_norm")),
    ]
    if cfg.attn_types[i] == "sparse":
        ih, ihd = cfg.index_num_heads, cfg.index_head_dim
        x = f"{p}self_attn.indexer." if hf else f"{p}self_attn.index_"
        rules += [
            _linear(f"{x}q_proj.weight", (ih * ihd, d), (*me, "index", "wq")),
            _linear(f"{x}k_proj.weight", (ihd, d), (*me, "index", "wk")),
            _copy(f"{x}q_norm.weight", (ihd,), (*me, "index", "q_norm")),
            _copy(f"{x}k_norm.weight", (ihd,), (*me, "index", "k_norm")),
        ]
    if cfg.mlp_types[i] == "dense":
        rules += _mlp(f"{p}mlp", d, cfg.dense_intermediate_size, (*me, "mlp"), is_fused(f"{p}mlp"))
        return _in_layer(rules, in_run)

    e, f = cfg.num_experts, cfg.moe_intermediate_size
    moe: PathKey = (*me, "moe")
    m = f"{p}mlp." if hf else f"{p}block_sparse_moe."
    rules += [
        _linear(f"{m}gate.weight", (e, d), (*moe, "router"), quant=False, fp32=True),
        _copy(f"{m}gate.e_score_correction_bias" if hf else f"{m}e_score_correction_bias", (e,),
              (*moe, "router_bias"), fp32=True),
    ]
    if hf:
        gate_up = (Piece((*moe, "w_gate"), True, rows=(0, f)), Piece((*moe, "w_up"), True, rows=(f, 2 * f)))
        rules += [
            TensorRule(f"{m}experts.gate_up_proj", (e, 2 * f, d), gate_up, stacked=True, quantizable=True),
            TensorRule(f"{m}experts.down_proj", (e, d, f), (Piece((*moe, "w_down"), True),), stacked=True,
                       quantizable=True),
        ]
    else:
        for j in range(e):
            x = f"{m}experts.{j}."
            rules += [
                _linear(f"{x}w1.weight", (f, d), (*moe, "w_gate"), index=j),
                _linear(f"{x}w3.weight", (f, d), (*moe, "w_up"), index=j),
                _linear(f"{x}w2.weight", (d, f), (*moe, "w_down"), index=j),
            ]
    if cfg.num_shared_experts:
        s = f"{m}shared_experts"
        rules += _mlp(s, d, cfg.shared_intermediate_size, (*moe, "shared"), is_fused(s))
    return _in_layer(rules, in_run)


def _in_layer(rules: list[TensorRule], j: int) -> list[TensorRule]:
    """Point every piece at layer j of its run's stacked params."""
    return [dataclasses.replace(r, pieces=tuple(dataclasses.replace(pc, layer=j) for pc in r.pieces))
            for r in rules]


def tensor_rules(cfg: M3Config, layout: Layout,
                 present: Container[str] | None = None) -> dict[str, TensorRule]:
    """Every tensor of `cfg`'s text backbone in `layout`, by name, in a natural file order.

    `present`: the checkpoint's tensor names when loading (picks fused vs split MLPs per site); None when
    writing.
    """
    d, v = cfg.hidden_size, cfg.vocab_size
    rules = [_copy(f"{layout.prefix}embed_tokens.weight", (v, d), ("embed",))]
    for i in range(cfg.num_layers):
        rules += _layer_rules(cfg, i, layout, present)
    rules.append(_copy(f"{layout.prefix}norm.weight", (d,), ("final_norm",)))
    rules.append(_linear(layout.lm_head, (v, d), ("lm_head",), quant=False))
    return {r.name: r for r in rules}


def detect_layout(names: Iterable[str]) -> Layout:
    """Which spelling a checkpoint uses, from its (non-skipped) tensor names."""
    names = [n for n in names if not is_skipped(n)]
    prefixes = set()
    for n in names:
        # `lm_head.weight` is shared by both transformers spellings, so it decides nothing.
        if n.startswith("language_model."):
            prefixes.add("released")
        elif n.startswith("model.language_model."):
            prefixes.add("transformers_vl")
        elif n.startswith("model."):
            prefixes.add("transformers")
    if len(prefixes) != 1:
        sample = ", ".join(sorted(names)[:5])
        what = "mixes " + " and ".join(sorted(prefixes)) if prefixes else "has no recognisable text-backbone"
        raise CheckpointError(f"checkpoint {what} tensor names (e.g. {sample})")
    layout = LAYOUTS[prefixes.pop()]
    # Sub-names are detected on their own, so e.g. a text-only export with the released sub-names loads too.
    released = any(".block_sparse_moe." in n or ".self_attn.index_" in n for n in names)
    transformers = any(".self_attn.indexer." in n or ".mlp.experts." in n or ".mlp.gate." in n for n in names)
    if released and transformers:
        raise CheckpointError("checkpoint mixes released (block_sparse_moe / index_*_proj) and transformers "
                              "(mlp.experts / indexer) tensor names")
    subnames: SubNames = "released" if released else "transformers" if transformers else layout.subnames
    if subnames != layout.subnames:
        layout = dataclasses.replace(layout, name=f"{layout.name}+{subnames}_subnames", subnames=subnames)
    return layout
