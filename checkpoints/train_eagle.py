"""Train the embedded EAGLE-3 draft (`checkpoints/tiny_eagle3/`) for the embedded tiny model, on the CPU, in minutes.

    python -m checkpoints.train_eagle --out checkpoints/tiny_eagle3

The draft is what the published M3 drafts are, small: one Llama layer of the target's width (128; 4 query heads and
2 KV heads of 32, MLP 3 x hidden as TorchSpec's templates), EAGLE-3.1 per-aux `fc_norm` and `norm_output`, no
embedding of its own (the target's is shared), and its own lm_head over a pruned draft vocabulary with d2t / t2d.

Why it is trained the way it is:
- Aux layers (1, 2, 3): the residual stream at the input of target layers 1, 2 and 3 (the outputs of layers 0, 1
  and 2). vLLM's default (2, L // 2, L - 3) gives (2, 2, 1) for a 4-layer target: a duplicate and no top layer.
  Layer 0's input is the bare embedding, and the output of the last layer cannot be captured (`forward(capture=)`
  records layer inputs), so (1, 2, 3) is the low / middle / high choice the M3 drafts' (2, 30, 57) make.
- Labels are the target's own soft distributions (EAGLE-3 / SpecForge: forward KL to the target, renormalised over
  the draft vocabulary), on the tiny model's training text (the Python standard library, split by file exactly as
  `train_tiny` split it). Positions whose target argmax lies outside the draft vocabulary are masked, as SpecForge
  does.
- Training-time test: `--ttt` chained passes per position (m3jax.eagle.ttt_forward), pass i fed the draft's own
  hidden state from pass i - 1 and attending to its own chain's keys; losses weighted 0.8 ** i (SpecForge).
- Draft vocabulary: the `--draft-vocab` tokens the target most often predicts greedily on training text (the tiny
  target's argmax uses under a thousand distinct tokens), so pruning costs almost no acceptance. The lm_head starts
  as the target's rows for them and the final norm as the target's (Gemma 1 + w becomes Llama w), so the draft's
  first logits are the target's logits of whatever its layer produces.
- The target runs the serving forward (`m3jax.model.forward` with `capture=`) inside the jitted step, without
  gradient: its hidden states are exactly what the engine hands the draft.

Acceptance (`evaluate_acceptance`): held-out prompts (the validation files), greedy continuations by the target,
then chain drafting of k tokens from every position of the continuation (teacher-forced through `propose_chain`,
exact because a chain only counts while it matches); accepted length = matched prefix + the bonus token, 1..k+1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from checkpoints.eagle import load_draft, write_draft
from checkpoints.train_tiny import corpus_files, lr_at, make_batch, read_texts, token_stream
from m3jax.api import M3Model, embedded_model_path, load_model
from m3jax.batch import KVPages, RowPlan, build_batch
from m3jax.config import M3Config
from m3jax.eagle import (
    DraftConfig,
    draft_param_specs,
    draft_vocab_logits,
    fuse_aux,
    propose_chain,
    ttt_forward,
    vocab_mapping,
)
from m3jax.model import forward
from m3jax.params import ParamSpec, map_specs
from pallas_kernels.choice import REFERENCE

AUX_LAYERS = (1, 2, 3)
DRAFT_VOCAB = 1024
SEQ_LEN = 128  # training windows
EVAL_PROMPT, EVAL_NEW = 64, 64  # held-out prompt tokens, greedy continuation tokens
LOSS_DECAY = 0.8  # pass i's loss weight: LOSS_DECAY ** i
FROZEN = ("d2t", "t2d")  # the vocabulary mapping: chosen before training, never trained


def draft_config(target: M3Config, draft_ids: np.ndarray) -> DraftConfig:
    """The embedded draft's shape for a target; `draft_ids`: the target ids of the draft vocabulary, ascending."""
    d = target.hidden_size
    return DraftConfig(
        hidden_size=d, num_heads=4, num_kv_heads=2, head_dim=d // 4, intermediate_size=3 * d,
        vocab_size=target.vocab_size, draft_vocab_size=len(draft_ids), target_hidden_size=d,
        aux_layer_ids=AUX_LAYERS, rms_norm_eps=1e-6, rope_theta=target.rope_theta,
        max_position_embeddings=target.max_position_embeddings, norm_output=True, fc_norm=True,
        own_embed=False, own_lm_head=True, vocab_map=len(draft_ids) < target.vocab_size,
    )


# ---- the target's features ---------------------------------------------------------------------------------

def target_features(params: Any, cfg: M3Config, ids_BS: np.ndarray | jax.Array,
                    capture: tuple[int, ...] = AUX_LAYERS) -> tuple[jax.Array, jax.Array]:
    """The serving forward over whole sequences: (aux hidden [A, B, S, D], logits [B, S, V] fp32)."""
    B, S = ids_BS.shape
    # The layout of B whole sequences depends on the shape only; the ids may be traced.
    batch = dataclasses.replace(make_batch(cfg, np.zeros((B, S), np.int32)),
                                token_ids=jnp.asarray(ids_BS, jnp.int32).reshape(-1))
    kv = KVPages.empty(cfg, 1 + batch.page_table.size, params["embed"].dtype)
    out = forward(params, cfg, kv, batch, REFERENCE, capture=capture)
    return out.aux_hidden.reshape(len(capture), B, S, -1), out.logits.reshape(B, S, -1)


def choose_draft_vocab(params: Any, cfg: M3Config, stream: np.ndarray, size: int, windows: int,
                       seed: int) -> np.ndarray:
    """The `size` target ids the target predicts most often greedily over `windows` random training windows
    (ties: by frequency in the text), ascending."""
    rng = np.random.default_rng(seed)
    fn = jax.jit(lambda p, ids: jnp.argmax(target_features(p, cfg, ids)[1], axis=-1))
    counts = np.zeros(cfg.vocab_size, np.int64)
    for _ in range(max(1, windows // 8)):
        starts = rng.integers(0, len(stream) - SEQ_LEN, 8)
        ids = np.stack([stream[s:s + SEQ_LEN] for s in starts])
        counts += np.bincount(np.asarray(fn(params, ids)).ravel(), minlength=cfg.vocab_size)
    text = np.bincount(stream, minlength=cfg.vocab_size)
    order = np.lexsort((-text, -counts))  # last key first: argmax count, then text frequency
    return np.sort(order[:size])


# ---- the draft's loss --------------------------------------------------------------------------------------

def init_draft(dcfg: DraftConfig, target_params: Any, draft_ids: np.ndarray, seed: int) -> dict[str, Any]:
    """Training init: matrices N(0, 1/fan_in) (outputs into the residual scaled by 1/sqrt(2)), norms 1, lm_head
    and final norm from the target (see the module docstring)."""
    rng = np.random.default_rng(seed)

    def make(spec: ParamSpec) -> np.ndarray:
        if spec.init == "norm":
            return np.ones(spec.shape, np.float32)
        if spec.init == "index":
            return np.zeros(spec.shape, np.int32 if spec.dtype_class == "int32" else np.bool_)
        std = 1.0 / math.sqrt(spec.fan_in)
        if spec.axes[-1] == "embed" and spec.axes[0] != "aux":  # wo, w_down
            std /= math.sqrt(2.0)
        return rng.normal(0.0, std, spec.shape).astype(np.float32)

    p = map_specs(make, draft_param_specs(dcfg))
    p["lm_head"] = np.asarray(target_params["lm_head"], np.float32)[:, draft_ids]
    p["final_norm"] = 1.0 + np.asarray(target_params["final_norm"], np.float32)
    if dcfg.vocab_map:
        p["d2t"] = (draft_ids - np.arange(len(draft_ids))).astype(np.int32)
        p["t2d"] = vocab_mapping(p["d2t"], dcfg.vocab_size)
    return p


def ttt_loss(dparams: Any, dcfg: DraftConfig, target_embed: jax.Array, aux_ABSD: jax.Array,
             target_logits_BSV: jax.Array, ids_BS: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """Weighted soft cross-entropy of `steps` chained passes against the target, and each pass's top-1 agreement.

    Pass i at index t reads token ids[t + 1 + i] and predicts the target's distribution at position t + 1 + i."""
    B, S = ids_BS.shape
    A = aux_ABSD.shape[0]
    g = fuse_aux(dparams, dcfg, aux_ABSD.reshape(A, B * S, -1)).reshape(B, S, -1)
    next_ids = jnp.concatenate([ids_BS[:, 1:], ids_BS[:, -1:]], axis=1)  # the last index is never valid
    outs, _ = ttt_forward(dparams, dcfg, target_embed, next_ids, g, steps)
    logits = draft_vocab_logits(dparams, dcfg, None, outs)  # [steps, B, S, Vd]
    draft_ids = jnp.arange(dcfg.draft_vocab_size) + dparams["d2t"] if dcfg.vocab_map \
        else jnp.arange(dcfg.vocab_size)
    t_logits = target_logits_BSV[..., draft_ids]
    in_vocab = jnp.isin(jnp.argmax(target_logits_BSV, -1), draft_ids)  # [B, S]
    losses, accs = [], []
    for i in range(steps):
        # Target position t + 1 + i for index t: shift left by 1 + i (the tail is masked).
        shift = 1 + i
        p = jax.nn.softmax(jnp.roll(t_logits, -shift, axis=1), axis=-1)
        mask = (jnp.arange(S) < S - shift)[None, :] & jnp.roll(in_vocab, -shift, axis=1)
        logp = jax.nn.log_softmax(logits[i], axis=-1)
        ce = -jnp.sum(p * logp, axis=-1)
        n = jnp.maximum(jnp.sum(mask), 1)
        losses.append(jnp.sum(jnp.where(mask, ce, 0.0)) / n)
        agree = jnp.argmax(logits[i], -1) == jnp.argmax(p, -1)
        accs.append(jnp.sum(jnp.where(mask, agree, False)) / n)
    loss = sum(LOSS_DECAY ** i * x for i, x in enumerate(losses))
    return loss, jnp.stack(accs)


def make_train_step(cfg: M3Config, dcfg: DraftConfig, steps: int, *, peak_lr: float, total: int, warmup: int,
                    weight_decay: float, clip: float) -> Any:
    """One jitted AdamW step: target forward (no gradient) -> draft TTT loss -> update of the float weights
    (`trainable`); d2t / t2d (`frozen`) never change. The optimiser state covers `trainable` only."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    specs = {k: v for k, v in draft_param_specs(dcfg).items() if k not in FROZEN}
    decayed = map_specs(lambda s: s.init == "matrix", specs)

    def loss_fn(trainable: Any, frozen: Any, *rest: Any) -> tuple[jax.Array, jax.Array]:
        return ttt_loss({**trainable, **frozen}, dcfg, *rest)

    def step_fn(trainable: Any, opt: dict[str, Any], frozen: Any, tparams: Any, ids: jax.Array) -> tuple[Any, ...]:
        aux, t_logits = jax.lax.stop_gradient(target_features(tparams, cfg, ids))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, accs), grads = grad_fn(trainable, frozen, tparams["embed"], aux, t_logits, ids, steps)
        gnorm = jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / (gnorm + 1e-6)), grads)
        t = opt["t"] + 1
        lr = lr_at(opt["t"], peak_lr, total, warmup)
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
        c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)

        def update(p: jax.Array, m: jax.Array, v: jax.Array, wd: bool) -> jax.Array:
            return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + (weight_decay * p if wd else 0.0))

        trainable = jax.tree.map(update, trainable, m, v, decayed)
        return trainable, {"m": m, "v": v, "t": t}, loss, accs, gnorm, lr

    return jax.jit(step_fn, donate_argnums=(0, 1))


# ---- acceptance --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Greedy chain drafting of k tokens, verified by the target's greedy tokens."""

    k: int
    mean_length: float  # mean accepted length (matched drafts + the bonus token, 1..k+1) over every position
    walk_length: float  # the same over the positions a speculative decoding run actually visits (tokens/verify)
    per_position: tuple[float, ...]  # P(the first j drafts all accepted), j = 1..k
    chains: int  # positions scored
    draft_vocab_coverage: float  # share of the target's greedy tokens inside the draft vocabulary

    def summary(self) -> str:
        rates = ", ".join(f"{r:.3f}" for r in self.per_position)
        return (f"mean acceptance length {self.mean_length:.3f} at k = {self.k} over {self.chains} positions "
                f"(decoding walk {self.walk_length:.3f}; per-position {rates}; greedy tokens in the draft "
                f"vocabulary {self.draft_vocab_coverage:.1%})")


def greedy_continuations(model: M3Model, prompts_BP: np.ndarray, new_tokens: int) -> np.ndarray:
    """The target's greedy continuations of every prompt, batched through the paged serving step: [B, P + n]."""
    B, P = prompts_BP.shape
    ps = model.page_size
    width = -(-(P + new_tokens) // ps)
    pages = [list(range(1 + b * width, 1 + (b + 1) * width)) for b in range(B)]
    kv = model.new_pages(1 + B * width)
    batch, idx = build_batch([RowPlan(prompts_BP[b].tolist(), 0, pages[b]) for b in range(B)], ps, B * P, B,
                             width)
    out = model.step(kv, batch)
    seqs = [list(map(int, p)) for p in prompts_BP]
    for i in range(new_tokens):
        toks = np.asarray(jnp.argmax(out.logits, axis=-1))
        for b in range(B):
            seqs[b].append(int(toks[idx[b]]))
        if i + 1 == new_tokens:
            break
        batch, idx = build_batch([RowPlan([seqs[b][-1]], P + i, pages[b]) for b in range(B)], ps, B, B, width)
        out = model.step(out.kv, batch)
    return np.asarray(seqs, np.int32)


def chain_acceptance(model: M3Model, dparams: Any, dcfg: DraftConfig, seqs_BS: np.ndarray, prompt_len: int,
                     k: int = 3) -> Acceptance:
    """Acceptance of k-token greedy chains from every position t of the greedy part of `seqs_BS` (positions whose
    next token and the k after it are the target's greedy tokens: prompt_len - 1 <= t <= S - 2 - k)."""
    B, S = seqs_BS.shape
    if S - 2 - k < prompt_len - 1:
        raise ValueError(f"sequences of {S} tokens leave no chain of {k} after a {prompt_len}-token prompt")

    @jax.jit
    def proposals(tparams: Any, dp: Any, ids: jax.Array) -> jax.Array:
        aux, _ = target_features(tparams, model.cfg, ids, dcfg.aux_layer_ids)
        A = aux.shape[0]
        g = fuse_aux(dp, dcfg, aux.reshape(A, B * S, -1)).reshape(B, S, -1)
        next_ids = jnp.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
        return propose_chain(dp, dcfg, tparams["embed"], tparams["lm_head"], next_ids, g, k)

    d = np.asarray(proposals(model.params, dparams, jnp.asarray(seqs_BS)))  # [k, B, S]: token for t + 2 + i
    ts = np.arange(prompt_len - 1, S - 1 - k)
    # hit[i, b, t]: the chain from t has its i-th proposal right.
    hit = np.stack([d[i][:, ts] == seqs_BS[:, ts + 2 + i] for i in range(k)])
    accepted = np.cumprod(hit, axis=0).sum(axis=0)  # [B, len(ts)]: matched prefix length
    lengths = accepted + 1
    walk = []
    for b in range(B):
        j = 0
        while j < len(ts):
            walk.append(lengths[b, j])
            j += int(lengths[b, j])
    if dcfg.vocab_map:
        in_vocab = vocab_mapping(np.asarray(dparams["d2t"]), dcfg.vocab_size)
        coverage = float(in_vocab[seqs_BS[:, prompt_len:]].mean())
    else:
        coverage = 1.0
    per_position = tuple(float(np.mean(accepted >= j)) for j in range(1, k + 1))
    return Acceptance(k, float(lengths.mean()), float(np.mean(walk)), per_position, int(lengths.size), coverage)


def held_out_prompts(tokenizer: Tokenizer, cfg: M3Config, count: int, length: int) -> np.ndarray:
    """`count` prompts of `length` tokens, evenly spaced through the validation files' token stream (files
    `train_tiny` held out: the target never trained on them)."""
    _, _, val_files = corpus_files()
    stream = token_stream(tokenizer, read_texts(val_files), cfg.bos_token_id, cfg.eos_token_ids[0])
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


def evaluate_acceptance(model: M3Model, dparams: Any, dcfg: DraftConfig, num_sequences: int = 32,
                        prompt_len: int = EVAL_PROMPT, new_tokens: int = EVAL_NEW, k: int = 3) -> Acceptance:
    """Mean acceptance length at k on held-out text: prompts from the validation files, the target's greedy
    continuations, chain drafting from every continuation position (see `chain_acceptance`)."""
    tokenizer = Tokenizer.from_file(str((model.path or embedded_model_path()) / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, model.cfg, num_sequences, prompt_len)
    seqs = greedy_continuations(model, prompts, new_tokens)
    return chain_acceptance(model, dparams, dcfg, seqs, prompt_len, k)


# ---- main --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpoints.train_eagle", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "tiny_eagle3")
    ap.add_argument("--target", type=Path, default=None, help="target checkpoint (default: the embedded tiny)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8, help=f"sequences of {SEQ_LEN} tokens per step")
    ap.add_argument("--ttt", type=int, default=4, help="chained passes per position (training-time test)")
    ap.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-sequences", type=int, default=32)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    model = load_model(args.target)
    cfg = model.cfg
    target_dir = model.path or embedded_model_path()
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    _, train_files, val_files = corpus_files()
    stream = token_stream(tokenizer, read_texts(train_files), cfg.bos_token_id, cfg.eos_token_ids[0])
    print(f"target {target_dir} ({cfg.num_layers} layers, hidden {cfg.hidden_size}); {len(train_files)} training "
          f"files, {len(stream)} tokens; {len(val_files)} held-out files for acceptance", file=sys.stderr)

    out = args.out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    draft_ids = choose_draft_vocab(model.params, cfg, stream, args.draft_vocab, 512, args.seed)
    dcfg = draft_config(cfg, draft_ids)
    dparams = jax.tree.map(jnp.asarray, init_draft(dcfg, model.params, draft_ids, args.seed))
    trainable = {k: v for k, v in dparams.items() if k not in FROZEN}
    frozen = {k: v for k, v in dparams.items() if k in FROZEN}
    print(f"draft: {dcfg.param_count() / 1e6:.3f}M parameters of its own, draft vocabulary {dcfg.draft_vocab_size}"
          f" of {dcfg.vocab_size}, aux layers {dcfg.aux_layer_ids}; {args.steps} steps of {args.batch} x {SEQ_LEN} "
          f"tokens, {args.ttt} TTT passes", file=sys.stderr)

    opt = {"m": jax.tree.map(jnp.zeros_like, trainable), "v": jax.tree.map(jnp.zeros_like, trainable),
           "t": jnp.zeros((), jnp.int32)}
    step_fn = make_train_step(cfg, dcfg, args.ttt, peak_lr=args.lr, total=args.steps,
                              warmup=max(1, min(100, args.steps // 10)), weight_decay=args.weight_decay,
                              clip=args.clip)
    rng = np.random.default_rng(args.seed + 1)
    curve: list[dict[str, Any]] = []
    recent_loss: list[float] = []
    recent_acc: list[np.ndarray] = []
    t_train = time.perf_counter()
    bar = tqdm(range(args.steps), file=sys.stderr, dynamic_ncols=True, mininterval=2.0)
    for step in bar:
        starts = rng.integers(0, len(stream) - SEQ_LEN, args.batch)
        ids = jnp.asarray(np.stack([stream[s:s + SEQ_LEN] for s in starts]))
        trainable, opt, loss, accs, gnorm, lr = step_fn(trainable, opt, frozen, model.params, ids)
        recent_loss = (recent_loss + [float(loss)])[-args.log_every:]
        recent_acc = (recent_acc + [np.asarray(accs)])[-args.log_every:]
        bar.set_postfix(loss=f"{recent_loss[-1]:.3f}", acc0=f"{recent_acc[-1][0]:.2f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            acc = np.mean(recent_acc, axis=0)
            curve.append({"step": step + 1, "loss": round(float(np.mean(recent_loss)), 4),
                          "top1_agreement_per_pass": [round(float(a), 4) for a in acc]})
            tqdm.write(f"step {step + 1:5d}  loss {np.mean(recent_loss):.3f}  agreement per pass "
                       f"{' '.join(f'{a:.3f}' for a in acc)}  lr {float(lr):.2e}  |g| {float(gnorm):.2f}  "
                       f"{time.perf_counter() - t_train:.0f}s", file=sys.stderr)
    bar.close()
    train_seconds = time.perf_counter() - t_train

    host = jax.tree.map(np.asarray, {**trainable, **frozen})
    write_draft(tmp, dcfg, host, dtype="bfloat16")
    # Measured on what ships: the bf16-stored weights, loaded back.
    t_eval = time.perf_counter()
    acceptance = evaluate_acceptance(model, load_draft(tmp)[1], dcfg, args.eval_sequences)
    print(f"held-out: {acceptance.summary()} ({time.perf_counter() - t_eval:.0f}s)", file=sys.stderr)
    record = {
        "command": " ".join(["python -m checkpoints.train_eagle", *(sys.argv[1:] if argv is None else argv)]),
        "target": str(target_dir.name),
        "steps": args.steps,
        "batch_shape": [args.batch, SEQ_LEN],
        "tokens_seen": args.steps * args.batch * SEQ_LEN,
        "ttt_passes": args.ttt,
        "loss": f"soft cross-entropy to the target's distribution renormalised over the draft vocabulary, pass i "
                f"weighted {LOSS_DECAY} ** i; positions whose target argmax is outside the draft vocabulary masked",
        "peak_lr": args.lr,
        "weight_decay": args.weight_decay,
        "seed": args.seed,
        "aux_layer_ids": list(dcfg.aux_layer_ids),
        "draft_vocab": f"the {dcfg.draft_vocab_size} target ids the target predicts most often (argmax) on 512 "
                       f"random training windows of {SEQ_LEN} tokens",
        "parameters": dcfg.param_count(),
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "curve": curve,
        "acceptance": {
            "k": acceptance.k,
            "mean_length": round(acceptance.mean_length, 4),
            "decoding_walk_length": round(acceptance.walk_length, 4),
            "per_position_rate": [round(r, 4) for r in acceptance.per_position],
            "positions": acceptance.chains,
            "greedy_tokens_in_draft_vocab": round(acceptance.draft_vocab_coverage, 4),
            "protocol": f"{args.eval_sequences} prompts of {EVAL_PROMPT} tokens evenly spaced through the held-out "
                        f"files' token stream, {EVAL_NEW} greedy target tokens each; k-token greedy chains from "
                        "every continuation position, with the shipped bf16 weights",
        },
        "corpus": {"train_files": len(train_files), "val_files": [f.name for f in val_files],
                   "train_tokens": int(len(stream))},
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
