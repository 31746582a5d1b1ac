"""M3's thinking, split out of generated text: `<mm:think>` ... `</mm:think>` goes to `reasoning_content` (vLLM's
field name), everything else to `content`.

The format (spec §6; M3's `chat_template.jinja`, which renders every assistant turn of the history as
`]~b]ai\\n` + (`<mm:think>` reasoning `</mm:think>` | `</mm:think>`) + content + tool calls + `[e~[`):

    generated text                                    reasoning_content   content
    <mm:think>Weigh a vs b.</mm:think>b is better.    "Weigh a vs b."     "b is better."
    </mm:think>b is better.                           None                "b is better."   (chose not to think)
    b is better.                                      None                "b is better."

How `chat_template_kwargs={"thinking_mode": ...}` changes the prompt's tail, after the `]~b]ai\\n` header of the
turn to generate (no newline follows either marker), and what the model then emits:

    thinking_mode        prompt ends with            the model emits
    "enabled"            ]~b]ai\\n<mm:think>          reasoning `</mm:think>` content: its output starts INSIDE the
                                                     block, so the opening marker never appears in generated text
    "disabled"           ]~b]ai\\n</mm:think>         content only: the template already closed the block
    "adaptive" / unset   ]~b]ai\\n                    either `<mm:think>` reasoning `</mm:think>` content, or a bare
                                                     `</mm:think>` then content (its "no thinking" answer), or content

So the parser must know where the prompt left off. `initial_phase(prompt_text)` (or `initial_phase_from_ids`)
reads that from the prompt's tail only: the text of the last turn after its `]~b]ai` header, read with the same
rules as generated text. It never searches the rest of the prompt: M3's system prompt itself spells out
`<mm:think></mm:think>` in its thinking instructions, and an earlier turn's markers say nothing about this one
(treating marker text elsewhere in the prompt as generated is a known bug of other servers).

Rules, identical for `split_reasoning` and the streaming `ReasoningParser` (the former is the latter fed in one
piece, so any split of the text into deltas gives the same result):

- UNDECIDED (adaptive): the block can only open at the very start of the output, after optional whitespace. A
  leading `<mm:think>` opens reasoning; a leading bare `</mm:think>` is dropped and the rest is content; anything
  else makes the whole output content (a marker later on is literal text, not a thinking block). Whitespace in
  front of a marker is dropped; without a marker it stays content.
- REASONING: text is reasoning until the first `</mm:think>`; after it everything is content, verbatim
  (whitespace included, later marker text included: there is one thinking block per turn).
- CONTENT: everything is content.
- End of generation inside the block (max_tokens, or a stop): all of it is reasoning and content is None.
- A marker split across deltas is held back until it completes; a partial marker that never completes is
  flushed by `finish()` as ordinary text of the channel it was in.

The parser works on text, so the request's text must keep M3's special tokens: decode with
`skip_special_tokens=False` (with the default True, `<mm:think>`/`</mm:think>` vanish from the text).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, Protocol

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"

# The chat template's turn structure (spec §6): `]~b]` + role + "\n" opens a turn, `[e~[` ends it.
ROLE_START = "]~b]"
END_OF_TURN = "[e~["
ASSISTANT_ROLE = "ai"

THINKING_MODES = ("enabled", "adaptive", "disabled")


class ReasoningPhase(enum.Enum):
    """Where the text stands: the parser's state, and what a prompt leaves the generated text in."""

    UNDECIDED = "undecided"  # the model may still open a block (or skip thinking with a bare closer)
    REASONING = "reasoning"  # inside <mm:think>: text is reasoning until </mm:think>
    CONTENT = "content"  # the block is over (or never was): text is content


class ReasoningDelta(NamedTuple):
    """What one `push` (or `finish`) adds to each channel; "" when nothing."""

    reasoning: str
    content: str


class _TailDecoder(Protocol):
    def token_to_id(self, token: str) -> int | None: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def generation_prompt_suffix(thinking_mode: str | None) -> str:
    """What M3's template writes after the `]~b]ai\\n` generation header for `thinking_mode` (None = unset).

    A checkpoint template that ignores `thinking_mode` (the embedded tiny one does) writes nothing; a server that
    wants the mode honoured there can append this to the rendered prompt itself.
    """
    if thinking_mode is None or thinking_mode == "adaptive":
        return ""
    if thinking_mode == "enabled":
        return THINK_START
    if thinking_mode == "disabled":
        return THINK_END
    raise ValueError(f"thinking_mode must be one of {list(THINKING_MODES)}, got {thinking_mode!r}")


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (text that may become it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """Streaming split of generated text into reasoning and content: `push(delta)` per text delta, `finish()` once
    at the end of generation. The concatenated outputs equal `split_reasoning(text, phase)` for any split."""

    def __init__(self, phase: ReasoningPhase = ReasoningPhase.UNDECIDED) -> None:
        self.phase = phase
        self._held = ""  # text that may still turn out to be (part of) a marker
        self._finished = False

    @classmethod
    def for_prompt(cls, prompt_text: str) -> ReasoningParser:
        """A parser for the text generated after `prompt_text` (the rendered chat prompt)."""
        return cls(initial_phase(prompt_text))

    @classmethod
    def for_prompt_ids(cls, prompt_ids: Sequence[int], tokenizer: _TailDecoder) -> ReasoningParser:
        """A parser for the text generated after the prompt `prompt_ids` (see `initial_phase_from_ids`)."""
        return cls(initial_phase_from_ids(prompt_ids, tokenizer))

    @property
    def reasoning_ended(self) -> bool:
        """True once text goes to content (the block closed, was skipped, or never opened)."""
        return self.phase is ReasoningPhase.CONTENT

    def push(self, delta: str) -> ReasoningDelta:
        """Split the next text delta; text that may be the start of a marker is held until it is settled."""
        if self._finished:
            raise RuntimeError("push after finish")
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.phase is ReasoningPhase.UNDECIDED:
                text = self._decide(text)
                if self.phase is ReasoningPhase.UNDECIDED:  # still a prefix of a marker (or only whitespace)
                    self._held = text
                    break
            elif self.phase is ReasoningPhase.REASONING:
                end = text.find(THINK_END)
                if end < 0:
                    keep = _partial_marker_len(text, THINK_END)
                    reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                reasoning.append(text[:end])
                text = text[end + len(THINK_END):]
                self.phase = ReasoningPhase.CONTENT
            else:
                content.append(text)
                break
        return ReasoningDelta("".join(reasoning), "".join(content))

    def _decide(self, text: str) -> str:
        """UNDECIDED: settle the phase from the start of the output if possible; returns the text left over."""
        body = text.lstrip()
        if body.startswith(THINK_START):
            self.phase = ReasoningPhase.REASONING
            return body[len(THINK_START):]  # the whitespace before the marker is formatting: dropped
        if body.startswith(THINK_END):
            self.phase = ReasoningPhase.CONTENT  # adaptive mode's "no thinking" answer: the closer is dropped
            return body[len(THINK_END):]
        if not body or THINK_START.startswith(body) or THINK_END.startswith(body):
            return text  # undecided yet: wait for more
        self.phase = ReasoningPhase.CONTENT  # plain text first: no block in this turn, whitespace included
        return text

    def finish(self) -> ReasoningDelta:
        """End of generation: flush held text (a partial marker that never completed is plain text)."""
        if self._finished:
            return ReasoningDelta("", "")
        self._finished = True
        held, self._held = self._held, ""
        if self.phase is ReasoningPhase.REASONING:
            return ReasoningDelta(held, "")
        if held:
            self.phase = ReasoningPhase.CONTENT
        return ReasoningDelta("", held)


def split_reasoning(text: str, phase: ReasoningPhase = ReasoningPhase.UNDECIDED) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole generated text; None for a channel with no text. `phase` is where
    the prompt left off (`initial_phase(prompt_text)`); the default suits a prompt that did not open a block."""
    parser = ReasoningParser(phase)
    first, last = parser.push(text), parser.finish()
    return (first.reasoning + last.reasoning) or None, (first.content + last.content) or None


def initial_phase(prompt_text: str) -> ReasoningPhase:
    """Where text generated after `prompt_text` starts, read from the prompt's last turn only.

    The last turn is the text after the last `]~b]`. If it is an unfinished assistant turn (`ai` header, no `[e~[`),
    the text after its header line is what the assistant has "said" already (the template's thinking prefix,
    or a prefill such as `continue_final_message`), so it is read with the generated-text rules and the phase it
    ends in is where generation starts: `<mm:think>` -> REASONING, `</mm:think>` -> CONTENT, nothing -> UNDECIDED.
    Any other prompt (a raw completion prompt, a finished turn) -> UNDECIDED.
    """
    start = prompt_text.rfind(ROLE_START)
    if start < 0:
        return ReasoningPhase.UNDECIDED
    turn = prompt_text[start + len(ROLE_START):]
    role, newline, prefill = turn.partition("\n")
    if role != ASSISTANT_ROLE or END_OF_TURN in prefill:
        return ReasoningPhase.UNDECIDED
    if not newline:
        return ReasoningPhase.UNDECIDED  # "]~b]ai" without its newline: the header is not finished
    reader = ReasoningParser()
    reader.push(prefill)
    return reader.phase


def initial_phase_from_ids(prompt_ids: Sequence[int], tokenizer: _TailDecoder) -> ReasoningPhase:
    """`initial_phase` of a token-id prompt: only the ids from the last `]~b]` on are decoded (with special tokens
    kept, so the markers are visible). A tokenizer without `]~b]` or a prompt without it -> UNDECIDED."""
    role_id = tokenizer.token_to_id(ROLE_START)
    if role_id is None:
        return ReasoningPhase.UNDECIDED
    ids = [int(i) for i in prompt_ids]
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == role_id:
            return initial_phase(tokenizer.decode(ids[i:], skip_special_tokens=False))
    return ReasoningPhase.UNDECIDED
