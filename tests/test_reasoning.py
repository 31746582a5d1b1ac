"""serving.reasoning: M3's `<mm:think>` blocks split into reasoning_content and content, whole and streaming.

Outputs are written from the format in m3-spec.md §6 and M3's chat template (see the module docstring): the
block opens only at the start of a turn, the template may already have opened (thinking_mode="enabled") or
closed (thinking_mode="disabled") it in the prompt, and adaptive mode answers "no thinking" with a bare closer.
"""

from __future__ import annotations

import codecs
import random
from pathlib import Path

import pytest

from serving.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningParser,
    ReasoningPhase,
    generation_prompt_suffix,
    initial_phase,
    initial_phase_from_ids,
    split_reasoning,
)
from serving.tokenizer import M3Tokenizer

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"
U, R, C = ReasoningPhase.UNDECIDED, ReasoningPhase.REASONING, ReasoningPhase.CONTENT

# (phase the prompt left, generated text, reasoning_content, content)
CASES = [
    # adaptive: the model opens a block, or answers "no thinking" with a bare closer, or just answers
    (U, "<mm:think>Compare a and b.\nb wins.</mm:think>b is better.", "Compare a and b.\nb wins.", "b is better."),
    (U, "</mm:think>b is better.", None, "b is better."),
    (U, "b is better.", None, "b is better."),
    (U, "\n\n<mm:think>x</mm:think>\n\ny", "x", "\n\ny"),  # whitespace before a marker is formatting
    (U, "  plain", None, "  plain"),  # ... but stays when no marker follows
    (U, "b is <mm:think>better</mm:think>", None, "b is <mm:think>better</mm:think>"),  # not at the start: text
    (U, "<mm:think>a</mm:think>b</mm:think>c<mm:think>d", "a", "b</mm:think>c<mm:think>d"),  # one block per turn
    (U, "<mm:think></mm:think>answer", None, "answer"),  # an empty block gives no reasoning
    (U, "<mm:think>still thinking when max_tokens hit", "still thinking when max_tokens hit", None),
    (U, "<mm:th", None, "<mm:th"),  # a partial marker that never completes is text
    (U, "</mm:thin", None, "</mm:thin"),
    (U, "<mm:think>so a < b and </mm:th", "so a < b and </mm:th", None),
    (U, "<", None, "<"),
    (U, "", None, None),
    (U, "   ", None, "   "),
    # enabled: the prompt ends in <mm:think>, so the output starts inside the block
    (R, "Compare a and b.</mm:think>b is better.", "Compare a and b.", "b is better."),
    (R, "<mm:think> is how I start</mm:think>ok", "<mm:think> is how I start", "ok"),  # inside: only the closer counts
    (R, "thinking until the end", "thinking until the end", None),
    (R, "</mm:think>", None, None),
    (R, "a </mm:thin", "a </mm:thin", None),
    # disabled: the prompt closed the block; markers in the output are literal text
    (C, "b is better.", None, "b is better."),
    (C, "<mm:think>x</mm:think>y", None, "<mm:think>x</mm:think>y"),
    # non-ASCII on both sides of the markers
    (U, "<mm:think>naïve 東京 😀</mm:think>café ✨", "naïve 東京 😀", "café ✨"),
]


def _stream(phase: ReasoningPhase, deltas: list[str]) -> tuple[str | None, str | None]:
    parser = ReasoningParser(phase)
    parts = [parser.push(d) for d in deltas] + [parser.finish()]
    return "".join(p.reasoning for p in parts) or None, "".join(p.content for p in parts) or None


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_split_reasoning(phase: ReasoningPhase, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(text, phase) == (reasoning, content)


@pytest.mark.parametrize(("phase", "text", "reasoning", "content"), CASES)
def test_streaming_matches_whole_text_at_every_cut(phase: ReasoningPhase, text: str, reasoning: str | None,
                                                  content: str | None) -> None:
    expected = (reasoning, content)
    for cut in range(len(text) + 1):
        assert _stream(phase, [text[:cut], text[cut:]]) == expected, cut
    assert _stream(phase, list(text)) == expected
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(phase, pieces) == expected, cuts


def test_streaming_at_every_utf8_byte() -> None:
    """Deltas as a byte-level detokenizer might cut them (an incremental UTF-8 decoder, "" mid-character)."""
    text = "<mm:think>naïve 東京 😀 a</mm:think>café ✨"
    data = text.encode()
    for cut in range(len(data) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        deltas = [decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)]
        assert _stream(U, deltas) == ("naïve 東京 😀 a", "café ✨"), cut
    decoder = codecs.getincrementaldecoder("utf-8")()
    assert _stream(U, [decoder.decode(bytes([b])) for b in data]) == ("naïve 東京 😀 a", "café ✨")


def test_markers_are_held_until_settled() -> None:
    parser = ReasoningParser(R)
    assert parser.push("abc</mm:") == ("abc", "")  # the partial closer is held
    assert parser.push("think>de") == ("", "de")
    assert parser.reasoning_ended
    parser = ReasoningParser(U)
    assert parser.push("  <mm") == ("", "")
    assert not parser.reasoning_ended and parser.phase is U
    assert parser.push(":think>x") == ("x", "")
    assert parser.phase is R
    assert parser.finish() == ("", "")


def test_finish_flushes_a_partial_marker_into_its_channel() -> None:
    parser = ReasoningParser(R)
    assert parser.push("so </mm:thi") == ("so ", "")
    assert parser.finish() == ("</mm:thi", "")
    parser = ReasoningParser(U)
    assert parser.push("<mm:thi") == ("", "")
    assert parser.finish() == ("", "<mm:thi")
    assert parser.finish() == ("", "")  # idempotent
    with pytest.raises(RuntimeError):
        parser.push("x")


def test_generation_prompt_suffix() -> None:
    assert generation_prompt_suffix("enabled") == THINK_START
    assert generation_prompt_suffix("disabled") == THINK_END
    assert generation_prompt_suffix("adaptive") == ""
    assert generation_prompt_suffix(None) == ""
    with pytest.raises(ValueError, match="thinking_mode"):
        generation_prompt_suffix("on")


# The system prompt of M3's template spells out the markers in its thinking instructions; a history turn has its
# own block. Neither may decide where generation starts: only the last turn's tail does.
SYSTEM = ("]~!b[]~b]system\nWhen thinking is enabled, wrap your reasoning in <mm:think></mm:think> tags. When "
          "disabled, begin after the </mm:think> prefix.[e~[\n]~b]developer\nYou are a helpful assistant.[e~[\n")
HISTORY = "]~b]user\nhi[e~[\n]~b]ai\n<mm:think>greet back</mm:think>Hello![e~[\n]~b]user\nand now?[e~[\n"


@pytest.mark.parametrize(("prompt", "phase"), [
    (SYSTEM + HISTORY + "]~b]ai\n<mm:think>", R),  # thinking_mode="enabled"
    (SYSTEM + HISTORY + "]~b]ai\n</mm:think>", C),  # thinking_mode="disabled"
    (SYSTEM + HISTORY + "]~b]ai\n", U),  # adaptive / unset
    (SYSTEM + "]~b]user\nexplain the <mm:think> tag[e~[\n]~b]ai\n", U),  # markers in a user turn: not ours
    (SYSTEM + HISTORY + "]~b]ai\n<mm:think>I already began", R),  # continue_final_message inside the block
    (SYSTEM + HISTORY + "]~b]ai\n<mm:think>done</mm:think>The answer", C),  # ... and after it
    (SYSTEM + HISTORY + "]~b]ai\nThe answer", C),  # a prefilled answer without thinking
    (SYSTEM + HISTORY + "]~b]ai\n<mm:think>", R),
    (SYSTEM + HISTORY, U),  # no generation prompt: the last turn is finished
    (SYSTEM + "]~b]user\n<mm:think>", U),  # the last turn is not the assistant's
    (SYSTEM + HISTORY + "]~b]ai", U),  # a header without its newline
    ("Write a poem.<mm:think>", U),  # a raw completion prompt has no turns
    ("", U),
])
def test_initial_phase_reads_only_the_last_turn(prompt: str, phase: ReasoningPhase) -> None:
    assert initial_phase(prompt) is phase
    assert ReasoningParser.for_prompt(prompt).phase is phase


@pytest.fixture(scope="module")
def tiny_tok() -> M3Tokenizer:
    return M3Tokenizer.from_dir(TINY)


@pytest.mark.parametrize(("mode", "phase"), [("enabled", R), ("disabled", C), ("adaptive", U), (None, U)])
def test_initial_phase_from_rendered_prompt_text_and_ids(tiny_tok: M3Tokenizer, mode: str | None,
                                                         phase: ReasoningPhase) -> None:
    messages = [{"role": "system", "content": "Use <mm:think></mm:think> when thinking."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "</mm:think>Hello!"},
                {"role": "user", "content": "and now? <mm:think>"}]
    # The embedded tiny template ignores thinking_mode (it renders no thinking prefix); M3's template appends
    # generation_prompt_suffix(mode) after the generation header, so add it the same way here.
    plain = tiny_tok.apply_chat_template(messages)
    assert tiny_tok.apply_chat_template(messages, thinking_mode=mode or "adaptive") == plain
    prompt = plain + generation_prompt_suffix(mode)
    assert initial_phase(prompt) is phase
    ids = tiny_tok.encode(prompt)
    assert initial_phase_from_ids(ids, tiny_tok) is phase
    assert ReasoningParser.for_prompt_ids(ids, tiny_tok).phase is phase


def test_initial_phase_from_ids_without_a_role_token(tiny_tok: M3Tokenizer) -> None:
    class NoRoles:
        def token_to_id(self, token: str) -> int | None:
            return None

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            raise AssertionError("nothing to decode")

    assert initial_phase_from_ids([1, 2, 3], NoRoles()) is U
    assert initial_phase_from_ids(tiny_tok.encode("no turns here <mm:think>"), tiny_tok) is U


def test_generated_ids_through_the_tokenizer(tiny_tok: M3Tokenizer) -> None:
    """End to end on the tiny tokenizer: the markers are special tokens, visible only with special tokens kept."""
    out_ids = tiny_tok.encode("<mm:think>plan</mm:think>answer")
    assert tiny_tok.decode(out_ids) == "plananswer"  # skip_special_tokens=True loses the markers
    text = tiny_tok.decode(out_ids, skip_special_tokens=False)
    assert split_reasoning(text) == ("plan", "answer")
