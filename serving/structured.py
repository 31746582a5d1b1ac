"""Structured output: a grammar constrains which token may come next (llguidance).

`StructuredOutputsParams` is what a request asks for, in vLLM's names: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a Lark grammar. `Grammars` compiles it once per request against the
checkpoint's tokenizer into a `GrammarState` (llguidance's `LLMatcher`), which
- fills the request's row of the step's allowed-token bitmask (`fill`; the device applies it with the rest of
  sampling, serving/sampling.py `TokenConstraints`), and
- consumes each sampled token (`accept`, called by serving/stopping.append_token, where a grammar that has
  reached its end finishes the request).

A grammar may be gated (`start_after_token`): it constrains only what follows that token, M3's `</mm:think>`,
so that with thinking on the reasoning is free and the reply after it follows the grammar. Until the gate token
has been sampled the row allows every token but EOS (the reply cannot end before it starts), and the matcher
sees nothing. `Grammars` keeps the matchers it built by grammar text and hands out copies, so a request's n
choices, and the same tools or schema sent again, compile once.

Why llguidance: it takes the checkpoint's own `tokenizers` JSON (no transformers, no torch), has no runtime
dependencies, and computes a 200k-token mask in tens of microseconds (measured in docs/benchmarks.md,
"Structured output"); xgrammar needs torch and transformers, outlines-core compiles a JSON schema to a regex
automaton first. Masks are computed on the host while the device runs the step's forward (serving/runner.py),
so with async scheduling they cost no device time.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept for reuse (the same tools or schema in the next request)
# JSON as `json.dumps` writes it: ", " and ": ", no other whitespace. llguidance's default lets any amount of
# whitespace in between, and a model can spend its whole max_tokens on it; a schema's own "x-guidance" options
# still override this.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass
class StructuredOutputsParams:
    """Exactly one of these (vLLM's `StructuredOutputsParams`)."""

    json: dict[str, Any] | str | None = None  # a JSON schema (object or its text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)
    # Not a kind: the grammar applies only after this token has been generated (the servers set M3's
    # `</mm:think>` when the prompt opened a thinking block); until then anything but EOS may be sampled.
    start_after_token: int | None = None

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs: give exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured outputs: json must be a JSON schema (an object or its text)")
        gate = self.start_after_token
        if gate is not None and (not isinstance(gate, int) or isinstance(gate, bool) or gate < 0):
            raise ValueError(f"structured outputs: start_after_token must be a token id, got {gate!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar of this request."""
        from llguidance import LLMatcher, grammar_from

        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise ValueError(f"structured outputs: the JSON schema is not valid JSON ({e})") from None
        if self.json_object:
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return grammar_from("choice", json.dumps(list(self.choice)))
        return LLMatcher.grammar_from_lark(self.grammar or "")


class GrammarState:
    """One request's grammar: what it allows next, and whether it has ended. With `start_after` (a token id) the
    grammar is gated: inactive until that token has been sampled (see the module docstring)."""

    def __init__(self, matcher: Any, start_after: int | None = None, eos_token_ids: Sequence[int] = ()):
        self.matcher = matcher
        self.gate = start_after  # None once the grammar is active
        self.eos_token_ids = tuple(eos_token_ids)

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, llguidance's layout). A grammar that
        has ended or failed allows anything: the request is being finished, its token is dropped. A closed gate
        allows anything but EOS."""
        if self.gate is not None:
            bitmask[row] = -1
            for t in self.eos_token_ids:
                if t // 32 < bitmask.shape[1]:
                    bitmask[row, t // 32] &= ~np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return
        if self.matcher.is_stopped() or self.matcher.is_error():
            bitmask[row] = -1
            return
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, token_id: int) -> None:
        """Consume a sampled token (always an allowed one; a refused one leaves the matcher in its error state,
        which `finished` reports). While gated only the gate token counts: it opens the grammar."""
        if self.gate is not None:
            if token_id == self.gate:
                self.gate = None
            return
        if not (self.matcher.is_stopped() or self.matcher.is_error()):
            self.matcher.consume_token(token_id)

    @property
    def gated(self) -> bool:
        return self.gate is not None

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows no further token (EOS included), or it failed."""
        return self.gate is None and (self.matcher.is_stopped() or self.matcher.is_error())

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class Grammars:
    """Compiles requests' grammars against one tokenizer (thread-safe: prepare runs on the clients' threads)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        from llguidance import LLExecutor, LLTokenizer

        # The model's vocabulary may be wider than the tokenizer's (padding rows): those ids are never allowed.
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.executor = LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) - 1)))
        # Matchers in their start state by grammar text (least recently used last), copied for each request.
        self._built: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> GrammarState:
        """ValueError (a 400 for the servers) when the grammar is not valid."""
        params.validate()
        text = params.grammar_text()
        with self._lock:
            base = self._built.get(text)
            if base is not None:
                self._built.move_to_end(text)
                return GrammarState(base.deep_copy(), params.start_after_token, self.eos_token_ids)
        base = self._build(text)
        with self._lock:
            self._built[text] = base
            while len(self._built) > MAX_CACHED_GRAMMARS:
                self._built.popitem(last=False)
            return GrammarState(base.deep_copy(), params.start_after_token, self.eos_token_ids)

    def _build(self, text: str) -> Any:
        from llguidance import LLMatcher

        error, messages = LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if error:
            raise ValueError(f"structured outputs: {messages[0] if messages else 'invalid grammar'}")
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: {matcher.get_error()}")
        return matcher

    def fill_rows(self, states: Sequence[tuple[GrammarState, int]], bitmask: np.ndarray) -> None:
        """Masks of many requests at once, on llguidance's own threads."""
        from llguidance.numpy import fill_next_token_bitmask_par

        live = [(s.matcher, row) for s, row in states if not s.finished and not s.gated]
        for s, row in states:
            if s.finished or s.gated:
                s.fill(bitmask, row)
        if live:
            fill_next_token_bitmask_par(self.executor, live, bitmask)
