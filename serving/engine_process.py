"""The engine core in a process of its own, and `RemoteCore`, its client in the servers' process.

Why: in one process the event loop's per-token work (SSE writes, JSON, metrics) and the engine's step thread
share one GIL. On the H100 at 128 concurrent streams the two together held the GIL 60% of the time and the
served step took twice the bare one; the engine thread alone needs about the bare step. vLLM runs its engine
core in a process of its own for the same reason. Here `m3jax serve` does too (`--engine-process`, the default).

    servers' process                                     engine process (spawned; JAX and the devices)
    AsyncEngine -> RemoteCore.prepare_group: check,      EngineCore: build the Request (detokeniser, grammar),
                   tokenise (the front end's tokenizer)     schedule, step, detokenise, decide stops
                   RemoteCore.submit ---- ("add", Prepared) --> core.submit(compact sink)
                   RemoteCore.abort ----- ("abort", id) ------> core.abort
    reader thread: OutputDeltas -> the request's        <-- one message per step: the step's OutputDeltas and
                   RequestOutput (request_output) -> sink       the load figures (`Readings`)

What crosses is plain data: `Prepared` requests one way, `OutputDelta`s (what a step added, never a request's
whole output) and the load figures the other. The engine process ignores SIGINT / SIGTERM (the servers' process
decides when to stop, and a terminal's Ctrl-C reaches both) and exits when its pipe closes: whatever ends the
servers' process, even `os._exit` in the middle of a compile, ends it too.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import pickle
import random
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from m3jax.settings import Settings
from serving.core import (
    EngineCore,
    EngineFacts,
    GrammarCache,
    OutputDelta,
    Prepared,
    Prompt,
    Sink,
    check_group,
    delta_output,
    load_tokenizer,
    request_output,
)
from serving.outputs import CumulativeOutput, RequestOutput, RequestOutputKind, SamplingParams

log = logging.getLogger("m3jax.engine_process")


@dataclasses.dataclass
class Readings:
    """The engine's load figures as of its last step (what /metrics and the model info read)."""

    num_waiting: int = 0
    num_running: int = 0
    pages_in_use: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    stats: dict[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, core: EngineCore) -> Readings:
        return cls(core.num_waiting, core.num_running, core.pages_in_use, core.prefix_cache_queries,
                   core.prefix_cache_hits, dict(core.stats))


# ---- the engine process ----------------------------------------------------------------------------------------


def freeze_heap() -> None:
    """Take what start-up left alive out of the cyclic collector's sight, as a server process starts serving.

    The engine's start-up (the model, its executables, JAX's caches) leaves some 320,000 objects in the
    oldest generation even for m3-tiny, and a full collection walks them all: 259 ms on the dev CPU, during
    which the process holds the GIL and, in the engine process, no step is dispatched (docs/benchmarks.md,
    "A full collection"). Python runs one whenever the survivors since the last grow past a quarter of that
    generation, so a long-running server meets it now and then, as a stall of every stream. Collected once
    here and then frozen (vLLM does the same), they are never walked again; what serving allocates is collected
    as before."""
    gc.collect()
    gc.freeze()


class _Outbox:
    """The engine process's side of the pipe. The step thread sends each step's deltas and load figures itself,
    right after the step: a thread of its own would have to win the GIL from the step thread first, which (busy
    with the next step) could hold it for a switch interval and delay every token, the first one included. A
    front end that falls behind fills the pipe and the step thread waits: back-pressure, nothing dropped."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._lock = threading.Lock()  # the step thread and the command thread both send
        self.pending: list[OutputDelta] = []  # the step thread's deltas since its last flush

    def add(self, delta: OutputDelta) -> None:
        """A request's sink (on the step thread)."""
        self.pending.append(delta)

    def flush(self, core: EngineCore) -> None:
        """After a step (on the step thread): send its deltas and the load figures."""
        deltas, self.pending = self.pending, []
        self.put(("step", deltas, Readings.of(core)))

    def put(self, message: Any) -> None:
        payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self._conn.send_bytes(payload)
        except (OSError, EOFError):  # the servers' process is gone: so is the reason to run
            os._exit(0)


def _build_in_child(settings: Settings, conn: Any) -> EngineCore:
    """The engine, built as `m3jax serve` builds it in one process; each stage and its log line go to the servers'
    process, which enters the stage and then logs the line (so that its signal handler names that stage)."""
    from serving import server

    server.stage_listener = lambda stage, line: conn.send_bytes(pickle.dumps(("stage", stage, line)))
    return server.build_engine(settings)


def child_main(settings: Settings, conn: Any, log_level: str, log_format: str) -> None:
    """The engine process: build the engine, then run it for the servers' process until told to stop or until
    the pipe closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # The command thread (a new request) waits for the GIL at most this long behind the step thread.
    sys.setswitchinterval(0.0005)
    from serving.server import setup_logging

    setup_logging(log_level, log_format)
    built = threading.Event()  # the core exists: the command thread may hand it commands
    stopped = threading.Event()  # the core has shut down: the process may end
    state: dict[str, Any] = {}

    def handle(kind: str, *args: Any) -> None:
        core, outbox = state["core"], state["outbox"]
        if kind == "add":
            prepared: Prepared = args[0]
            try:
                req = core.build(prepared)
            except Exception as e:  # noqa: BLE001 - e.g. a grammar that does not compile here: fail this request
                log.exception("request %s could not be admitted", prepared.request_id)
                outbox.put(("rejected", prepared.request_id, str(e), isinstance(e, ValueError)))
                return
            core.submit(req, prepared.text, outbox.add, compact=True)
        elif kind == "abort":
            core.abort(args[0])
        elif kind == "shutdown":
            core.shutdown(args[0])
            outbox.put(("stopped",))
            stopped.set()

    def receive() -> None:
        # Commands are handled on this thread as they arrive: a new request reaches the step thread's queue
        # without another thread hand-off on its way.
        try:
            while not stopped.is_set():
                message = pickle.loads(conn.recv_bytes())
                built.wait()  # nothing is sent before "ready"; this only orders the first command after it
                handle(*message)
        except (EOFError, OSError):  # the servers' process ended (or closed its end): end at once
            os._exit(0)
        except BaseException:  # a bug: end, so that the servers' process sees the pipe close and says so
            log.exception("the engine process's command thread failed")
            os._exit(1)

    threading.Thread(target=receive, name="m3jax-engine-recv", daemon=True).start()
    try:
        core = _build_in_child(settings, conn)
    except BaseException as e:  # noqa: BLE001 - handed to the servers' process, which raises it
        try:
            payload = pickle.dumps(("error", e))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            payload = pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))
        conn.send_bytes(payload)
        return
    outbox = _Outbox(conn)
    core.after_step = lambda: outbox.flush(core)
    state.update(core=core, outbox=outbox)
    freeze_heap()
    core.start()
    built.set()
    outbox.put(("ready", core.facts))
    stopped.wait()


# ---- the servers' process --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Stream:
    """A request's output on the client side of the pipe: made cumulative here (RequestOutputKind.CUMULATIVE;
    FINAL_ONLY: only once, when it finishes), or passed on as it came (DELTA: nothing kept, nothing copied)."""

    prepared: Prepared
    sink: Sink
    whole: CumulativeOutput = dataclasses.field(default_factory=CumulativeOutput)

    def apply(self, delta: OutputDelta) -> RequestOutput | None:
        """The RequestOutput for the client, or None (FINAL_ONLY, unfinished)."""
        p = self.prepared
        kind = p.params.output_kind
        if kind is RequestOutputKind.DELTA:
            return delta_output(delta, p.parent_id, p.index, p.text, p.prompt_ids)
        w = self.whole
        w.add(delta.delta_text, delta.delta_token_ids, delta.logprobs, delta.prompt_logprobs)
        if kind is RequestOutputKind.FINAL_ONLY and delta.finish_reason is None:
            return None
        return request_output(delta, p.parent_id, p.index, p.text, p.prompt_ids, w.text, list(w.token_ids),
                              list(w.logprobs) if w.logprobs is not None else None, w.prompt_logprobs)


class EngineProcessExited(RuntimeError):
    """The engine process ended (during start-up, or while serving)."""


class RemoteCore:
    """An `EngineCore` in another process, with the surface its clients use (`AsyncEngine`, `ServingCore`):
    prepare / submit / abort / shutdown, the facts and the load figures. Requests are checked and tokenised
    here; outputs come back as deltas and are made whole here."""

    def __init__(self, settings: Settings, on_stage: Callable[[str, str], None] | None = None,
                 on_exit: Callable[[], None] | None = None):
        self.settings = settings
        self.on_exit = on_exit  # called (on the reader thread) if the engine process ends unasked
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold JAX's threads
        self._conn, child_conn = ctx.Pipe()
        root = logging.getLogger()
        fmt = "json" if any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers) else "text"
        self._proc = ctx.Process(target=child_main, name="m3jax-engine",
                                 args=(settings, child_conn, logging.getLevelName(root.level), fmt), daemon=True)
        self._proc.start()
        child_conn.close()
        self.facts = self._wait_ready(on_stage)  # a bad model path or checkpoint is the engine's error to name
        self.tokenizer = load_tokenizer(settings)
        self.max_model_len = self.facts.max_model_len
        self.eos_token_ids = self.facts.eos_token_ids
        self.num_speculative_tokens = self.facts.num_speculative_tokens
        self.num_pages = self.facts.num_pages
        self.num_executables = self.facts.num_executables
        self.warmup_seconds = self.facts.warmup_seconds
        self.stats: collections.Counter[str] = collections.Counter()
        self._readings = Readings()
        self._rng = random.Random(settings.seed)
        self._grammar_cache = GrammarCache(self.tokenizer, self.facts.vocab_size, self.eos_token_ids)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the streams table and the pipe's sending end
        self._stopped = threading.Event()
        self._closing = False  # shutdown asked: the pipe closing is then expected
        self.alive = True
        self._reader = threading.Thread(target=self._read_loop, name="m3jax-engine-client", daemon=True)
        self._reader.start()

    def _recv(self) -> Any:
        return pickle.loads(self._conn.recv_bytes())

    def _wait_ready(self, on_stage: Callable[[str, str], None] | None) -> EngineFacts:
        while True:
            try:
                kind, *args = self._recv()
            except (EOFError, OSError):
                self._proc.join(5)
                raise EngineProcessExited(f"the engine process exited during start-up (exit code "
                                          f"{self._proc.exitcode})") from None
            if kind == "stage":  # (a stage, its log line)
                if on_stage is not None:
                    on_stage(*args)
                else:
                    log.info("%s", args[1], extra={"stage": args[0]})
            elif kind == "error":
                self._proc.join(5)
                raise args[0]
            elif kind == "ready":
                return args[0]

    # ---- requests in -----------------------------------------------------------------------------------------
    def prepare_group(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
                      ) -> list[tuple[Prepared, str | None]]:
        """Check and tokenise here (the engine process builds the requests): `EngineCore.prepare_group`'s
        checks, and its grammar, compiled here too so that a bad one is refused before anything is sent."""
        group = check_group(self.facts, self.tokenizer, self._rng, prompt, params, request_id)
        self.compile_grammar(group[0].params)
        return [(p, p.text) for p in group]

    def compile_grammar(self, params: SamplingParams) -> Any:
        return self._grammar_cache.compile(params)

    def submit(self, req: Prepared, prompt_text: str | None = None, sink: Sink | None = None) -> str:
        if not self.alive:
            raise EngineProcessExited("the engine process has exited")
        with self._lock:
            self._streams[req.request_id] = _Stream(req, sink or (lambda out: None))
            self._send(("add", req))
        return req.request_id

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._send(("abort", request_id))

    def abort_all(self) -> None:
        with self._lock:
            ids = {s.prepared.parent_id or rid for rid, s in self._streams.items()}
        for rid in ids:
            self.abort(rid)

    def _send(self, message: Any) -> None:
        if self.alive:  # a pipe closed meanwhile: the reader sees it and fails what is in flight
            with contextlib.suppress(OSError, EOFError):
                self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def start(self) -> None:
        """The engine process steps itself (`AsyncEngine` calls this of an in-process core)."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Let in-flight requests finish (up to `timeout` seconds), abort the rest, stop the engine process."""
        with self._lock:
            self._closing = True
            self._send(("shutdown", timeout))
        self._stopped.wait(timeout + 10)
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    # ---- outputs back (the reader thread) --------------------------------------------------------------------
    def _read_loop(self) -> None:
        kind = None
        while kind != "stopped":
            try:
                kind, *args = self._recv()
            except (EOFError, OSError):
                kind = None
                break
            if kind == "step":
                deltas, readings = args
                self._readings = readings
                for key, value in readings.stats.items():  # counters only grow: never a reset between scrapes
                    self.stats[key] = value
                for delta in deltas:
                    self._deliver(delta)
            elif kind == "rejected":  # ValueError: the request's fault (a 400), anything else the server's
                rid, error, bad_request = args
                self._deliver(OutputDelta(rid, [], "", "error", None, error, bad_request, {}, None, None))
        self.alive = False
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid in list(streams):  # nothing more will come for them
            self._deliver(OutputDelta(rid, [], "", "error", None, "the engine process exited", False, {}, None,
                                      None), streams)
        self._stopped.set()
        if kind != "stopped" and not self._closing:
            self._proc.join(1)
            log.error("the engine process exited (exit code %s); %d requests in flight failed",
                      self._proc.exitcode, len(streams))
            if self.on_exit is not None:
                self.on_exit()

    def _deliver(self, delta: OutputDelta, streams: dict[str, _Stream] | None = None) -> None:
        table = self._streams if streams is None else streams
        stream = table.get(delta.request_id)
        if stream is None:
            return
        out = stream.apply(delta)
        if delta.finish_reason is not None:
            with self._lock:
                table.pop(delta.request_id, None)
        if out is None:
            return
        try:
            stream.sink(out)
        except Exception:  # noqa: BLE001 - one client's failing sink must not stop the others' outputs
            log.exception("a request's output sink failed")

    # ---- read-only load figures (as of the engine's last step) ------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._readings.num_waiting

    @property
    def num_running(self) -> int:
        return self._readings.num_running

    @property
    def pages_in_use(self) -> int:
        return self._readings.pages_in_use

    @property
    def prefix_cache_queries(self) -> int:
        return self._readings.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._readings.prefix_cache_hits
