"""The servers' APIs with real clients: the generated gRPC stub, the standard health stub, reflection, and the
`openai` package over HTTP; malformed requests get clear 4xx / INVALID_ARGUMENT answers and the server keeps
serving. One `m3jax serve` subprocess for the module."""

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving_helpers import ServerProcess, model_args, scrape, wait_idle

from serving.http_server import APIError, completion_prompt, parse_body, sampling_params
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    srv = ServerProcess(model_args(base), tmp_path_factory.mktemp("api") / "server.log")
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
    cases = [({"max_tokens": "5"}, "max_tokens"), ({"max_tokens": -1}, "max_tokens"), ({"n": 2}, "n"),
             ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"stop": 5}, "stop"),
             ({"stream_options": {}}, "stream_options"), ({"echo": True}, "echo")]
    for body, param in cases:
        with pytest.raises(APIError) as e:
            sampling_params(body, chat=False, max_model_len=256)
        assert e.value.param == param and e.value.status == 400, body
    with pytest.raises(APIError, match="top_logprobs"):
        sampling_params({"top_logprobs": 2}, chat=True, max_model_len=256)
    for bad in (b"\xff{}", b"{", b"[]", b'{"a": NaN}', b'{"prompt": "\\ud800"}'):
        with pytest.raises(APIError):
            parse_body(bad)
    with pytest.raises(APIError, match="batch of 2"):
        completion_prompt(["a", "b"])


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
        (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])), "role"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), sampling=pb.SamplingParams(logprobs=1000)), "logprobs"),
    ]

    async def run(stub, ch):
        got = []
        for req, _ in cases:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _collect(stub, req)
            got.append((e.value.code(), e.value.details()))
        ok = await _collect(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                     sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)))
        return got, ok

    got, ok = _grpc(server, run)
    for (code, details), (_, needle) in zip(got, cases, strict=True):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, (code, details)
    assert ok[-1].usage.completion_tokens == 2


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
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in token_chunks) == choice.text
    assert [t for c in token_chunks for t in c.choices[0].token_ids] == choice.token_ids
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
        (body(prompt=[1, 2], n=1000), 400, "n", "n=1"),
        (body(prompt=[1, 2], model="gpt-4"), 404, "model", "does not exist"),
        (body(prompt=[7] * 300), 400, "prompt", "model length"),
        (body(prompt=[[1], [2]]), 400, "prompt", "batch of 2"),
        (body(prompt=[1, 2], logprobs=100), 400, "logprobs", "logprobs"),
        (body(prompt=[1, 2], stream="yes"), 400, "stream", "boolean"),
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
    ]
    for data, needle in chat_cases:
        got_status, got = _post(server, "/v1/chat/completions", data)
        assert got_status == 400 and needle in got["error"]["message"], got
    # openai raises its typed errors for them.
    with pytest.raises(openai.BadRequestError):
        _client(server).completions.create(model=server.model, prompt=[1, 2], max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        _client(server).completions.create(model="nope", prompt=[1, 2])
    # ... and the server keeps serving.
    status, ok = _post(server, "/v1/completions", body(prompt=[1, 2, 3], max_tokens=3, ignore_eos=True))
    assert status == 200 and ok["usage"]["completion_tokens"] == 3
    assert wait_idle(server.http_url)["m3jax_requests_in_flight"] == 0
