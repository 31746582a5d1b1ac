"""Train the embedded default model (`checkpoints/tiny/`): a tiny M3-architecture model, on the CPU, in minutes.

    python -m checkpoints.train_tiny --out checkpoints/tiny --steps 1600

Everything M3 has, small: a dense-attention first layer then MSA layers, dense-MLP then MoE layers (the two kinds
misaligned on layer 1), 8 experts top-2 with a shared expert and a selection-only routing bias, partial RoPE, and
MSA blocks of 16 with top-4 selection so that any context past 64 tokens really drops blocks.

Why it is trained the way it is:
- Corpus: the Python standard library's top-level modules, which every machine running this has; no download.
  Validation files are every tenth file by sorted name, so the split is by file and deterministic. The BPE is
  fitted to the training files only.
- The loss runs `m3jax.model.forward` itself over a flat ragged `Batch` with fresh zero `KVPages` (gradients flow
  through the page writes and gathers), so the shipped weights are trained with exactly the serving forward,
  MSA block selection included: what the model learned to use is what the server will give it.
- That forward gathers each token's whole page list, so a step's cost grows much faster than its token count
  with the sequence length. Most steps use short sequences; every fifth step uses 256-token ones, where MSA
  really drops blocks and the far positions are trained.
- The routing bias never receives a gradient (it only picks experts); after each step it moves a fixed step
  toward balanced expert load (aux-loss-free balancing), as M3 trains it.
- Block selection is a top-k, which passes no gradient to the MSA index branch: cross-entropy alone leaves its
  projections at their random init (up to weight decay, which its RMS norms make irrelevant). An index that
  picks well needs an objective of its own, out of scope here; the sparse layers learn to use a fixed,
  content-dependent selection that always includes the query's own block.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from checkpoints.tokenizer import write_tokenizer_files
from checkpoints.writer import write_checkpoint
from m3jax.batch import Batch, KVPages, RowPlan, build_batch, page_size
from m3jax.config import M3Config
from m3jax.model import forward
from m3jax.params import ParamSpec, map_specs, param_specs
from pallas_kernels import ops
from pallas_kernels.choice import REFERENCE
from pallas_kernels.moe.reference import route

# The embedded model's shape. Its own config, not a preset: presets describe M3 itself.
CONFIG = M3Config(
    vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    attn_types=("dense", "sparse", "sparse", "sparse"), mlp_types=("dense", "dense", "moe", "moe"),
    dense_intermediate_size=256, moe_intermediate_size=64, shared_intermediate_size=128,
    num_experts=8, num_experts_per_tok=2, num_shared_experts=1, routed_scaling_factor=2.0,
    rope_theta=10000.0, rotary_dim=16, max_position_embeddings=4096,
    index_num_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=4, index_local_blocks=1,
    bos_token_id=None, eos_token_ids=(0,),  # replaced by the trained tokenizer's ]~!b[ / [e~[ ids
)

SEQ_LEN = 256  # training sequences; also the evaluation windows
# Top-level stdlib modules between these sizes (drops stubs and the few giant ones), sorted by name.
MIN_FILE_BYTES, MAX_FILE_BYTES = 1_000, 120_000
EXCLUDED_FILES = ("stringprep.py",)  # a generated table of hex literals, not code
VAL_EVERY, VAL_OFFSET = 10, 5
EVAL_WINDOWS = 16  # non-overlapping windows of SEQ_LEN for the final train / validation loss


# ---- corpus ------------------------------------------------------------------------------------------------

def corpus_files() -> tuple[Path, list[Path], list[Path]]:
    """(stdlib dir, train files, validation files): deterministic for a given Python installation."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(stdlib.glob("*.py"))
             if MIN_FILE_BYTES <= f.stat().st_size <= MAX_FILE_BYTES and f.name not in EXCLUDED_FILES]
    val = files[VAL_OFFSET::VAL_EVERY]
    train = [f for f in files if f not in set(val)]
    return stdlib, train, val


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def token_stream(tok: Tokenizer, texts: list[str], bos: int, eos: int) -> np.ndarray:
    """One long stream: `]~!b[ file [e~[` per file. Training windows start anywhere in it, so the model also
    learns to continue text that starts mid-file without a BOS (as `m3jax generate` prompts do)."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray([bos, *enc.ids, eos], np.int32))
    return np.concatenate(parts)


# ---- the loss, through the serving forward -----------------------------------------------------------------

@contextlib.contextmanager
def recording_routing() -> Iterator[list[jax.Array]]:
    """While active, every `ops.moe` call (one per MoE layer, in layer order) also appends its chosen expert ids
    [T, k] to the yielded list, for the load-balancing bias update. The forward itself is unchanged."""
    chosen: list[jax.Array] = []
    original = ops.moe

    def moe(h_TD: jax.Array, p: dict[str, Any], *, top_k: int, **kw: Any) -> jax.Array:
        chosen.append(route(h_TD, p["router"], p["router_bias"], top_k)[0])
        return original(h_TD, p, top_k=top_k, **kw)

    ops.moe = moe  # type: ignore[assignment]
    try:
        yield chosen
    finally:
        ops.moe = original  # type: ignore[assignment]


def make_batch(cfg: M3Config, windows: np.ndarray) -> Batch:
    """A flat ragged batch with one request row per training sequence, each on its own pages (page 0 stays the
    padding sink), logits for every token."""
    B, L = windows.shape
    ps = page_size(cfg)
    per_row = -(-L // ps)
    rows = [RowPlan(windows[b].tolist(), 0, range(1 + b * per_row, 1 + (b + 1) * per_row), sample=False)
            for b in range(B)]
    batch, _ = build_batch(rows, ps, B * L, B, per_row, num_logit_rows=0)
    batch.logit_rows = jnp.arange(B * L, dtype=jnp.int32)
    return batch


def loss_and_loads(params: Any, cfg: M3Config, batch: Batch, targets_T: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy (nats) and, per MoE layer, each expert's share of routed slots [M, E]."""
    num_pages = 1 + batch.page_table.size  # static: every row has its own pages, plus the sink
    with recording_routing() as chosen:
        # Unrolled: the recorder sees each MoE layer's call at the top level (inside a scan it would see one).
        out = forward(params, cfg, KVPages.empty(cfg, num_pages, jnp.float32), batch, REFERENCE, unroll=True)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    loss = -jnp.mean(jnp.take_along_axis(logp, targets_T[:, None], axis=-1))
    loads = jnp.stack([jnp.bincount(c.reshape(-1), length=cfg.num_experts) / c.size for c in chosen])
    return loss, loads


# ---- optimiser ---------------------------------------------------------------------------------------------

def init_params(cfg: M3Config, seed: int) -> Any:
    """Training init: matrices N(0, 1/fan_in) with residual output projections scaled by 1/sqrt(2 * layers),
    Gemma norm weights 0 (scale 1), routing bias 0 (balancing moves it)."""
    rng = np.random.default_rng(seed)
    residual_out = 1.0 / math.sqrt(2 * cfg.num_layers)

    def make(spec: ParamSpec) -> np.ndarray:
        if spec.init in ("norm", "zeros"):
            return np.zeros(spec.shape, np.float32)
        std = 1.0 / math.sqrt(spec.fan_in)
        if spec.axes[-1] == "embed" and spec.axes[0] != "vocab":  # wo, w_down: write into the residual
            std *= residual_out
        return rng.normal(0.0, std, spec.shape).astype(np.float32)

    return jax.tree.map(jnp.asarray, map_specs(make, param_specs(cfg)))


def _masks(cfg: M3Config) -> tuple[Any, Any]:
    """(trained by gradient, weight-decayed) per param: the routing bias is neither; norms are not decayed."""
    specs = param_specs(cfg)
    trained = map_specs(lambda s: s.init != "zeros", specs)  # "zeros": the routing bias
    decayed = map_specs(lambda s: s.init == "matrix", specs)
    return trained, decayed


def lr_at(step: jax.Array, peak: float, total: int, warmup: int) -> jax.Array:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    s = step.astype(jnp.float32)
    frac = jnp.clip((s - warmup) / max(total - warmup, 1), 0.0, 1.0)
    cosine = peak * (0.1 + 0.9 * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
    return jnp.where(s < warmup, peak * (s + 1) / warmup, cosine)


def make_train_step(cfg: M3Config, *, peak_lr: float, total: int, warmup: int,
                    weight_decay: float, clip: float, bias_step: float) -> Any:
    b1, b2, eps = 0.9, 0.95, 1e-8
    grad_fn = jax.value_and_grad(loss_and_loads, has_aux=True)

    def step_fn(params: Any, opt: dict[str, Any], batch: Batch, targets: jax.Array) -> tuple[Any, ...]:
        trained, decayed = _masks(cfg)
        (loss, loads), grads = grad_fn(params, cfg, batch, targets)
        gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (gnorm + 1e-6)), grads)
        t = opt["t"] + 1
        lr = lr_at(opt["t"], peak_lr, total, warmup)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
        c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)

        def update(p: jax.Array, m: jax.Array, v: jax.Array, tr: bool, wd: bool) -> jax.Array:
            if not tr:
                return p
            u = (m / c1) / (jnp.sqrt(v / c2) + eps) + (weight_decay * p if wd else 0.0)
            return p - lr * u

        params = jax.tree.map(update, params, m, v, trained, decayed)
        # Aux-loss-free balancing: overloaded experts' bias goes down, underloaded ones' up.
        row = 0  # loads has one row per MoE layer, in layer order
        for r, run in enumerate(cfg.layer_runs):
            if run.mlp == "moe":
                run_loads = loads[row:row + run.count]  # [layers, E]
                step = bias_step * jnp.sign(jnp.mean(run_loads, axis=-1, keepdims=True) - run_loads)
                params["runs"][r]["moe"]["router_bias"] = params["runs"][r]["moe"]["router_bias"] + step
                row += run.count
        return params, {"m": m, "v": v, "t": t}, loss, gnorm, lr, loads

    # One compile per batch shape (the short and the long sequences).
    return jax.jit(step_fn, donate_argnums=(0, 1))


# ---- main --------------------------------------------------------------------------------------------------

def eval_loss(params: Any, cfg: M3Config, stream: np.ndarray, batch_size: int) -> float:
    """Mean loss over EVAL_WINDOWS evenly spaced windows of the stream (deterministic)."""
    n = min(EVAL_WINDOWS, (len(stream) - 1) // (SEQ_LEN + 1))
    starts = np.linspace(0, len(stream) - SEQ_LEN - 2, n).astype(np.int64)
    fn = jax.jit(lambda p, b, t: loss_and_loads(p, cfg, b, t)[0])
    losses = []
    for i in range(0, n, batch_size):
        w = np.stack([stream[s:s + SEQ_LEN + 1] for s in starts[i:i + batch_size]])
        losses.append(float(fn(params, make_batch(cfg, w[:, :-1]), jnp.asarray(w[:, 1:].reshape(-1)))) * len(w))
    return sum(losses) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints.train_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--batch-tokens", type=int, default=512, help="tokens per step (batch x sequence length)")
    ap.add_argument("--short-len", type=int, default=64, help="sequence length of the cheap steps")
    ap.add_argument("--long-every", type=int, default=5, help="every Nth step uses full SEQ_LEN sequences")
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--bias-step", type=float, default=1e-3, help="routing-bias balancing step per train step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    # Written next to the target and swapped in at the end: a failed run never leaves a half-written model.
    out = args.out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    stdlib, train_files, val_files = corpus_files()
    train_texts, val_texts = read_texts(train_files), read_texts(val_files)
    ids = write_tokenizer_files(tmp, CONFIG.vocab_size, CONFIG.max_position_embeddings, texts=train_texts)
    cfg = CONFIG.replace(bos_token_id=ids.bos, eos_token_ids=(ids.eos,))
    tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    train_stream = token_stream(tok, train_texts, ids.bos, ids.eos)
    val_stream = token_stream(tok, val_texts, ids.bos, ids.eos)
    corpus_bytes = sum(len(t.encode()) for t in train_texts), sum(len(t.encode()) for t in val_texts)
    print(f"corpus: {len(train_files)} train files ({corpus_bytes[0] / 1e6:.2f} MB, {len(train_stream)} tokens), "
          f"{len(val_files)} validation files ({corpus_bytes[1] / 1e6:.2f} MB, {len(val_stream)} tokens) "
          f"from {stdlib}", file=sys.stderr)
    # Attention here is the serving path: every token gathers its row's whole page list, so a step's cost grows
    # with the sequence length far faster than its token count. Most steps therefore use short sequences (local
    # statistics, the bulk of the loss); every `long_every`-th step uses SEQ_LEN ones, where MSA really drops
    # blocks and the far positions get trained. Tokens per step are the same for both.
    shapes = {"short": (args.batch_tokens // args.short_len, args.short_len),
              "long": (args.batch_tokens // SEQ_LEN, SEQ_LEN)}
    is_long = [(s + 1) % args.long_every == 0 for s in range(args.steps)]
    print(f"model: {cfg.param_count() / 1e6:.2f}M parameters; {args.steps} steps of {args.batch_tokens} tokens "
          f"({sum(is_long)} of {shapes['long'][0]} x {SEQ_LEN}, the rest {shapes['short'][0]} x {args.short_len})",
          file=sys.stderr)

    params = init_params(cfg, args.seed)
    opt = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params),
           "t": jnp.zeros((), jnp.int32)}
    step_fn = make_train_step(cfg, peak_lr=args.lr, total=args.steps, warmup=max(1, min(100, args.steps // 10)),
                              weight_decay=args.weight_decay, clip=args.clip, bias_step=args.bias_step)
    rng = np.random.default_rng(args.seed)
    recent: list[float] = []
    t_train = time.perf_counter()
    bar = tqdm(range(args.steps), file=sys.stderr, dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        B, L = shapes["long" if is_long[step] else "short"]
        starts = rng.integers(0, len(train_stream) - L - 1, B)
        w = np.stack([train_stream[s:s + L + 1] for s in starts])
        params, opt, loss, gnorm, lr, loads = step_fn(params, opt, make_batch(cfg, w[:, :-1]),
                                                      jnp.asarray(w[:, 1:].reshape(-1)))
        recent = (recent + [float(loss)])[-args.log_every:]
        bar.set_postfix(loss=f"{recent[-1]:.3f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            imbalance = float(jnp.max(loads) * cfg.num_experts)
            tqdm.write(f"step {step + 1:5d}  loss {np.mean(recent):.3f}  lr {float(lr):.2e}  |g| {float(gnorm):.2f}"
                       f"  max expert load {imbalance:.2f}x mean  {time.perf_counter() - t_train:.0f}s",
                       file=sys.stderr)
    bar.close()
    train_seconds = time.perf_counter() - t_train

    train_loss = eval_loss(params, cfg, train_stream, shapes["long"][0])
    val_loss = eval_loss(params, cfg, val_stream, shapes["long"][0])
    print(f"final loss (nats/token): train {train_loss:.3f} (ppl {math.exp(train_loss):.1f}), validation "
          f"{val_loss:.3f} (ppl {math.exp(val_loss):.1f}); uniform would be {math.log(cfg.vocab_size):.3f}",
          file=sys.stderr)

    host = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    write_checkpoint(tmp, cfg, host, layout="released", dtype="bfloat16")
    generation = {"bos_token_id": ids.bos, "eos_token_id": ids.eos, "do_sample": True, "temperature": 0.7,
                  "top_p": 0.95, "top_k": 40}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    record = {
        "command": "python -m checkpoints.train_tiny " + " ".join(sys.argv[1:] if argv is None else argv),
        "steps": args.steps,
        "batch_tokens": args.batch_tokens,
        "batch_shapes": {k: list(v) for k, v in shapes.items()},
        "long_steps": sum(is_long),
        "tokens_seen": args.steps * args.batch_tokens,
        "peak_lr": args.lr,
        "seed": args.seed,
        "parameters": cfg.param_count(),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "final_train_loss": round(train_loss, 4),
        "final_val_loss": round(val_loss, 4),
        "final_train_perplexity": round(math.exp(train_loss), 2),
        "final_val_perplexity": round(math.exp(val_loss), 2),
        "loss_note": f"nats/token, fp32 weights, mean over {EVAL_WINDOWS} evenly spaced {SEQ_LEN}-token windows",
        "corpus": {
            "description": f"Python {sys.version.split()[0]} standard library, top-level modules "
                           f"({MIN_FILE_BYTES}-{MAX_FILE_BYTES} bytes, without {', '.join(EXCLUDED_FILES)}) sorted by "
                           f"name; every {VAL_EVERY}th file "
                           f"from index {VAL_OFFSET} is validation; each file wrapped as ]~!b[ text [e~[",
            "train_files": len(train_files),
            "val_files": [f.name for f in val_files],
            "train_bytes": corpus_bytes[0],
            "val_bytes": corpus_bytes[1],
            "train_tokens": int(len(train_stream)),
            "val_tokens": int(len(val_stream)),
        },
        "jax": jax.__version__,
    }
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {record['total_seconds']:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
