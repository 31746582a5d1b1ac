"""A server with an API key and a tiny admission limit (--max-queue 2): authentication, back-pressure (429 /
RESOURCE_EXHAUSTED at once, with Retry-After, never a hang), `m3jax bench serve` against it, JSON logs, and
graceful shutdown on SIGTERM (in-flight requests finish, exit code 0). One `m3jax serve` subprocess for the module;
the last test stops it. Besides it, short-lived servers: a signal at each moment of start-up (loading weights,
compiling, just before ready) ends the process with exit 0 within 5 s, and a port in use fails before the model
loads."""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from serving_helpers import REPO, ServerProcess, model_args, serve_command, serve_env, wait_for_log, wait_idle

from serving.bench import RequestResult, compute_metrics, make_workload
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)
LONG = {"max_tokens": 253, "temperature": 0, "ignore_eos": True}  # 3-token prompts fill the 256-token model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess([*model_args(tmp_path_factory.getbasetemp()), "--max-queue", "2", "--log-format", "json"],
                        tmp_path_factory.mktemp("lifecycle") / "server.log", env={"M3JAX_API_KEY": KEY})
    yield srv
    srv.kill()


def _status(url, headers=None, data=None):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bench_metrics_arithmetic():
    rs = [RequestResult(True, 10, 5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
          RequestResult(True, 10, 3, ttft=0.2, e2e=0.4, itl=[0.1] * 2), RequestResult(False, error="x")]
    m = compute_metrics(rs, duration=2.0, num_gpus=2)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (2, 1, 8)
    assert m["output_throughput"] == 4.0 and m["output_throughput_per_gpu"] == 2.0
    assert m["median_tpot_ms"] == pytest.approx(100.0) and m["interactivity"] == pytest.approx(10.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_e2el_ms"] == pytest.approx(450.0)
    w = make_workload(50, 100, 10, 0.8, seed=0, vocab_size=64, avoid_ids=frozenset({3}))
    assert all(80 <= len(p) <= 100 and 3 not in p for p in w.prompts) and all(8 <= n <= 10 for n in w.output_lens)


def test_api_key_is_required(server):
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    url = server.http_url + "/v1/completions"
    assert _status(url, data=body)[0] == 401
    status, err = _status(url, {"Authorization": "Bearer wrong"}, body)
    assert status == 401 and err["error"]["code"] == "invalid_api_key"
    assert _status(url, AUTH, body)[0] == 200
    assert _status(server.http_url + "/health")[0] == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0).models.list()

    async def run():
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.M3JaxStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ModelInfo(pb.ModelInfoRequest())
            info = await stub.ModelInfo(pb.ModelInfoRequest(), metadata=GRPC_AUTH)
            return e.value.code(), info

    code, info = asyncio.run(run())
    assert code == grpc.StatusCode.UNAUTHENTICATED and info.max_queue == 2


def test_overload_is_refused_at_once(server):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session, \
                grpc.aio.insecure_channel(server.grpc_target) as ch:
            stub = pb_grpc.M3JaxStub(ch)
            # Fill both admission slots with long streams, one per protocol, and wait for their first tokens.
            held = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                                    sampling=pb.SamplingParams(**LONG)), metadata=GRPC_AUTH)
            assert (await held.read()).token_ids
            resp = await session.post(server.http_url + "/v1/completions",
                                      json={"prompt": [4, 5, 6], "stream": True, **LONG})
            assert resp.status == 200 and (await resp.content.readline()).startswith(b"data:")

            t0 = time.monotonic()
            refused = await session.post(server.http_url + "/v1/chat/completions",
                                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            http_status, http_body, retry_after = refused.status, await refused.json(), refused.headers
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])),
                                             metadata=GRPC_AUTH):
                    pass
            elapsed = time.monotonic() - t0
            held.cancel()
            resp.close()
            return http_status, http_body, retry_after.get("Retry-After"), e.value, elapsed

    http_status, http_body, retry_after, error, elapsed = asyncio.run(run())
    assert http_status == 429 and "limit of 2" in http_body["error"]["message"] and retry_after == "1"
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("grpc-retry-pushback-ms", "1000") in tuple(error.trailing_metadata())
    assert elapsed < 5.0, "a refusal must be immediate"
    m = wait_idle(server.http_url)
    assert m["m3jax_kv_pages_in_use"] == 0 and m["m3jax_requests_rejected_total"] >= 2
    # Back-pressure refusals were never admitted: no finish reason of an admitted request counts them.
    assert not [k for k in m if k.startswith("m3jax_requests_total{") and "rejected" in k]
    # The slots are free again.
    status, ok = _status(server.http_url + "/v1/completions", AUTH,
                         json.dumps({"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}).encode())
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_bench_serve_writes_results_and_plot(server, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "m3jax", "bench", "serve", "--base-url", server.http_url, "--input-len", "24",
           "--output-len", "8", "--concurrency", "1,2", "--num-prompts", "4", "--num-gpus", "2",
           "--warmups-per-concurrency", "1", "--result-dir", str(out), "--tag", "t"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "M3JAX_API_KEY": KEY}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for c in (1, 2):
        rec = json.loads((out / f"t-c{c}.json").read_text())
        m = rec["metrics"]
        assert rec["config"]["concurrency"] == c and rec["config"]["num_warmups"] == c
        assert rec["config"]["prompt_format"] == "ids" and rec["device"] and "git_revision" in rec
        assert (m["completed"], m["failed"]) == (4, 0)
        # ignore_eos: every request produced exactly the output length it drew.
        wl = make_workload(4, 24, 8, 0.8, seed=c, vocab_size=1)
        assert m["total_output_tokens"] == sum(wl.output_lens) and m["total_input_tokens"] == sum(wl.input_lens)
        assert m["output_throughput_per_gpu"] == pytest.approx(m["output_throughput"] / 2)
        assert m["median_ttft_ms"] > 0 and m["median_tpot_ms"] > 0 and m["p99_itl_ms"] > 0
        assert m["interactivity"] == pytest.approx(1000 / m["median_tpot_ms"])
        # The engine's own decode step over the level, read from the server's counters around it.
        assert m["engine_decode_step_ms"] > 0 and 1 <= m["engine_decode_rows_mean"] <= c
        # What the server's TTFT is made of: its queue and prefill parts sum to no more than the whole.
        assert m["server_prefill_mean_ms"] > 0 and m["server_queue_mean_ms"] >= 0
        assert m["server_queue_mean_ms"] + m["server_prefill_mean_ms"] <= m["server_ttft_mean_ms"] + 1e-6
        # With the hand-off to the engine before them and the first token's delivery after, they are all of it.
        parts = ("handoff", "queue", "prefill", "delivery")
        assert sum(m[f"server_{p}_mean_ms"] for p in parts) == pytest.approx(m["server_ttft_mean_ms"], rel=1e-6)
        assert m["server_handoff_mean_ms"] > 0 and m["server_delivery_mean_ms"] > 0
        # Every step of the level, prefills included: its period and the engine thread's wait for the device.
        assert m["engine_steps"] > 0 and 0 <= m["engine_device_wait_ms_per_step"] <= m["engine_step_period_ms"]
        assert m["engine_tokens_per_step"] >= 1
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_log_lines(server):
    """--log-format json: one object per line, with the start-up stages and per-request access fields."""
    status, _ = _status(server.http_url + "/v1/completions", AUTH,
                        json.dumps({"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}).encode())
    assert status == 200
    lines = [json.loads(line) for line in server.log_tail(10**7).splitlines() if line.startswith("{")]
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert [s for s in ("loading", "loaded", "compiling", "engine_ready", "ready")
            if s not in {line.get("stage") for line in lines}] == []
    access = [line for line in lines if line["logger"] == "m3jax.access" and line.get("path") == "/v1/completions"]
    assert access[-1]["status"] == 200 and access[-1]["method"] == "POST" and access[-1]["latency"] > 0
    assert (access[-1]["prompt_tokens"], access[-1]["completion_tokens"]) == (2, 2)
    assert access[-1]["request_id"].startswith("cmpl-") and access[-1]["finish_reason"] == "length"


# ---- start-up: signals at every moment, ports checked first ----------------------------------------------------


def _fifo_checkpoint(base, tmp_path):
    """The test model's checkpoint with its weights file replaced by a named pipe: loading blocks reading it,
    as on a slow network filesystem, until the process ends."""
    from m3jax.api import embedded_model_path

    source = model_args(base)
    src = Path(source[1]) if source else embedded_model_path()
    dst = tmp_path / "slow-checkpoint"
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            os.mkfifo(dst / f.name)
        elif f.is_file():
            shutil.copy(f, dst / f.name)
    return ["--model", str(dst)]


@pytest.mark.parametrize("moment", ["importing", "loading", "compiling", "just before ready"])
def test_a_signal_during_start_up_exits_0_within_5s(moment, tmp_path, tmp_path_factory):
    args, sig, pattern = {
        # Half a second in: the interpreter is importing the server's modules (jax), before any log line.
        "importing": (model_args(tmp_path_factory.getbasetemp()), signal.SIGTERM, None),
        # Weights that never arrive: the signal lands while loading blocks in a read.
        "loading": (_fifo_checkpoint(tmp_path_factory.getbasetemp(), tmp_path), signal.SIGTERM,
                    r"m3jax.serve: loading "),
        # An empty compilation cache: every step shape is compiled (seconds each), Ctrl-C lands in one.
        "compiling": ([*model_args(tmp_path_factory.getbasetemp()), "--compilation-cache-dir",
                       str(tmp_path / "cold")], signal.SIGINT, r"m3jax.serve: compiling "),
        # The engine is built (its steps from the shared cache) and the servers are about to start.
        "just before ready": (model_args(tmp_path_factory.getbasetemp()), signal.SIGTERM,
                              r"m3jax.serve: engine ready in "),
    }[moment]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(args), cwd=REPO, env=serve_env(), stdout=subprocess.DEVNULL,
                                stderr=log)
        try:
            if pattern is None:
                time.sleep(0.5)
            else:
                wait_for_log(proc, log_path, pattern)
            t0 = time.monotonic()
            proc.send_signal(sig)
            rc = proc.wait(30)
            elapsed = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert rc == 0 and elapsed < 5.0, (rc, elapsed, text[-3000:])
    if moment == "importing":  # (on a very fast machine a later stage's handler may already have answered)
        assert "during start-up (" in text, text[-3000:]
    elif moment == "just before ready":
        assert "during start-up (" in text or "shut down cleanly" in text, text[-3000:]
    else:
        assert f"{signal.Signals(sig).name} during start-up ({moment}): exiting" in text, text[-3000:]
        assert "engine ready" not in text


def test_a_port_in_use_fails_before_the_model_loads(tmp_path_factory):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run(serve_command(model_args(tmp_path_factory.getbasetemp()), ("0", str(port))),
                              cwd=REPO, env=serve_env(), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[-1] == f"error: cannot use 127.0.0.1:{port} for the HTTP server (--http-port): Address already in use"
    assert "loading" not in proc.stderr and "ready" not in proc.stdout
    assert elapsed < 60


def test_sigterm_finishes_in_flight_requests_and_exits_0(server):
    async def run():
        async with aiohttp.ClientSession(headers=AUTH) as session:
            resp = await session.post(server.http_url + "/v1/completions",
                                      json={"prompt": [1, 2, 3], "stream": True, "stream_options":
                                            {"include_usage": True}, **LONG, "max_tokens": 60})
            assert (await resp.content.readline()).startswith(b"data:")
            server.proc.send_signal(signal.SIGTERM)
            lines = [line async for line in resp.content if line.startswith(b"data:")]
        return lines

    lines = asyncio.run(run())
    assert lines[-1].strip() == b"data: [DONE]"
    usage = json.loads(lines[-2][5:])["usage"]
    assert usage["completion_tokens"] == 60, "the in-flight request runs to its end"
    assert server.proc.wait(timeout=60) == 0, server.log_tail()  # on its own: no second signal
    server.stop()
    assert "shut down cleanly" in server.log_tail()
