"""`m3jax serve`: one Engine behind a gRPC server and an OpenAI-compatible HTTP server, on one asyncio loop.

    m3jax serve [--model DIR|preset] [--grpc-port 50051] [--http-port 8000] [--host 127.0.0.1] [--max-queue 256] ...

Every flag is a field of `m3jax.settings.Settings` (`m3jax serve --help` lists them with their defaults).

The parts:
- `ServingCore`: what both front ends share. Back-pressure (a bound on requests admitted and not finished,
  counted across both servers; past it a request is refused at once, never queued without bound), request ids,
  metrics, and `RequestStream`, the one way a front end runs a request.
- `serve()`: builds the EngineCore, starts both servers, prints the bound ports, and on SIGINT / SIGTERM shuts down
  gracefully: stop accepting, let in-flight requests finish for `--shutdown-timeout` seconds (a second signal
  aborts them at once), abort what is left, stop the engine loop, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
import types
import uuid
from typing import Any

from m3jax.settings import Settings
from m3jax.settings import add_arguments as add_settings_arguments
from serving.core import EngineCore, Prompt
from serving.engine import AsyncEngine
from serving.metrics import ServerMetrics
from serving.outputs import RequestOutput, SamplingParams

log = logging.getLogger("m3jax.serve")


class Overloaded(Exception):
    """Back-pressure: the server already holds `max_queue` requests (HTTP 429 / RESOURCE_EXHAUSTED)."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests (HTTP 503 / UNAVAILABLE)."""


class RequestStream:
    """One admitted request. Iterate it for RequestOutputs; use it as `async with` so that, however the front
    end leaves (finished, client gone, error, cancelled task), an unfinished request is aborted (its pages
    freed) and its admission slot returned.

    The first `__anext__` tokenises and validates (ValueError at once for a bad request), then waits for the
    first token.
    """

    def __init__(self, core: ServingCore, prompt: Prompt, params: SamplingParams, request_id: str, api: str):
        self.core = core
        self.request_id = request_id
        self.api = api
        self.arrival = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._first: float | None = None
        self._last: float | None = None
        self._gen = core.async_engine.generate(prompt, params, request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        try:
            # Closing the engine's generator while it waits at a yield runs its `finally`: the abort.
            await self._gen.aclose()
        finally:
            if self.finish_reason is None:
                self.finish_reason = "cancelled"  # the front end left early: its client went away
            self.core._release(self)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        try:
            out = await self._gen.__anext__()
        except ValueError:
            self.finish_reason = "rejected"  # refused before its first token: bad request
            raise
        except RuntimeError:
            self.finish_reason = "error"
            raise
        self._observe(out)
        return out

    def _observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.core.metrics
        n = len(out.delta_token_ids)
        if n:
            if self._first is None:
                self._first = now
                self.num_prompt_tokens = len(out.prompt_token_ids)
                m.prompt_tokens.inc(self.num_prompt_tokens)
                m.ttft.observe(now - self.arrival)
            elif self._last is not None:
                for _ in range(n):  # tokens that arrive together share the gap
                    m.itl.observe((now - self._last) / n)
            self._last = now
            self.num_tokens += n
            m.generation_tokens.inc(n)
        if out.finished:
            self.finish_reason = out.outputs[0].finish_reason or "stop"
            m.e2e.observe(now - self.arrival)
            if self._first is not None and self.num_tokens > 1:
                m.tpot.observe((now - self._first) / (self.num_tokens - 1))
            # The engine has freed its pages: give the slot back now, before the front end sends the last
            # message, so that a client that starts its next request on receiving it is not refused.
            self.core._release(self)


class ServingCore:
    """State shared by the gRPC and HTTP front ends over one EngineCore."""

    def __init__(self, engine: EngineCore, async_engine: AsyncEngine, model_name: str, model_path: str,
                 max_queue: int = Settings.max_queue, api_key: str | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.engine = engine
        self.async_engine = async_engine
        self.model_name = model_name
        self.model_path = model_path
        self.max_queue = max_queue
        self.api_key = api_key or None
        self.draining = False
        self.started = time.time()
        self.active: dict[str, RequestStream] = {}
        stats = engine.stats
        self.metrics = ServerMetrics(
            gauges={
                "m3jax_num_requests_waiting": ("Requests queued in the engine", lambda: engine.num_waiting),
                "m3jax_num_requests_running": ("Requests holding KV pages", lambda: engine.num_running),
                "m3jax_requests_in_flight": ("Requests admitted by the servers and not finished",
                                             lambda: len(self.active)),
                "m3jax_max_queue": ("Admission limit (--max-queue)", lambda: self.max_queue),
                "m3jax_kv_pages_in_use": ("KV cache pages in use", lambda: engine.pages_in_use),
                "m3jax_kv_pages_total": ("Usable KV cache pages", lambda: engine.num_pages),
                "m3jax_kv_cache_usage_ratio": ("Fraction of KV pages in use",
                                               lambda: engine.pages_in_use / max(engine.num_pages, 1)),
            },
            counters={
                "m3jax_engine_steps": ("Engine steps run", lambda: stats.get("steps", 0)),
                "m3jax_engine_step_tokens": ("Tokens through the model", lambda: stats.get("step_tokens", 0)),
                "m3jax_preemptions": ("Requests preempted (recomputed later)", lambda: stats.get("preemptions", 0)),
                "m3jax_prefix_cache_queries": ("Tokens looked up in the prefix cache at admission",
                                               lambda: engine.prefix_cache_queries),
                "m3jax_prefix_cache_hits": ("Tokens found in the prefix cache (not computed again)",
                                            lambda: engine.prefix_cache_hits),
            })

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def open(self, prompt: Prompt, params: SamplingParams, api: str, request_id: str | None = None,
             prefix: str = "req") -> RequestStream:
        """Admit a request, or refuse it at once: ShuttingDown, Overloaded, ValueError (duplicate id). Runs on
        the event loop, so the check and the insertion are atomic with respect to other requests."""
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if len(self.active) >= self.max_queue:
            self.metrics.rejected.inc()
            raise Overloaded(f"the server is at its limit of {self.max_queue} requests in flight; retry later")
        rid = request_id or f"{prefix}-{uuid.uuid4().hex}"
        if rid in self.active:
            raise ValueError(f"request id {rid!r} is already in flight")
        stream = RequestStream(self, prompt, params, rid, api)
        self.active[rid] = stream
        return stream

    def _release(self, stream: RequestStream) -> None:
        if self.active.get(stream.request_id) is stream:
            del self.active[stream.request_id]
            self.metrics.requests.labels(stream.api, stream.finish_reason or "unknown").inc()

    def encode_chat(self, messages: Any, **template_kwargs: Any) -> list[int]:
        """Prompt ids of a conversation through the checkpoint's chat template (ValueError for a bad one)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template: send token ids")
        return self.tokenizer.encode_chat(messages, add_generation_prompt=template_kwargs.pop(
            "add_generation_prompt", True), **template_kwargs)

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight; its stream ends with finish_reason "abort". False if there is none."""
        if request_id not in self.active:
            return False
        self.async_engine.abort(request_id)
        return True

    def abort_all(self) -> None:
        for rid in list(self.active):
            self.async_engine.abort(rid)

    def check_api_key(self, header: str | None) -> bool:
        """`Authorization: Bearer <key>` (HTTP header or gRPC metadata), compared in constant time."""
        if self.api_key is None:
            return True
        import hmac

        expected = f"Bearer {self.api_key}".encode()
        return header is not None and hmac.compare_digest(header.strip().encode(), expected)

    def model_info(self) -> dict[str, Any]:
        """What ModelInfo and /v1/models report: the model and the engine's current load."""
        e = self.engine
        cfg = e.model.cfg
        return {
            "model": self.model_name,
            "path": self.model_path,
            "max_model_len": e.max_model_len,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": sorted(e.eos_token_ids),
            "has_tokenizer": e.tokenizer is not None,
            "dtype": e.settings.compute_dtype(),
            "tensor_parallel_size": e.settings.tensor_parallel_size,
            "device": device_description(e.settings.tensor_parallel_size),
            "page_size": e.model.page_size,
            "num_pages": e.num_pages,
            "pages_in_use": e.pages_in_use,
            "num_waiting": e.num_waiting,
            "num_running": e.num_running,
            "requests_in_flight": len(self.active),
            "max_queue": self.max_queue,
        }


def device_description(num: int = 1) -> str:
    import jax

    d = jax.devices()[0]
    return f"{num} x {d.device_kind}" if d.platform != "cpu" else f"{num} x cpu"


# ---- the command -------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p)


class _StartupInterrupted(Exception):
    pass


def _interrupt_startup(signum: int, frame: Any) -> None:
    raise _StartupInterrupted(signal.Signals(signum).name)


def serve(args: argparse.Namespace) -> int:
    settings = Settings.from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Until the loop owns the signals, a SIGTERM during the (long) start-up still means a clean exit 0.
    old = {s: signal.signal(s, _interrupt_startup) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        t0 = time.perf_counter()
        engine = EngineCore(settings)
        log.info("engine ready in %.1fs (%d KV pages, model length %d, %d step executables)",
                 time.perf_counter() - t0, engine.num_pages, engine.max_model_len, engine.num_executables)
    except _StartupInterrupted as e:
        print(f"[m3jax] interrupted by {e} during start-up", file=sys.stderr)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    name = settings.served_model_name or (settings.model if settings.model is not None else "m3jax/tiny")
    core = ServingCore(engine, AsyncEngine(engine), name, settings.model or "embedded", settings.max_queue,
                       settings.api_key)
    try:
        asyncio.run(_serve_async(core, settings))
    except OSError as e:  # a port in use, an address that is not ours: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve_async(core: ServingCore, args: Settings) -> None:
    from serving.grpc_server import GrpcServer
    from serving.http_server import HttpServer

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("%s: shutting down (in-flight requests get %.0fs to finish; signal again to abort them)",
                     sig.name, args.shutdown_timeout)
            stop.set()
        else:
            log.info("%s again: aborting %d in-flight requests", sig.name, len(core.active))
            core.abort_all()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    grpc_server = GrpcServer(core) if args.grpc_port >= 0 else None
    http_server = HttpServer(core, shutdown_timeout=args.shutdown_timeout) if args.http_port >= 0 else None
    parts = []
    try:
        if grpc_server is not None:
            port = await grpc_server.start(args.host, args.grpc_port)
            parts.append(f"grpc={_hostport(args.host, port)}")
        if http_server is not None:
            port = await http_server.start(args.host, args.http_port)
            parts.append(f"http=http://{_hostport(args.host, port)}")
        # One line that scripts and tests wait for: the real ports (port 0 asks for any free one).
        print(f"[m3jax] ready: {' '.join(parts)} model={core.model_name}", flush=True)
        await stop.wait()
    finally:
        core.draining = True
        # Stop accepting on both servers at once; each lets its in-flight calls run for the grace period and
        # then cancels them, which aborts their engine requests (RequestStream.__aexit__).
        stops = []
        if grpc_server is not None:
            stops.append(grpc_server.stop(args.shutdown_timeout))
        if http_server is not None:
            stops.append(http_server.stop())
        await asyncio.gather(*stops, return_exceptions=True)
        core.abort_all()
        # Blocking: waits for the engine thread to drain aborts and stop.
        await loop.run_in_executor(None, core.async_engine.shutdown, 5.0)
        with contextlib.suppress(Exception):
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        log.info("shut down cleanly")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
