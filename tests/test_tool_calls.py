"""serving.tool_calls: M3's namespaced XML tool calls -> OpenAI tool_calls, whole and streaming.

Outputs are written from M3's format (every structural tag prefixed by `]<]minimax[>[`, parameters named by
their own tags, nested values as nested elements, arrays as <item>s; see the module docstring), including the
deviations real M3 deployments show (unprefixed inner tags, elided opening tags, missing closers).
Every case is also streamed cut at every character (and, for non-ASCII text, at every UTF-8 byte): joined
content, joined arguments and issues must equal the whole-text result.
"""

from __future__ import annotations

import codecs
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from serving_helpers import m3_like_template

from serving.reasoning import ReasoningParser, ReasoningPhase, split_reasoning
from serving.tokenizer import M3Tokenizer
from serving.tool_calls import (
    NS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCallParser,
    ToolCallResult,
    extract_tool_calls,
    forced_call_prefix,
    parse_tool_calls,
    render_tool_calls,
)

TINY = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny"


def _fn(name: str, properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": list(required)}}}


TOOLS = [
    _fn("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("create_order", {
        "user_id": {"type": "integer"}, "urgent": {"type": "boolean"}, "note": {"type": "string"},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                              "qty": {"type": "integer"}}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "metadata": {"type": "object", "additionalProperties": {"type": "integer"}},
    }),
    _fn("write_file", {"path": {"type": "string"}, "content": {"type": "string"}, "html": {"type": "string"}},
        ["path"]),
    _fn("calc", {"x": {"type": "number"}, "n": {"type": ["integer", "null"]}, "flag": {"type": "boolean"},
                 "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "level": {"enum": [1, 2, 3]},
                 "opts": {"type": "object"}, "vals": {"type": "array"}, "-n": {"type": "integer"}}),
]


def el(name: str, body: str) -> str:
    return f"{NS}<{name}>{body}{NS}</{name}>"


def invoke(name: str, *params: str) -> str:
    return f'{NS}<invoke name="{name}">' + "".join(params) + f"{NS}</invoke>"


def block(*invokes: str) -> str:
    return TOOL_CALL_START + "\n" + "\n".join(invokes) + "\n" + TOOL_CALL_END


# name -> (text, expected content, expected [(function, arguments)], expected issue kinds)
CASES: dict[str, tuple[str, str, list[tuple[str, dict[str, Any]]], list[str]]] = {
    "no_call": ("Just an answer with a < b and arr[0] > 1 ] [", "Just an answer with a < b and arr[0] > 1 ] [",
                [], []),
    "single_call_text_before": (
        "Let me check." + block(invoke("get_weather", el("city", "Paris"), el("days", "3"))),
        "Let me check.", [("get_weather", {"city": "Paris", "days": 3})], []),
    "several_invokes_one_block": (
        block(invoke("get_weather", el("city", "Paris")), invoke("get_weather", el("city", "Tokyo"),
                                                                 el("unit", "celsius"))),
        "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo", "unit": "celsius"})], []),
    "several_blocks_text_between_and_after": (
        "First." + block(invoke("get_weather", el("city", "Oslo"))) + " Then." +
        block(invoke("write_file", el("path", "a.txt"), el("content", "hi"))) + " Done.",
        "First. Then. Done.",
        [("get_weather", {"city": "Oslo"}), ("write_file", {"path": "a.txt", "content": "hi"})], []),
    "nested_objects_and_arrays": (
        block(invoke("create_order", el("user_id", "42"), el("urgent", "true"),
                     el("note", "Leave at the front desk."),
                     el("shipping", el("city", "Singapore") + el("zip", "018956")),
                     el("items", el("item", el("sku", "book-001") + el("qty", "2")) +
                        el("item", el("sku", "pen-007") + el("qty", "5"))),
                     el("tags", el("item", "gift") + el("item", "fragile")),
                     el("scores", el("item", "1.5") + el("item", "-2e2")),
                     el("metadata", el("score", "42") + el("rank", "7")))),
        "", [("create_order", {"user_id": 42, "urgent": True, "note": "Leave at the front desk.",
                               "shipping": {"city": "Singapore", "zip": 18956},
                               "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
                               "tags": ["gift", "fragile"], "scores": [1.5, -200.0],
                               "metadata": {"score": 42, "rank": 7}})], []),
    "nested_with_newlines_between_tags": (
        block(invoke("create_order", "\n" + el("shipping", "\n" + el("city", "Oslo") + "\n" + el("zip", "150") +
                                                "\n") + "\n")),
        "", [("create_order", {"shipping": {"city": "Oslo", "zip": 150}})], []),
    "json_text_in_parameters": (
        block(invoke("calc", el("opts", ' {"a": [1, {"b": null}]} '), el("vals", "[1, \"two\"]"),
                     el("x", "3.5"))),
        "", [("calc", {"opts": {"a": [1, {"b": None}]}, "vals": [1, "two"], "x": 3.5})], []),
    "values_with_lt_amp_and_newlines": (
        block(invoke("write_file", el("path", "src/main.py"),
                     el("content", "def f(a, b):\n    return a < b && b > 0  # <tag> & </path>\n"))),
        "", [("write_file", {"path": "src/main.py",
                             "content": "def f(a, b):\n    return a < b && b > 0  # <tag> & </path>\n"})], []),
    "value_containing_its_own_closing_tag": (
        block(invoke("write_file", el("path", "p.html"),
                     el("html", "<!DOCTYPE html>\n<html>\n  <body><h2>Hi</h2></body>\n</html>"),
                     el("content", "ends with </content>"))),
        "", [("write_file", {"path": "p.html", "html": "<!DOCTYPE html>\n<html>\n  <body><h2>Hi</h2></body>\n</html>",
                             "content": "ends with </content>"})], []),
    "string_values_are_verbatim": (
        block(invoke("write_file", el("path", " spaced "), el("content", "\n  indented\n"))),
        "", [("write_file", {"path": " spaced ", "content": "\n  indented\n"})], []),
    "typed_scalars": (
        block(invoke("calc", el("x", " -4.25 "), el("n", "5.0"), el("flag", "True"), el("either", "7"),
                     el("level", "2"), el("-n", "3"))),
        "", [("calc", {"x": -4.25, "n": 5, "flag": True, "either": 7, "level": 2, "-n": 3})], []),
    "union_falls_back_to_string_and_null": (
        block(invoke("calc", el("either", "seven"), el("n", "null"))),
        "", [("calc", {"either": "seven", "n": None})], []),
    "empty_object_and_array": (
        block(invoke("calc", el("opts", ""), el("vals", ""))),
        "", [("calc", {"opts": {}, "vals": []})], []),
    "unprefixed_inner_tags": (
        TOOL_CALL_START + '\n<invoke name="get_weather">' + NS + "<city>Paris</city>" + NS + "<days>2</days>"
        + "</invoke>\n" + TOOL_CALL_END,
        "", [("get_weather", {"city": "Paris", "days": 2})], []),
    "unprefixed_wrapper_and_parameter_tags": (
        '<tool_call>\n<invoke name="get_weather"><city>Paris</city>\n<days>2</days></invoke>\n</tool_call>',
        "", [("get_weather", {"city": "Paris", "days": 2})], []),
    "unprefixed_nested_close": (
        block(invoke("create_order", el("shipping", f"{NS}<city>Rome</city>{NS}<zip>100</zip>"))),
        "", [("create_order", {"shipping": {"city": "Rome", "zip": 100}})], []),
    "invoke_without_lt": (
        TOOL_CALL_START + f'\n{NS}invoke name="get_weather">' + el("city", "Lima") + f"{NS}</invoke>\n"
        + TOOL_CALL_END,
        "", [("get_weather", {"city": "Lima"})], []),
    "elided_opening_tag": (
        block(f'{NS}<invoke name="write_file">{NS}offerta.docx{NS}</path>' + el("content", "Hello")
              + f"{NS}</invoke>"),
        "", [("write_file", {"path": "offerta.docx", "content": "Hello"})], []),
    "m2_style_parameters": (
        TOOL_CALL_START + '\n<invoke name="get_weather"><parameter name="city">Paris</parameter>'
        '<parameter name="days">4</parameter></invoke>\n' + TOOL_CALL_END,
        "", [("get_weather", {"city": "Paris", "days": 4})], []),
    "missing_invoke_and_block_closers": (
        TOOL_CALL_START + "\n" + f'{NS}<invoke name="get_weather">' + el("city", "A") + "\n"
        + f'{NS}<invoke name="get_weather">' + el("city", "B") + "\n" + TOOL_CALL_END,
        "", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})], []),
    "wrapper_left_out": (
        "Calling." + invoke("get_weather", el("city", "Kyiv")) + "\nDone.",
        "Calling.Done.", [("get_weather", {"city": "Kyiv"})], ["unclosed_block"]),
    "non_ascii": (
        "Météo à Zürich 😀" + block(invoke("get_weather", el("city", "東京 Zürich 😀"))) + " ✨",
        "Météo à Zürich 😀 ✨", [("get_weather", {"city": "東京 Zürich 😀"})], []),
    # -- malformed output: never raises, degrades to text, reported
    "unknown_function": (
        "Hm." + block(invoke("launch_rocket", el("target", "moon")), invoke("get_weather", el("city", "Rome"))),
        "Hm." + invoke("launch_rocket", el("target", "moon")), [("get_weather", {"city": "Rome"})],
        ["unknown_function"]),
    "bad_typed_value": (
        block(invoke("get_weather", el("city", "Paris"), el("days", "a few"))),
        "", [("get_weather", {"city": "Paris", "days": "a few"})], ["bad_value"]),
    "nested_elements_for_a_scalar": (
        block(invoke("get_weather", el("city", el("name", "Paris")))),
        "", [("get_weather", {"city": el("name", "Paris")})], ["bad_value"]),
    "unclosed_call_mid_parameter": (
        "Sure." + TOOL_CALL_START + "\n" + f'{NS}<invoke name="write_file">' + el("path", "a.py")
        + f"{NS}<content>def f():\n    return",
        "Sure." + f"{NS}<content>def f():\n    return", [("write_file", {"path": "a.py"})], ["unclosed_call"]),
    "unclosed_call_after_header": (
        TOOL_CALL_START + "\n" + f'{NS}<invoke name="get_weather">',
        "", [("get_weather", {})], ["unclosed_call", "missing_parameter"]),
    "unclosed_header": (
        "x" + TOOL_CALL_START + "\n" + f'{NS}<invoke name="get_wea',
        "x" + f'{NS}<invoke name="get_wea', [], ["unclosed_call"]),
    "unclosed_block_after_invokes": (
        block(invoke("get_weather", el("city", "A")))[:-len(TOOL_CALL_END)],
        "", [("get_weather", {"city": "A"})], ["unclosed_block"]),
    "empty_block": (
        "a" + TOOL_CALL_START + "\n" + TOOL_CALL_END + "b", "a" + TOOL_CALL_START + "\n" + TOOL_CALL_END + "b",
        [], ["empty_block"]),
    "bare_tool_call_in_prose": (
        "Wrap calls in a <tool_call> tag.", "Wrap calls in a <tool_call> tag.", [], ["empty_block"]),
    "stray_text_inside_invoke": (
        block(invoke("get_weather", el("city", "Oslo"), "I will also need the [days] here.", el("days", "2"))),
        "I will also need the [days] here.", [("get_weather", {"city": "Oslo", "days": 2})], ["stray_text"]),
    "duplicate_unknown_and_missing_parameters": (
        block(invoke("write_file", el("content", "a"), el("content", "b"), el("mode", "0644"))),
        "", [("write_file", {"content": "a", "mode": "0644"})],
        ["duplicate_parameter", "unknown_parameter", "missing_parameter"]),
    "parameter_closed_by_invoke_end": (
        block(f'{NS}<invoke name="get_weather">' + f"{NS}<city>Paris{NS}</invoke>"),
        "", [("get_weather", {"city": "Paris"})], ["unclosed_parameter"]),
    "nameless_invoke": (
        block(f"{NS}<invoke>" + el("city", "X") + f"{NS}</invoke>"),
        f"{NS}<invoke>" + el("city", "X") + f"{NS}</invoke>", [], ["malformed_invoke"]),
    "stray_marker_in_text": (f"a {NS} b {NS}</x> c", f"a {NS} b {NS}</x> c", [], []),
}


def _calls(result: ToolCallResult) -> list[tuple[str, dict[str, Any]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls]


def _ids() -> Callable[[], str]:
    counter = iter(range(10**6))
    return lambda: f"call_{next(counter)}"


@pytest.mark.parametrize("name", list(CASES))
def test_whole_text(name: str) -> None:
    text, content, calls, issue_kinds = CASES[name]
    result = extract_tool_calls(text, TOOLS)
    assert result.content == content
    assert _calls(result) == calls
    assert [i.kind for i in result.issues] == issue_kinds
    for call in result.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    got_content, got_calls = parse_tool_calls(text, TOOLS)
    assert got_content == (content or None)
    assert [c["function"] for c in got_calls] == [c["function"] for c in result.tool_calls]


def _stream(text_deltas: Sequence[str], tools: Any = TOOLS) -> tuple[ToolCallResult, str, list[dict[str, Any]]]:
    """Stream the deltas; returns the parser's result, joined content deltas, and calls rebuilt from the deltas
    (checking that each call's id and name come first, then only argument fragments)."""
    parser = ToolCallParser(tools, id_factory=_ids())
    content, calls = [], []
    for out in [*(parser.push(d) for d in text_deltas), parser.finish()]:
        content.append(out.content)
        for delta in out.tool_calls:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function"
                assert delta["function"]["arguments"] == ""
                calls.append({"id": delta["id"], "type": "function",
                              "function": {"name": delta["function"]["name"], "arguments": ""}})
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return parser.result(), "".join(content), calls


@pytest.mark.parametrize("name", list(CASES))
def test_streaming_matches_whole_text_at_every_cut(name: str) -> None:
    text = CASES[name][0]
    expected = extract_tool_calls(text, TOOLS, id_factory=_ids())
    for cut in range(len(text) + 1):
        result, content, calls = _stream([text[:cut], text[cut:]])
        assert result == expected, cut
        assert content == expected.content and calls == expected.tool_calls, cut
    result, content, calls = _stream(list(text))
    assert (result, content, calls) == (expected, expected.content, expected.tool_calls)


@pytest.mark.parametrize("name", ["non_ascii", "nested_objects_and_arrays", "unclosed_call_mid_parameter"])
def test_streaming_at_every_utf8_byte(name: str) -> None:
    text = CASES[name][0]
    expected = extract_tool_calls(text, TOOLS, id_factory=_ids())
    data = text.encode()
    for cut in range(len(data) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        result, content, calls = _stream([decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)])
        assert (result, content, calls) == (expected, expected.content, expected.tool_calls), cut


def test_arguments_stream_per_parameter() -> None:
    text = block(invoke("get_weather", el("city", "Paris"), el("days", "3")))
    parser = ToolCallParser(TOOLS, id_factory=lambda: "call_x")
    head = parser.push(text[:text.index(f"{NS}<city>")])
    assert head.tool_calls == [{"index": 0, "id": "call_x", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]
    rest = parser.push(text[text.index(f"{NS}<city>"):])
    assert [d["function"]["arguments"] for d in rest.tool_calls] == ['{"city": "Paris"', ', "days": 3', "}"]
    assert parser.finish() == ("", [])
    assert parser.tool_calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 3}'


def test_no_tools_accepts_any_function_untyped() -> None:
    text = block(invoke("anything", el("n", "5"), el("obj", el("a", "1") + el("a", "2")),
                        el("lst", el("item", "x") + el("item", "y")), el("js", '{"k": true}')))
    result = extract_tool_calls(text, None)
    assert _calls(result) == [("anything", {"n": "5", "obj": {"a": ["1", "2"]}, "lst": ["x", "y"],
                                            "js": {"k": True}})]
    assert result.issues == []
    assert _calls(extract_tool_calls(text, [])) == _calls(result)  # an empty tool list is no tool list


def test_issue_details() -> None:
    text = "Hm." + block(invoke("launch_rocket", el("target", "moon")),
                         invoke("get_weather", el("city", "Paris"), el("days", "many")))
    issues = extract_tool_calls(text, TOOLS).issues
    assert issues[0].kind == "unknown_function" and issues[0].function == "launch_rocket"
    assert issues[0].call_index is None and issues[0].text == f'{NS}<invoke name="launch_rocket">'
    assert issues[1].kind == "bad_value" and issues[1].call_index == 0 and issues[1].function == "get_weather"
    assert issues[1].parameter == "days" and issues[1].text == "many"
    nested = extract_tool_calls(block(invoke("create_order", el("items", el("item", el("qty", "two"))))), TOOLS)
    assert [(i.kind, i.parameter, i.text) for i in nested.issues] == [("bad_value", "items.0.qty", "two")]


def test_tool_call_inside_reasoning_stays_reasoning_and_after_it_is_parsed() -> None:
    call = block(invoke("get_weather", el("city", "Paris")))
    text = f"<mm:think>Maybe {call}? Yes, call it.</mm:think>Checking." + call
    expected_reasoning = f"Maybe {call}? Yes, call it."
    reasoning, content = split_reasoning(text)
    assert reasoning == expected_reasoning
    whole = extract_tool_calls(content, TOOLS, id_factory=_ids())
    assert whole.content == "Checking." and _calls(whole) == [("get_weather", {"city": "Paris"})]

    def pipeline(deltas: Sequence[str]) -> tuple[str, ToolCallResult, list[dict[str, Any]]]:
        """What a server does per delta: reasoning first, its content into the tool parser."""
        rp, tp = ReasoningParser(ReasoningPhase.UNDECIDED), ToolCallParser(TOOLS, id_factory=_ids())
        reasoning_parts, tool_deltas = [], []
        for d in [*deltas, None]:
            r = rp.push(d) if d is not None else rp.finish()
            reasoning_parts.append(r.reasoning)
            out = tp.push(r.content)
            tool_deltas.extend(out.tool_calls)
        tool_deltas.extend(tp.finish().tool_calls)
        return "".join(reasoning_parts), tp.result(), tool_deltas

    for cut in range(len(text) + 1):
        got_reasoning, got, _ = pipeline([text[:cut], text[cut:]])
        assert got_reasoning == expected_reasoning and got == whole, cut
    got_reasoning, got, deltas = pipeline(list(text))
    assert (got_reasoning, got) == (expected_reasoning, whole)
    assert [d["function"].get("name") for d in deltas] == ["get_weather", None, None]


def test_forced_call_prefix() -> None:
    assert forced_call_prefix("get_weather") == ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_weather">'
    assert forced_call_prefix() == ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="'
    for bad in ("", 'a"b', "a>b"):
        with pytest.raises(ValueError):
            forced_call_prefix(bad)
    # What the model then generates completes the call; pushing the prefix first announces it.
    generated = el("city", "Paris") + f"{NS}</invoke>\n{TOOL_CALL_END}"
    parser = ToolCallParser(TOOLS, id_factory=lambda: "call_f")
    announced = parser.push(forced_call_prefix("get_weather"))
    assert announced.tool_calls[0]["function"]["name"] == "get_weather"
    parser.push(generated)
    parser.finish()
    assert _calls(parser.result()) == [("get_weather", {"city": "Paris"})] and parser.content == ""
    # tool_choice="required": the prefix stops inside the name
    assert _calls(extract_tool_calls(forced_call_prefix() + 'get_weather">' + generated, TOOLS)) == [
        ("get_weather", {"city": "Paris"})]


# Calls whose arguments survive M3's rendering (no None values, no empty containers for untyped parameters).
ROUND_TRIP_CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": json.dumps({"city": "Paris", "days": 3})}},
    {"id": "call_2", "type": "function", "function": {"name": "create_order", "arguments": json.dumps({
        "user_id": 7, "urgent": False, "note": "a < b & c\nline 2 </note> <b>bold</b>",
        "shipping": {"city": "Zürich", "zip": 8001},
        "items": [{"sku": "x-1", "qty": 1}, {"sku": "y-2", "qty": 10}], "tags": ["a", "b c"],
        "scores": [0.5, 3.0, -1e-05], "metadata": {"k": 1}}, ensure_ascii=False)}},
    {"id": "call_3", "type": "function", "function": {"name": "calc", "arguments": json.dumps({
        "x": 2.5, "n": 4, "flag": True, "either": "word", "level": 3,
        "opts": {"deep": {"word": "x", "list": ["a", "b"]}}, "vals": [], "-n": -1})}},
    {"id": "call_4", "type": "function", "function": {"name": "write_file",
                                                      "arguments": json.dumps({"path": "", "content": "\n"})}},
]


def test_render_tool_calls_round_trips() -> None:
    text = render_tool_calls(ROUND_TRIP_CALLS)
    assert text.startswith(TOOL_CALL_START + "\n" + f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>')
    assert text.endswith(f"{NS}</invoke>\n{TOOL_CALL_END}")
    result = extract_tool_calls(text, TOOLS)
    assert result.issues == []
    assert _calls(result) == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in ROUND_TRIP_CALLS]
    assert render_tool_calls([]) == ""
    # None values are left out by the template (and so by the renderer): they cannot come back.
    assert render_tool_calls([{"function": {"name": "f", "arguments": {"a": None, "b": 1}}}]) == (
        f'{TOOL_CALL_START}\n{NS}<invoke name="f">{NS}<b>1{NS}</b>{NS}</invoke>\n{TOOL_CALL_END}')


# A chat template with M3's rendering rules for assistant tool calls and tool results (m3-spec.md §6; the
# checkpoint's own chat_template.jinja): written here because the embedded tiny template renders neither.
M3_LIKE_TEMPLATE = m3_like_template(r"""
{{- ']~!b[]~b]system\nThink inside <mm:think></mm:think>. Call tools in ' ~ ns ~ '<tool_call>' ~ ns
    ~ '</tool_call>.[e~[\n' -}}
""", r"""{%- if add_generation_prompt -%}{{- ']~b]ai\n' -}}{%- endif -%}
""")


@pytest.fixture(scope="module")
def tiny_tok() -> M3Tokenizer:
    return M3Tokenizer.from_dir(TINY)


def _conversation(arguments_as_objects: bool) -> list[dict[str, Any]]:
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])
                                if arguments_as_objects else c["function"]["arguments"]}}
             for c in ROUND_TRIP_CALLS]
    return [{"role": "user", "content": "Weather in Paris, then order."},
            {"role": "assistant", "content": "On it.", "reasoning_content": "Two tools needed.",
             "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "call_2", "content": "ordered"}]


def _assistant_turn(rendered: str) -> str:
    start = rendered.index("]~b]ai\n") + len("]~b]ai\n")
    return rendered[start:rendered.index("[e~[", start)]


def test_chat_template_round_trip(tiny_tok: M3Tokenizer) -> None:
    """Render an assistant turn with tool calls through M3Tokenizer and parse it back into the same calls.

    M3's template iterates `arguments.items()`: it needs the arguments as objects, so a server must turn OpenAI's
    JSON-string arguments into objects before rendering (done here by the test)."""
    rendered = tiny_tok.apply_chat_template(_conversation(True), add_generation_prompt=False,
                                            chat_template=M3_LIKE_TEMPLATE)
    assert "]~b]tool\n<response>{\"temp\": 21}</response>\n<response>ordered</response>[e~[\n" in rendered
    turn = _assistant_turn(rendered)
    reasoning, content = split_reasoning(turn)
    assert reasoning == "Two tools needed."
    result = extract_tool_calls(content, TOOLS)
    assert result.content == "On it." and result.issues == []
    assert _calls(result) == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                              for c in ROUND_TRIP_CALLS]
    assert content == "On it." + render_tool_calls(ROUND_TRIP_CALLS)  # the renderer writes what the template does
    # The same text through the tokenizer's ids (special tokens kept) parses the same.
    ids = tiny_tok.encode(turn)
    assert split_reasoning(tiny_tok.decode(ids, skip_special_tokens=False)) == (reasoning, content)


def test_tiny_checkpoint_template_drops_tool_calls(tiny_tok: M3Tokenizer) -> None:
    """The embedded tiny template renders only `content`: an assistant turn's tool calls (and reasoning) are
    dropped, tool results become plain `]~b]tool` turns. So there is nothing to parse back from it."""
    rendered = tiny_tok.apply_chat_template(_conversation(False), add_generation_prompt=False)
    assert rendered == ("]~!b[]~b]user\nWeather in Paris, then order.[e~[\n]~b]ai\nOn it.[e~[\n"
                        ']~b]tool\n{"temp": 21}[e~[\n]~b]tool\nordered[e~[\n')
    assert parse_tool_calls(_assistant_turn(rendered), TOOLS) == ("On it.", [])


_FRAGMENTS = [NS, NS, NS, "<tool_call>", "</tool_call>", '<invoke name="get_weather">', '<invoke name="nope">',
              'invoke name="calc">', "<invoke>", "</invoke>", "<city>", "</city>", "<days>", "</days>", "<x>", "</x>",
              "<item>", "</item>", "<opts>", "</opts>", "Paris", "3", "4.5", "true", " ", "\n", "<", ">", "]", "[",
              "/", "text", "<mm:think>", '{"a": 1}', "é😀"]


def test_random_malformed_output_never_raises_and_streams_exactly() -> None:
    rng = random.Random(25)
    for _ in range(400):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 40)))
        expected = extract_tool_calls(text, TOOLS, id_factory=_ids())
        for call in expected.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        result, content, calls = _stream(pieces)
        assert (result, content, calls) == (expected, expected.content, expected.tool_calls), text
        result, _, _ = _stream(list(text))
        assert result == expected, text


def test_long_value_streams_in_linear_time() -> None:
    """A large file written through a tool, streamed in small deltas, must not re-parse the value per delta."""
    body = "line of code < with & markup </content> inside\n" * 2000  # ~100k characters
    text = block(invoke("write_file", el("path", "big.txt"), el("content", body)))
    parser = ToolCallParser(TOOLS)
    for i in range(0, len(text), 4):
        parser.push(text[i:i + 4])
    parser.finish()
    assert json.loads(parser.tool_calls[0]["function"]["arguments"])["content"] == body


def test_unprefixed_close_followed_by_an_unprefixed_tag() -> None:
    """A bare closing tag followed by an unprefixed tag closes the value only if that tag is one of the function's
    parameters (the model dropped NS from every tag); otherwise both are text of the value."""
    kept = block(invoke("write_file", el("html", "x</html><p>y</p>")))
    assert _calls(extract_tool_calls(kept, TOOLS)) == [("write_file", {"html": "x</html><p>y</p>"})]
    split = block(f'{NS}<invoke name="write_file"><html>x</html><path>a.txt</path>{NS}</invoke>')
    assert _calls(extract_tool_calls(split, TOOLS)) == [("write_file", {"html": "x", "path": "a.txt"})]
    untyped = '<tool_call><invoke name="f"><a>1</a><b>2</b></invoke></tool_call>'
    assert _calls(extract_tool_calls(untyped, None)) == [("f", {"a": "1", "b": "2"})]


def test_odd_values_and_schemas_never_raise() -> None:
    huge = "9" * 5000  # beyond Python's int/str conversion limit
    result = extract_tool_calls(block(invoke("get_weather", el("city", "x"), el("days", huge))), TOOLS)
    assert _calls(result) == [("get_weather", {"city": "x", "days": huge})]
    assert [i.kind for i in result.issues] == ["bad_value"]
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(3000):
        deep = {"anyOf": [deep]}
    odd_tools = [{"type": "function"}, {"function": {"name": "f", "parameters": "not a schema"}}, "nonsense",
                 {"function": {"name": "g", "parameters": {"properties": {"v": deep, "w": {"type": "no-such"}}}}}]
    text = block(invoke("f", el("v", "1")), invoke("g", el("v", "2"), el("w", "3")))
    assert _calls(extract_tool_calls(text, odd_tools)) == [("f", {"v": "1"}), ("g", {"v": "2", "w": "3"})]
    nested = "".join(f"{NS}<a>" for _ in range(200)) + "x" + "".join(f"{NS}</a>" for _ in range(200))
    result = extract_tool_calls(block(invoke("f", el("v", nested))), None)
    assert len(result.tool_calls) == 1


def test_push_after_finish() -> None:
    parser = ToolCallParser(TOOLS)
    parser.finish()
    assert parser.finish() == ("", [])
    with pytest.raises(RuntimeError):
        parser.push("x")
