"""Cross-layer MSA top-k reuse (`index_topk_freq` = N): how far the logits move from N = 1 (off).

Runs the embedded model (or --model) on held-out standard-library text long enough that selection drops
blocks, for N = 1, 2, 3; reports the max / mean absolute logit difference, the next-token agreement of the
argmax, and the loss. Writes benchmarks/results/topk-reuse.json.

    python benchmarks/topk_reuse.py [--model DIR] [--tokens 512]
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()

    import dataclasses
    import email.message

    from m3jax import load_model
    from serving.tokenizer import M3Tokenizer

    base = load_model(args.model, dtype="float32")
    tok = M3Tokenizer.from_dir(base.path)
    ids = tok.encode(inspect.getsource(email.message))[: args.tokens]
    ids_np = np.asarray([ids], np.int32)
    ref = base.logits(ids_np)[0]

    def loss(logits: np.ndarray) -> float:
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        return float(np.mean(lse[:-1] - logits[np.arange(len(ids) - 1), ids[1:]]))

    rows = []
    for freq in (1, 2, 3):
        from m3jax.api import M3Model

        model = M3Model(dataclasses.replace(base.cfg, index_topk_freq=freq), base.params, base.rules, base.dtype)
        got = model.logits(ids_np)[0]
        diff = np.abs(got - ref)
        rows.append({"index_topk_freq": freq, "max_abs_logit_diff": float(diff.max()),
                     "mean_abs_logit_diff": float(diff.mean()),
                     "argmax_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1))), "loss": loss(got)})
    root = Path(__file__).resolve().parents[1]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout
    result = {"op": "msa_topk_reuse", "model": str(base.path), "tokens": len(ids),
              "sparse_layers": list(base.cfg.sparse_layers), "git_rev": rev.strip(), "rows": rows}
    out = root / "benchmarks" / "results" / "topk-reuse.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
