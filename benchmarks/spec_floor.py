"""The HBM byte floor of a speculative step against a plain one on full M3, and the speed-up it allows.

Issue 24's GPU targets (a k = 3 verify at batch 32 within 1.3x of a plain step; a projected speed-up of 2x at
batch 1 and 1.5x at batch 32) are ratios of two decode steps. Both steps are weight-streaming: their floor is the
bytes they must read over the HBM bandwidth, so the ratio of their floors is what a kernel stack at its floors
would measure. This counts those bytes from the parameter declarations (`m3jax.params.param_specs`,
`m3jax.eagle.draft_param_specs`); nothing is timed.

Per step, each request `--context` tokens deep:
- every layer's non-expert weights, the lm_head, and the shared expert, once;
- the routed experts the step's tokens touch. With each token's top-k drawn independently and uniformly (what
  random weights give; "independent"), n tokens touch E (1 - (1 - k/E)^n) of the E experts on average. A verify
  step has B (1 + k) tokens against a plain step's B. "shared": a request's verify rows route exactly as its
  first row does, the most a real checkpoint's neighbouring tokens could share;
- KV: a dense layer reads each request's whole context, an MSA layer its selected blocks and the index keys of
  the whole context (a lower bound for verify rows, which may select more blocks between them);
- the draft (speculative step only): its first pass reads fc, its layer and its lm_head, each chained pass the
  layer and the lm_head; the embedding is a lookup.

The speed-up at a mean accepted length L is L * plain / spec (a token costs plain / 1 without speculation, spec /
L with it), at InferenceX's M3 EAGLE3 lengths (`benchmarks/bench_spec.py`'s ACCEPTANCE).

    PYTHONPATH=. python benchmarks/spec_floor.py [--batches 1 8 32 64] [--ks 1 3] [--context 2048]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import jax

from benchmarks.bench_spec import ACCEPTANCE
from benchmarks.timing import git_rev
from checkpoints.eagle import inferact_draft_config
from m3jax.config import M3Config, preset
from m3jax.eagle import draft_param_specs
from m3jax.params import is_spec, layer_specs

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet; the ratios do not depend on it
ROUTED = ("w_gate", "w_up", "w_down")


def _bytes(tree: Any) -> float:
    """The bytes of declared weights in bf16 (fp32 where declared so: the router)."""
    return sum(math.prod(s.shape) * (4 if s.dtype_class == "fp32" else 2)
               for s in jax.tree.leaves(tree, is_leaf=is_spec))


def expert_bytes(cfg: M3Config, fmt: str) -> float:
    """One routed expert's gate, up and down: bf16, or MXFP8's one byte per weight and one scale per 32."""
    n = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return n * {"bf16": 2.0, "mxfp8": 1 + 1 / 32}[fmt]


def touched_experts(cfg: M3Config, tokens: int) -> float:
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def target_bytes(cfg: M3Config, fmt: str, batch: int, rows: int, context: int, routing: str) -> float:
    """The bytes one target step over `batch` requests of `rows` rows each must read."""
    kv_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    total = 2.0 * cfg.hidden_size * cfg.vocab_size  # the lm_head
    routed_tokens = batch * (rows if routing == "independent" else 1)
    for i in range(cfg.num_layers):
        spec = layer_specs(cfg, i)
        if "moe" in spec:
            moe = spec.pop("moe")
            spec["moe_rest"] = {name: v for name, v in moe.items() if name not in ROUTED}
            total += touched_experts(cfg, routed_tokens) * expert_bytes(cfg, fmt)
        total += _bytes(spec)
        if cfg.attn_types[i] == "dense":
            total += batch * context * kv_per_token
        else:
            selected = min(context, cfg.index_topk_blocks * cfg.index_block_size)
            total += batch * (selected * kv_per_token + context * cfg.index_head_dim * 2)
    return total


def draft_bytes(k: int) -> float:
    """The published GQA draft's k passes: fc on the first, the layer and lm_head on each."""
    specs = draft_param_specs(inferact_draft_config(gqa=True))
    return _bytes(specs["fc"]) + k * (_bytes(specs["layer"]) + _bytes(specs["lm_head"]))


def floors(cfg: M3Config, fmt: str, batch: int, k: int, context: int, routing: str) -> dict[str, Any]:
    plain = target_bytes(cfg, fmt, batch, 1, context, routing)
    verify = target_bytes(cfg, fmt, batch, 1 + k, context, routing)
    spec = verify + draft_bytes(k)
    rec: dict[str, Any] = {
        "op": "spec_floor", "model": "m3-full", "moe_format": fmt, "batch": batch, "k": k, "context": context,
        "routing": routing,
        "touched_experts_plain": touched_experts(cfg, batch),
        "touched_experts_verify": touched_experts(cfg, batch * (1 + k if routing == "independent" else 1)),
        "plain_bytes": plain, "verify_bytes": verify, "spec_bytes": spec,
        "plain_floor_s": plain / HBM_BYTES_PER_S, "spec_floor_s": spec / HBM_BYTES_PER_S,
        "verify_over_plain": verify / plain, "spec_over_plain": spec / plain,
    }
    for mode, length in ACCEPTANCE[k].items():
        rec[f"speedup_{mode}"] = length * plain / spec
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--out", default="benchmarks/results/spec-floor-m3-full.json")
    args = ap.parse_args()
    cfg = preset("m3-full")
    records = [floors(cfg, fmt, b, k, args.context, routing)
               for routing in ("independent", "shared") for fmt in ("bf16", "mxfp8")
               for b in args.batches for k in args.ks]
    for r in records:
        r["git_rev"] = git_rev()
        print(f"{r['routing']:>11} {r['moe_format']:>5} B={r['batch']:>3} k={r['k']}: verify/plain "
              f"{r['verify_over_plain']:.2f}, spec/plain {r['spec_over_plain']:.2f}, speed-up "
              f"{r['speedup_thinking_on']:.2f} / {r['speedup_thinking_off']:.2f} (thinking on / off)")
    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
