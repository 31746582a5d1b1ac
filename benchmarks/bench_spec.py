"""The cost of a speculative step on the GPU, and the speed-up it projects at measured acceptance lengths.

m3-slice (the real widths, 4 layers) with a random EAGLE-3 draft of the published M3 draft's shapes
(`Inferact/MiniMax-M3-EAGLE3-GQA`: 6144 wide, 4 KV heads, own embedding and lm_head over 200,064 tokens). Random
weights make acceptance meaningless, so this times the work: at batch B, each request `--context` tokens deep,
- plain: the engine's decode step (forward of B single-token rows, whose argmax samples greedy rows), back to
  back;
- spec k: the engine's speculative step (the target over B rows of 1 + k tokens, verification, the draft's
  first pass and k - 1 chained passes), back to back: "spec_greedy", the executable the engine runs for greedy
  rows.
With `--temperature T` (> 0; InferenceX's acceptance lengths were measured at 1.0) every row samples, with
`--top-p P` if given: the plain step is the forward and then its sampling executable ("sample_draw", or
"sample_filter" with top-p), the speculative one "spec_draw" / "spec_filter". `--also-general` times the
same rows through "spec" too, whose sampling conditionals make the dispatch wait for the device (the executable of
steps with a penalty or a grammar). All are the executables the engine runs, timed inside their jitted graphs with
only dispatch between them.

A token then costs plain / 1 without speculation and spec_k / L with it, L the mean accepted length (accepted
drafts + 1), so the projected speed-up is L * plain / spec_k, given here at InferenceX's M3 EAGLE3 acceptance
lengths (SPEED-Bench coding, temperature 1.0).

On the full 60-layer model the target's share of the step grows with its depth while the draft's does not. With
two or more `--models` of M3's widths and different depths (m3-slice-1moe: 1 dense + 1 MoE layer; m3-slice-2moe:
1 + 2, both held by an H100; m3-slice: 1 + 3), each step time is fitted as a + b * layers over the models (the
same draft in each, so its cost sits in a), and the fit is carried to m3-full's 60 layers (its 3 dense layers
counted at the MoE layers' slope: an approximation on the slow side for both steps): the "projection" records.

    PYTHONPATH=. python benchmarks/bench_spec.py [--models m3-slice-1moe m3-slice] [--moe-format mxfp8]
        [--batches 1 8 32 64] [--ks 1 3] [--context 2048] [--temperature 1.0 [--top-p 0.95]]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.timing import git_rev

# InferenceX, MiniMax M3 + EAGLE3, SPEED-Bench coding at temperature 1.0: mean accepted length by k.
ACCEPTANCE = {1: {"thinking_on": 1.78, "thinking_off": 1.84}, 3: {"thinking_on": 2.83, "thinking_off": 2.93}}


def _time(fn: Any, steps: int) -> float:
    """Seconds per call of `fn` dispatched back to back (it returns what to block on)."""
    import jax

    jax.block_until_ready([fn() for _ in range(3)])
    t0 = time.perf_counter()
    outs = [fn() for _ in range(steps)]
    jax.block_until_ready(outs)
    return (time.perf_counter() - t0) / steps


def _rows(batch: int, context: int, k: int, pages_per_row: int, ps: int, vocab: int, sampling: Any) -> list[Any]:
    from serving.scheduler import ScheduledRow

    rng = np.random.default_rng(batch * 10 + k)
    return [ScheduledRow(i, rng.integers(0, vocab, 1 + k).tolist(), context,
                         list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)), True, i,
                         dataclasses.replace(sampling, seed=i), context, 0, k) for i in range(batch)]


def _plain(model: Any, batch: int, context: int, num_pages: int, pages_per_row: int, max_len: int, steps: int,
           sampling_params: Any) -> tuple[float, float, str, dict[str, Any]]:
    """(seconds per plain decode step, compile seconds, its sampling variant, its kernel-busy profile)."""
    import jax

    from serving.runner import ModelRunner
    from serving.sampling import GREEDY_VARIANT, variant
    from serving.scheduler import SchedulerOutput

    vocab = model.cfg.vocab_size
    plain = ModelRunner(model, num_pages, batch, batch, max_len)
    scheduled = SchedulerOutput(_rows(batch, context, 0, pages_per_row, model.page_size, vocab, sampling_params), [])
    num_tokens, forward_args, sampling, _ = plain.inputs(scheduled)
    # Greedy rows: the forward's own argmax is the step's sampling; sampled ones: the variant's executable after it.
    how = GREEDY_VARIANT if sampling is None else variant(sampling, batch, vocab, constrained=False,
                                                          want_logprobs=False)
    host = jax.device_put(plain.host_pack("forward", num_tokens).pack(forward_args))
    fwd = plain.executable("forward", num_tokens)
    if sampling is not None:
        sample_exe = plain.executable(how, sampling.num_rows)
        sampling = jax.device_put(sampling)

    def plain_step() -> Any:
        plain.kv, plain.history, logits, (plain.prev_tokens, out) = fwd(model.params, plain.kv, plain.history,
                                                                        plain.prev_tokens, host)
        if sampling is not None:
            plain.prev_tokens, out = sample_exe(logits, sampling)
        return out.tokens

    return _time(plain_step, steps), sum(e["seconds"] for e in plain.compile_log), how, _busy(plain_step, steps)


def _busy(fn: Any, steps: int) -> dict[str, Any]:
    """The device's own time for `fn`'s calls (kernel-busy per call and the top kernels; empty on the CPU), so a
    step's device work and its host overhead can be told apart."""
    from benchmarks.timing import device_profile

    return device_profile(fn, [()], calls=steps, top=12)


def measure(model: Any, draft_cfg: Any, draft_params: Any, batch: int, context: int, ks: list[int], steps: int,
            also_general: bool = False, temperature: float = 0.0, top_p: float = 1.0) -> dict[str, Any]:
    import jax

    from serving.outputs import SamplingParams
    from serving.runner import Draft, ModelRunner
    from serving.scheduler import SchedulerOutput

    ps = model.page_size
    pages_per_row = -(-(context + 2 * max(ks) + 1) // ps)
    num_pages = 1 + batch * pages_per_row
    max_len = pages_per_row * ps
    vocab = model.cfg.vocab_size
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    rec: dict[str, Any] = {"batch": batch, "context": context, "temperature": temperature, "top_p": top_p}

    rec["plain_step_s"], rec["plain_compile_s"], rec["plain_sampling"], prof = _plain(
        model, batch, context, num_pages, pages_per_row, max_len, steps, sampling)
    rec.update({f"plain_{key}": value for key, value in prof.items()})
    for k in ks:
        runner = ModelRunner(model, num_pages, batch, batch * (1 + k), max_len, draft=Draft(draft_cfg, draft_params, k))
        scheduled = SchedulerOutput(_rows(batch, context, k, pages_per_row, ps, vocab, sampling), [])
        num_tokens, inputs = runner.spec_inputs(scheduled)
        what = runner.spec_variant(inputs, None, False)  # the engine's choice for these rows
        inputs = jax.device_put(inputs)
        runner.executable(what, num_tokens)
        rec[f"spec_k{k}_executable"] = what
        spec_step = functools.partial(lambda r, w, n, x: r.run_spec(w, n, x, None).emitted, runner, what,
                                      num_tokens, inputs)
        rec[f"spec_k{k}_step_s"] = _time(spec_step, steps)
        rec.update({f"spec_k{k}_{key}": value for key, value in _busy(spec_step, steps).items()})
        if also_general:  # the same rows through the general executable, whose sampling holds conditionals
            runner.executable("spec", num_tokens)
            rec[f"spec_k{k}_general_step_s"] = _time(
                lambda r=runner, n=num_tokens, x=inputs: r.run_spec("spec", n, x, None).emitted, steps)
        rec[f"spec_k{k}_compile_s"] = sum(e["seconds"] for e in runner.compile_log)
        _ratios(rec, k)
        del runner
    return rec


def _ratios(rec: dict[str, Any], k: int) -> None:
    """A k-draft step over the plain one, and the projected speed-up at each published acceptance length: a token
    costs plain / 1 without speculation and spec_k / L with it."""
    rec[f"spec_k{k}_over_plain"] = rec[f"spec_k{k}_step_s"] / rec["plain_step_s"]
    for mode, length in ACCEPTANCE[k].items():
        rec[f"speedup_k{k}_{mode}"] = length * rec["plain_step_s"] / rec[f"spec_k{k}_step_s"]


def project(records: list[dict[str, Any]], ks: list[int], depth: int) -> list[dict[str, Any]]:
    """Per batch, the plain and k-draft steps fitted as a + b * layers over the measured depths (least squares)
    and evaluated at `depth`; nothing when fewer than two depths were measured."""
    out = []
    for b in sorted({r["batch"] for r in records}):
        rows = [r for r in records if r["batch"] == b]
        layers = np.array([r["num_layers"] for r in rows], float)
        if len(set(layers)) < 2:
            continue

        def at_depth(key: str, layers: np.ndarray = layers, rows: list[dict[str, Any]] = rows
                     ) -> tuple[float, float]:
            slope, intercept = np.polyfit(layers, [r[key] for r in rows], 1)
            return float(intercept + slope * depth), float(slope)

        rec: dict[str, Any] = {"op": "spec_step_projection", "batch": b, "num_layers": depth,
                               "from_models": [r["model"] for r in rows], "temperature": rows[0]["temperature"],
                               "top_p": rows[0]["top_p"],
                               "moe_format": rows[0]["moe_format"], "device": rows[0]["device"],
                               "git_rev": rows[0]["git_rev"]}
        rec["plain_step_s"], rec["plain_per_layer_s"] = at_depth("plain_step_s")
        for k in ks:
            rec[f"spec_k{k}_step_s"], rec[f"spec_k{k}_per_layer_s"] = at_depth(f"spec_k{k}_step_s")
            _ratios(rec, k)
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["m3-slice"],
                    help="presets of M3's widths; two or more depths add the full-depth projection")
    ap.add_argument("--moe-format", default="bf16", choices=("bf16", "mxfp8", "mxfp4"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--also-general", action="store_true",
                    help="also time the general speculative executable (sampling under conditionals) on the same rows")
    ap.add_argument("--temperature", type=float, default=0.0, help="the rows' temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the rows' top_p (1: off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from checkpoints.eagle import inferact_draft_config, random_draft_params
    from m3jax.api import M3Model
    from m3jax.config import preset
    from m3jax.params import init_params

    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    device = jax.devices()[0].device_kind
    records = []
    for name in args.models:
        cfg = preset(name)
        t0 = time.perf_counter()
        model = M3Model.create(cfg, init_params(cfg, seed=0, dtype=dtype), dtype, moe_weight_format=args.moe_format)
        # The published draft's shapes; its aux layers moved into the slice's depth (the first, middle and last).
        # A model narrower than M3 (a CPU check of this script) gets a draft of its own width.
        L = cfg.num_layers
        dcfg = inferact_draft_config(gqa=True).replace(aux_layer_ids=(min(1, L - 1), L // 2, L - 1))
        if cfg.hidden_size != dcfg.target_hidden_size or cfg.vocab_size != dcfg.vocab_size:
            dcfg = dcfg.replace(hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, num_heads=4,
                                num_kv_heads=2, head_dim=16, intermediate_size=2 * cfg.hidden_size,
                                vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size)
        draft_params = random_draft_params(dcfg, seed=1, dtype=jnp.dtype(dtype))
        print(f"{name} and its draft ready in {time.perf_counter() - t0:.1f} s ({dcfg.param_count() / 1e9:.2f} B "
              "draft parameters)", flush=True)
        for b in args.batches:
            rec = {"op": "spec_step", "model": name, "num_layers": L, "moe_format": args.moe_format,
                   **measure(model, dcfg, draft_params, b, args.context, args.ks, args.steps, args.also_general,
                             args.temperature, args.top_p),
                   "device": device, "git_rev": git_rev(), "acceptance_lengths": ACCEPTANCE}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        del model, draft_params
    for rec in project(records, args.ks, preset("m3-full").num_layers):
        print(json.dumps(rec), flush=True)
        records.append(rec)
    name = "spec-h200" if "H200" in device else f"spec-{device.replace(' ', '_')}"
    name += "-sampled.json" if args.temperature > 0 else ".json"
    out = Path(args.out or f"benchmarks/results/{name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
