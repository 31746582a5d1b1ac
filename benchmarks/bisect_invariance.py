"""Where a request's numbers first change with the batch: the layer-by-layer bisection behind issue 27.

One request R (a prompt of `--prompt-len` tokens, then one decode token) is run through the bare model step in
several batch compositions, each on a fresh page pool, and its rows are compared bitwise with R alone:
- `with_other`: R's prompt in the same step as another request's prompt (R second, so its rows move);
- `chunked`: R's prompt in two steps (the second half reading the first half's K/V from the pages);
- `decode_batch`: R's decode token next to `--decode-rows - 1` other requests' decode tokens (their contexts
  filled by a prefill step first);
- `chunked_padded`: R's prompt in uneven chunks (37, 64, 27, 100, the rest), each step padded as the engine pads
  (a power-of-two token bucket of at least 64, `--decode-rows` rows);
- `big_bucket`: R's prompt alone in a step padded to `--big-bucket` tokens;
- `decode_beside_prefill`: R's decode token in one step with another request's 63-token prefill chunk.
For each composition: per layer, the max |difference| of R's residual stream at the layer's input, the MSA block
selections of R's rows per sparse layer (how many differ), and the final hidden state and logits. The first layer
whose input differs names the layer whose ops vary with the batch; its attention or MLP half tells which family.

    PYTHONPATH=. python benchmarks/bisect_invariance.py [--model m3-slice-1moe] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import git_rev


def _rows_differing(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.sum(np.any(a != b, axis=tuple(range(1, a.ndim)))))


def _piece_diff(a: np.ndarray, b: np.ndarray) -> dict:
    """How one intermediate of R's rows differs: max |difference|, and the first rows (tokens) that differ."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(a64 == b64, 0.0, np.abs(a64 - b64))
    rows = np.flatnonzero(np.any(d != 0, axis=tuple(range(1, d.ndim))))
    return {"max_abs_diff": float(np.nan_to_num(np.max(d), nan=np.inf)) if d.size else 0.0,
            "rows": rows[:16].tolist(), "num_rows": int(rows.size)}


def bisect(cfg, params, kernels, dtype, prompt_len: int, other_len: int, decode_rows: int,
           big_bucket: int = 2048) -> dict:
    """{composition: comparison with R alone} (see the module docstring); `kernels` resolved, params prepared."""
    from m3jax.api import M3Model
    from m3jax.batch import RowPlan, build_batch
    from m3jax.model import forward
    from m3jax.sharding import make_rules

    rules = make_rules(1)
    kernels = kernels.on(rules.topology)
    model = M3Model(cfg, params, rules, dtype, kernels=kernels)
    ps = model.page_size
    capture = tuple(range(cfg.num_layers))
    # params as an argument: closed over, jit would bake 20 GB of weights into the executable as constants.
    fwd = jax.jit(lambda params, kv, batch: forward(params, cfg, kv, batch, kernels, capture=capture,
                                                    all_hidden=True), compiler_options=kernels.compiler_options)

    def step(kv, batch):
        return fwd(params, kv, batch)

    pieces = jax.jit(functools.partial(last_layer_pieces, cfg=cfg, kernels=kernels),
                     compiler_options=kernels.compiler_options)
    last = cfg.num_layers - 1

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    other = rng.integers(0, cfg.vocab_size, other_len).tolist()
    decode_token = int(rng.integers(0, cfg.vocab_size))
    width = -(-(max(prompt_len, other_len) + 2) // ps)
    def pages(i: int) -> range:
        return range(1 + i * width, 1 + (i + 1) * width)

    def run(kv, rows: list[RowPlan], num_tokens: int, num_rows: int | None = None):
        batch, _ = build_batch(rows, ps, num_tokens, num_rows or len(rows), width)
        t = time.perf_counter()
        out = step(kv, batch)
        jax.block_until_ready(out.hidden)
        # The last layer's intermediate values, from its captured input and the step's pages.
        out.pieces = pieces(params, out.kv, batch, out.aux_hidden[last])
        print(f"[bisect] step of {num_tokens} tokens / {len(rows)} rows: {time.perf_counter() - t:.1f} s", flush=True)
        return out.kv, out

    def r_rows(out, start: int, n: int) -> dict:
        """R's rows of one step's outputs: aux hidden per layer, final hidden, selections per sparse layer."""
        sel = {i: np.asarray(s[start:start + n]) for i, s in out.selections.items()}
        pieces = {k: np.asarray(a[start:start + n]) for k, a in out.pieces.items()}
        return {"pieces": pieces, "aux": np.asarray(out.aux_hidden[:, start:start + n].astype(jnp.float32)),
                "hidden": np.asarray(out.hidden[start:start + n].astype(jnp.float32)), "sel": sel}

    def compare(a: dict, b: dict) -> dict:
        per_layer = [float(np.max(np.abs(a["aux"][i] - b["aux"][i]))) for i in range(cfg.num_layers)]
        first = next((i for i, d in enumerate(per_layer) if d > 0), None)
        rec = {"input_max_abs_diff_by_layer": per_layer, "first_layer_whose_input_differs": first,
                "hidden_max_abs_diff": float(np.max(np.abs(a["hidden"] - b["hidden"]))),
                "selection_rows_differing_by_layer": {str(i): _rows_differing(a["sel"][i], b["sel"][i])
                                                      for i in a["sel"]}}
        if "pieces" in a and "pieces" in b:  # one-step compositions: the last layer's pieces, in order
            rec["last_layer"] = {k: _piece_diff(a["pieces"][k], b["pieces"][k]) for k in a["pieces"]}
        diff_T = np.any(a["hidden"] != b["hidden"], axis=-1)
        rec["tokens_differing"] = np.flatnonzero(diff_T)[:32].tolist()
        return rec

    n = prompt_len
    # R alone: the whole prompt, then its decode token.
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, out = run(kv, [RowPlan(prompt, 0, pages(0))], n)
    alone_prefill = r_rows(out, 0, n)
    kv, out = run(kv, [RowPlan([decode_token], n, pages(0))], 1)
    alone_decode = r_rows(out, 0, 1)

    results = {}
    # Another prompt first, R's second.
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, out = run(kv, [RowPlan(other, 0, pages(1)), RowPlan(prompt, 0, pages(0))], len(other) + n)
    results["with_other"] = compare(alone_prefill, r_rows(out, len(other), n))
    # R's prompt in two chunks: the second half's rows.
    half = n // 2
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, _ = run(kv, [RowPlan(prompt[:half], 0, pages(0), sample=False)], half)
    kv, out = run(kv, [RowPlan(prompt[half:], half, pages(0))], n - half)
    second = {k: (v[:, half:] if k == "aux" else v[half:]) if k != "sel" else {i: s[half:] for i, s in v.items()}
              for k, v in alone_prefill.items() if k != "pieces"}
    results["chunked"] = compare(second, r_rows(out, 0, n - half))
    # R's decode token among others' (their prompts prefilled in one step first).
    others = [rng.integers(0, cfg.vocab_size, other_len).tolist() for _ in range(decode_rows - 1)]
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, _ = run(kv, [RowPlan(prompt, 0, pages(0))], n)
    for j, o in enumerate(others):
        kv, _ = run(kv, [RowPlan(o, 0, pages(j + 1))], len(o))
    rows = [RowPlan([int(rng.integers(0, cfg.vocab_size))], len(o), pages(j + 1)) for j, o in enumerate(others)]
    kv, out = run(kv, [*rows[: len(rows) // 2], RowPlan([decode_token], n, pages(0)), *rows[len(rows) // 2:]],
                  decode_rows)
    results["decode_batch"] = compare(alone_decode, r_rows(out, len(rows) // 2, 1))

    # As the engine cuts and pads: R's prompt in uneven chunks, each step padded to a power-of-two token bucket
    # (at least 64) and `decode_rows` rows; its rows compared chunk by chunk.
    sizes, left = [], n
    for size in (37, 64, 27, 100):
        sizes.append(min(size, left))
        left -= sizes[-1]
    sizes = [s for s in [*sizes, left] if s]
    kv = model.new_pages(1 + 2 * decode_rows * width)
    got, start = [], 0
    for size in sizes:
        plan = RowPlan(prompt[start:start + size], start, pages(0), sample=start + size == n)
        kv, out = run(kv, [plan], max(64, 1 << (size - 1).bit_length()), decode_rows)
        got.append(r_rows(out, 0, size))
        start += size
    joined = {"aux": np.concatenate([g["aux"] for g in got], axis=1),
              "hidden": np.concatenate([g["hidden"] for g in got]),
              "sel": {i: np.concatenate([g["sel"][i] for g in got]) for i in alone_prefill["sel"]}}
    results["chunked_padded"] = {"chunks": sizes, **compare(alone_prefill, joined)}
    # R's whole prompt in a step padded to `--big-bucket` tokens (the in-program K split of the linear kernel).
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, out = run(kv, [RowPlan(prompt, 0, pages(0))], big_bucket, decode_rows)
    results["big_bucket"] = compare(alone_prefill, r_rows(out, 0, n))
    # R's decode token in the same step as another request's 63-token prefill chunk, padded to 64 tokens.
    kv = model.new_pages(1 + 2 * decode_rows * width)
    kv, _ = run(kv, [RowPlan(prompt, 0, pages(0))], n)
    kv, out = run(kv, [RowPlan([decode_token], n, pages(0)), RowPlan(other[:63], 0, pages(1), sample=False)],
                  64, decode_rows)
    results["decode_beside_prefill"] = compare(alone_decode, r_rows(out, 0, 1))
    return results


def last_layer_pieces(params, kv, batch, x_TD, *, cfg, kernels) -> dict[str, jax.Array]:
    """The last layer's intermediate values for every token of a step ([T, ...] each), recomputed from the
    layer's input `x_TD` and the step's pages (rewriting a token's K/V writes the same values): when R's input
    rows are equal but its output rows are not, the first piece that differs names the op that varies.
    attn / mlp: the two halves' outputs; sparse layers: index queries, block scores, selected blocks; MoE
    layers on the kernels: normed input, router logits, expert ids and weights, each (token, choice) row of
    the down GEMM's output, and the combine."""
    from m3jax.model import (
        LayerPages,
        apply_rope,
        attention,
        mlp,
        projections_of_h,
        rms_norm,
        rope_tables,
        split_in_place,
        with_in_place,
    )
    from pallas_kernels import ops
    from pallas_kernels.attention import tuning
    from pallas_kernels.attention.ragged import query_blocks
    from pallas_kernels.moe import kernel as moe_kernel
    from pallas_kernels.moe import layout
    from pallas_kernels.moe.dispatch import invariant_router_logits
    from pallas_kernels.moe.tiles import invariant_tiles
    from pallas_kernels.msa.kernel import block_scores

    last = cfg.num_layers - 1
    r, run = next((r, run) for r, run in enumerate(cfg.layer_runs) if last in run.layers)
    j = run.layers.index(last)
    rp = params["runs"][r]
    whole, rest = split_in_place(rp)
    lp = with_in_place(jax.tree.map(lambda a: a[j], rest), whole)
    flat = LayerPages(*(None if a is None else a.reshape(-1, *a.shape[2:])
                        for a in (kv.k[r], kv.v[r], kv.index_k[r])))
    ps = flat.k.shape[1]
    b = batch.with_page_offset(j * (flat.k.shape[0] // run.count), ps)
    rope = rope_tables(batch.positions, cfg.rotary_dim, cfg.rope_theta, x_TD.dtype)
    h_TD = rms_norm(x_TD, lp["input_norm"], cfg.rms_norm_eps, kernels)
    o_TD, _, blocks = attention(lp, cfg, run.attn, h_TD, b, rope, flat, None, True, kernels, j)
    out = {"attn": o_TD}
    impl, inv = kernels.attention, kernels.batch_invariant
    if run.attn == "sparse" and impl != "reference":
        ix = lp["index"]
        # The index's q as the layer computes it: the fourth output of its one launch for every projection of h.
        iq = rms_norm(ops.project_many(h_TD, projections_of_h(lp, True), impl=impl, layer=j, invariant=inv)[3],
                      ix["q_norm"], cfg.rms_norm_eps, kernels)
        iq = apply_rope(iq, *rope)
        R, P = b.page_table.shape
        tiles = tuning.index_tiles(b.num_tokens, R, P, iq.shape[1], invariant=inv)
        qbs = query_blocks(b.token_row, b.positions, bt=tiles.block_tokens or tiles.bt, num_rows=R)
        scores = block_scores(iq, flat.index_k, b.page_table, b.positions, qbs, tiles=tiles,
                              interpret=impl == "interpret")
        out.update(index_q=iq, block_scores=scores, blocks=blocks)
    h2_TD = rms_norm(x_TD + o_TD, lp["post_attn_norm"], cfg.rms_norm_eps, kernels)
    out["mlp"] = mlp(lp, cfg, run.mlp, h2_TD, b, kernels, j)
    m = lp.get("moe", {})
    interpret = kernels.moe == "interpret"
    experts, shared_slot = moe_kernel.experts_of(m) if "experts" in m else (None, False)
    tiles = experts and inv and kernels.moe != "reference" and moe_kernel.kernel_tiles(
        b.num_tokens, experts, interpret=interpret,
        tiles=invariant_tiles(layout.weight_format(experts), b.num_tokens, interpret=interpret))
    if run.mlp == "moe" and tiles:  # the pieces of what `ops.moe` ran on the kernels
        logits = invariant_router_logits(h2_TD, m["router"], impl=kernels.moe)
        idx, w = moe_kernel.route(h2_TD, m["router"], m["router_bias"], cfg.num_experts_per_tok, logits)
        pad_T = jnp.arange(b.num_tokens) >= b.query_start[-1]
        idx = jnp.where(pad_T[:, None], idx[:1], idx)
        lay = moe_kernel.sort_and_pad(idx, w, num_slots=layout.num_slots(experts), shared_slot=shared_slot,
                                      bm=tiles.bm, routed_scaling=cfg.routed_scaling_factor)
        S = layout.num_slots(experts)
        flat_e = {k: v.reshape(-1, *v.shape[2:]) if k != layout.WIDE_SCALES else v for k, v in experts.items()}
        slot_B = jnp.where(lay.slot_B >= 0, lay.slot_B + j * S, -1)
        act = moe_kernel.gate_up(h2_TD, lay.row_token_M, slot_B, lay.rows_B, flat_e, tiles, alpha=cfg.swiglu_alpha,
                                 limit=cfg.swiglu_limit, interpret=interpret)
        y_MD = moe_kernel.down(act, slot_B, lay.rows_B, flat_e, tiles, interpret=interpret)
        out.update(mlp_input=h2_TD, router_logits=logits, expert_ids=idx, expert_weights=w,
                   expert_rows=y_MD[lay.dest_TJ], combined=moe_kernel.combine(y_MD, lay.dest_TJ, lay.w_TJ))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="m3-slice-1moe")
    ap.add_argument("--prompt-len", type=int, default=600, help="several index blocks of 128 tokens")
    ap.add_argument("--other-len", type=int, default=200)
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--big-bucket", type=int, default=2048, help="token bucket of the `big_bucket` composition")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"),
                    help="activation/weight dtype (default: bf16 on the GPU, fp32 elsewhere)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "pallas", "interpret", "reference"))
    ap.add_argument("--out", default="benchmarks/results/bisect-invariance.json")
    args = ap.parse_args()

    from checkpoints.prepare import prepare_params
    from m3jax.config import preset
    from m3jax.params import init_params
    from pallas_kernels.choice import KernelChoice

    cfg = preset(args.model)
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if (args.dtype or ("bf16" if on_gpu else "fp32")) == "bf16" else jnp.float32
    kernels = KernelChoice(args.kernels, args.kernels, batch_invariant=args.batch_invariant).resolve()
    t = time.perf_counter()
    params = init_params(cfg, dtype=dtype)
    if kernels.moe != "reference":
        params = prepare_params(params, "bf16", keep_reference=False)
    jax.block_until_ready(params)
    print(f"[bisect] params ready in {time.perf_counter() - t:.1f} s", flush=True)
    results = bisect(cfg, params, kernels, dtype, args.prompt_len, args.other_len, args.decode_rows,
                     args.big_bucket)
    n = args.prompt_len
    rec = {"op": "invariance_bisection", "model": args.model, "batch_invariant": args.batch_invariant,
           "kernels": kernels.attention, "dtype": jnp.dtype(dtype).name, "prompt_len": n, "results": results,
           "device": jax.devices()[0].device_kind, "git_rev": git_rev()}
    print(json.dumps(rec), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rec, indent=2) + "\n")


if __name__ == "__main__":
    main()
