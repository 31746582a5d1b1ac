"""serving.tokenizer on a byte-level BPE trained here in a few milliseconds (no download, no real checkpoint).

The tokenizer has M3's shape where it matters: byte-level BPE over every byte (so any byte sequence, including
half an emoji, is some token sequence), M3's special tokens as added tokens, an M3-style chat template that
writes `]~!b[` itself, and configs that disagree about the BOS the way M3's do (spec §6).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from serving.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    M3Tokenizer,
    StopChecker,
    TokenizerError,
    TokenizerMissing,
    find_stop,
)

BOS, ROLE, EOT, THINK, END_THINK = "]~!b[", "]~b]", "[e~[", "<mm:think>", "</mm:think>"
SPECIALS = [BOS, ROLE, EOT, THINK, END_THINK]

# Multi-byte text on purpose: 2-byte Greek/Latin-1, 3-byte CJK, 4-byte emoji (plus modifiers and ZWJ joins),
# so BPE learns merges that end in the middle of a character.
_SAMPLES = [
    "The quick brown fox jumps over the lazy dog. def main(): return 42\n",
    "Γειά σου κόσμε! Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλικο σκύλο.\n",
    "你好，世界。今天天气很好，我们去公园散步吧。机器学习和深度学习。\n",
    "こんにちは世界。東京は大きな都市です。\n",
    "Emoji: 😀😃😄😁 🎉🎊 👍🏽👋🏿 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🚀✨\n",
    "naïve café résumé — “quotes” € £ ¥ 10°C ±3\n",
]
CORPUS = [s * 6 for s in _SAMPLES]

TEMPLATE = """{{- ']~!b[' -}}
{%- if tools -%}
{{- ']~b]system\\n' ~ (tools | tojson) ~ '[e~[\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message['role'] == 'tool' -%}
{{- raise_exception('a conversation cannot start with a tool result') -}}
{%- endif -%}
{%- set role = 'ai' if message['role'] == 'assistant' else message['role'] -%}
{{- ']~b]' ~ role ~ '\\n' ~ message['content'] ~ '[e~[\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- ']~b]ai\\n' -}}
{%- if thinking_mode == 'enabled' -%}
{{- '<mm:think>' -}}
{%- endif -%}
{%- endif -%}
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-symbol table, which pre_tokenizers.ByteLevel uses."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_SYMBOL = _bytes_to_unicode()


def _train(post_bos: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)  # at the top of the id range, as in M3
    if post_bos:
        # A post-processor that prepends BOS, as Llama-style tokenizer.json files have.
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return tok


def _write_checkpoint(directory: Path, tok: Tokenizer, *, jinja: str | None = TEMPLATE,
                      config_template: object = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    tokenizer_config: dict[str, object] = {
        "add_bos_token": False,
        # M3's BOS conflict (spec §6): the tokenizer files name the role token, the text config `]~!b[`.
        "bos_token": {"content": ROLE, "special": True},
        "eos_token": EOT,
    }
    if config_template is not None:
        tokenizer_config["chat_template"] = config_template
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": ROLE, "eos_token": EOT}))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[ROLE], "eos_token_id": [ids[EOT], 7]}))
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "minimax_m3_vl", "text_config": {"bos_token_id": ids[BOS], "eos_token_id": 9}}))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    return _train()


@pytest.fixture(scope="module")
def tok(trained: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> M3Tokenizer:
    directory = tmp_path_factory.mktemp("ckpt")
    # tokenizer_config carries a different template: chat_template.jinja must win.
    _write_checkpoint(directory, trained, config_template="WRONG {{ messages }}")
    return M3Tokenizer.from_dir(directory)


def _byte_ids(tok: M3Tokenizer, data: bytes) -> list[int]:
    """One single-byte token per byte: any byte string, even a broken one, as token ids."""
    ids = [tok.token_to_id(_BYTE_SYMBOL[b]) for b in data]
    assert None not in ids
    return ids  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------------------
# Loading, encode/decode


TEXTS = ["", "hello world", "Γειά σου κόσμε", "你好，世界。", "😀🎉👍🏽👨‍👩‍👧‍👦",
         "mixed: café 你好 😀 end\n\n  x", "unseen: Здравствуй мир ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \t\r\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: M3Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok: M3Tokenizer) -> None:
    for s in SPECIALS:
        i = tok.token_to_id(s)
        assert i is not None and i >= tok.vocab_size - len(SPECIALS)
        assert tok.encode(s) == [i]
        assert tok.decode([i], skip_special_tokens=False) == s
        assert tok.decode([i]) == ""
    ids = tok.encode(f"{ROLE}ai\nhi{EOT}")
    assert ids[0] == tok.token_to_id(ROLE) and ids[-1] == tok.token_to_id(EOT)
    assert tok.decode(ids) == "ai\nhi"


def test_ids_from_configs(tok: M3Tokenizer) -> None:
    # The template's BOS wins over generation_config / special_tokens_map's `]~b]`.
    assert tok.bos_token_id == tok.token_to_id(BOS)
    # Union of generation_config and config (incl. text_config), plus `[e~[`, without duplicates.
    assert tok.eos_token_ids == (tok.token_to_id(EOT), 7, 9)
    assert tok.bos_token == ROLE and tok.eos_token == EOT  # what the template sees, as transformers passes it
    assert tok.add_bos_token is False
    assert tok.token_to_id(END_THINK) == tok.vocab_size - 1
    assert tok.decode([tok.vocab_size + 3, *tok.encode("ok")]) == "ok"  # unused embedding rows decode to ""


def test_missing_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerMissing, match="token ids") as info:
        M3Tokenizer.from_dir(tmp_path)
    assert isinstance(info.value, ValueError)


def test_broken_files(tmp_path: Path, trained: Tokenizer) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        M3Tokenizer.from_dir(tmp_path)
    _write_checkpoint(tmp_path, trained)
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        M3Tokenizer.from_dir(tmp_path)


# ------------------------------------------------------------------------------------------------------------
# Chat template


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
RENDERED = (f"{BOS}{ROLE}system\nBe brief.{EOT}\n{ROLE}user\nHi 😀{EOT}\n{ROLE}ai\nHello!{EOT}\n"
            f"{ROLE}user\n2+2?{EOT}\n{ROLE}ai\n")


def test_chat_template_renders_exactly(tok: M3Tokenizer) -> None:
    assert tok.apply_chat_template(CHAT) == RENDERED
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == RENDERED.removesuffix(f"{ROLE}ai\n")
    assert tok.apply_chat_template(CHAT, thinking_mode="enabled") == RENDERED + THINK
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}]
    with_tools = tok.apply_chat_template(CHAT, tools=tools)
    # transformers' tojson: no HTML escaping, non-ASCII kept.
    tools_turn = f"{ROLE}system\n{json.dumps(tools, ensure_ascii=False)}{EOT}\n"
    assert with_tools == BOS + tools_turn + RENDERED[len(BOS):]


def test_encode_chat_has_one_bos(tok: M3Tokenizer) -> None:
    ids = tok.encode_chat(CHAT)
    bos = tok.token_to_id(BOS)
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids[-3:] == [tok.token_to_id(ROLE), *tok.encode("ai\n")]
    assert tok.decode(ids, skip_special_tokens=False) == RENDERED


def test_no_doubled_bos_with_a_bos_adding_post_processor(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path, _train(post_bos=True))
    tok = M3Tokenizer.from_dir(tmp_path)
    bos = tok.token_to_id(BOS)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi", add_special_tokens=True)[0] == bos
    assert tok.encode(f"{BOS}hi", add_special_tokens=True).count(bos) == 1
    assert tok.encode_chat(CHAT).count(bos) == 1


def test_template_sources(tmp_path: Path, trained: Tokenizer) -> None:
    simple = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    _write_checkpoint(tmp_path / "a", trained, jinja=None,
                      config_template=[{"name": "default", "template": simple},
                                       {"name": "tool_use", "template": "TOOLS {{ tools | length }}"}])
    tok = M3Tokenizer.from_dir(tmp_path / "a")
    assert tok.apply_chat_template(CHAT[:2]) == "system:Be brief.;user:Hi 😀;"
    assert tok.apply_chat_template(CHAT[:2], tools=[{"name": "f"}]) == "TOOLS 1"
    assert tok.apply_chat_template(CHAT[:2], chat_template="tool_use", tools=[]) == "TOOLS 0"
    # transformers' extras: {% generation %} blocks render their body; loop controls work.
    gen = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}" \
          "{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}"
    assert tok.apply_chat_template(CHAT, chat_template=gen) == "<Be brief.>"
    _write_checkpoint(tmp_path / "b", trained, jinja=None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        M3Tokenizer.from_dir(tmp_path / "b").apply_chat_template(CHAT)


def test_template_raise_exception(tok: M3Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="cannot start with a tool result"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_template_is_sandboxed(tok: M3Tokenizer) -> None:
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CHAT, chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(CHAT, chat_template="{{ ''.__class__.__mro__ }}")


@pytest.mark.parametrize("messages", [
    "hello", [], [["user", "hi"]], [{"role": "robot", "content": "hi"}], [{"content": "hi"}],
    [{"role": "user"}], [{"role": "user", "content": 3}], [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": None}],
])
def test_bad_messages(tok: M3Tokenizer, messages: object) -> None:
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_assistant_tool_call_without_content(tok: M3Tokenizer) -> None:
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert "]~b]ai\nNone" in tok.apply_chat_template(msgs, chat_template=TEMPLATE)
    # OpenAI's JSON-string arguments reach the template as a mapping (M3's template iterates them).
    items = "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments.items() %}" \
            "{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}"
    assert tok.apply_chat_template(msgs, chat_template=items, add_generation_prompt=False) == "a=[1, 2];"
    bad = {"id": "2", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    with pytest.raises(ValueError, match="arguments is not valid JSON"):
        tok.apply_chat_template([msgs[0], {"role": "assistant", "content": None, "tool_calls": [bad]}])


# ------------------------------------------------------------------------------------------------------------
# Incremental detokenizer


def _stream(tok: M3Tokenizer, ids: list[int], **kw: object) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kw)  # type: ignore[arg-type]
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


def test_detok_random_sequences_match_decode(tok: M3Tokenizer) -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 40))).tolist()
        skip = bool(trial % 2)
        prompt = rng.integers(0, tok.vocab_size, size=int(rng.integers(0, 8))).tolist() if trial % 3 else None
        pieces, detok = _stream(tok, ids, prompt_ids=prompt, skip_special_tokens=skip)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == expected == detok.text, (ids, prompt)


def test_detok_valid_text_never_emits_replacement(tok: M3Tokenizer) -> None:
    rng = np.random.default_rng(1)
    chars = list("".join(_SAMPLES) + "𝔘Здравствуй☃")
    for _ in range(100):
        text = "".join(rng.choice(chars, size=int(rng.integers(1, 60))).tolist())
        cut = len(text) // 3  # prompt / output split on a character boundary, as a real prompt ends
        pieces, _ = _stream(tok, tok.encode(text[cut:]), prompt_ids=tok.encode(text[:cut]))
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == text[cut:]
        # Byte by byte: the worst split, every emoji cut into four.
        pieces, _ = _stream(tok, _byte_ids(tok, text.encode()))
        assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == text


def test_detok_holds_a_split_emoji(tok: M3Tokenizer) -> None:
    ids = _byte_ids(tok, "a😀b".encode())
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids] == ["a", "", "", "", "😀", "b"]
    assert detok.flush() == "" and detok.text == "a😀b"


def test_detok_invalid_bytes(tok: M3Tokenizer) -> None:
    # Invalid bytes stay U+FFFD; only the trailing, maybe-unfinished character is ever held.
    for data in (b"\xe2\x82A", b"\xe2\x82\xff\xffA", b"\xed\xa0\x80x", b"ok\xf0\x9f", b"\xff"):
        pieces, _ = _stream(tok, _byte_ids(tok, data))
        assert "".join(pieces) == data.decode("utf-8", "replace")
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in _byte_ids(tok, b"\xff\xff\xff")] == ["", "\ufffd", "\ufffd"]
    assert detok.flush() == "\ufffd"


def test_detok_work_per_token_is_bounded(tok: M3Tokenizer) -> None:
    widths: list[int] = []

    class Recording:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            widths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "".join(_SAMPLES) * 20
    ids = tok.encode(text)
    assert len(ids) > 1000
    pieces, _ = _stream(Recording(), ids)  # type: ignore[arg-type]
    assert "".join(pieces) == text
    assert max(widths) <= 8  # the window, never the whole output


def test_detok_prompt_ending_mid_character(tok: M3Tokenizer) -> None:
    ids = _byte_ids(tok, "x😀".encode())
    # The prompt holds the emoji's first two bytes; output text is what decode(output) gives.
    pieces, _ = _stream(tok, ids[3:], prompt_ids=ids[:3])
    assert "".join(pieces) == tok.decode(ids[3:])


# ------------------------------------------------------------------------------------------------------------
# Stop strings


def test_find_stop() -> None:
    assert find_stop("hello STOP world", ["STOP", "world"], 0) == 6
    assert find_stop("hello STOP world", ["world", "o"], 0) == 4
    assert find_stop("abcSTOPdef", ["STOP"], start=5) == 3  # began before `start`, ends in the new text
    assert find_stop("STOPabcdef", ["STOP"], start=6) is None  # wholly before: checked already
    assert find_stop("abc", [], 0) is None and find_stop("abc", [""], 0) is None


def test_stop_checker_holds_partial_stop() -> None:
    sc = StopChecker(["<stop>", "END"])
    assert sc.push("Hello <") == ("Hello ", False)
    assert sc.push("st") == ("", False)
    assert sc.push("a") == ("<sta", False)  # no longer a prefix of any stop string
    assert sc.push("y E") == ("y ", False)
    assert sc.push("ND tail") == ("", True)
    assert sc.stop_str == "END" and sc.stopped
    assert sc.push("more") == ("", True) and sc.flush() == ""


def test_stop_checker_truncates_and_flushes() -> None:
    sc = StopChecker(["\n\n"], include_stop=False)
    assert sc.push("a\nb\n") == ("a\nb", False)
    assert sc.push("\nc") == ("", True)
    sc = StopChecker(["</s>"], include_stop=True)
    assert sc.push("x</s>y") == ("x</s>", True)
    sc = StopChecker(["STOP"])
    assert sc.push("no ST") == ("no ", False)
    assert sc.flush() == "ST"  # the stream ended: the held tail was never a stop
    assert StopChecker(None).push("abc") == ("abc", False)


def test_stop_checker_random_chunks_match_reference() -> None:
    rng = np.random.default_rng(2)
    alphabet = list("ab\n<>/")
    for _ in range(400):
        stops = ["".join(rng.choice(alphabet, size=int(rng.integers(1, 5))).tolist())
                 for _ in range(int(rng.integers(1, 4)))]
        full = "".join(rng.choice(alphabet, size=int(rng.integers(0, 40))).tolist())
        hits = [i for i in (full.find(s) for s in stops) if i != -1]
        expected = full[:min(hits)] if hits else full
        sc = StopChecker(stops)
        out, stopped, pos = [], False, 0
        while pos < len(full) and not stopped:
            n = int(rng.integers(0, 5))
            emit, stopped = sc.push(full[pos:pos + n])
            out.append(emit)
            pos += n
            # Everything emitted is final: a prefix of the answer.
            assert expected.startswith("".join(out))
        if not stopped:
            out.append(sc.flush())
        assert "".join(out) == expected and stopped == bool(hits), (stops, full)


def test_engine_loop(tok: M3Tokenizer) -> None:
    """Detokenizer into stop checker, as the engine chains them (module docstring)."""
    text = "Γειά 😀 world. 你好 STOP not this"
    ids = _byte_ids(tok, text.encode())  # the stop string's own split points are arbitrary too
    detok, sc = IncrementalDetokenizer(tok), StopChecker(["STOP"])
    out = []
    for i in ids:
        emit, stopped = sc.push(detok.push(i))
        out.append(emit)
        if stopped:
            break
    assert stopped and "".join(out) == "Γειά 😀 world. 你好 "


def test_text_state_reads_any_tail_of_its_text(tok: M3Tokenizer) -> None:
    """`TextState.since(k)` is `text[k:]` wherever k falls: inside a piece, on a boundary, across many pieces,
    after they were joined (more than 64, or `text` read), and at the end (""). The engine reads each step's new
    tail (`since(seen)`); those reads join to the text."""
    from serving.stopping import TextState

    text = "Γειά 😀 world. 你好 " * 12 + "STOP not this"
    ids = _byte_ids(tok, text.encode())
    assert len(ids) > 100
    state = TextState(IncrementalDetokenizer(tok), StopChecker(["STOP"]))
    rng = np.random.default_rng(0)
    reads, seen = [], 0
    for n, i in enumerate(ids):
        stopped = state.push(i, final=n == len(ids) - 1)
        reads.append(state.since(seen))
        seen += len(reads[-1])
        if n in (30, 100) or stopped or n == len(ids) - 1:
            ks = sorted({0, seen, state.length, *rng.integers(0, state.length + 1, 8).tolist()})
            tails = [state.since(k) for k in ks]  # before `text` joins the pieces
            whole = state.text
            assert state.length == len(whole) == seen and "".join(reads) == whole
            assert tails == [whole[k:] for k in ks], n
        if stopped:
            break
    assert stopped and state.text == "Γειά 😀 world. 你好 " * 12
