"""Speculative decoding with an EAGLE-3 draft, inside the engine's step.

A running request that decodes gets a row of 1 + k tokens: its last token and the k draft tokens the previous
step proposed. One compiled step (`spec_step`) then
1. runs the target over the whole flat batch (prefill chunks, plain decodes and these verification rows alike),
   capturing the residual stream at the draft's aux layers;
2. samples every verification position and accepts the drafts by the speculative sampling rule
   (`serving.sampling.verify`: greedy drafts, so accept with probability p(d); on rejection draw from p without
   d): a request emits its a accepted drafts and one more token, 1 + a in all;
3. runs the draft's first pass over the same batch (each position fed the token that follows it, the target's
   fused aux states as hidden input), which fills the draft's KV pages for every new position and proposes the
   token after the last emitted one (the rest of its layer runs at that one position per request), then k - 1
   chained passes, each one token per request fed its own previous proposal and hidden state: the k drafts of
   the next step.
Positions past the accepted ones hold rejected tokens' K/V (target and draft): nothing reads them before they
are rewritten, since every query sees only positions up to its own and the request's next row starts right
after its last accepted token. The scheduler rolls `num_computed` back; pages stay with the request.

Greedy output is exactly the output without speculation (tests hold the engine to it for k = 1..4, under
preemption, chunked prefill and ragged batches); sampled output follows the same distribution (a
chi-square test of `verify`). Requests with penalties or a grammar are not drafted for (their rows carry no
drafts): the device-side penalty history and a grammar's state would both have to follow each draft position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from m3jax.batch import Batch, KVPages, page_size
from m3jax.eagle import DraftConfig, DraftPages, draft_step, fuse_aux, shift_tokens
from m3jax.model import forward
from pallas_kernels.choice import KernelChoice
from serving.sampling import (
    GREEDY_VARIANT,
    HistoryRows,
    PenaltyHistory,
    SamplingTensors,
    TokenConstraints,
    record_history,
    sample_as,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    """Per request row [R]: the tokens it emits (`emitted[:, :num_emitted]`), and the next step's drafts."""

    emitted: jax.Array  # i32[R, 1 + k]
    num_emitted: jax.Array  # i32[R]: 1 + accepted drafts; 0 for rows that sample nothing
    drafts: jax.Array  # i32[R, k]
    logprobs: jax.Array  # f32[R, 1 + k]: raw-model log-probability of each emitted token
    top_ids: jax.Array  # i32[R, 1 + k, max_logprobs]
    top_logprobs: jax.Array  # f32[R, 1 + k, max_logprobs]


def chain_batch(batch: Batch, tokens_R: jax.Array, positions_R: jax.Array, valid_R: jax.Array, ps: int) -> Batch:
    """One draft token per request row at `positions_R` (a chained draft pass); invalid rows and positions past
    the page table write to the sink slot."""
    R, P = batch.page_table.shape
    page = positions_R // ps
    ok = valid_R & (page < P)
    slot = jnp.where(ok, batch.page_table[jnp.arange(R), jnp.minimum(page, P - 1)] * ps + positions_R % ps, 0)
    r = jnp.arange(R, dtype=jnp.int32)
    return Batch(token_ids=tokens_R, positions=jnp.where(ok, positions_R, 0), token_row=r, slot_mapping=slot,
                 page_table=batch.page_table, logit_rows=r, query_start=jnp.arange(R + 1, dtype=jnp.int32),
                 seq_lens=jnp.where(ok, positions_R + 1, 0))


def spec_step(params: Any, draft_params: Any, kv: KVPages, draft_pages: DraftPages, history: PenaltyHistory,
              batch: Batch, history_rows: HistoryRows, sampling: SamplingTensors, constraints: TokenConstraints,
              draft_next_L: jax.Array, row_next_R: jax.Array, num_logits_R: jax.Array, *, cfg: Any,
              dcfg: DraftConfig, kernels: KernelChoice, k: int, max_logprobs: int, how: str = "sample"
              ) -> tuple[KVPages, DraftPages, PenaltyHistory, SpecOutput]:
    """The whole speculative step (the module docstring). `batch.logit_rows` is the [R, 1 + k] grid of
    `build_batch(..., logits_per_row=1 + k)`; `draft_next_L` the draft token following each logit row (-1:
    none); `row_next_R` the token following a row's last position when it samples nothing (the next prompt
    token of a chunk that stops short of the prompt's end); `num_logits_R` each row's logit rows (0, 1 or 1 + its
    drafts). `how` (static): the step's sampling variant (`sampling.variant`), which the verification runs
    (`sampling.sample_as`): all but "sample" hold no conditional (and read no history or constraints)."""
    R = batch.page_table.shape[0]
    W = 1 + k
    history = record_history(history, history_rows, batch.token_ids, batch.token_row, batch.positions,
                             batch.query_start[-1])
    out = forward(params, cfg, kv, batch, kernels, capture=dcfg.aux_layer_ids)
    s = sample_as(how, out.logits, sampling, max_logprobs, history, constraints, drafts=draft_next_L)

    # Acceptance: a request emits its leading accepted drafts, then the rejected position's residual draw, or
    # the bonus token (the last position's own draw) when every draft was accepted.
    j = jnp.arange(W)[None, :]
    n = num_logits_R[:, None]
    accept = s.accept.reshape(R, W) & (j < n - 1)
    a = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # accepted drafts per row
    drafts_RW = draft_next_L.reshape(R, W)
    last = jnp.where(a[:, None] < n - 1, s.residual.reshape(R, W), s.tokens.reshape(R, W))
    emitted = jnp.where(j < a[:, None], drafts_RW, jnp.where(j == a[:, None], last, -1))
    emitted = jnp.where(j < n, emitted, -1).astype(jnp.int32)
    num_emitted = jnp.where(num_logits_R > 0, a + 1, 0).astype(jnp.int32)
    if how == GREEDY_VARIANT:  # no row asked for logprobs: no vocabulary-wide log-softmax over every position
        logprobs = jnp.zeros(emitted.shape, jnp.float32)
    else:
        raw = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1).reshape(R, W, -1)
        logprobs = jnp.take_along_axis(raw, jnp.maximum(emitted, 0)[..., None], axis=-1)[..., 0]

    # The draft's first pass: every position fed the token that follows it; a sampling row's last accepted
    # position gets the token it emitted last, and its logits propose the first draft of the next step.
    first_logit = batch.logit_rows.reshape(R, W)[:, 0]  # flat index of each row's first logit position
    draft_row = jnp.where(num_logits_R > 0, first_logit + a, batch.query_start[1:] - 1)
    bonus = jnp.take_along_axis(emitted, a[:, None], axis=1)[:, 0]
    tokens = shift_tokens(batch, jnp.where(num_logits_R > 0, bonus, row_next_R))
    tokens = tokens.at[jnp.where(num_logits_R > 0, draft_row, batch.num_tokens)].set(bonus, mode="drop")
    g = fuse_aux(draft_params, dcfg, out.aux_hidden)
    first = draft_step(draft_params, dcfg, params["embed"], params["lm_head"], draft_pages,
                       dataclasses.replace(batch, token_ids=tokens, logit_rows=draft_row), g, kernels.attention)
    draft_pages = first.pages
    proposal = jnp.argmax(first.logits, axis=-1).astype(jnp.int32)
    hidden = first.hidden
    position = batch.positions[draft_row]
    valid = num_logits_R > 0
    proposals = [proposal]
    for i in range(1, k):  # chained passes: one token per request, its own previous proposal and hidden state
        step = draft_step(draft_params, dcfg, params["embed"], params["lm_head"], draft_pages,
                          chain_batch(batch, proposal, position + i, valid, page_size(cfg)), hidden,
                          kernels.attention)
        draft_pages = step.pages
        proposal = jnp.argmax(step.logits, axis=-1).astype(jnp.int32)
        hidden = step.hidden
        proposals.append(proposal)
    result = SpecOutput(emitted, num_emitted, jnp.stack(proposals, axis=1), logprobs,
                        s.top_ids.reshape(R, W, -1), s.top_logprobs.reshape(R, W, -1))
    return out.kv, draft_pages, history, result
