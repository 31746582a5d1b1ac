"""The servers' APIs with real clients: the generated gRPC stub, the standard health stub, reflection, and the
`openai` package over HTTP; malformed requests get clear 4xx / INVALID_ARGUMENT answers and the server keeps
serving. One `m3jax serve` subprocess for the module."""

import asyncio
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import ServerProcess, model_args, scrape, wait_idle

from serving.http_server import UNSUPPORTED, APIError, check_fields, completion_prompt, parse_body, sampling_params
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    srv = ServerProcess([*model_args(base), "--throughput-log-interval", "1"],
                        tmp_path_factory.mktemp("api") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def info(server):
    async def get():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            return await pb_grpc.M3JaxStub(ch).ModelInfo(pb.ModelInfoRequest())

    return asyncio.run(get())


def _grpc(server, fn):
    async def run():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            return await fn(pb_grpc.M3JaxStub(ch), ch)

    return asyncio.run(run())


async def _collect(stub, req, **kw):
    return [r async for r in stub.Generate(req, **kw)]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ---- no server needed -------------------------------------------------------------------------------------


def test_committed_stubs_match_the_proto(tmp_path):
    """The committed stubs are what grpc_tools makes of m3jax.proto now (regenerate: python -m serving.proto)."""
    from serving.proto import GENERATED, PROTO, generate

    fresh = generate(tmp_path)
    for name, path in zip(GENERATED, fresh, strict=True):
        assert path.read_text() == (PROTO.parent / name).read_text(), f"{name} is stale: python -m serving.proto"


def test_openai_fields_map_to_sampling_params():
    body = {"max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "x", "logprobs": 2,
            "presence_penalty": 0.1, "frequency_penalty": 0.2, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
            "ignore_eos": True, "stop_token_ids": [4], "stream": True, "stream_options": {"include_usage": True}}
    p, opts = sampling_params(body, chat=False, max_model_len=256)
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.logprobs) == (7, 0.0, 0.5, 3, ["x"], 2)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, list(p.stop_token_ids)) == (5, 0.1, 1.1, True, [4])
    assert (p.presence_penalty, p.frequency_penalty) == (0.1, 0.2) and opts.stream and opts.include_usage
    chat, _ = sampling_params({"max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3}, chat=True,
                              max_model_len=256)
    assert (chat.max_tokens, chat.logprobs) == (5, 3)
    assert sampling_params({}, chat=True, max_model_len=256)[0].max_tokens == 256
    assert completion_prompt([[1, 2]]) == [1, 2] and completion_prompt(["a"]) == "a"
    cases = [({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"n": 0}, "n"),
             ({"n": 17}, "n"), ({"best_of": 3}, "best_of"), ({"temperature": "hot"}, "temperature"),
             ({"top_p": 0}, "top_p"), ({"stop": 5}, "stop"), ({"stream_options": {}}, "stream_options"),
             ({"prompt_logprobs": "1"}, "prompt_logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
             ({"logit_bias": {"1": 200}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
             ({"response_format": {"type": "xml"}}, "response_format"), ({"guided_choice": "a"}, "guided_choice"),
             ({"structured_outputs": {"choice": []}}, "structured_outputs")]
    for body, param in cases:
        with pytest.raises(APIError) as e:
            sampling_params(body, chat=False, max_model_len=256)
        assert e.value.param == param and e.value.status == 400, body
    with pytest.raises(APIError, match="top_logprobs"):
        sampling_params({"top_logprobs": 2}, chat=True, max_model_len=256)
    # n, logit_bias, echo and the spellings of structured output.
    p, opts = sampling_params({"n": 3, "best_of": 3, "logit_bias": {"5": -100, "7": 2.5}, "echo": True,
                               "response_format": {"type": "json_object"}}, chat=False, max_model_len=256)
    assert (p.n, p.logit_bias, opts.echo, opts.structured_param) == (3, {5: -100.0, 7: 2.5}, True, "response_format")
    # echo with logprobs: the prompt's tokens get logprobs too (at least as many top entries as asked).
    q, q_opts = sampling_params({"echo": True, "logprobs": 2}, chat=False, max_model_len=256)
    assert (q.prompt_logprobs, q_opts.echo_logprobs, q_opts.prompt_logprobs) == (2, 2, None)
    q, q_opts = sampling_params({"echo": True, "logprobs": 1, "prompt_logprobs": 3}, chat=False, max_model_len=256)
    assert (q.prompt_logprobs, q_opts.echo_logprobs, q_opts.prompt_logprobs) == (3, 1, 3)
    q, q_opts = sampling_params({"prompt_logprobs": 0}, chat=True, max_model_len=256)
    assert (q.prompt_logprobs, q_opts.echo_logprobs, q_opts.prompt_logprobs) == (0, None, 0)
    assert p.structured_outputs.json_object
    for body, param, kind in (({"guided_json": {"type": "object"}}, "guided_json", "json"),
                              ({"guided_regex": "a+"}, "guided_regex", "regex"),
                              ({"guided_choice": ["a", "b"]}, "guided_choice", "choice"),
                              ({"guided_grammar": "start: \"a\""}, "guided_grammar", "grammar"),
                              ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs", "json"),
                              ({"response_format": {"type": "json_schema", "json_schema": {
                                  "name": "n", "schema": {"type": "object"}, "strict": True}}}, "response_format",
                               "json")):
        p, opts = sampling_params(body, chat=True, max_model_len=256)
        assert opts.structured_param == param and getattr(p.structured_outputs, kind), body
    assert sampling_params({"response_format": {"type": "text"}}, chat=True,
                           max_model_len=256)[0].structured_outputs is None
    for bad in (b"\xff{}", b"{", b"[]", b'{"a": NaN}', b'{"prompt": "\\ud800"}'):
        with pytest.raises(APIError):
            parse_body(bad)
    with pytest.raises(APIError, match="batch of 2"):
        completion_prompt(["a", "b"])


def test_unsupported_and_unknown_fields_are_refused_by_name():
    """Every UNSUPPORTED field set to something is a 400 naming it; at its neutral value (or null) it passes;
    OpenAI's bookkeeping fields pass; an unknown field is a 400 naming it."""
    asked = {"echo": True, "suffix": "x", "functions": [{}], "function_call": "auto", "reasoning_effort": "high",
             "include_stop_str_in_output": True, "min_tokens": 3, "allowed_token_ids": [1],
             "bad_words": ["x"], "use_beam_search": True, "truncate_prompt_tokens": 5,
             "continue_final_message": True, "chat_template": "{{ x }}", "documents": [{}],
             "modalities": ["audio"], "audio": {}, "prediction": {}, "web_search_options": {}}
    assert set(asked) == set(UNSUPPORTED), "every unsupported field has a case here"
    for name, value in asked.items():
        with pytest.raises(APIError) as e:
            sampling_params({name: value}, chat=True, max_model_len=256)
        assert e.value.param == name and e.value.status == 400 and name in e.value.message, name
    neutral = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}, "min_tokens": 0, "guided_json": None, "user": "u",
               "metadata": {"a": "b"}, "parallel_tool_calls": False, "functions": [], "function_call": "none"}
    sampling_params(neutral, chat=True, max_model_len=256)
    with pytest.raises(APIError, match="unknown field `max_token`") as e:
        sampling_params({"max_token": 5}, chat=False, max_model_len=256)
    assert e.value.param == "max_token"
    with pytest.raises(APIError, match="unknown field `messages`"):
        check_fields({"messages": []}, frozenset({"prompt"}))
    # max_tokens as set by the client is remembered by name (the model-length check names it); unset: a default.
    assert sampling_params({"max_tokens": 5}, chat=False, max_model_len=256)[1].max_tokens_param == "max_tokens"
    assert sampling_params({"max_completion_tokens": 5}, chat=True,
                           max_model_len=256)[1].max_tokens_param == "max_completion_tokens"
    p, opts = sampling_params({}, chat=False, max_model_len=256)
    assert (p.max_tokens, opts.max_tokens_param) == (16, None)


def test_tokenisation_releases_the_gil_and_equals_encode():
    """M3Tokenizer.encode goes through the binding's encode_batch (which releases the GIL, so worker-thread
    tokenisation lets the event loop run) and gives exactly what the binding's encode gives."""
    from m3jax.api import embedded_model_path
    from serving.tokenizer import M3Tokenizer

    if not (embedded_model_path() / "tokenizer.json").is_file():
        pytest.skip("no embedded tokenizer")
    tok = M3Tokenizer.from_dir(embedded_model_path())
    for text in ("def fibonacci(n):\n    return n", "ünïcödé 漢字 \U0001f600", "", "]~b]user\nhi[e~[\n" * 3):
        assert tok.encode(text) == tok.backend.encode(text, add_special_tokens=False).ids, text


# ---- gRPC ---------------------------------------------------------------------------------------------------


def test_grpc_generate_streams_tokens_text_logprobs_usage(server, info):
    assert info.model == server.model and info.max_model_len == 256 and info.num_pages > 0
    prompt = [t for t in range(3, 40) if t not in info.eos_token_ids][:20]

    async def run(stub, ch):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True))
        return await _collect(stub, req), await _collect(stub, req)

    a, b = _grpc(server, run)
    ids = [t for m in a for t in m.token_ids]
    assert len(ids) == 6 and ids == [t for m in b for t in m.token_ids], "greedy must be deterministic"
    assert list(a[0].prompt_token_ids) == prompt and not a[1].prompt_token_ids
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in a[:-1])
    assert a[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (a[-1].usage.prompt_tokens, a[-1].usage.completion_tokens, a[-1].usage.total_tokens) == (20, 6, 26)
    lps = [lp for m in a for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 2 for lp in lps)
    # Greedy: the chosen token is the most likely one.
    assert all(lp.token_id == max(lp.top, key=lambda t: t.logprob).token_id for lp in lps)
    assert len({m.request_id for m in a}) == 1


def test_grpc_text_chat_and_stop_reasons(server, info):
    if not info.has_tokenizer:
        pytest.skip("the model has no tokenizer")

    async def run(stub, ch):
        text = await _collect(stub, pb.GenerateRequest(
            text="def fibonacci(n):", request_id="my-id-1",
            sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        chat = await _collect(stub, pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="hello")]),
            sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
        first = [t for m in text for t in m.token_ids]
        # Stop on the latest token that has not appeared before it (a trained model may repeat tokens).
        k = max(i for i, t in enumerate(first) if t not in first[:i])
        stopped = await _collect(stub, pb.GenerateRequest(
            text="def fibonacci(n):", sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                  stop_token_ids=[first[k]])))
        return text, chat, stopped, first, k

    text, chat, stopped, first, k = _grpc(server, run)
    assert all(m.request_id == "my-id-1" for m in text)
    assert text[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(first) == 8
    assert chat[-1].usage.completion_tokens >= 1 and chat[0].prompt_token_ids
    assert [t for m in stopped for t in m.token_ids] == first[:k + 1]
    assert stopped[-1].finish_reason == pb.FINISH_REASON_STOP and stopped[-1].stop_token_id == first[k]


def test_grpc_health_and_reflection(server):
    async def run(stub, ch):
        health = health_pb2_grpc.HealthStub(ch)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
        ours = await health.Check(health_pb2.HealthCheckRequest(service="m3jax.v1.M3Jax"))
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        names = []
        async for resp in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names += [s.name for s in resp.list_services_response.service]
        return overall.status, ours.status, names

    overall, ours, names = _grpc(server, run)
    assert overall == ours == health_pb2.HealthCheckResponse.SERVING
    assert "m3jax.v1.M3Jax" in names and "grpc.health.v1.Health" in names


def test_grpc_invalid_arguments_and_server_keeps_serving(server, info):
    long_prompt = [5] * 300
    cases = [
        (pb.GenerateRequest(), "no prompt"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=-3)),
         "max_tokens"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(temperature=-1)),
         "temperature"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, info.vocab_size + 5])), "vocabulary"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=long_prompt)), "model length"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(max_tokens=255)),
         "`max_tokens` is too large: 255. This model's maximum context length is 256 tokens and your request "
         "has 2 input tokens"),
        (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])), "role"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(logprobs=1000)), "logprobs"),
        # This server was started without --enable-prompt-logprobs.
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams(prompt_logprobs=1)),
         "--enable-prompt-logprobs"),
    ]

    async def run(stub, ch):
        got = []
        for req, _ in cases:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _collect(stub, req)
            got.append((e.value.code(), e.value.details()))
        ok = await _collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                     sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)))
        # max_tokens unset: a default (16), lowered to the room a long prompt leaves, not refused.
        room = await _collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 250),
                                                       sampling=pb.SamplingParams(ignore_eos=True)))
        return got, ok, room

    got, ok, room = _grpc(server, run)
    for (code, details), (_, needle) in zip(got, cases, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (code, details)
    assert ok[-1].usage.completion_tokens == 2
    assert room[-1].usage.completion_tokens == 6 and room[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_grpc_abort_rpc_ends_the_stream(server):
    async def run(stub, ch):
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                sampling=pb.SamplingParams(max_tokens=250, ignore_eos=True)))
        first = await call.read()
        found = await stub.Abort(pb.AbortRequest(request_id=first.request_id))
        rest = []
        while (m := await call.read()) is not grpc.aio.EOF:
            rest.append(m)
        missing = await stub.Abort(pb.AbortRequest(request_id="no-such-request"))
        return found.found, rest, missing.found

    found, rest, missing = _grpc(server, run)
    assert found and not missing
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].usage.completion_tokens < 250
    assert wait_idle(server.http_url)["m3jax_kv_pages_in_use"] == 0


# ---- HTTP (the openai package) --------------------------------------------------------------------------------


def test_openai_completions_stream_and_not(server, info):
    client = _client(server)
    prompt = [t for t in range(3, 40) if t not in info.eos_token_ids][:12]
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True}, logprobs=1)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6 and full.usage.prompt_tokens == 12
    assert len(choice.logprobs.token_logprobs) == 6 and len(choice.token_ids) == 6
    chunks = list(client.completions.create(model=server.model, prompt=[prompt], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=1,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in token_chunks) == choice.text
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == choice.token_ids
    streamed = [c.choices[0].logprobs for c in token_chunks if c.choices[0].logprobs is not None]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):  # each chunk has its tokens' own
        assert [x for lp in streamed for x in getattr(lp, field)] == getattr(choice.logprobs, field), field
    assert token_chunks[-1].choices[0].finish_reason == "length"

    # The same greedy request over gRPC gives the same tokens.
    grpc_ids = _grpc(server, lambda stub, ch: _collect(stub, pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=6, temperature=0,
                                                                      ignore_eos=True))))
    assert [t for m in grpc_ids for t in m.token_ids] == choice.token_ids
    if info.has_tokenizer:
        text = client.completions.create(model=server.model, prompt="def fibonacci(n):", max_tokens=4,
                                         temperature=0, seed=1)
        assert text.usage.completion_tokens >= 1


def test_openai_chat_stream_and_not(server, info):
    if not info.has_tokenizer:
        pytest.skip("the model has no tokenizer")
    client = _client(server)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    full = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    c = full.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length" and full.usage.completion_tokens == 5
    assert len(c.logprobs.content) == 5 and all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # Same prompt without the list-of-parts form: the parts were joined with a newline.
    flat = [messages[0], {"role": "user", "content": "hello\nthere"}]
    again = client.chat.completions.create(model=server.model, messages=flat, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == c.message.content


def test_models_health_metrics(server):
    models = _client(server).models.list().data
    assert [m.id for m in models] == [server.model] and models[0].owned_by == "m3jax"
    with urllib.request.urlopen(server.http_url + "/health", timeout=10) as r:
        assert r.status == 200
    m = scrape(server.http_url)
    for name in ("m3jax_num_requests_waiting", "m3jax_num_requests_running", "m3jax_kv_pages_in_use",
                 "m3jax_kv_pages_total", "m3jax_time_to_first_token_seconds_count",
                 "m3jax_time_per_output_token_seconds_count", "m3jax_inter_token_latency_seconds_count",
                 "m3jax_prompt_tokens_total", "m3jax_generation_tokens_total"):
        assert name in m, name
    assert m["m3jax_kv_pages_total"] > 0 and m["m3jax_generation_tokens_total"] > 0


def _post(server, path, data: bytes, headers=None):
    req = urllib.request.Request(server.http_url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_malformed_requests_get_clear_errors(server):
    def body(**kw):
        return json.dumps(kw).encode()

    cases = [
        (b"{not json", 400, None, "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
        (b"[1, 2]", 400, None, "JSON object"),
        (b'{"prompt": "a\\ud800b"}', 400, None, "surrogate"),
        (body(prompt=[1, 2], max_tokens="5"), 400, "max_tokens", "integer"),
        (body(prompt=[1, 2], temperature="hot"), 400, "temperature", "number"),
        (body(prompt=5), 400, "prompt", "prompt"),
        (body(prompt=[1, 2], max_tokens=-4), 400, "max_tokens", "positive"),
        (body(prompt=[1, 2], n=1000), 400, "n", "`n` must be in [1, 16]"),
        (body(prompt=[1, 2], model="gpt-4"), 404, "model", "does not exist"),
        (body(prompt=[7] * 300), 400, "prompt", "model length"),
        (body(prompt=[[1], [2]]), 400, "prompt", "batch of 2"),
        (body(prompt=[1, 2], logprobs=100), 400, "logprobs", "logprobs"),
        # Prompt logprobs (asked for, or needed by echo with logprobs) on a server started without them.
        (body(prompt=[1, 2], prompt_logprobs=1), 400, "prompt_logprobs", "--enable-prompt-logprobs"),
        (body(prompt=[1, 2], echo=True, logprobs=1), 400, "prompt_logprobs", "--enable-prompt-logprobs"),
        (body(prompt=[1, 2], stream="yes"), 400, "stream", "boolean"),
        # Nothing asked for is silently changed: a max_tokens that does not fit, fields this server lacks.
        (body(prompt=[1, 2], max_tokens=255), 400, "max_tokens", "is too large: 255"),
        (body(prompt=[1, 2], tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", "unknown field"),
        (body(prompt=[1, 2], logit_bias={"5": 1000}), 400, "logit_bias", "[-100, 100]"),
        (body(prompt=[1, 2], response_format={"type": "xml"}), 400, "response_format", "json_schema"),
        (body(prompt=[1, 2], suffix="x"), 400, "suffix", "not supported"),
        (body(prompt=[1, 2], max_tokens=2, frobnicate=1), 400, "frobnicate", "unknown field"),
    ]
    for data, status, param, needle in cases:
        got_status, got = _post(server, "/v1/completions", data)
        err = got["error"]
        assert got_status == status and needle in err["message"] and err["param"] == param, (data, got)
        assert set(err) == {"message", "type", "param", "code"}
    status, got = _post(server, "/v1/completions", body(prompt=[1, 2], model="gpt-4"))
    assert got["error"]["code"] == "model_not_found"
    chat_cases = [
        (body(messages="hi"), "messages"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "only text parts"),
        (body(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "logprobs"),
        (body(messages=[{"role": "user", "content": "x"}], max_completion_tokens=1000),
         "`max_completion_tokens` is too large: 1000"),
        (body(messages=[{"role": "user", "content": "x"}], tool_choice="required"), "tool_choice"),
    ]
    for data, needle in chat_cases:
        got_status, got = _post(server, "/v1/chat/completions", data)
        assert got_status == 400 and needle in got["error"]["message"], got
    # Neutral values of unsupported fields, and OpenAI's bookkeeping fields, pass.
    status, ok = _post(server, "/v1/completions", body(prompt=[1, 2, 3], max_tokens=2, n=1, suffix="", logit_bias={},
                                                       echo=False, user="someone", ignore_eos=True))
    assert status == 200 and ok["usage"]["completion_tokens"] == 2
    # openai raises its typed errors for them.
    with pytest.raises(openai.BadRequestError):
        _client(server).completions.create(model=server.model, prompt=[1, 2], max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="nope", prompt=[1, 2])
    # ... and the server keeps serving.
    status, ok = _post(server, "/v1/completions", body(prompt=[1, 2, 3], max_tokens=3, ignore_eos=True))
    assert status == 200 and ok["usage"]["completion_tokens"] == 3
    m = wait_idle(server.http_url)
    assert m["m3jax_requests_in_flight"] == 0
    # Bad requests count as `invalid`; back-pressure (requests_rejected) is another thing and did not happen.
    assert m['m3jax_requests_total{api="http",finish_reason="invalid"}'] >= 3
    assert m["m3jax_requests_rejected_total"] == 0


def test_max_tokens_defaults_fill_the_room_the_prompt_leaves(server, info):
    """Unset max_tokens is not a refusal: chat generates up to the model length (vLLM's default), completions up
    to 16 or the room left."""
    client = _client(server)
    if info.has_tokenizer:
        chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == info.max_model_len
    long = client.completions.create(model=server.model, prompt=[5] * 250, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 6 and long.choices[0].finish_reason == "length"


def test_tokenize_detokenize_version_and_model_card(server, info):
    status, card = _get_json(server, "/v1/models/" + server.model)
    assert status == 200 and card["id"] == server.model and card["max_model_len"] == info.max_model_len
    status, missing = _get_json(server, "/v1/models/no-such-model")
    assert status == 404 and missing["error"]["code"] == "model_not_found"
    status, v = _get_json(server, "/version")
    assert status == 200 and re.fullmatch(r"\d+\.\d+.*", v["version"])
    if not info.has_tokenizer:
        assert _post(server, "/tokenize", json.dumps({"prompt": "x"}).encode())[0] == 400
        return
    status, tok = _post(server, "/tokenize", json.dumps({"model": server.model, "prompt": "def fibonacci(n):",
                                                         "return_token_strs": True}).encode())
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    assert tok["max_model_len"] == info.max_model_len
    status, detok = _post(server, "/detokenize", json.dumps({"tokens": tok["tokens"]}).encode())
    assert status == 200 and detok == {"prompt": "def fibonacci(n):"}
    # The chat form gives exactly the ids a chat completion feeds the model.
    messages = [{"role": "user", "content": "hello"}]
    status, chat_tok = _post(server, "/tokenize", json.dumps({"messages": messages}).encode())
    full = _client(server).chat.completions.create(model=server.model, messages=messages, max_tokens=1,
                                                   extra_body={"return_token_ids": True})
    assert status == 200 and chat_tok["tokens"] == full.choices[0].prompt_token_ids
    for path, bad, param in (("/tokenize", {"prompt": "x", "tools": [{}]}, "tools"),
                             ("/tokenize", {}, "prompt"),
                             ("/detokenize", {"tokens": [info.vocab_size]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, err = _post(server, path, json.dumps(bad).encode())
        assert status == 400 and err["error"]["param"] == param, (path, bad, err)


def _get_json(server, path):
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_vllm_metric_names_parse_with_prometheus_client(server):
    """vLLM's names and labels (what its Grafana dashboards read), beside m3jax's own."""
    _post(server, "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}).encode())
    wait_idle(server.http_url)
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    want = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
            "vllm:kv_cache_usage_perc": "gauge", "vllm:time_to_first_token_seconds": "histogram",
            "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
            "vllm:request_time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
            "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
            "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
            "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
            "vllm:num_preemptions": "counter", "vllm:request_queue_time_seconds": "histogram",
            "vllm:request_prefill_time_seconds": "histogram"}
    for name, kind in want.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels["model_name"] == server.model for s in families[name].samples), name
    # The engine thread's wait for the device, beside its step counters (the rest of its time is host work).
    wait = families["m3jax_engine_device_wait_seconds"]
    assert wait.type == "counter" and wait.samples[0].value > 0

    def value(name, suffix="", **labels):
        return sum(s.value for s in families[name].samples
                   if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("vllm:generation_tokens", "_total") == value("m3jax_generation_tokens", "_total") > 0
    assert value("vllm:time_to_first_token_seconds", "_count") == value("m3jax_time_to_first_token_seconds", "_count")
    assert value("vllm:request_success", "_total", finished_reason="length") > 0
    # The engine's part of each TTFT, split at the first chunk's launch: queue + prefill, never more than the
    # TTFT the server saw (which also holds the front end's work).
    n = value("vllm:time_to_first_token_seconds", "_count")
    assert value("vllm:request_queue_time_seconds", "_count") == value("vllm:request_prefill_time_seconds",
                                                                       "_count") == n
    engine = value("vllm:request_queue_time_seconds", "_sum") + value("vllm:request_prefill_time_seconds", "_sum")
    assert 0 < engine <= value("vllm:time_to_first_token_seconds", "_sum")
    # The rest of it: the request's hand-off to the engine, and its first token's way back to the handler.
    outside = value("m3jax_request_handoff_seconds", "_sum") + value("m3jax_first_token_delivery_seconds", "_sum")
    assert value("m3jax_request_handoff_seconds", "_count") == n and outside > 0
    assert engine + outside == pytest.approx(value("vllm:time_to_first_token_seconds", "_sum"), rel=1e-6)
    assert value("m3jax_request_prefill_time_seconds", "_sum") == value("vllm:request_prefill_time_seconds", "_sum")
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} >= {
        "stop", "length", "abort", "error"}


def test_health_stays_fast_while_huge_prompts_are_refused(server, info):
    """A 20 MB body is refused (413) from its Content-Length; a prompt just under the body limit is tokenised on
    a worker thread with the GIL released and refused (400: far over the model length). Meanwhile /health,
    polled every 10 ms over one keep-alive connection, answers within 100 ms every time."""
    limit = 2**20 + 32 * info.max_model_len  # the default --max-request-body-mb for this model length
    huge = json.dumps({"prompt": "def f(x): return x " * 1_100_000}).encode()
    near = json.dumps({"prompt": ("def f(x): return x " * 100_000)[:limit - 100]}).encode()
    assert len(huge) > 20e6 and limit - 200 < len(near) <= limit

    latencies: list[float] = []
    stop = threading.Event()
    host, port = server.http_url.removeprefix("http://").split(":")

    def probe():
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        while not stop.is_set():
            t = time.monotonic()
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            latencies.append(time.monotonic() - t)
            assert resp.status == 200
            time.sleep(0.01)
        conn.close()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        too_large = _post(server, "/v1/completions", huge)
        t1 = time.monotonic()
        too_long = _post(server, "/v1/completions", near)
        t2 = time.monotonic()
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert too_large[0] == 413 and too_large[1]["error"]["code"] == "request_too_large", too_large
    assert too_long[0] == 400 and "model length" in too_long[1]["error"]["message"], too_long
    assert t1 - t0 < 10 and t2 - t1 < 10
    assert len(latencies) > 10 and max(latencies) < 0.1, sorted(latencies)[-5:]


def test_log_lines_when_output_is_not_a_terminal(server):
    """The fixture's stdout is a pipe and its stderr a file: start-up stages, an access line per request and the
    periodic throughput line (--throughput-log-interval 1) are all there."""
    status, _ = _post(server, "/v1/completions", json.dumps({"prompt": [1, 2, 3], "max_tokens": 2,
                                                              "ignore_eos": True}).encode())
    assert status == 200
    deadline = time.monotonic() + 10
    while "Avg generation throughput: " not in server.log_tail(10**7) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log_tail(10**7)
    for stage in ("INFO m3jax.serve: loading ", "INFO m3jax.serve: model loaded in ",
                  "INFO m3jax.serve: compiling 4 step shapes (8, 16, 32, 64 tokens)",
                  "INFO m3jax.serve: engine ready in ", "INFO m3jax.serve: ready: grpc="):
        assert stage in log, stage
    assert re.search(r'INFO m3jax.access: 127\.0\.0\.1 "POST /v1/completions" 200 [\d.]+s prompt_tokens=3 '
                     r"completion_tokens=2 finish_reason=length request_id=cmpl-", log)
    assert re.search(r"INFO m3jax.access: \S+ gRPC Generate OK [\d.]+s prompt_tokens=\d+", log)
    assert re.search(r"INFO m3jax.stats: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ "
                     r"tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit "
                     r"rate: [\d.]+%", log)
