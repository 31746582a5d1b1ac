"""On-device sampling: greedy, seeds, batch invariance, filters, penalties, logprobs, validation.

Few distinct shapes on purpose (each costs a compile): V = 16 everywhere, max_logprobs = 3, and batches of
1, 5 and 2048 rows (the last for the empirical checks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.sampling import (
    HistoryRows,
    PenaltyHistory,
    SamplingTensors,
    apply_penalties,
    greedy,
    plainly_greedy,
    prompt_logprobs,
    record_history,
    sample,
    validate_sampling,
    variant,
)

V = 16
K_LOGPROBS = 3
N_EMPIRICAL = 2048

_sample = jax.jit(sample, static_argnames="max_logprobs")


@dataclasses.dataclass
class P:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = 0


def run(logits: np.ndarray, t: SamplingTensors, history: PenaltyHistory | None = None):
    out = _sample(jnp.asarray(logits, jnp.float32), t, max_logprobs=K_LOGPROBS, history=history)
    return jax.tree.map(np.asarray, out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def random_logits(rows: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)


# A hand-made distribution: 4 large tokens at shuffled ids (so the sort matters), 12 small ones.
_PERM = np.random.default_rng(7).permutation(V)
_PROBS_SORTED = np.array([0.35, 0.25, 0.15, 0.10] + [0.0125] * 12)
HAND_PROBS = np.empty(V)
HAND_PROBS[_PERM] = _PROBS_SORTED
HAND_LOGITS = np.log(HAND_PROBS).astype(np.float32)


def top_ids(n: int) -> set[int]:
    return {int(i) for i in _PERM[:n]}


# ---- greedy, seeds, batch invariance ----------------------------------------------------------------------


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(N_EMPIRICAL, seed=0)
    logits[0, [3, 9]] = logits[0].max() + 1.0  # a tie: argmax takes the lower id
    t = SamplingTensors.build([P()] * N_EMPIRICAL, [0] * N_EMPIRICAL, N_EMPIRICAL)
    out = run(logits, t)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    assert out.tokens[0] == 3
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(N_EMPIRICAL), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1, kind="stable")[:, :K_LOGPROBS])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, -1)[:, ::-1][:, :K_LOGPROBS], atol=1e-5)


def test_plain_steps_take_branch_free_samplers_with_the_same_results() -> None:
    """The host picks a sampling executable by what the step's rows need (`variant`); each plain one ("greedy",
    "draw", "filter": no conditional, so dispatch never waits for the device) gives what `sample` gives."""
    logits = random_logits(64, seed=4, scale=3.0)
    logits[5, [2, 11]] = logits[5].max() + 1.0  # a tie
    greedy_rows = SamplingTensors.build([P()] * 60, [0] * 60, 64, num_slots=8)
    assert variant(greedy_rows, 8, V, constrained=False, want_logprobs=False) == "sample_greedy"
    out = jax.tree.map(np.asarray, jax.jit(greedy, static_argnums=1)(jnp.asarray(logits), K_LOGPROBS))
    np.testing.assert_array_equal(out.tokens, run(logits, greedy_rows).tokens)
    assert out.top_ids.shape == (64, K_LOGPROBS)

    plain = jax.jit(sample, static_argnames=("max_logprobs", "filtered", "drawn"))
    temperature_only = [P(), P(temperature=0.7, seed=3), P(temperature=1.3, seed=None)] * 20
    filtering = temperature_only[:30] + [P(temperature=0.9, top_k=4, seed=5), P(temperature=1.0, top_p=0.6),
                                         P(temperature=1.0, min_p=0.2, seed=9)] * 10
    for params, how in ((temperature_only, "sample_draw"), (filtering, "sample_filter")):
        t = SamplingTensors.build(params, list(range(len(params))), 64, num_slots=8,
                                  rng=np.random.default_rng(0))
        assert variant(t, 8, V, constrained=False, want_logprobs=False) == how
        got = plain(jnp.asarray(logits), t, K_LOGPROBS, filtered=how == "sample_filter", drawn=True)
        want = run(logits, t)
        for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, got)), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)

    # Greedy with logprobs asked draws nothing but needs them: "draw"; a penalty, a bias or a grammar: the
    # general sampling.
    assert variant(greedy_rows, 8, V, constrained=False, want_logprobs=True) == "sample_draw"
    assert variant(greedy_rows, 8, V, constrained=True, want_logprobs=False) == "sample"
    penalised = SamplingTensors.build([P(), P(frequency_penalty=0.5)], [0, 0], 4, slots=[0, 1], num_slots=8)
    assert variant(penalised, 8, V, constrained=False, want_logprobs=False) == "sample"
    # top_k >= V is off: no filter.
    off = SamplingTensors.build([P(temperature=1.0, top_k=V)], [0], 4, num_slots=8)
    assert variant(off, 8, V, constrained=False, want_logprobs=False) == "sample_draw"


def test_prompt_logprobs_are_the_lm_heads_raw_log_softmax_in_padded_chunks() -> None:
    """11 tokens in chunks of 4 (the last padded): each token's target logprob, rank (1 + the tokens strictly
    more likely) and top ids equal numpy's log-softmax of hidden @ lm_head."""
    rng = np.random.default_rng(3)
    hidden = rng.normal(size=(11, 8)).astype(np.float32)
    lm_head = rng.normal(size=(8, V)).astype(np.float32)
    targets = rng.integers(0, V, 11).astype(np.int32)
    targets[[2, 10]] = -1
    out = jax.jit(prompt_logprobs, static_argnames=("max_logprobs", "chunk"))(
        hidden, lm_head, targets, max_logprobs=K_LOGPROBS, chunk=4)
    logits = hidden.astype(np.float64) @ lm_head
    ref = logits - logits.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    has = targets >= 0
    want = ref[np.arange(11), np.maximum(targets, 0)]
    np.testing.assert_allclose(np.asarray(out.logprobs)[has], want[has], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.ranks)[has], 1 + (ref > want[:, None] + 1e-6).sum(-1)[has])
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-ref, axis=-1)[:, :K_LOGPROBS])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-ref, axis=-1)[:, :K_LOGPROBS], rtol=1e-5,
                               atol=1e-5)


def test_seeded_sampling_is_reproducible_and_batch_invariant() -> None:
    target_logits = random_logits(1, seed=1, scale=0.3)[0]  # flat-ish: many tokens are plausible
    neighbours = random_logits(5, seed=2)
    neighbour_params = [
        P(),  # greedy
        P(temperature=1.0, seed=99, top_k=3, top_p=0.8),  # forces the filter branch
        P(temperature=0.5, seed=5, repetition_penalty=1.5, frequency_penalty=0.3),  # forces a history
        None,  # the target goes here
        P(temperature=1.2, seed=1234, min_p=0.2),  # same seed as the target, different step
    ]
    history = PenaltyHistory.from_histories([([1, 2, 3], [4, 4, 5])], V)
    for target in (P(temperature=0.9, seed=1234), P(temperature=0.9, seed=(1 << 40) + 1234, top_p=0.9)):
        alone, batched = [], []
        for step in range(8):
            t1 = SamplingTensors.build([target], [step], 1)
            alone.append(run(target_logits[None], t1).tokens[0])
            params = [target if p is None else p for p in neighbour_params]
            t5 = SamplingTensors.build(params, [3, 1, 4, step, 0], 5, slots=[-1, -1, 0, -1, -1], num_slots=1)
            logits = neighbours.copy()
            logits[3] = target_logits
            out = run(logits, t5, history)
            batched.append(out.tokens[3])
            assert out.tokens[0] == logits[0].argmax()  # greedy next to sampled / penalised rows
        assert alone == batched
        assert len(set(alone)) > 3  # the step changes the draw
        # Same seed and step again: same token.
        again = run(target_logits[None], SamplingTensors.build([target], [5], 1)).tokens[0]
        assert again == alone[5]


def test_seed_words_are_jax_key_data() -> None:
    t = SamplingTensors.build([P(seed=12345), P(seed=(7 << 32) | 9), P(seed=-1)], [0, 0, 0], 4)
    np.testing.assert_array_equal(t.seeds[0], jax.random.key_data(jax.random.key(12345)))
    np.testing.assert_array_equal(t.seeds[1], [7, 9])
    np.testing.assert_array_equal(t.seeds[2], [0xFFFFFFFF, 0xFFFFFFFF])
    np.testing.assert_array_equal(t.seeds[3], [0, 0])


# ---- empirical: one 2048-row call per check, rows differ only by seed ------------------------------------


def sample_many(logits_row: np.ndarray, **params: float) -> np.ndarray:
    rows = [P(seed=1000 + i, **{"temperature": 1.0, **params}) for i in range(N_EMPIRICAL)]
    t = SamplingTensors.build(rows, [3] * N_EMPIRICAL, N_EMPIRICAL)
    return run(np.broadcast_to(logits_row, (N_EMPIRICAL, V)), t).tokens


def test_temperature_one_matches_softmax() -> None:
    logits = random_logits(1, seed=3, scale=0.5)[0]
    probs = np.exp(log_softmax(logits))
    counts = np.bincount(sample_many(logits), minlength=V)
    expected = probs * N_EMPIRICAL
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45.0, (chi2, counts, expected)  # 15 dof: P(chi2 > 45) ~ 1e-4


def test_temperature_sharpens() -> None:
    logits = random_logits(1, seed=4)[0]
    probs = np.exp(log_softmax(logits / 0.5))
    counts = np.bincount(sample_many(logits, temperature=0.5), minlength=V)
    np.testing.assert_allclose(counts / N_EMPIRICAL, probs, atol=0.04)


def test_top_k() -> None:
    assert set(sample_many(HAND_LOGITS, top_k=3).tolist()) == top_ids(3)
    # top_k = 1 is greedy whatever the seed; off values (0, >= V) keep everything.
    assert set(sample_many(HAND_LOGITS, top_k=1).tolist()) == top_ids(1)
    assert len(set(sample_many(HAND_LOGITS, top_k=V).tolist())) == V


def test_top_p_keeps_smallest_prefix_with_enough_mass() -> None:
    # Sorted masses 0.35, 0.25, 0.15, 0.10, ...: p = 0.55 needs 2 tokens, p = 0.8 needs 4.
    assert set(sample_many(HAND_LOGITS, top_p=0.55).tolist()) == top_ids(2)
    assert set(sample_many(HAND_LOGITS, top_p=0.8).tolist()) == top_ids(4)
    assert set(sample_many(HAND_LOGITS, top_p=0.01).tolist()) == top_ids(1)  # at least one token
    # top_p after top_k renormalises: among (0.35, 0.25, 0.15) / 0.75, p = 0.45 needs 1 token, 0.5 needs 2.
    assert set(sample_many(HAND_LOGITS, top_k=3, top_p=0.45).tolist()) == top_ids(1)
    assert set(sample_many(HAND_LOGITS, top_k=3, top_p=0.5).tolist()) == top_ids(2)


def test_min_p() -> None:
    # Threshold 0.3 * 0.35 = 0.105: the 0.10 token and the tail go.
    assert set(sample_many(HAND_LOGITS, min_p=0.3).tolist()) == top_ids(3)
    kept = sample_many(HAND_LOGITS, min_p=0.3)
    frac = np.array([(kept == i).mean() for i in _PERM[:3]])
    np.testing.assert_allclose(frac, _PROBS_SORTED[:3] / _PROBS_SORTED[:3].sum(), atol=0.04)


# ---- penalties ---------------------------------------------------------------------------------------------


def test_penalties_change_the_argmax() -> None:
    base = np.full((5, V), -3.0, np.float32)
    base[:, 2], base[:, 5] = 2.0, 1.8  # rows 0, 2, 3: token 2 leads by 0.2
    base[1, 2], base[1, 5] = -1.0, -1.1  # row 1: all negative, token 2 leads by 0.1
    base[4, 2], base[4, 5] = 1.0, 0.5  # row 4: token 2 leads by 0.5
    params = [
        P(repetition_penalty=1.2),  # 2 in the prompt: 2.0 / 1.2 = 1.67 < 1.8
        P(repetition_penalty=1.2),  # 2 in the output, negative: -1.0 * 1.2 = -1.2 < -1.1
        P(presence_penalty=0.5),  # 2 once in the output: 1.5 < 1.8
        P(presence_penalty=0.5),  # 2 only in the prompt: presence counts the output only
        P(frequency_penalty=0.2),  # 2 three times in the output: 1.0 - 0.6 = 0.4 < 0.5
    ]
    hists = [([2, 7], [9]), ([7], [2]), ([0], [2]), ([2, 2], [9]), ([], [2, 11, 2, 2])]
    history = PenaltyHistory.from_histories(hists, V)
    t = SamplingTensors.build(params, [1, 1, 1, 1, 4], 5, slots=range(5), num_slots=5)
    out = run(base, t, history)
    np.testing.assert_array_equal(out.tokens, [5, 5, 5, 2, 5])
    # Logprobs stay those of the raw model.
    np.testing.assert_allclose(out.logprobs, log_softmax(base)[np.arange(5), out.tokens], atol=1e-5)

    penalised = np.asarray(apply_penalties(jnp.asarray(base), jax.tree.map(jnp.asarray, t),
                                           jax.tree.map(jnp.asarray, history)))
    np.testing.assert_allclose(penalised[0, [2, 7, 9]], [2.0 / 1.2, -3.0 * 1.2, -3.0 * 1.2], rtol=1e-6)
    np.testing.assert_allclose(penalised[4, [2, 5, 11]], [1.0 - 0.6, 0.5, -3.0 - 0.2], rtol=1e-6)
    # Row 3: the prompt-only token 2 is untouched, the output token 9 pays the presence penalty once.
    np.testing.assert_array_equal(penalised[3, [2, 5, 9]], base[3, [2, 5, 9]] - [0, 0, 0.5])


# ---- builder -----------------------------------------------------------------------------------------------


def test_history_recorded_on_the_device_equals_the_host_tables() -> None:
    """Steps that feed a request's prompt in chunks and then its outputs one by one build exactly the tables of
    its (prompt, output); a row that starts over (position 0: preemption) clears its slot first; untracked rows
    and padding record nothing."""
    prompt, output = [3, 5, 5, 9, 1, 12], [5, 7, 7, 2]
    h = jax.tree.map(jnp.asarray, PenaltyHistory.empty(3, V))
    step = jax.jit(record_history)

    def feed(h, start, tokens, pad=3):
        n = len(tokens)
        rows = HistoryRows(np.array([1, 3], np.int32), np.array([len(prompt), 0], np.int32),
                           np.array([start == 0, True]))
        ids = np.array(tokens + [4] * pad, np.int32)
        token_row = np.array([0] * n + [1] * pad, np.int32)  # row 1: untracked (slot 3 = past the tables)
        pos = np.array(list(range(start, start + n)) + [0] * pad, np.int32)
        return step(h, rows, ids, token_row, pos, np.int32(n + pad))

    h = feed(h, 0, [13, 14, 15])  # stale history from an earlier owner of the slot ...
    seq = prompt + output
    for start, end in ((0, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10)):  # ... cleared by the new start
        h = feed(h, start, seq[start:end])
    want = PenaltyHistory.from_histories([([], []), (prompt, output), ([], [])], V)
    np.testing.assert_array_equal(np.asarray(h.seen), want.seen)
    np.testing.assert_array_equal(np.asarray(h.counts), want.counts)


def test_builder_pads_and_checks() -> None:
    t = SamplingTensors.build([P(temperature=0.7, top_k=-1, seed=None)], [4], 4, num_slots=2)
    assert t.num_rows == 4
    assert t.top_k[0] == 0 and t.step[0] == 4
    np.testing.assert_array_equal(t.slot, 2)  # no penalty: no history slot
    np.testing.assert_array_equal(t.temperature[1:], 0.0)  # padding rows are greedy with everything off
    np.testing.assert_array_equal(t.top_p[1:], 1.0)
    np.testing.assert_array_equal(t.repetition_penalty[1:], 1.0)
    t = SamplingTensors.build([P(), P(presence_penalty=0.1)], [3, 3], 2, slots=[-1, 1], num_slots=2)
    assert t.slot.tolist() == [2, 1]

    with pytest.raises(ValueError, match="num_rows_bucket"):
        SamplingTensors.build([P(), P()], [0, 0], 1)
    with pytest.raises(ValueError, match="history slot"):
        SamplingTensors.build([P(frequency_penalty=0.5)], [0], 1)


# ---- validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_p": "0.5"}, "top_p"),
        ({"temperature": True}, "temperature"),
    ],
)
def test_validation_rejects(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} "):
        validate_sampling(**kwargs)


def test_validation_accepts_edges() -> None:
    validate_sampling()
    validate_sampling(temperature=0, top_p=1, top_k=-1, min_p=1, repetition_penalty=0.5)
    validate_sampling(presence_penalty=-2, frequency_penalty=2, logprobs=20, max_logprobs=20)
    validate_sampling(top_k=0, logprobs=0)


def test_plainly_greedy_rows_are_exactly_the_steps_variant_leaves_to_the_forward() -> None:
    """A step builds no SamplingTensors when every row is `plainly_greedy`: that must be exactly when `variant`
    would pick the forward's own argmax, for any mix of rows."""
    from serving.outputs import SamplingParams
    from serving.structured import StructuredOutputsParams

    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6), SamplingParams(temperature=0.7),
             SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.0, repetition_penalty=1.2),
             SamplingParams(temperature=0.0, logit_bias={3: 1.0}), SamplingParams(temperature=0.0, logit_bias={}),
             SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a+"))]
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows = [kinds[i] for i in rng.integers(0, len(kinds), rng.integers(1, 5))]
        t = SamplingTensors.build(rows, [0] * len(rows), 8, slots=list(range(len(rows))), num_slots=8)
        constrained = any(r.logit_bias or r.structured_outputs is not None for r in rows)
        want_logprobs = any(r.logprobs is not None for r in rows)
        picked = variant(t, 8, V, constrained=constrained, want_logprobs=want_logprobs)
        assert all(map(plainly_greedy, rows)) == (picked == "sample_greedy"), rows
