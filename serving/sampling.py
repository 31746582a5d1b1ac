"""On-device sampling: pure JAX functions called inside the engine's jitted step, plus the host-side builder.

Every per-request parameter is an array with one row per sampled row, so one compiled function serves any mix
of greedy, seeded, filtered and penalised requests; the only static inputs are shapes and `max_logprobs`.

Processing order (as vLLM's v1 sampler):
  raw logits -> logit_bias and a grammar's allowed tokens (`TokenConstraints`) -> penalties (repetition, then
  frequency / presence) -> temperature -> min_p, top_k, top_p filtering -> Gumbel-max sampling with the row's
  own key.
Greedy rows (temperature <= 1e-5, vLLM's epsilon) take the argmax of the penalised logits: exactly argmax,
so a greedy request's tokens do not depend on the rest of the batch.

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): `log_softmax` of the raw model logits,
before penalties, temperature and filtering, for the chosen token and for the `max_logprobs` most likely
tokens.

Randomness: row r's key is `fold_in(wrap_key_data(seeds[r], threefry2x32), step[r])` and its noise is a
Gumbel vector over the whole vocabulary drawn from that key alone. So a seeded request draws the same token
whatever its row index, whatever else is in the batch, and across preemption-by-recompute (the step is the
number of tokens the request has generated, not an engine counter).

Token history for penalties lives on the device (`PenaltyHistory`): per request slot (`Request.slot`), which
token ids its prompt or output holds (`seen [S, V]`) and how often each occurs in the output (`counts [S, V]`).
Each step records the tokens it feeds the model (`record_history`, inside the jitted step), so the tables are
complete when that step samples, whatever the history length: no shape ever depends on it, nothing is sent from
the host, and a step can be scheduled before the previous step's tokens reach the host. Only requests that use
a penalty are tracked (their rows carry a slot; others carry S, which every scatter drops). A request's slot is
cleared by its first step (position 0: a new request, or one recomputed after preemption), which then
re-records its whole prompt and output.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

# vLLM treats temperatures below this as greedy: dividing by a tiny temperature overflows to inf.
GREEDY_EPS = 1e-5
DEFAULT_MAX_LOGPROBS = 20
# Most tokens one request may bias (OpenAI's limit for `logit_bias`): a fixed width, so no request makes a shape.
MAX_LOGIT_BIAS = 300

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1


class SamplingParamsLike(Protocol):
    """What the builder reads from a request's sampling parameters (serving.api.SamplingParams fits).

    Missing attributes mean "off", so a bare object samples greedily.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None


# Host numpy arrays from `build`, device arrays (or tracers) inside the jitted step.
Array = jax.Array | np.ndarray

# (prompt token ids, output token ids so far) of the request a row samples for.
TokenHistory = tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling inputs for L sampled rows; all leaves, no static fields (one compile for any mix)."""

    temperature: Array  # f32[L]; <= GREEDY_EPS means greedy
    top_k: Array  # i32[L]; 0 or >= V means off
    top_p: Array  # f32[L]; 1 means off
    min_p: Array  # f32[L]; 0 means off
    repetition_penalty: Array  # f32[L]; 1 means off
    presence_penalty: Array  # f32[L]; 0 means off
    frequency_penalty: Array  # f32[L]; 0 means off
    # u32[L, 2]: the request's seed as two 32-bit words (hi, lo), i.e. threefry2x32 key data. Two words so
    # that 64-bit client seeds do not collide; for seeds < 2**32 this is exactly jax.random.key(seed).
    seeds: Array
    step: Array  # i32[L]: tokens the request has generated before this row's token
    slot: Array  # i32[L]: the request's PenaltyHistory slot; S (past the tables) when it uses no penalty

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParamsLike],
        steps: Sequence[int],
        num_rows_bucket: int,
        *,
        slots: Sequence[int] | None = None,
        num_slots: int = 0,
        rng: np.random.Generator | None = None,
    ) -> SamplingTensors:
        """Numpy `SamplingTensors` for `len(params_list)` rows padded to `num_rows_bucket` with greedy rows.

        `steps[i]` is the number of tokens row i's request has generated before the token this row samples (a
        decode row: len(output_ids); draft-verification row j of a request: len(output_ids) + j). `slots[i]` is
        the PenaltyHistory slot of row i's request (needed for rows with a penalty) in a table of `num_slots`.
        An unseeded request gets a fresh random seed from `rng` (the engine fixes one per request at admission
        so that unseeded requests survive preemption unchanged).
        """
        n = len(params_list)
        if num_rows_bucket < n:
            raise ValueError(f"num_rows_bucket={num_rows_bucket} is smaller than the {n} rows to sample")
        if len(steps) != n:
            raise ValueError(f"got {len(steps)} steps for {n} rows")
        rng = rng if rng is not None else np.random.default_rng()
        L = num_rows_bucket

        # One tuple per row, then whole columns: per-row numpy stores cost more than the rest of a step's host work.
        values = np.array([_row_values(p) for p in params_list], np.float64).reshape(n, len(_FIELDS))
        off = np.array([default for _, default in _FIELDS], np.float64)
        cols = np.concatenate([values, np.broadcast_to(off, (L - n, len(_FIELDS)))])
        temperature, top_k, top_p, min_p, rep, presence, frequency = (
            cols[:, j].astype(np.int32 if name == "top_k" else np.float32) for j, (name, _) in enumerate(_FIELDS))
        top_k = np.maximum(top_k, 0)  # -1 (vLLM's "off") -> 0
        seeds = np.zeros((L, 2), np.uint32)
        s64 = np.array([int(rng.integers(0, 1 << 63)) if (x := getattr(p, "seed", None)) is None else int(x) & _U64
                        for p in params_list], np.uint64)
        seeds[:n, 0], seeds[:n, 1] = s64 >> np.uint64(32), s64 & np.uint64(_U32)
        step = np.zeros(L, np.int32)
        step[:n] = steps
        slot = np.full(L, num_slots, np.int32)
        penalised = np.flatnonzero((rep[:n] != 1.0) | (presence[:n] != 0.0) | (frequency[:n] != 0.0))
        if len(penalised):
            want = np.asarray(slots if slots is not None else [-1] * n, np.int64)[penalised]
            bad = penalised[(want < 0) | (want >= num_slots)]
            if len(bad):
                raise ValueError(f"row {bad[0]} uses a penalty but has no history slot in [0, {num_slots})")
            slot[penalised] = want

        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=rep,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seeds=seeds,
            step=step,
            slot=slot,
        )


# What each row of SamplingTensors holds, in `_row_values` order, with the value that means "off".
_FIELDS = (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
           ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


_ROW_GETTER = operator.attrgetter(*(name for name, _ in _FIELDS))


def _row_values(p: SamplingParamsLike) -> tuple[float, ...]:
    # One C call for the common case (every field present and set): this runs for every sampled row of every step.
    try:
        values = _ROW_GETTER(p)
    except AttributeError:
        values = (None,)
    if None not in values:
        return values
    return tuple(_attr(p, name, default) for name, default in _FIELDS)


def plainly_greedy(p: SamplingParamsLike) -> bool:
    """A row the forward's own argmax samples (`variant` gives GREEDY_VARIANT for a step of only such rows):
    greedy, no penalty, no logprobs, no logit bias, no grammar. Decided from the row's parameters, so such a step
    builds no SamplingTensors at all."""
    return (_row_values(p)[0] <= GREEDY_EPS and not uses_penalty(p) and getattr(p, "logprobs", None) is None
            and not getattr(p, "logit_bias", None) and getattr(p, "structured_outputs", None) is None)


def uses_penalty(p: SamplingParamsLike) -> bool:
    _, _, _, _, rep, presence, frequency = _row_values(p)
    return rep != 1.0 or presence != 0.0 or frequency != 0.0


def _attr(p: Any, name: str, default: float) -> float:
    v = getattr(p, name, None)
    return default if v is None else v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyHistory:
    """Device-resident token history of S request slots (see the module docstring); donated by the step."""

    seen: Array  # bool[S, V]: in the prompt or the output
    counts: Array  # i32[S, V]: occurrences in the output

    @classmethod
    def empty(cls, num_slots: int, vocab_size: int) -> PenaltyHistory:
        return cls(jnp.zeros((num_slots, vocab_size), bool), jnp.zeros((num_slots, vocab_size), jnp.int32))

    @classmethod
    def from_histories(cls, histories: Sequence[TokenHistory], vocab_size: int) -> PenaltyHistory:
        """Tables for slots 0 .. n-1 from (prompt, output) id lists, built on the host (tests, tools)."""
        seen = np.zeros((len(histories), vocab_size), bool)
        counts = np.zeros((len(histories), vocab_size), np.int32)
        for i, (prompt, output) in enumerate(histories):
            seen[i, np.asarray(prompt, np.int64)] = True
            seen[i, np.asarray(output, np.int64)] = True
            np.add.at(counts[i], np.asarray(output, np.int64), 1)
        return cls(seen, counts)

    @property
    def num_slots(self) -> int:
        return int(self.seen.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryRows:
    """Per request row of a step [R]: where its tokens are recorded (`slot`: S = not tracked), where its prompt
    ends (tokens from there on are output), and whether this step starts it from position 0 (`reset`)."""

    slot: Array  # i32[R]
    prompt_len: Array  # i32[R]
    reset: Array  # bool[R]

    @classmethod
    def untracked(cls, num_rows: int, num_slots: int) -> HistoryRows:
        return cls(np.full(num_rows, num_slots, np.int32), np.zeros(num_rows, np.int32), np.zeros(num_rows, bool))


def record_history(h: PenaltyHistory, rows: HistoryRows, token_ids_T: jax.Array, token_row_T: jax.Array,
                   positions_T: jax.Array, num_valid: jax.Array) -> PenaltyHistory:
    """Add the step's input tokens (the first `num_valid`; the rest is padding) to their rows' slots, after
    clearing the slots of rows that start over. Untracked rows scatter past the tables (dropped)."""
    S = h.num_slots
    seen, counts = h.seen, h.counts

    def clear(tables: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        slots = jnp.where(rows.reset, rows.slot, S)
        return tables[0].at[slots].set(False, mode="drop"), tables[1].at[slots].set(0, mode="drop")

    # Always, not under a lax.cond on "any row resets": on the GPU a conditional's predicate is read back on the
    # host, so dispatching the forward would wait for the step before it (rows that do not reset are dropped).
    seen, counts = clear((seen, counts))
    valid_T = jnp.arange(token_ids_T.shape[0]) < num_valid
    slot_T = jnp.where(valid_T, rows.slot[token_row_T], S)
    output_T = (positions_T >= rows.prompt_len[token_row_T]).astype(jnp.int32)
    seen = seen.at[slot_T, token_ids_T].set(True, mode="drop")
    counts = counts.at[slot_T, token_ids_T].add(output_T, mode="drop")
    return PenaltyHistory(seen, counts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    tokens: jax.Array  # i32[L]
    logprobs: jax.Array  # f32[L]: raw-model log-probability of tokens
    top_ids: jax.Array  # i32[L, max_logprobs]: most likely tokens of the raw model, descending
    top_logprobs: jax.Array  # f32[L, max_logprobs]
    # With `drafts` (speculative decoding): whether row r accepts the draft token that follows it, and the token
    # it emits instead when it does not (see `verify`). None otherwise.
    accept: jax.Array | None = None  # bool[L]
    residual: jax.Array | None = None  # i32[L]


# ---- device side -------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenConstraints:
    """Per sampled row [L]: additive logit biases (`logit_bias`, at most MAX_LOGIT_BIAS tokens) and the tokens a
    grammar allows next, as a bitmask (bit v % 32 of word v // 32 set: token v allowed; every bit set: anything,
    as llguidance's masks are laid out). Built on the host; a batch that uses neither sends a cached empty one."""

    bias_ids: Array  # i32[L, MAX_LOGIT_BIAS]; -1: none
    bias_values: Array  # f32[L, MAX_LOGIT_BIAS]
    allowed: Array  # i32[L, ceil(V / 32)]

    @classmethod
    def empty(cls, num_rows: int, vocab_size: int) -> TokenConstraints:
        return cls(np.full((num_rows, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((num_rows, MAX_LOGIT_BIAS), np.float32),
                   np.full((num_rows, -(-vocab_size // 32)), -1, np.int32))

    @classmethod
    def build(cls, biases: Sequence[dict[int, float] | None], num_rows: int, vocab_size: int) -> TokenConstraints:
        """`biases[i]`: row i's token -> bias (None: none). The allowed-token masks start all-set; a grammar
        fills its rows of `allowed` in place."""
        c = cls.empty(num_rows, vocab_size)
        for i, bias in enumerate(biases):
            if bias:
                if len(bias) > MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
                c.bias_ids[i, : len(bias)] = list(bias)
                c.bias_values[i, : len(bias)] = list(bias.values())
        return c


def apply_constraints(logits: jax.Array, c: TokenConstraints) -> jax.Array:
    """Biases added, then every token outside the row's allowed set at -inf; each skipped when no row uses it."""
    L, V = logits.shape

    def add_bias(x: jax.Array) -> jax.Array:
        ids = jnp.where(c.bias_ids < 0, V, c.bias_ids)  # -1 points past the vocabulary: dropped
        return x.at[jnp.arange(L)[:, None], ids].add(c.bias_values, mode="drop")

    def mask(x: jax.Array) -> jax.Array:
        v = jnp.arange(V, dtype=jnp.int32)
        bits = (c.allowed[:, v >> 5] >> (v & 31)[None, :]) & 1
        return jnp.where(bits != 0, x, -jnp.inf)

    logits = jax.lax.cond(jnp.any(c.bias_ids >= 0), add_bias, lambda x: x, logits)
    return jax.lax.cond(jnp.any(c.allowed != -1), mask, lambda x: x, logits)


def apply_penalties(logits: jax.Array, t: SamplingTensors, h: PenaltyHistory) -> jax.Array:
    """Repetition (vLLM/HF: prompt or output), then frequency and presence (OpenAI: output counts).

    A row with every penalty off comes back bit-identical (its slot is past the tables: nothing seen, counts 0,
    and x - 0 == x), which is what keeps greedy rows batch-invariant next to penalised ones. The gather of the
    [L, V] tables is skipped when no row is penalised.
    """
    S = h.num_slots

    def penalise(logits: jax.Array) -> jax.Array:
        tracked = (t.slot < S)[:, None]
        slot = jnp.minimum(t.slot, S - 1)
        seen = h.seen[slot] & tracked
        counts = jnp.where(tracked, h.counts[slot], 0)
        rep = t.repetition_penalty[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - t.frequency_penalty[:, None] * counts.astype(logits.dtype)
        return logits - t.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)

    if S == 0:
        return logits
    return jax.lax.cond(jnp.any(t.slot < S), penalise, lambda x: x, logits)


def filter_mask(scaled: jax.Array, t: SamplingTensors) -> jax.Array:
    """bool[L, V]: tokens that survive min_p, top_k and top_p, each row with its own parameters.

    One stable descending sort per row; ranks break ties by lower token id, so the kept set is deterministic.
    min_p: drop p < min_p * p_max. top_k: keep rank < k. top_p (on the distribution renormalised after
    min_p and top_k, as vLLM): keep the smallest prefix whose mass >= p, i.e. a token is kept when the mass
    strictly before it is < p; rank 0 is always kept. Each parameter at its "off" value keeps every token.
    """
    L, V = scaled.shape
    ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (L, V))
    # Sorting the negated logits ascending with a stable sort = descending order, ties by lower id.
    neg_sorted, sorted_ids = jax.lax.sort((-scaled, ids), dimension=1, num_keys=1, is_stable=True)
    sorted_logits = -neg_sorted

    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = probs >= t.min_p[:, None] * probs[:, :1]
    k = jnp.where((t.top_k <= 0) | (t.top_k >= V), V, t.top_k)
    keep &= jnp.arange(V)[None, :] < k[:, None]

    renorm = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Exclusive cumulative sum by shifting (cumsum - p would round differently from the mass truly before).
    mass_before = jnp.concatenate([jnp.zeros((L, 1), renorm.dtype), jnp.cumsum(renorm, axis=-1)[:, :-1]], -1)
    # top_p >= 1 is "off" explicitly: a rounded cumulative sum can reach 1.0 before the tail's tiny tokens.
    keep &= (mass_before < t.top_p[:, None]) | (t.top_p[:, None] >= 1.0)
    keep = keep.at[:, 0].set(True)

    # Back to vocabulary order (sorted_ids is a permutation per row, so the scatter is exact).
    return jnp.zeros((L, V), bool).at[jnp.arange(L)[:, None], sorted_ids].set(keep)


def row_noise(t: SamplingTensors, vocab_size: int, stream: int = 0) -> jax.Array:
    """f32[L, V] Gumbel noise; row r depends only on (seeds[r], step[r]), V and `stream` (0: the draw itself;
    others: speculative decoding's residual draw, independent of it)."""

    def one(seed_words: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed_words, impl="threefry2x32"), step)
        if stream:
            key = jax.random.fold_in(key, 1 << 30 | stream)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)

    return jax.vmap(one)(t.seeds, t.step)


def row_uniform(t: SamplingTensors) -> jax.Array:
    """f32[L]: one uniform per row from its own key, for speculative decoding's acceptance test."""

    def one(seed_words: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(seed_words, impl="threefry2x32"), step)
        return jax.random.uniform(jax.random.fold_in(key, 1 << 30 | 2), (), jnp.float32)

    return jax.vmap(one)(t.seeds, t.step)


def verify(scaled: jax.Array, keep: jax.Array, is_greedy: jax.Array, greedy_tokens: jax.Array, t: SamplingTensors,
           drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling with greedy drafts (the draft's proposal is its argmax, so its distribution q is
    one-hot): row r accepts the draft token d that follows it with probability p(d) (min(1, p / q) with q(d) = 1),
    where p is the row's distribution after penalties, temperature and filters; on rejection it emits a token
    drawn from p with d removed, renormalised (max(p - q, 0) normalised). A greedy row accepts iff d is its
    argmax and otherwise emits its argmax. Output tokens then follow p exactly, whatever the drafts.
    Returns (accept bool[L], residual i32[L]); rows with no draft (d = -1) accept nothing."""
    L, V = scaled.shape
    has = drafts >= 0
    d = jnp.maximum(drafts, 0)
    masked = jnp.where(keep, scaled, -jnp.inf)
    p_d = jnp.exp(jnp.take_along_axis(masked, d[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(masked, axis=-1))
    accept_sampled = row_uniform(t) < p_d
    not_d = jnp.arange(V)[None, :] != d[:, None]
    residual_sampled = jnp.argmax(jnp.where(keep & not_d, scaled + row_noise(t, V, stream=1), -jnp.inf),
                                  axis=-1).astype(jnp.int32)
    accept = has & jnp.where(is_greedy, greedy_tokens == d, accept_sampled)
    residual = jnp.where(is_greedy, greedy_tokens, residual_sampled)
    return accept, residual


def sample(logits: jax.Array, t: SamplingTensors, max_logprobs: int, history: PenaltyHistory | None = None,
           constraints: TokenConstraints | None = None, drafts: jax.Array | None = None, *,
           filtered: bool | None = None, drawn: bool | None = None) -> SampleOutput:
    """Sample one token per row of `logits[L, V]`; `max_logprobs` (static) is the width of the top lists;
    `history` the penalty tables (None: no row may use a penalty); `constraints` logit biases and grammar masks;
    `drafts` i32[L] (speculative decoding): the draft token that follows each row (-1: none), to `verify`.
    `filtered` / `drawn` (static): whether any row needs the top-k/top-p/min-p filter / a random draw, when the
    host has decided it (`variant`); None decides it on the device, under a conditional."""
    logits = logits.astype(jnp.float32)
    L, V = logits.shape
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)

    if constraints is not None:
        logits = apply_constraints(logits, constraints)
    penalised = apply_penalties(logits, t, history) if history is not None else logits
    greedy_tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
    is_greedy = t.temperature <= GREEDY_EPS
    scaled = penalised / jnp.where(is_greedy, 1.0, t.temperature)[:, None]

    # The sort and the noise are the expensive parts, skipped for batches that do not need them: by the host
    # (`filtered`, `drawn`: no conditional, so dispatch never waits for the device) or else by lax.cond. A
    # row's result is the same either way (a row with filters off gets an all-true mask from filter_mask too),
    # so skipping does not make a row depend on its neighbours.
    def skip(static: bool | None, pred: jax.Array, yes: Callable, no: Callable, *args: jax.Array) -> jax.Array:
        if static is None:
            return jax.lax.cond(pred, yes, no, *args)
        return yes(*args) if static else no(*args)

    keep = skip(filtered, jnp.any(~is_greedy & filters(t, V)), lambda s: filter_mask(s, t),
                lambda s: jnp.ones(s.shape, bool), scaled)

    def draw(s: jax.Array, m: jax.Array) -> jax.Array:
        # Gumbel-max: argmax(logits + Gumbel) is a draw from softmax(logits) restricted to the kept tokens.
        perturbed = jnp.where(m, s + row_noise(t, V), -jnp.inf)
        return jnp.argmax(perturbed, axis=-1).astype(jnp.int32)

    sampled = skip(drawn, jnp.any(~is_greedy), draw, lambda s, m: greedy_tokens, scaled, keep)
    tokens = jnp.where(is_greedy, greedy_tokens, sampled)
    accept = residual = None
    if drafts is not None:
        accept, residual = verify(scaled, keep, is_greedy, greedy_tokens, t, drafts)

    token_logprobs, top_ids, top_logprobs = logprobs_of(raw_logprobs, tokens, max_logprobs)
    return SampleOutput(tokens, token_logprobs, top_ids, top_logprobs, accept, residual)


def greedy(logits: jax.Array, max_logprobs: int) -> SampleOutput:
    """`sample` for a step whose every row is greedy and asks for nothing else (no penalty, bias, grammar or
    logprobs: `variant`): the same tokens, the argmax of the fp32 logits, which `sample` leaves unchanged
    for such rows. None of `sample`'s conditionals: on the GPU a conditional's predicate is read back on the host,
    so dispatching `sample` waits for the forward before it, and the host cannot prepare the next step
    meanwhile. The logprob fields are zeros (no row asked for them)."""
    L = logits.shape[0]
    tokens = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    return SampleOutput(tokens, jnp.zeros((L,), jnp.float32), jnp.zeros((L, max_logprobs), jnp.int32),
                        jnp.zeros((L, max_logprobs), jnp.float32))


def greedy_verify(logits: jax.Array, drafts: jax.Array, max_logprobs: int) -> SampleOutput:
    """`sample(..., drafts=drafts)` for a speculative step whose every row is plainly greedy (`plainly_greedy`):
    the argmax, each draft accepted iff it equals it, the argmax as the token emitted instead. The same result as
    `sample` gives such rows, with none of its conditionals: on the GPU a conditional's predicate is read back on
    the host, so the dispatch of the whole speculative step would wait for the target's forward before it could
    launch the draft's passes. The logprob fields are zeros (no row asked for them)."""
    out = greedy(logits, max_logprobs)
    return dataclasses.replace(out, accept=(drafts >= 0) & (out.tokens == drafts), residual=out.tokens)


# The samplings of a plain step (no penalty, bias or grammar), by what its rows need; each gives the tokens `sample`
# gives, without its conditionals. Anything else takes the general "sample".
GREEDY_VARIANT = "sample_greedy"  # computed inside the forward executable (serving/runner.py), not on its own
PLAIN_VARIANTS = (GREEDY_VARIANT, "sample_draw", "sample_filter")
VARIANTS = ("sample", *PLAIN_VARIANTS)


def sample_as(how: str, logits: jax.Array, t: SamplingTensors | None, max_logprobs: int,
              history: PenaltyHistory | None = None, constraints: TokenConstraints | None = None,
              drafts: jax.Array | None = None) -> SampleOutput:
    """`sample` as variant `how` (`variant`, one of `VARIANTS`) runs it: the plain variants with the choices made
    on the host (no conditional; `history` and `constraints` unread), "sample" with everything and its
    conditionals. `drafts`: a speculative step's (see `sample`)."""
    if how == GREEDY_VARIANT:
        return greedy(logits, max_logprobs) if drafts is None else greedy_verify(logits, drafts, max_logprobs)
    if how in PLAIN_VARIANTS:
        return sample(logits, t, max_logprobs, drafts=drafts, filtered=how == "sample_filter", drawn=True)
    if how != "sample":
        raise ValueError(f"unknown sampling variant {how!r} (one of {VARIANTS})")
    return sample(logits, t, max_logprobs, history, constraints, drafts=drafts)


def variant(t: SamplingTensors, num_slots: int, vocab_size: int, *, constrained: bool, want_logprobs: bool) -> str:
    """Host side: the sampling executable for a step with host `SamplingTensors` `t` (padding rows are greedy
    and penalty-free): "sample_greedy" (every row greedy, no logprobs asked), "sample_draw" (some row draws or
    asks for logprobs, none filters), "sample_filter" (some row filters), or "sample" when a row has a penalty
    or the step has biases or grammar masks."""
    if constrained or not np.all(np.asarray(t.slot) >= num_slots):
        return "sample"
    sampled = np.asarray(t.temperature) > GREEDY_EPS
    if not sampled.any():
        return "sample_draw" if want_logprobs else GREEDY_VARIANT
    return "sample_filter" if (sampled & filters(t, vocab_size)).any() else "sample_draw"


def filters(t: SamplingTensors, vocab_size: int) -> Array:
    """bool[L]: rows with top-k, top-p or min-p on (numpy or jax arrays alike: the host's `variant` and the
    device's `sample` decide with the same expression)."""
    return ((t.top_k > 0) & (t.top_k < vocab_size)) | (t.top_p < 1.0) | (t.min_p > 0.0)


def logprobs_of(raw_logprobs: jax.Array, tokens: jax.Array, max_logprobs: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """From rows of raw log-probabilities [L, V] (`log_softmax` of the fp32 logits): each row's log-probability
    of `tokens[L]`, and its top `max_logprobs` ids and log-probabilities, descending. Sampled tokens and prompt
    tokens alike."""
    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    if max_logprobs > 0:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, max_logprobs)
    else:
        top_logprobs = jnp.zeros((raw_logprobs.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((raw_logprobs.shape[0], 0), jnp.int32)
    return token_logprobs, top_ids.astype(jnp.int32), top_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per token of a step [T]: the log-probability of the token that follows it (`target`), its rank (1 + the
    tokens more likely), and the top tokens, from the same raw log-softmax as sampled tokens' logprobs."""

    logprobs: jax.Array  # f32[T]
    ranks: jax.Array  # i32[T]
    top_ids: jax.Array  # i32[T, max_logprobs]
    top_logprobs: jax.Array  # f32[T, max_logprobs]


def prompt_logprobs(hidden_TD: jax.Array, lm_head_DV: jax.Array, targets_T: jax.Array, max_logprobs: int,
                    chunk: int = 64) -> PromptLogprobs:
    """Prompt logprobs of every token of a step: `hidden_TD` the final-normed hidden states, `targets_T` the next
    prompt token of each (-1: none; its entries are meaningless). The vocabulary-wide logits are made `chunk`
    tokens at a time (a sequential map over the tokens padded to a multiple of it), so a step of T tokens never
    holds [T, V] at once; each chunk's logits are the forward's lm_head einsum, log-softmaxed as `sample` does."""
    T, D = hidden_TD.shape
    c = min(chunk, T)
    pad = -T % c
    h_NCD = jnp.pad(hidden_TD, ((0, pad), (0, 0))).reshape(-1, c, D)
    t_NC = jnp.pad(targets_T, (0, pad), constant_values=-1).reshape(-1, c)

    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        h_CD, t_C = args
        logits_CV = jnp.einsum("td,dv->tv", h_CD, lm_head_DV, preferred_element_type=jnp.float32)
        raw_CV = jax.nn.log_softmax(logits_CV, axis=-1)
        lp, top_ids, top_lp = logprobs_of(raw_CV, jnp.maximum(t_C, 0), max_logprobs)
        rank = 1 + jnp.sum(raw_CV > lp[:, None], axis=-1, dtype=jnp.int32)
        return lp, rank, top_ids, top_lp

    out = jax.lax.map(one, (h_NCD, t_NC))
    lp, rank, top_ids, top_lp = (x.reshape(-1, *x.shape[2:])[:T] for x in out)
    return PromptLogprobs(lp, rank, top_ids, top_lp)


# ---- validation for the API layer --------------------------------------------------------------------------


def _number(name: str, value: Any) -> float:
    # bool is an int in Python; a client sending `true` for a numeric field is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return float(value)


def validate_sampling(
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logprobs: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> None:
    """Raise ValueError naming the parameter when a value is outside what `sample` supports.

    top_k: 0 or -1 mean off (vLLM accepts -1). logprobs: None means not requested.
    """
    t = _number("temperature", temperature)
    if not (0.0 <= t < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    p = _number("top_p", top_p)
    if not (0.0 < p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    k = _number("top_k", top_k)
    if not float(k).is_integer():
        raise ValueError(f"top_k must be an integer, got {top_k}")
    if k < -1:
        raise ValueError(f"top_k must be >= 0, or -1 / 0 for off, got {top_k}")
    m = _number("min_p", min_p)
    if not (0.0 <= m <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    r = _number("repetition_penalty", repetition_penalty)
    if not (0.0 < r < math.inf):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (-2.0 <= _number(name, value) <= 2.0):
            raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
    if logprobs is not None:
        n = _number("logprobs", logprobs)
        if not float(n).is_integer():
            raise ValueError(f"logprobs must be an integer, got {logprobs}")
        if not (0 <= n <= max_logprobs):
            raise ValueError(f"logprobs must be in [0, {max_logprobs}], got {logprobs}")
