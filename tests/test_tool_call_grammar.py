"""The tool-call grammar (serving/tool_calls.py `tool_call_grammar`) against the parser it must agree with: every
output the grammar allows, drawn at random from its token masks, parses into calls without issues whose
arguments validate against the tool's JSON schema; the canonical rendering of valid arguments is allowed.

Run with the embedded tokenizer, where `]<]minimax[>[` is text (nine ordinary tokens), and with a copy where it is
one special token, as in M3's vocabulary (the grammar then names it as a token)."""

import json

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from tokenizers import AddedToken, Tokenizer

from m3jax.api import embedded_model_path
from serving.reasoning import split_reasoning
from serving.structured import Grammars, GrammarState, StructuredOutputsParams
from serving.tool_calls import (
    NS,
    extract_tool_calls,
    inline_refs,
    inline_tool_refs,
    render_tool_calls,
    tool_call_grammar,
)

TINY = embedded_model_path()
EOS = 2039

WEATHER = {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "detailed": {"type": "boolean"},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "offset": {"type": "number"},
    "count": {"type": "integer"},
    "where": {"type": "object", "required": ["lat"], "properties": {
        "lat": {"type": "number"}, "name": {"type": ["string", "null"], "maxLength": 8}}},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 5}},
    "stops": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/stop"}},
    "mode": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"const": "auto"}]},
    "note": {"allOf": [{"type": "string"}, {"maxLength": 4}]},
}, "$defs": {"stop": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}}}
TOOLS = inline_tool_refs([{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                     {"type": "function", "function": {"name": "noop"}},
                     {"type": "function", "function": {"name": "pick", "parameters": {
                         "type": "object", "required": ["x"], "properties": {"x": {"enum": [1, 2, "a]b"]}}}}}])
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}


def _tokenizer(ns_special: bool) -> Tokenizer:
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    if ns_special:
        tok.add_special_tokens([AddedToken(NS, special=True, normalized=False)])
    return tok


def _specials(tok: Tokenizer) -> dict[str, int]:
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}


class Walker:
    """Random outputs of a grammar: at each step one token its mask allows, structure-like tokens (`]`, `<`,
    special tokens) preferred so that free text ends, the more so the longer the walk."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.n = tok.get_vocab_size(with_added_tokens=True)
        self.lltok = LLTokenizer(tok.to_str(), n_vocab=self.n, eos_token=[EOS])
        specials = set(_specials(tok).values())
        texts = [tok.decode([i], skip_special_tokens=False) for i in range(self.n)]
        self.weight = np.array([8.0 if (t[:1] in ("]", "<") or i in specials) else 1.0
                                for i, t in enumerate(texts)])

    def walk(self, grammar: str, rng: np.random.Generator, cap: int = 500) -> tuple[list[int], bool]:
        text = LLMatcher.grammar_from_lark(grammar)
        error, messages = LLMatcher.validate_grammar_with_warnings(text, self.lltok)
        assert not error, messages
        m = LLMatcher(self.lltok, text, log_level=0)
        mask = allocate_token_bitmask(1, self.n)
        out: list[int] = []
        for step in range(cap):
            if m.is_stopped():
                return out, True
            fill_next_token_bitmask(m, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:self.n])
            assert len(allowed), "the grammar allows nothing before it is complete"
            if list(allowed) == [EOS]:
                assert m.consume_token(EOS)
                return out, True
            allowed = allowed[allowed != EOS]
            w = self.weight[allowed] ** (1 + step // 100)
            token = int(rng.choice(allowed, p=w / w.sum()))
            assert m.consume_token(token), m.get_error()
            out.append(token)
        return out, False

    def accepts(self, grammar: str, text: str) -> bool:
        m = LLMatcher(self.lltok, LLMatcher.grammar_from_lark(grammar), log_level=0)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return all(m.consume_token(t) for t in ids) and (m.is_accepting() or m.is_stopped())


@pytest.fixture(scope="module", params=[False, True], ids=["ns-text", "ns-special"])
def walker(request):
    return Walker(_tokenizer(request.param))


def _calls(text: str) -> list[tuple[str, dict]]:
    reasoning, content = split_reasoning(text)
    result = extract_tool_calls(content or "", TOOLS)
    assert result.issues == [] and not result.content, (text, result)
    calls = []
    for c in result.tool_calls:
        args = json.loads(c["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[c["function"]["name"]])
        calls.append((c["function"]["name"], args))
    return calls


@pytest.mark.parametrize("kwargs", [{"function": "get_weather"}, {"function": "pick"}, {}, {"parallel": False},
                                    {"optional_thinking": True}], ids=repr)
def test_every_output_of_the_grammar_is_a_valid_call(walker, kwargs):
    grammar = tool_call_grammar(TOOLS, special_tokens=_specials(walker.tok), **kwargs)
    rng = np.random.default_rng(len(repr(kwargs)))
    finished = 0
    for _ in range(5):
        ids, done = walker.walk(grammar, rng)
        if not done:
            continue
        finished += 1
        calls = _calls(walker.tok.decode([i for i in ids if i != EOS], skip_special_tokens=False))
        assert calls
        if "function" in kwargs:
            assert [name for name, _ in calls] == [kwargs["function"]]
        if kwargs.get("parallel") is False or "function" in kwargs:
            assert len(calls) == 1
    assert finished >= 3


def test_the_canonical_rendering_of_valid_arguments_is_allowed(walker):
    args = {"city": "Paris & ]", "days": 3, "unit": "celsius", "detailed": False, "ratio": 0.5, "offset": -1.5e3,
            "where": {"lat": 48.85, "name": "Cité"}, "tags": ["a", "b"], "stops": [{"n": 1}, {"n": 2}],
            "mode": "auto", "note": "hey"}
    specials = _specials(walker.tok)
    named = tool_call_grammar(TOOLS, function="get_weather", special_tokens=specials)
    required = tool_call_grammar(TOOLS, special_tokens=specials)
    single = tool_call_grammar(TOOLS, parallel=False, special_tokens=specials)
    thinking = tool_call_grammar(TOOLS, optional_thinking=True, special_tokens=specials)
    one = render_tool_calls([{"function": {"name": "get_weather", "arguments": args}}])
    two = render_tool_calls([{"function": {"name": "get_weather", "arguments": {"city": "x", "days": 1}}},
                             {"function": {"name": "pick", "arguments": {"x": "a]b"}}}])
    assert _calls(one) == [("get_weather", args)]
    assert walker.accepts(named, one) and walker.accepts(required, one) and walker.accepts(single, one)
    assert walker.accepts(required, two) and not walker.accepts(single, two) and not walker.accepts(named, two)
    assert walker.accepts(thinking, "<mm:think>Let me see.</mm:think>" + two)
    assert walker.accepts(thinking, "</mm:think>" + one) and walker.accepts(thinking, one)
    # What the schema forbids is not allowed: a missing required parameter, a value out of range, a `<`.
    for bad in ({"city": "x"}, {"city": "x", "days": 9}, {"city": "a<b", "days": 1}, {"city": "", "days": 1},
                {"city": "x", "days": 1, "unit": "kelvin"}, {"city": "x", "days": 1, "stops": []}):
        text = render_tool_calls([{"function": {"name": "get_weather", "arguments": bad}}])
        assert not walker.accepts(named, text), bad


def test_schemas_no_call_can_satisfy_are_refused():
    for params, needle in (({"type": "object", "required": ["x"]}, "required parameter"),
                           ({"type": "object", "properties": {"a b": {"type": "string"}}}, "element name"),
                           ({"type": "object", "required": ["x"], "properties": {"x": {"enum": [None, {"a": 1}]}}},
                            "enum"),
                           ({"type": "object", "properties": {"x": {"type": "array", "minItems": 3,
                                                                    "maxItems": 1}}}, "minItems")):
        with pytest.raises(ValueError, match=needle):
            tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": params}}])
    with pytest.raises(ValueError, match="not among"):
        tool_call_grammar(TOOLS, function="nope")
    with pytest.raises(ValueError, match="special tokens"):
        tool_call_grammar(TOOLS, optional_thinking=True, special_tokens={})


def test_inline_refs():
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#/definitions/missing"},
                                               "r": {"$ref": "#/$defs/R"}},
              "$defs": {"A": {"type": "integer"}, "R": {"type": "object", "properties": {"r": {"$ref": "#/$defs/R"}}}}}
    out = inline_refs(schema)
    assert out["properties"]["a"] == {"type": "integer"} and out["properties"]["b"] == {}
    assert SCHEMAS["get_weather"]["properties"]["stops"]["items"]["properties"]["n"] == {"type": "integer"}
    depth, node = 0, out["properties"]["r"]
    while node.get("properties"):  # a recursive schema is cut, not followed forever
        node, depth = node["properties"]["r"], depth + 1
    assert 0 < depth < 20


def test_a_gated_grammar_starts_after_its_token():
    """GrammarState with start_after_token: until that token every token but EOS is allowed and the grammar sees
    nothing; then the grammar constrains, and it finishes the request when complete."""
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    think_end = tok.token_to_id("</mm:think>")
    grammars = Grammars(tok.to_str(), 2048, [EOS])
    gated = grammars.compile(StructuredOutputsParams(choice=["yes"], start_after_token=think_end))
    plain = grammars.compile(StructuredOutputsParams(choice=["yes"]))
    assert isinstance(gated, GrammarState) and gated.gated and not plain.gated
    mask = np.zeros((2, 64), dtype=np.int32)

    def allowed(row):
        return set(np.flatnonzero(np.unpackbits(mask[row].view(np.uint8), bitorder="little")[:2048]))

    grammars.fill_rows([(gated, 0), (plain, 1)], mask)
    assert allowed(0) == set(range(2048)) - {EOS}
    yes = set(allowed(1))
    for t in tok.encode("I think so", add_special_tokens=False).ids:
        gated.accept(t)
        assert not gated.finished
    gated.accept(think_end)
    assert not gated.gated
    grammars.fill_rows([(gated, 0)], mask)
    assert allowed(0) == yes
    for t in tok.encode("yes", add_special_tokens=False).ids:
        gated.accept(t)
    assert gated.finished
    # The same grammar text compiles once: the second request copies the first one's matcher.
    assert len(grammars._built) == 1
    with pytest.raises(ValueError, match="start_after_token"):
        StructuredOutputsParams(choice=["a"], start_after_token=-1).validate()

