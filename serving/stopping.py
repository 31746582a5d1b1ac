"""The one place that decides a request is finished and records why: `append_token`.

Every sampled token of every request passes through it, in order: EOS, stop token ids, the end of a grammar,
max_tokens, the model length and stop strings are all judged here, and the verdict lands on the request
(`finish_reason`, `stop_reason`). Aborts and errors are the only other ends a request can have; the scheduler
records those. The request's text (detokenised incrementally, held back where it could still become a stop string) is
produced here too, because a stop string can only be judged on text.
"""

from __future__ import annotations

import dataclasses

from serving.outputs import GrowingText
from serving.request import FinishReason, Request
from serving.tokenizer import IncrementalDetokenizer, StopChecker


@dataclasses.dataclass
class TextState:
    """A request's output text: incremental detokeniser plus stop strings."""

    detok: IncrementalDetokenizer | None
    stops: StopChecker
    # The text emitted so far (stop strings excluded); a stream reads its new tail each step (`since`).
    emitted: GrowingText = dataclasses.field(default_factory=GrowingText)

    @property
    def text(self) -> str:
        return self.emitted.text

    @property
    def length(self) -> int:
        return self.emitted.length

    def since(self, start: int) -> str:
        return self.emitted.since(start)

    def push(self, token_id: int | None, final: bool) -> bool:
        """Add a token's text (None: no token, only the end when `final`); True when a stop string has been
        reached."""
        if self.detok is None:
            return False
        piece = self.detok.push(token_id) if token_id is not None else ""
        if final:
            piece += self.detok.flush()
        new, stopped = self.stops.push(piece)
        if final and not stopped:
            new += self.stops.flush()
        self.emitted.append(new)
        return stopped


def append_token(req: Request, token_id: int, max_model_len: int) -> FinishReason | None:
    """Record a sampled token on `req` and decide whether it finishes the request. Returns the reason (also set
    on `req.finish_reason`, with `req.stop_reason` for a stop string or stop token), or None to go on."""
    req.output_ids.append(token_id)
    reason = None
    if req.grammar is not None:
        req.grammar.accept(token_id)
    eos = token_id in req.eos_token_ids and not req.ignore_eos
    if eos or token_id in req.stop_token_ids:
        reason = FinishReason.STOP
        req.stop_reason = token_id if token_id in req.stop_token_ids else None
    elif req.grammar is not None and req.grammar.finished:
        reason = FinishReason.STOP  # the grammar allows nothing more: the output is complete
    elif len(req.output_ids) >= req.max_tokens or req.num_prompt + len(req.output_ids) >= max_model_len:
        reason = FinishReason.LENGTH
    # The EOS that ends a request is not text of it (a stop token id is, as in vLLM, unless special tokens are
    # skipped): with special tokens kept in the text (`skip_special_tokens=False`, what M3's reasoning and
    # tool-call parsers need), M3's end-of-turn token would otherwise end every answer.
    if req.text is not None and req.text.push(None if eos else token_id, final=reason is not None):
        reason = FinishReason.STOP  # a stop string ends the text here, whatever else this token did
        req.stop_reason = req.text.stops.stop_str
    req.finish_reason = reason
    return reason
