"""The cost of a speculative step on the GPU, and the speed-up it projects at measured acceptance lengths.

m3-slice (the real widths, 4 layers) with a random EAGLE-3 draft of the published M3 draft's shapes
(`Inferact/MiniMax-M3-EAGLE3-GQA`: 6144 wide, 4 KV heads, own embedding and lm_head over 200,064 tokens). Random
weights make acceptance meaningless, so this times the work: at batch B, each request `--context` tokens deep,
- plain: the engine's decode step (forward of B single-token rows, whose argmax samples greedy rows), back to
  back;
- spec k: the engine's speculative step (the target over B rows of 1 + k tokens, verification, the draft's
  first pass and k - 1 chained passes), back to back: "spec_greedy", the executable the engine runs for greedy
  rows.
With `--sampled` every row samples at temperature 1.0 with top_p 0.95 (as agents' clients ask): the plain step is
the forward and then its "sample_filter" executable, the speculative one "spec_filter". `--also-general` times the
same rows through "spec" too, whose sampling conditionals make the dispatch wait for the device (the executable of
steps with a penalty or a grammar). All are the executables the engine runs, timed inside their jitted graphs with
only dispatch between them.

A token then costs plain / 1 without speculation and spec_k / L with it, L the mean accepted length (accepted
drafts + 1), so the projected speed-up is L * plain / spec_k, given here at InferenceX's M3 EAGLE3 acceptance
lengths (SPEED-Bench coding, temperature 1.0). On the full 60-layer model the target's share of the step grows
with its depth while the draft's does not, so these slice projections understate the full model's.

    PYTHONPATH=. python benchmarks/bench_spec.py [--batches 1 8 32 64] [--ks 1 3] [--context 2048] [--sampled]
"""

from __future__ import annotations

import argparse
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


def _rows(batch: int, context: int, k: int, pages_per_row: int, ps: int, vocab: int, sampled: bool) -> list[Any]:
    from serving.outputs import SamplingParams
    from serving.scheduler import ScheduledRow

    rng = np.random.default_rng(batch * 10 + k)
    return [ScheduledRow(i, rng.integers(0, vocab, 1 + k).tolist(), context,
                         list(range(1 + i * pages_per_row, 1 + (i + 1) * pages_per_row)), True, i,
                         SamplingParams(temperature=1.0, top_p=0.95, seed=i) if sampled else
                         SamplingParams(temperature=0.0), context, 0, k) for i in range(batch)]


def _plain(model: Any, batch: int, context: int, num_pages: int, pages_per_row: int, max_len: int, steps: int,
           sampled: bool) -> tuple[float, float, str]:
    """(seconds per plain decode step, compile seconds, its sampling variant)."""
    import jax

    from serving.runner import ModelRunner
    from serving.sampling import GREEDY_VARIANT, variant
    from serving.scheduler import SchedulerOutput

    vocab = model.cfg.vocab_size
    plain = ModelRunner(model, num_pages, batch, batch, max_len)
    scheduled = SchedulerOutput(_rows(batch, context, 0, pages_per_row, model.page_size, vocab, sampled), [])
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

    return _time(plain_step, steps), sum(e["seconds"] for e in plain.compile_log), how


def measure(model: Any, draft_cfg: Any, draft_params: Any, batch: int, context: int, ks: list[int], steps: int,
            also_general: bool = False, sampled: bool = False) -> dict[str, Any]:
    import jax

    from serving.runner import Draft, ModelRunner
    from serving.scheduler import SchedulerOutput

    ps = model.page_size
    pages_per_row = -(-(context + 2 * max(ks) + 1) // ps)
    num_pages = 1 + batch * pages_per_row
    max_len = pages_per_row * ps
    vocab = model.cfg.vocab_size
    rec: dict[str, Any] = {"batch": batch, "context": context,
                           "sampling": "temperature 1.0, top_p 0.95" if sampled else "greedy"}

    rec["plain_step_s"], rec["plain_compile_s"], rec["plain_sampling"] = _plain(
        model, batch, context, num_pages, pages_per_row, max_len, steps, sampled)
    for k in ks:
        runner = ModelRunner(model, num_pages, batch, batch * (1 + k), max_len, draft=Draft(draft_cfg, draft_params, k))
        scheduled = SchedulerOutput(_rows(batch, context, k, pages_per_row, ps, vocab, sampled), [])
        num_tokens, inputs = runner.spec_inputs(scheduled)
        what = runner.spec_variant(inputs, None, False)  # the engine's choice for these rows
        inputs = jax.device_put(inputs)
        runner.executable(what, num_tokens)
        rec[f"spec_k{k}_executable"] = what
        rec[f"spec_k{k}_step_s"] = _time(lambda r=runner, w=what, n=num_tokens, x=inputs: r.run_spec(w, n, x, None)
                                         .emitted, steps)
        if also_general:  # the same rows through the general executable, whose sampling holds conditionals
            runner.executable("spec", num_tokens)
            rec[f"spec_k{k}_general_step_s"] = _time(
                lambda r=runner, n=num_tokens, x=inputs: r.run_spec("spec", n, x, None).emitted, steps)
        rec[f"spec_k{k}_compile_s"] = sum(e["seconds"] for e in runner.compile_log)
        rec[f"spec_k{k}_over_plain"] = rec[f"spec_k{k}_step_s"] / rec["plain_step_s"]
        for mode, length in ACCEPTANCE[k].items():
            rec[f"speedup_k{k}_{mode}"] = length * rec["plain_step_s"] / rec[f"spec_k{k}_step_s"]
        del runner
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--also-general", action="store_true",
                    help="also time the general speculative executable (sampling under conditionals) on the same rows")
    ap.add_argument("--sampled", action="store_true",
                    help="rows sample (temperature 1.0, top_p 0.95) instead of greedy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from checkpoints.eagle import inferact_draft_config, random_draft_params
    from m3jax.api import M3Model
    from m3jax.config import preset
    from m3jax.params import init_params

    cfg = preset(args.model)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    t0 = time.perf_counter()
    model = M3Model.create(cfg, init_params(cfg, seed=0, dtype=dtype), dtype)
    # The published draft's shapes; its aux layers moved into the slice's depth (the first, middle and last).
    # A model narrower than M3 (a CPU check of this script) gets a draft of its own width.
    L = cfg.num_layers
    dcfg = inferact_draft_config(gqa=True).replace(aux_layer_ids=(1, L // 2, L - 1))
    if cfg.hidden_size != dcfg.target_hidden_size or cfg.vocab_size != dcfg.vocab_size:
        dcfg = dcfg.replace(hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, num_heads=4,
                            num_kv_heads=2, head_dim=16, intermediate_size=2 * cfg.hidden_size,
                            vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size)
    draft_params = random_draft_params(dcfg, seed=1, dtype=jnp.dtype(dtype))
    print(f"model and draft ready in {time.perf_counter() - t0:.1f} s ({dcfg.param_count() / 1e9:.2f} B draft "
          "parameters)", flush=True)
    device = jax.devices()[0].device_kind
    records = []
    for b in args.batches:
        rec = {"op": "spec_step", "model": args.model, **measure(model, dcfg, draft_params, b, args.context, args.ks,
                                                                  args.steps, args.also_general, args.sampled),
               "device": device, "git_rev": git_rev(), "acceptance_lengths": ACCEPTANCE}
        print(json.dumps(rec), flush=True)
        records.append(rec)
    name = "spec-h200" if "H200" in device else f"spec-{device.replace(' ', '_')}"
    name += "-sampled.json" if args.sampled else ".json"
    out = Path(args.out or f"benchmarks/results/{name}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
