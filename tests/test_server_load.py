"""The server under load and under faults: 64 concurrent streams (half gRPC, half HTTP) each equal to the same
request run alone, 100 clients that vanish mid-stream, a gRPC deadline; afterwards no request and no KV page is
left behind. One `m3jax serve` subprocess for the module."""

import asyncio

import aiohttp
import grpc
import numpy as np
import openai
import pytest
from serving_helpers import ServerProcess, model_args, scrape, wait_idle

from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(model_args(tmp_path_factory.getbasetemp()), tmp_path_factory.mktemp("load") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def info(server):
    return _model_info(server)


def _requests(info, n, seed):
    """Ragged prompts (1..200 tokens) and max_tokens (1..32), no EOS inside a prompt."""
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(min(info.vocab_size, 4096)) if t not in set(info.eos_token_ids)])
    return [(rng.choice(allowed, int(rng.integers(1, 201))).tolist(), int(rng.integers(1, 33))) for _ in range(n)]


async def _grpc_ids(stub, prompt, max_tokens):
    ids, finish = [], None
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0))
    async for m in stub.Generate(req):
        ids += m.token_ids
        finish = m.finish_reason
    return ids, {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}.get(finish, str(finish))


async def _http_ids(client, model, prompt, max_tokens):
    ids, finish = [], None
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"return_token_ids": True})
    async for chunk in stream:
        if chunk.choices:
            ids += chunk.choices[0].token_ids
            finish = chunk.choices[0].finish_reason or finish
    return ids, finish


def test_64_concurrent_streams_equal_each_request_alone(server, info):
    reqs = _requests(info, 64, seed=0)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.M3JaxStub(ch)

            def one(i):
                prompt, max_tokens = reqs[i]
                if i % 2:
                    return _http_ids(client, server.model, prompt, max_tokens)
                return _grpc_ids(stub, prompt, max_tokens)

            together = await asyncio.gather(*(one(i) for i in range(len(reqs))))
            alone = [await one(i) for i in range(len(reqs))]
        await client.close()
        return together, alone

    together, alone = asyncio.run(run())
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert got == want, f"request {i} ({'http' if i % 2 else 'grpc'}): batched {got} != alone {want}"
        assert got[1] in ("stop", "length") and 1 <= len(got[0]) <= reqs[i][1]
    m = wait_idle(server.http_url)
    assert m["m3jax_kv_pages_in_use"] == 0 and m["m3jax_requests_in_flight"] == 0
    assert m["m3jax_num_requests_running"] == 0 and m["m3jax_num_requests_waiting"] == 0
    after = _model_info(server)
    assert (after.pages_in_use, after.num_running, after.num_waiting, after.requests_in_flight) == (0, 0, 0, 0)
    assert after.num_pages == info.num_pages


def _model_info(server):
    async def get():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            return await pb_grpc.M3JaxStub(ch).ModelInfo(pb.ModelInfoRequest())

    return asyncio.run(get())


def _cancelled(m):
    return sum(v for k, v in m.items() if k.startswith("m3jax_requests_total{") and 'finish_reason="cancelled"' in k)


def test_100_clients_that_vanish_mid_stream_leave_nothing_behind(server, info):
    reqs = _requests(info, 100, seed=1)
    before = _cancelled(scrape(server.http_url))
    # Long enough (ignore_eos, the whole model length) that every request is still running when its client leaves.
    def sampling(prompt):
        return {"max_tokens": info.max_model_len - len(prompt), "temperature": 0, "ignore_eos": True}

    async def http_client(session, prompt):
        async with session.post(server.http_url + "/v1/completions",
                                json={"prompt": prompt, "stream": True, **sampling(prompt)}) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data:"):
                    break
            resp.close()  # drop the connection after the first chunk

    async def grpc_client(stub, prompt):
        call = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                                sampling=pb.SamplingParams(**sampling(prompt))))
        first = await call.read()
        assert first.token_ids
        call.cancel()

    async def run():
        async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.M3JaxStub(ch)
            await asyncio.gather(*(http_client(session, p) if i % 2 else grpc_client(stub, p)
                                   for i, (p, _) in enumerate(reqs)))

    asyncio.run(run())
    m = wait_idle(server.http_url)
    assert m["m3jax_kv_pages_in_use"] == 0 and m["m3jax_requests_in_flight"] == 0, m
    assert m["m3jax_num_requests_running"] == 0 and m["m3jax_num_requests_waiting"] == 0
    assert _cancelled(m) - before == 100
    # Still serving.
    ids, finish = asyncio.run(_one_grpc(server, reqs[0][0], 3))
    assert len(ids) == 3 or finish == "stop"


async def _one_grpc(server, prompt, max_tokens):
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        return await _grpc_ids(pb_grpc.M3JaxStub(ch), prompt, max_tokens)


def test_grpc_deadline_aborts_the_request(server):
    before = _cancelled(scrape(server.http_url))

    async def run():
        got = []
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.M3JaxStub(ch)
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                     sampling=pb.SamplingParams(max_tokens=253, ignore_eos=True))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for m in stub.Generate(req, timeout=0.5):
                    got += m.token_ids
        return e.value.code(), got

    code, got = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 0 < len(got) < 253, "the deadline must pass while the request runs"
    m = wait_idle(server.http_url)
    assert m["m3jax_kv_pages_in_use"] == 0 and m["m3jax_requests_in_flight"] == 0
    assert _cancelled(m) - before == 1
