"""What users send to an M3 server, with the `openai` package (and the gRPC stub) against a real `m3jax serve` on
127.0.0.1: prefix caching, forced tool calls, structured output, n > 1, logit_bias, echo, the reasoning split
and thinking_mode, tool calls parsed from generated text, tool results rendered back.

The server runs a copy of the test checkpoint with an M3-like chat template (tools, thinking_mode, assistant tool
calls, tool results; the embedded template renders none of them) and with `]<]minimax[>[` as a special token, as
in M3's vocabulary (it takes the id of the embedded tokenizer's unused `<think>`). The tiny model never writes
M3's markers by itself, so outputs that need them are forced with grammars (`structured_outputs`) and logit
biases. One server for the module; the engine settings are those of every server test (shared compiled steps).
"""

import asyncio
import json
import random
import types

import grpc
import jsonschema
import numpy as np
import openai
import pytest
from serving_helpers import ServerProcess, checkpoint_copy, m3_like_template, scrape, wait_idle

from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc
from serving.tokenizer import M3Tokenizer
from serving.tool_calls import NS

TEMPLATE = m3_like_template(r"""{{- ']~!b[' -}}
{%- if tools -%}
{{- ']~b]system\n' -}}
{%- for t in tools -%}
{{- t.function.name ~ '(' ~ (t.function.parameters.properties.keys() | join(',')) ~ ')\n' -}}
{%- endfor -%}
{{- '[e~[\n' -}}
{%- endif -%}
""", r"""{%- if add_generation_prompt -%}
{{- ']~b]ai\n' -}}
{%- if thinking_mode == 'enabled' -%}{{- '<mm:think>' -}}
{%- elif thinking_mode == 'disabled' -%}{{- '</mm:think>' -}}{%- endif -%}
{%- endif -%}
""")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 6},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]},
}}
BOOK = {"type": "object", "additionalProperties": False, "required": ["guests", "vip"], "properties": {
    "guests": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0,
                                                                           "maximum": 120}}}},
    "vip": {"type": "boolean"},
}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book", "parameters": BOOK}}]
SCHEMAS = {"get_weather": WEATHER, "book": BOOK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_copy(tmp_path_factory.getbasetemp(), "m3-like-checkpoint", TEMPLATE, {2042: NS})


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = ServerProcess(["--model", str(ckpt), "--throughput-log-interval", "0", "--enable-prompt-logprobs"],
                        tmp_path_factory.mktemp("features") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def tok(ckpt):
    return M3Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def ids(tok):
    names = {"ns": NS, "think": "<mm:think>", "unthink": "</mm:think>", "call": "<tool_call>",
             "uncall": "</tool_call>", "eot": "[e~["}
    return types.SimpleNamespace(**{k: tok.token_to_id(v) for k, v in names.items()})


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _grpc(server, fn):
    async def run():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            return await fn(pb_grpc.M3JaxStub(ch))

    return asyncio.run(run())


def _collect_grpc(server, req):
    async def run(stub):
        return [m async for m in stub.Generate(req)]

    return _grpc(server, run)


def _streamed_calls(chunks, index=0):
    """OpenAI streaming tool-call deltas of one choice joined into whole calls (and checked for their shape)."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch.choices:
            if choice.index != index:
                continue
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _check_call(name, arguments):
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


# ---- prefix caching ----------------------------------------------------------------------------------------


def test_prefix_cache_hits_are_counted_and_greedy_output_is_unchanged(server):
    """The same long prompt twice: the first is computed in full (no hits), the second starts from its cached
    pages (hits counted in tokens, under m3jax's and vLLM's names), and greedy output is the same token for
    token. A prompt sharing only the prefix hits those pages too."""
    client = _client(server)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 2000) for _ in range(100)]

    def hits():
        m = scrape(server.http_url)
        vllm = sum(v for k, v in m.items() if k.startswith("vllm:prefix_cache_hits_total"))
        assert vllm == m["m3jax_prefix_cache_hits_total"]
        return m["m3jax_prefix_cache_hits_total"], m["m3jax_prefix_cache_queries_total"]

    def run(p):
        out = client.completions.create(model=server.model, prompt=p, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        wait_idle(server.http_url)
        return out.choices[0].token_ids

    h0, q0 = hits()
    cold = run(prompt)
    h1, q1 = hits()
    warm = run(prompt)
    h2, q2 = hits()
    assert h1 == h0 and q1 > q0, "a prompt never seen before hits nothing"
    assert h2 - h1 >= 96, "the second time, the prompt's full pages (6 of 16 tokens) come from the cache"
    assert warm == cold
    run(prompt[:96] + [5, 6, 7, 8])
    assert hits()[0] - h2 >= 96


# ---- tool calls --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_calls_have_valid_arguments(server, temperature):
    """tool_choice naming a function, and "required": constrained decoding makes the reply a call whose JSON
    arguments validate against the tool's schema, whole and streamed."""
    client = _client(server)
    seed = {"seed": 5} if temperature else {}
    named = {"type": "function", "function": {"name": "book"}}
    for choice, parallel in ((named, True), ("required", False)):
        kw = dict(model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=190,
                  temperature=temperature, parallel_tool_calls=parallel, **seed)
        full = client.chat.completions.create(**kw)
        c = full.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if choice is named:
            assert call.function.name == "book"
        _check_call(call.function.name, call.function.arguments)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        streamed = _streamed_calls(chunks)
        assert [(s["name"], json.loads(s["arguments"])) for s in streamed] == [
            (call.function.name, json.loads(call.function.arguments))]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)


def _call_grammar(ids, *calls, prefix="Sure."):
    """A Lark grammar that makes the model write exactly `prefix` and these invokes (name, {key: regex}) in M3's
    format, the markers as their special tokens."""
    ns = f"<[{ids.ns}]>"
    invokes = []
    for name, params in calls:
        body = " ".join(f'{ns} "<{k}>" /{rx}/ {ns} "</{k}>"' for k, rx in params.items())
        invokes.append(f'{ns} "<invoke name=\\"{name}\\">" {body} {ns} "</invoke>\\n"')
    return f'start: "{prefix}" {ns} <[{ids.call}]> "\\n" {" ".join(invokes)} {ns} <[{ids.uncall}]>'


def test_tool_calls_parsed_from_generated_text(server, ids):
    """tool_choice auto: M3's format in the output (forced here by a grammar, as the tiny model never writes it)
    becomes `tool_calls` typed by the schema, with content before it; streamed in OpenAI's delta shape. With
    tool_choice none the same text stays text (its markers removed, as special tokens are by default)."""
    client = _client(server)
    grammar = _call_grammar(ids, ("get_weather", {"city": "[A-Z][a-z]{2,4}", "days": "[1-7]"}))
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, max_tokens=150, temperature=0,
              extra_body={"structured_outputs": {"grammar": grammar}})
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.message.content == "Sure." and c.finish_reason == "tool_calls"
    [call] = c.message.tool_calls
    args = _check_call("get_weather", call.function.arguments)
    assert isinstance(args["days"], int)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Sure."
    assert [(s["name"], s["arguments"]) for s in _streamed_calls(chunks)] == [
        ("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = client.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason == "stop"
    assert plain.message.content.startswith("Sure.\n<invoke name=\"get_weather\"><city>") and NS not in \
        plain.message.content


def test_parallel_tool_calls_false_stops_after_the_first_call(server, ids):
    """tool_choice auto with parallel_tool_calls false: generation ends where the first invoke closes, so a reply
    has at most one call (here the grammar would write two)."""
    client = _client(server)
    grammar = _call_grammar(ids, ("get_weather", {"city": "Rome", "days": "2"}),
                            ("get_weather", {"city": "Oslo", "days": "3"}))
    kw = dict(model=server.model, messages=ASK, tools=TOOLS, max_tokens=180, temperature=0,
              extra_body={"structured_outputs": {"grammar": grammar}})
    both = client.chat.completions.create(**kw).choices[0]
    assert [json.loads(t.function.arguments)["city"] for t in both.message.tool_calls] == ["Rome", "Oslo"]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [json.loads(t.function.arguments) for t in one.message.tool_calls] == [{"city": "Rome", "days": 2}]
    assert one.finish_reason == "tool_calls" and one.model_extra.get("stop_reason") is None


def test_tool_results_and_calls_render_back_through_the_template(server, tok):
    """An assistant turn's tool calls (OpenAI's JSON-string arguments) and the tool results go through the
    checkpoint's template: /tokenize shows them in M3's format, and a chat completion feeds exactly those ids."""
    client = _client(server)
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    import urllib.request

    req = urllib.request.Request(server.http_url + "/tokenize", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"messages": messages, "tools": TOOLS}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        tokens = json.loads(r.read())["tokens"]
    text = tok.decode(tokens, skip_special_tokens=False)
    assert (f'{NS}<tool_call>\n{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>'
            f'{NS}</invoke>\n{NS}</tool_call>[e~[\n]~b]tool\n<response>{{"temp": 21}}</response>[e~[\n]~b]ai\n'
            ) in text
    assert text.startswith("]~!b[]~b]system\nget_weather(city,days,unit)\nbook(guests,vip)\n")
    out = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, max_tokens=2,
                                         extra_body={"return_token_ids": True})
    assert out.choices[0].prompt_token_ids == tokens


def test_tool_requests_that_cannot_be_honoured_are_refused(server):
    client = _client(server)
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
        (dict(tool_choice="required"), "tool_choice", "needs `tools`"),
        (dict(tools=[{"type": "retrieval"}]), "tools", "only function tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                     "required": ["x"]}}}],
              tool_choice="required"), "tools", "required parameter"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
         "both constrain"),
        (dict(functions=[{"name": "f"}]), "functions", "send `tools`"),
    ]
    for kw, param, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **kw)
        err = e.value.body
        assert err["param"] == param and needle in err["message"], (kw, err)


# ---- structured output -------------------------------------------------------------------------------------

REPLY = {"type": "object", "additionalProperties": False, "required": ["answer", "score", "tags"], "properties": {
    "answer": {"type": "string", "enum": ["yes", "no"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 10},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}},
}}


def test_json_schema_reply_parses_and_validates(server):
    client = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY, "strict": True}}
    for temperature, seed in ((0.0, None), (1.0, 3)):
        full = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=120,
                                              temperature=temperature, seed=seed, response_format=fmt)
        c = full.choices[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), REPLY)
    chunks = list(client.chat.completions.create(model=server.model, messages=ASK, max_tokens=120, temperature=0,
                                                 response_format=fmt, stream=True))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(streamed), REPLY)
    obj = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=120, temperature=0,
                                         response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(obj), dict)
    # vLLM's spellings, on completions too.
    kinds = [({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
             ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
             ({"structured_outputs": {"json": REPLY}}, lambda t: jsonschema.validate(json.loads(t), REPLY) is None),
             ({"guided_json": json.dumps(REPLY)}, lambda t: jsonschema.validate(json.loads(t), REPLY) is None)]
    for extra, ok in kinds:
        text = client.completions.create(model=server.model, prompt="x = ", max_tokens=100, temperature=0,
                                         extra_body=extra).choices[0].text
        assert ok(text), (extra, text)


def test_invalid_structured_output_is_a_400_naming_the_field(server):
    client = _client(server)
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}},
              "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
             ({"response_format": {"type": "yaml"}}, "response_format"),
             ({"guided_regex": "(unclosed"}, "guided_regex"),
             ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
             ({"guided_json": "{not json"}, "guided_json"),
             ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
             ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
             ({"response_format": {"type": "json_object"}, "guided_regex": "b"}, "guided_regex")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    assert wait_idle(server.http_url)["m3jax_kv_pages_in_use"] == 0


# ---- n, logit_bias, echo -----------------------------------------------------------------------------------


def test_n_returns_n_choices_streamed_and_not(server):
    client = _client(server)
    kw = dict(model=server.model, max_tokens=6, temperature=1.0, seed=11, n=2)
    full = client.chat.completions.create(messages=ASK, **kw, extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1] and full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(messages=ASK, **kw, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == full.choices[i].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    done = client.completions.create(prompt="def f(x):", **kw, extra_body={"ignore_eos": True,
                                                                           "return_token_ids": True})
    assert [c.index for c in done.choices] == [0, 1] and done.usage.completion_tokens == 12
    assert done.choices[0].token_ids != done.choices[1].token_ids  # independent draws (seed + index)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(prompt="x", model=server.model, n=1, best_of=3)


def test_logit_bias_forces_and_bans_tokens(server, tok):
    client = _client(server)
    token = tok.encode(" fish")[0]
    out = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=4, temperature=0,
                                    logit_bias={str(token): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == [token] * 4
    chat = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=3, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == tok.decode([token]) * 3
    greedy = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0].token_ids[0]
    banned = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=1, temperature=0,
                                       logit_bias={str(greedy): -100}, extra_body={"return_token_ids": True})
    assert banned.choices[0].token_ids[0] != greedy
    for bad in ({"abc": 1}, {"5": 101}, {"5": True}, {"-3": 1}, {str(tok.vocab_size + 10**6): 1},
                {str(i): 1 for i in range(301)}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=server.model, prompt="x", max_tokens=1, logit_bias=bad)
        assert e.value.body["param"] == "logit_bias", (bad, e.value.body)


def test_echo_puts_the_prompt_before_the_completion(server):
    client = _client(server)
    plain = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "def f(x):" + plain.choices[0].text
    chunks = list(client.completions.create(model=server.model, prompt="def f(x):", max_tokens=4, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    assert chunks[0].choices[0].text.startswith("def f(x):")


def _plp_values(entries, prompt):
    """vLLM's prompt_logprobs list -> [(logprob, rank)] of the prompt's own tokens, checking its shape."""
    assert len(entries) == len(prompt) and entries[0] is None
    out = []
    for p, e in enumerate(entries[1:], start=1):
        mine = e[str(prompt[p])]
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        out.append((mine["logprob"], mine["rank"]))
    return out


def test_prompt_logprobs_on_both_endpoints_and_grpc(server, tok):
    """`prompt_logprobs` (vLLM's field) per completions choice, at the top of a chat answer and on the first
    streamed chunk; echo with logprobs leads the legacy logprobs with the prompt's; gRPC's first message carries
    the same values."""
    client = _client(server)
    prompt = tok.encode("def f(x): return x * 2")
    out = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    entries = out.choices[0].prompt_logprobs
    values = _plp_values(entries, prompt)
    # The top 2 (ranks 1 and 2), and the prompt's token beside them when it is not one of them.
    assert [len(e) for e in entries[1:]] == [2 if rank <= 2 else 3 for _, rank in values]
    assert all(sorted(v["rank"] for k, v in e.items() if k != str(t)) in ([1, 2], [1], [2])
               for e, t in zip(entries[1:], prompt[1:], strict=True))
    assert all(lp <= 0 for lp, _ in values)

    streamed = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0,
                                              stream=True, extra_body={"prompt_logprobs": 2}))
    firsts = [c for c in streamed if getattr(c.choices[0], "prompt_logprobs", None)]
    assert len(firsts) == 1 and firsts[0] is streamed[0]
    assert _plp_values(firsts[0].choices[0].prompt_logprobs, prompt) == values

    echoed = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=1)
    lp = echoed.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(prompt)], [v for v, _ in values], rtol=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens) == echoed.choices[0].text
    assert not hasattr(echoed.choices[0], "prompt_logprobs") or echoed.choices[0].prompt_logprobs is None

    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    chat_prompt = chat.model_extra["prompt_logprobs"]
    assert chat_prompt[0] is None and all(len(e) == 1 for e in chat_prompt[1:])
    chat_chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0, stream=True,
        extra_body={"prompt_logprobs": 0}))
    with_plp = [c for c in chat_chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(with_plp) == 1 and with_plp[0].model_extra["prompt_logprobs"] == chat_prompt

    # Both at once: each keeps its own number of top entries (the engine computes the larger).
    both = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                     logprobs=1, extra_body={"prompt_logprobs": 3})
    assert all(len(t) == 1 for t in both.choices[0].logprobs.top_logprobs[1:])
    assert all(sum(v["rank"] <= 3 for v in e.values()) == 3 for e in both.choices[0].prompt_logprobs[1:])

    msgs = _collect_grpc(server, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=3, temperature=0, prompt_logprobs=2)))
    assert len(msgs[0].prompt_logprobs) == len(prompt) - 1 and not any(m.prompt_logprobs for m in msgs[1:])
    assert [e.token_id for e in msgs[0].prompt_logprobs] == prompt[1:]
    np.testing.assert_allclose([e.logprob for e in msgs[0].prompt_logprobs], [v for v, _ in values], rtol=1e-5)
    assert [e.rank for e in msgs[0].prompt_logprobs] == [r for _, r in values]


# ---- reasoning ---------------------------------------------------------------------------------------------


def test_reasoning_is_split_streamed_and_not(server, ids):
    """A reply that thinks (`<mm:think>` ... `</mm:think>`, forced by a grammar) comes back with the thinking in
    reasoning_content and the rest in content, whole and in streaming deltas. Marker text in the prompt (an
    earlier turn's thinking, a user quoting the markers) is not generated text and changes nothing."""
    client = _client(server)
    grammar = (f'start: <[{ids.think}]> /[a-z]{{2,6}}( [a-z]{{2,6}}){{2,3}}/ <[{ids.unthink}]> '
               f'/[A-Z][a-z]{{2,6}}( [a-z]{{2,6}}){{1,2}}[.]/')
    kw = dict(model=server.model, max_tokens=80, temperature=0, extra_body={"structured_outputs": {"grammar":
                                                                                                   grammar}})
    history = [{"role": "user", "content": "Say <mm:think> to me"},
               {"role": "assistant", "content": "Done.", "reasoning_content": "Quoted markers."}, *ASK]
    for messages in (ASK, history):
        c = client.chat.completions.create(messages=messages, **kw).choices[0]
        reasoning, content = c.message.model_extra["reasoning_content"], c.message.content
        assert reasoning and content and content[0].isupper() and content.endswith("."), c.message
        assert "<mm:think>" not in reasoning + content and "</mm:think>" not in reasoning + content
        chunks = list(client.chat.completions.create(messages=messages, **kw, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
        assert "".join(d.content or "" for d in deltas) == content
    # Without markers in the output nothing is reasoning (the prompt's markers are not read as generated).
    plain = client.chat.completions.create(model=server.model, messages=history, max_tokens=5, temperature=0)
    assert plain.choices[0].message.model_extra["reasoning_content"] is None


def test_thinking_mode_reaches_the_template_and_grammars_start_after_the_thinking(server, ids):
    client = _client(server)

    def prompt_tail(mode):
        out = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=1,
                                             extra_body={"return_token_ids": True,
                                                         "chat_template_kwargs": {"thinking_mode": mode}})
        return out.choices[0].prompt_token_ids[-1]

    assert prompt_tail("enabled") == ids.think and prompt_tail("disabled") == ids.unthink
    assert prompt_tail("adaptive") not in (ids.think, ids.unthink)
    enabled = {"chat_template_kwargs": {"thinking_mode": "enabled"}}
    # The prompt opened the block: everything generated is reasoning until `</mm:think>`.
    c = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=6, temperature=0,
                                       extra_body=enabled).choices[0]
    assert c.message.content is None and c.message.model_extra["reasoning_content"]
    # A forced call (and a JSON schema) apply after the reasoning: the gate lets `</mm:think>` through (biased
    # here, as the tiny model does not end its thinking), then the grammar makes the call.
    bias = {str(ids.unthink): 100}
    c = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=190, temperature=0,
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       logit_bias=bias, extra_body=enabled).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.model_extra["reasoning_content"] is None
    _check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": REPLY}}
    c = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=120, temperature=0,
                                       response_format=fmt, logit_bias=bias, extra_body=enabled).choices[0]
    jsonschema.validate(json.loads(c.message.content), REPLY)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=ASK, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"thinking_mode": "sometimes"}})
    assert e.value.body["param"] == "chat_template_kwargs"


# ---- gRPC --------------------------------------------------------------------------------------------------


def test_grpc_n_logit_bias_and_structured_output(server, tok):
    token = tok.encode(" fish")[0]
    msgs = _collect_grpc(server, pb.GenerateRequest(text="def f(x):", sampling=pb.SamplingParams(
        max_tokens=3, n=2, temperature=1.0, seed=2, logit_bias={token: 100.0})))
    by_choice = {i: [t for m in msgs if m.index == i for t in m.token_ids] for i in (0, 1)}
    assert by_choice == {0: [token] * 3, 1: [token] * 3}
    assert [m.finish_reason for m in msgs if m.finish_reason] == [pb.FINISH_REASON_LENGTH] * 2
    assert msgs[-1].usage.completion_tokens == 6 and sum(m.HasField("usage") for m in msgs) == 1
    schema = pb.StructuredOutputs(json_schema=json.dumps(REPLY))
    msgs = _collect_grpc(server, pb.GenerateRequest(text="x = ", sampling=pb.SamplingParams(
        max_tokens=120, temperature=0, structured_outputs=schema)))
    jsonschema.validate(json.loads("".join(m.text for m in msgs)), REPLY)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    choice = pb.StructuredOutputs(choice=pb.Choices(choices=["left", "right"]))
    msgs = _collect_grpc(server, pb.GenerateRequest(text="x = ", sampling=pb.SamplingParams(
        max_tokens=20, temperature=0, structured_outputs=choice)))
    assert "".join(m.text for m in msgs) in ("left", "right")

    async def refused(stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub, pb.GenerateRequest(text="x", sampling=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(regex="(unclosed"))))
        return e.value

    async def _collect(stub, req):
        return [m async for m in stub.Generate(req)]

    err = _grpc(server, refused)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs" in err.details()


def test_grpc_chat_tools_and_reasoning(server, ids):
    tools = [pb.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"]))
             for t in TOOLS]
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])], tools=tools,
                   tool_choice_function="get_weather")
    msgs = _collect_grpc(server, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=150,
                                                                                        temperature=0)))
    deltas = [d for m in msgs for d in m.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_")
    _check_call("get_weather", "".join(d.arguments for d in deltas))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS and not "".join(m.text for m in msgs)
    grammar = f'start: <[{ids.think}]> "let me see" <[{ids.unthink}]> "Paris."'
    msgs = _collect_grpc(server, pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                     chat_template_kwargs={"thinking_mode": "adaptive"}),
        sampling=pb.SamplingParams(max_tokens=40, temperature=0,
                                   structured_outputs=pb.StructuredOutputs(grammar=grammar))))
    assert "".join(m.reasoning_text for m in msgs) == "let me see" and "".join(m.text for m in msgs) == "Paris."

    async def refused(stub):
        errors = []
        for chat in (pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")],
                             chat_template_kwargs={"thinking_mode": "sometimes"}),
                     pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], tool_choice_function="nope"),
                     pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], tools=tools,
                             tool_choice_mode="required"),
                     ):
            req = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(
                max_tokens=4, structured_outputs=pb.StructuredOutputs(json_object=True)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in stub.Generate(req)]
            errors.append((e.value.code(), e.value.details()))
        return errors

    for (code, details), needle in zip(_grpc(server, refused), ("thinking_mode", "nope", "both constrain"),
                                       strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
