"""Whether this backend's XLA moves the query-block metadata out of a layer scan.

The attention ops compute `ragged.query_blocks` from the step's `token_row` and `pos` alone, the same for every
layer. If XLA's while-loop invariant code motion hoists it, a scan pays it once per step; if not, once per
layer (on the CPU XLA hoists it; on the H100 at revs 47a239b and 7108030 it does not: docs/benchmarks.md). That
is why the model computes it once per step itself (`ragged.step_query_blocks`); this script asks the compiler
the question again, without that.
This compiles a scan whose body calls `query_blocks` at the index and block-sparse prefill block sizes and
reports which of the metadata's ops (scatter, reduce-window, sort) stay inside the compiled loop body:

    PYTHONPATH=. python benchmarks/check_hoisting.py --out hoisting.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.timing import git_rev
from pallas_kernels.attention.ragged import query_blocks

OPS = ("scatter", "reduce-window", "sort")


def compiled_text(num_tokens: int, num_rows: int, layers: int) -> str:
    def run(x: jax.Array, token_row: jax.Array, pos: jax.Array) -> jax.Array:
        def layer(x: jax.Array, _: None) -> tuple[jax.Array, None]:
            out = x
            for bt in (8, 32):  # the block-sparse and the index query blocks of a prefill on a Hopper GPU
                qb = query_blocks(token_row, pos, bt=bt, num_rows=num_rows)
                out = out + qb.max_pos_Q[qb.block_T].astype(x.dtype) + qb.length_Q.sum().astype(x.dtype)
            return out * 0.5, None

        return jax.lax.scan(layer, x, None, length=layers)[0]

    args = (jnp.ones((num_tokens,), jnp.float32), jnp.zeros((num_tokens,), jnp.int32),
            jnp.arange(num_tokens, dtype=jnp.int32))
    return jax.jit(run).lower(*args).compile().as_text()


def body_ops(hlo: str) -> dict[str, int]:
    """Counts of the metadata's ops in the while loop's body and in the computations it calls."""
    comps: dict[str, str] = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s", block)
        if m:
            comps[m.group(1)] = block
    m = re.search(r"\swhile\(.*?body=%?([\w.\-]+)", hlo)
    if not m:
        return {op: 0 for op in OPS}
    seen, todo, text = set(), [m.group(1)], []
    while todo:  # the body and everything it calls (fusions, wrapped ops)
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        text.append(comps[name])
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[name])
    joined = "\n".join(text)
    return {op: len(re.findall(rf"\s{op}\(", joined)) for op in OPS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    in_body = body_ops(compiled_text(args.tokens, args.rows, args.layers))
    rec = {"op": "scan_hoisting", "tokens": args.tokens, "rows": args.rows, "layers": args.layers,
           "metadata_ops_in_loop_body": in_body, "hoisted": not any(in_body.values()),
           "device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
           "git_rev": git_rev()}
    print(json.dumps(rec), flush=True)
    Path(args.out).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
