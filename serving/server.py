"""`m3jax serve`: one Engine behind a gRPC server and an OpenAI-compatible HTTP server, on one asyncio loop.

    m3jax serve [--model DIR|preset] [--grpc-port 50051] [--http-port 8000] [--host 127.0.0.1] [--max-queue 256] ...

Every flag is a field of `m3jax.settings.Settings` (`m3jax serve --help` lists them with their defaults).

The parts:
- `ServingCore`: what both front ends share. Back-pressure (a bound on requests admitted and not finished,
  counted across both servers; past it a request is refused at once, never queued without bound), request ids,
  tokenisation off the event loop, the model-length check of max_tokens, metrics, and `RequestStream`, the one
  way a front end runs a request.
- `OutputPlan` / `MessageParser`: what a chat reply goes through, for both front ends: M3's reasoning split
  into `reasoning_content`, tool calls parsed into `tool_calls`, the tool-call grammar of `tool_choice`
  "required" or a named function, and the gate that starts any grammar after `</mm:think>` when the prompt
  opened a thinking block. The reasoning phase comes from the rendered prompt's tail (never from marker text
  elsewhere in the prompt); requests that parse are decoded with special tokens kept, and what is left of them
  after parsing is removed unless the client asked for `skip_special_tokens=false`.
- `serve()`: checks every flag and binds both ports before anything heavy starts, then loads the model and
  builds the engine on a worker thread (logging each stage), starts both servers, prints the bound ports, logs
  throughput while serving, and on SIGINT / SIGTERM shuts down gracefully.

Signals, at every moment:
- during start-up (loading weights, compiling or loading step executables, starting the servers) a signal
  ends the process at once with exit 0. Start-up runs on a worker thread while the main thread only waits, so
  the signal handler runs within 0.1 s however long a load or an XLA compile takes, and it exits through
  `os._exit` rather than an exception that library code could catch and swallow;
- while serving, the first signal drains: stop accepting, let in-flight requests finish for
  `--shutdown-timeout` seconds, stop the engine, exit 0; a second one aborts the in-flight requests; a third
  exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from m3jax.settings import Settings, flag
from m3jax.settings import add_arguments as add_settings_arguments
from serving.core import EngineCore, Prompt
from serving.engine import AsyncEngine
from serving.engine_process import RemoteCore, freeze_heap
from serving.metrics import Reading, ServerMetrics
from serving.outputs import RequestOutput, RequestOutputKind, SamplingParams
from serving.reasoning import (
    THINK_END,
    THINK_START,
    THINKING_MODES,
    ReasoningParser,
    ReasoningPhase,
    initial_phase_from_ids,
)
from serving.structured import StructuredOutputsParams
from serving.tool_calls import INVOKE_END, ToolCallParser, inline_tool_refs, tool_call_grammar

log = logging.getLogger("m3jax.serve")
stats_log = logging.getLogger("m3jax.stats")

# What a front end hands to `ServingCore.open`: text, token ids, or a function that makes the ids (a chat
# template to render); text and functions run on a worker thread.
PromptSource = Prompt | Callable[[], list[int]]


class EngineLost(Exception):
    """The engine process ended while serving."""


class Overloaded(Exception):
    """Back-pressure: the server already holds `max_queue` requests (HTTP 429 / RESOURCE_EXHAUSTED)."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests (HTTP 503 / UNAVAILABLE)."""


class RequestError(ValueError):
    """A bad request, found before it reached the engine; `param` names the field at fault (None: the prompt)."""

    def __init__(self, message: str, param: str | None = None, num_prompt_tokens: int = 0):
        super().__init__(message)
        self.param = param
        self.num_prompt_tokens = num_prompt_tokens  # for the access log, when the prompt was tokenised


# ---- what a chat reply goes through ---------------------------------------------------------------------------

TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclasses.dataclass
class OutputPlan:
    """How a request's output is constrained and read back. A front end builds it from the request's fields
    (`ServingCore.chat_plan` for chat; a bare one otherwise); `ServingCore.fit` completes it once the prompt is
    rendered."""

    reasoning: bool = False  # split M3's thinking into reasoning_content
    tools: list[dict[str, Any]] | None = None  # parse tool calls against these ($refs inlined); None: no parsing
    tool_choice: str = "auto"  # "auto", "required", or "function" (`function` names it); "none" parses nothing
    function: str | None = None
    parallel_tool_calls: bool = True
    keep_special: bool = False  # the client asked for special tokens in its text (skip_special_tokens=false)
    structured_param: str | None = None  # the field that asked for structured output (named in its errors)
    # Set by `ServingCore.fit`:
    phase: ReasoningPhase | None = None  # where the prompt left the reasoning
    strip: tuple[str, ...] = ()  # special-token texts removed from what the client sees
    internal_stop: str | None = None  # a stop string the server added (not reported as a stop_reason)

    @property
    def parses(self) -> bool:
        return self.reasoning or self.tools is not None

    @property
    def forced(self) -> bool:
        """tool_choice "required" or a named function: the reply is a call, by grammar."""
        return self.tools is not None and self.tool_choice in ("required", "function")


@dataclasses.dataclass
class MessageDelta:
    """What one piece of generated text adds to a chat message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class _Stripper:
    """Removes whole occurrences of some strings from a stream of text, holding back a tail that may still
    become one."""

    def __init__(self, texts: tuple[str, ...]):
        self.texts = texts
        self.held = ""

    def push(self, text: str, final: bool) -> str:
        if not self.texts:
            return text
        s = self.held + text
        for t in self.texts:
            if t in s:
                s = s.replace(t, "")
        keep = 0
        if not final:
            for t in self.texts:
                for k in range(min(len(s), len(t) - 1), keep, -1):
                    if t.startswith(s[-k:]):
                        keep = k
                        break
        self.held = s[len(s) - keep:]
        return s[:len(s) - keep]


class MessageParser:
    """One choice's generated text -> reasoning, content and tool calls: `push(delta_text)` per update, `finish()`
    once at its end (streaming and whole replies go through the same steps)."""

    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self._reasoning = ReasoningParser(plan.phase or ReasoningPhase.UNDECIDED) if plan.reasoning else None
        self._tools = ToolCallParser(plan.tools) if plan.tools is not None else None
        self._strip = (_Stripper(plan.strip), _Stripper(plan.strip))
        self._parts: tuple[list[str], list[str]] = ([], [])
        self.tool_calls: list[dict[str, Any]] = []

    def push(self, text: str) -> MessageDelta:
        return self._step(text, final=False)

    def finish(self) -> MessageDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> MessageDelta:
        reasoning, content = "", text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.push(text) if text else ("", "")
            if final:
                more = self._reasoning.finish()
                reasoning, content = reasoning + more.reasoning, content + more.content
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            if content:
                content, calls = self._tools.push(content)
                calls = list(calls)
            if final:
                rest = self._tools.finish()
                content, calls = content + rest.content, calls + list(rest.tool_calls)
                self.tool_calls = list(self._tools.tool_calls)
        reasoning = self._strip[0].push(reasoning, final)
        content = self._strip[1].push(content, final)
        self._parts[0].append(reasoning)
        self._parts[1].append(content)
        return MessageDelta(reasoning, content, calls)

    @property
    def reasoning(self) -> str | None:
        return "".join(self._parts[0]) or None

    @property
    def content(self) -> str | None:
        return "".join(self._parts[1]) or None

    @property
    def called(self) -> bool:
        """Tool calls were made (known once `finish` has run)."""
        return bool(self.tool_calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" for a reply that ended by itself after making calls."""
        return "tool_calls" if reason == "stop" and self.called else reason

    def stop_reason(self, stop_reason: str | int | None) -> str | int | None:
        return None if stop_reason is not None and stop_reason == self.plan.internal_stop else stop_reason


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools` (function tools only): RequestError naming `tools` for anything else. [] is None."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("`tools` must be an array of {\"type\": \"function\", \"function\": {...}} objects",
                           "tools")
    names: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
            raise RequestError(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function must be an object with a `name`", "tools")
        name = fn["name"]
        if '"' in name or ">" in name or "<" in name:
            raise RequestError(f"tools[{i}].function.name {name!r} cannot be written in M3's tool-call format",
                               "tools")
        if name in names:
            raise RequestError(f"tools[{i}]: a second function named {name!r}", "tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, Mapping) and params.get("type", "object") == "object"):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema of an object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"tools[{i}].function.description must be a string", "tools")
        out.append({**tool, "type": "function", "function": dict(fn)})
    return out


def check_template_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: extra variables of the chat template (M3: `thinking_mode`). RequestError naming the
    field for a variable the server sets itself or a thinking_mode M3's template does not know."""
    reserved = {"messages", "tools", "add_generation_prompt", "chat_template"} & set(kwargs)
    if reserved:
        raise RequestError(f"`chat_template_kwargs` may not set {', '.join(sorted(reserved))}",
                           "chat_template_kwargs")
    mode = kwargs.get("thinking_mode")
    if mode is not None and mode not in THINKING_MODES:
        raise RequestError(f"`chat_template_kwargs.thinking_mode` must be one of {', '.join(THINKING_MODES)}, got "
                           f"{mode!r}", "chat_template_kwargs")
    return dict(kwargs)


def check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """OpenAI `tool_choice` -> (mode, function name): "auto" (the default with tools), "none" (the default
    without), "required", or ("function", name). RequestError naming `tool_choice` for anything else."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise RequestError(f"`tool_choice` must be one of {', '.join(TOOL_CHOICE_MODES)} or "
                               f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}', "tool_choice")
        if choice != "none" and not tools:
            raise RequestError(f"`tool_choice` {choice!r} needs `tools`", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    if not (isinstance(choice, Mapping) and choice.get("type", "function") == "function" and isinstance(fn, Mapping)
            and isinstance(fn.get("name"), str)):
        raise RequestError('`tool_choice` must be "auto", "none", "required" or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice")
    names = [t["function"]["name"] for t in tools or ()]
    if fn["name"] not in names:
        raise RequestError(f"`tool_choice` names the function {fn['name']!r}, which is not among `tools` "
                           f"({', '.join(map(repr, names)) or 'none given'})", "tool_choice")
    return "function", fn["name"]


# ---- one request -------------------------------------------------------------------------------------------------


class RequestStream:
    """One admitted request. Iterate it for RequestOutputs; use it as `async with` so that, however the front
    end leaves (finished, client gone, error, cancelled task), an unfinished request is aborted (its pages
    freed) and its admission slot returned.

    The first `__anext__` tokenises (on a worker thread) and validates, raising ValueError at once for a bad
    request (a `RequestError` naming the field where the server found it), then waits for the first token.
    """

    def __init__(self, core: ServingCore, prompt: PromptSource, params: SamplingParams, request_id: str, api: str,
                 max_tokens_param: str | None, plan: OutputPlan | None = None):
        self.core = core
        self.request_id = request_id
        self.api = api
        # The front ends read each update's delta and keep what they need: an update then copies nothing of
        # the output before it (`params` is the front end's own, built for this request).
        params.output_kind = RequestOutputKind.DELTA
        self.params = params
        self.max_tokens_param = max_tokens_param
        self.plan = plan if plan is not None else OutputPlan()
        self.choices_left = params.n  # the stream ends when all n choices have finished
        self.arrival = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._prompt: PromptSource | None = prompt
        self._first: float | None = None
        self._last: float | None = None
        self._gen: Any = None  # the engine's stream, once the prompt is tokenised

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        try:
            if self._gen is not None:
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
            if self._gen is None:
                prompt, self._prompt = self._prompt, None
                ids, self.params = await self.core.prepare(prompt, self.params, self.max_tokens_param, self.plan)
                self.num_prompt_tokens = len(ids)
                self._gen = self.core.async_engine.generate(ids, self.params, self.request_id)
            out = await self._gen.__anext__()
        except ValueError as e:
            self.finish_reason = "invalid"  # refused before its first token: a bad request (400)
            self.num_prompt_tokens = getattr(e, "num_prompt_tokens", 0) or self.num_prompt_tokens
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
                t = out.metrics
                phases = ({"queue": t["scheduled"] - t["arrival"], "prefill": t["first_token"] - t["scheduled"],
                           "handoff": t["arrival"] - self.arrival, "delivery": now - t["first_token"]}
                          if {"arrival", "scheduled", "first_token"} <= t.keys() else {})
                m.first_token(now - self.arrival, self.num_prompt_tokens, **phases)
            m.tokens(n, now - self._last if self._last is not None else None)
            self._last = now
            self.num_tokens += n
        if out.finished:
            self.choices_left -= 1
        if out.finished and not self.choices_left:
            self.finish_reason = out.outputs[0].finish_reason or "stop"
            # The engine has freed its pages: give the slot back now, before the front end sends the last
            # message, so that a client that starts its next request on receiving it is not refused.
            self.core._release(self)

    @property
    def reached_engine(self) -> bool:
        return self._gen is not None


# ---- what both servers share --------------------------------------------------------------------------------


class ServingCore:
    """State shared by the gRPC and HTTP front ends over one engine core (in this process or another)."""

    def __init__(self, engine: EngineCore | RemoteCore, async_engine: AsyncEngine, model_name: str, model_path: str,
                 max_queue: int = Settings.max_queue, api_key: str | None = None,
                 reasoning_parser: str = Settings.reasoning_parser, tool_call_parser: str = Settings.tool_call_parser):
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
        # Tokenising, chat templates and large JSON bodies: off the event loop.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="m3jax-tokenize")
        self.metrics = ServerMetrics(model_name, self._readings(), engine.max_model_len)
        tok = engine.tokenizer
        # The tokenizer's special tokens (text -> id): grammars name them as tokens; parsed replies drop them.
        self.special_tokens: dict[str, int] = {} if tok is None else {
            t.content: i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
        # M3's reasoning split needs its markers as tokens of this vocabulary (M3's and the embedded model's).
        self.reasoning_parser = reasoning_parser != "none" and {THINK_START, THINK_END} <= set(self.special_tokens)
        self.tool_call_parser = tool_call_parser != "none" and tok is not None

    def _readings(self) -> list[Reading]:
        engine, stats, name = self.engine, self.engine.stats, (("model_name", self.model_name),)

        def usage() -> float:
            return engine.pages_in_use / max(engine.num_pages, 1)

        return [
            Reading("gauge", "m3jax_num_requests_waiting", "Requests queued in the engine", lambda: engine.num_waiting),
            Reading("gauge", "m3jax_num_requests_running", "Requests holding KV pages", lambda: engine.num_running),
            Reading("gauge", "m3jax_requests_in_flight", "Requests admitted by the servers and not finished",
                    lambda: len(self.active)),
            Reading("gauge", "m3jax_max_queue", "Admission limit (--max-queue)", lambda: self.max_queue),
            Reading("gauge", "m3jax_kv_pages_in_use", "KV cache pages in use", lambda: engine.pages_in_use),
            Reading("gauge", "m3jax_kv_pages_total", "Usable KV cache pages", lambda: engine.num_pages),
            Reading("gauge", "m3jax_kv_cache_usage_ratio", "Fraction of KV pages in use", usage),
            Reading("counter", "m3jax_engine_steps", "Engine steps run", lambda: stats.get("steps", 0)),
            Reading("counter", "m3jax_engine_step_tokens", "Tokens through the model",
                    lambda: stats.get("step_tokens", 0)),
            Reading("counter", "m3jax_engine_decode_steps", "Decode-only steps launched right after another",
                    lambda: stats.get("decode_steps", 0)),
            Reading("counter", "m3jax_engine_decode_step_seconds", "Time between those steps' launches (the decode "
                    "step as the engine runs it: host work, dispatch and device)",
                    lambda: stats.get("decode_step_us", 0) / 1e6),
            Reading("counter", "m3jax_engine_decode_step_rows", "Requests in those steps (their mean batch size)",
                    lambda: stats.get("decode_step_rows", 0)),
            Reading("counter", "m3jax_engine_device_wait_seconds", "Time the engine thread waited for a step's "
                    "sampled tokens; the rest of its time is host work (scheduling, inputs, outputs)",
                    lambda: stats.get("device_wait_us", 0) / 1e6),
            Reading("counter", "m3jax_preemptions", "Requests preempted (recomputed later)",
                    lambda: stats.get("preemptions", 0)),
            Reading("counter", "m3jax_prefix_cache_queries", "Tokens looked up in the prefix cache at admission",
                    lambda: engine.prefix_cache_queries),
            Reading("counter", "m3jax_prefix_cache_hits", "Tokens found in the prefix cache (not computed again)",
                    lambda: engine.prefix_cache_hits),
            # vLLM's names and labels, for the dashboards written for it.
            Reading("gauge", "vllm:num_requests_running", "Number of requests in model execution batches.",
                    lambda: engine.num_running, name),
            Reading("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    lambda: engine.num_waiting, name),
            Reading("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage, name),
            Reading("gauge", "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage "
                    "(vLLM's older name of vllm:kv_cache_usage_perc).", usage, name),
            Reading("counter", "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                    lambda: stats.get("preemptions", 0), name),
            Reading("counter", "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                    "tokens.", lambda: engine.prefix_cache_queries, name),
            Reading("counter", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                    lambda: engine.prefix_cache_hits, name),
            *self._spec_readings(),
        ]

    def _spec_readings(self) -> list[Reading]:
        """Speculative decoding's counters, under m3jax's and vLLM's names (none without a draft): verifications,
        draft tokens verified, accepted ones, and accepted by draft position."""
        k = self.engine.num_speculative_tokens
        if not k:
            return []
        stats, name = self.engine.stats, (("model_name", self.model_name),)
        out = []
        for ours, theirs, key, doc in (
                ("drafts", "drafts", "spec_num_drafts", "Verifications of a request's draft tokens"),
                ("draft_tokens", "draft_tokens", "spec_num_draft_tokens", "Draft tokens verified"),
                ("accepted_tokens", "accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted")):
            out.append(Reading("counter", f"m3jax_spec_decode_num_{ours}", doc, lambda key=key: stats.get(key, 0)))
            out.append(Reading("counter", f"vllm:spec_decode_num_{theirs}", doc + ".",
                               lambda key=key: stats.get(key, 0), name))
        for pos in range(k):
            key, at = f"spec_accepted_at_{pos}", ("position", str(pos))
            out.append(Reading("counter", "m3jax_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                               "by position in the draft", lambda key=key: stats.get(key, 0), (at,)))
            out.append(Reading("counter", "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                               "position.", lambda key=key: stats.get(key, 0), (*name, at)))
        return out

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- requests ------------------------------------------------------------------------------------------
    def open(self, prompt: PromptSource, params: SamplingParams, api: str, request_id: str | None = None,
             prefix: str = "req", max_tokens_param: str | None = None, plan: OutputPlan | None = None
             ) -> RequestStream:
        """Admit a request, or refuse it at once: ShuttingDown, Overloaded, ValueError (duplicate id). Runs on
        the event loop, so the check and the insertion are atomic with respect to other requests.

        `max_tokens_param`: the field in which the client set max_tokens (its name goes into the error when the
        prompt and max_tokens do not fit the model length), or None when the client did not set it and
        `params.max_tokens` is only a default (then it is lowered to what fits). `plan`: what the output goes
        through (`chat_plan`), completed when the prompt has been rendered."""
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if len(self.active) >= self.max_queue:
            self.metrics.overloaded()
            raise Overloaded(f"the server is at its limit of {self.max_queue} requests in flight; retry later")
        rid = request_id or f"{prefix}-{uuid.uuid4().hex}"
        if rid in self.active:
            raise ValueError(f"request id {rid!r} is already in flight")
        stream = RequestStream(self, prompt, params, rid, api, max_tokens_param, plan)
        self.active[rid] = stream
        return stream

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenising threads, so the event loop keeps answering (/health, other streams)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def prepare(self, prompt: PromptSource, params: SamplingParams, max_tokens_param: str | None,
                      plan: OutputPlan | None = None) -> tuple[list[int], SamplingParams]:
        if isinstance(prompt, list | tuple) and params.structured_outputs is None and not (plan and plan.forced):
            # Token ids and no grammar to compile: O(prompt) list work, bounded by the model length. On the loop,
            # it saves the time to first token two hand-overs to and from a worker thread.
            return self.fit(prompt, params, max_tokens_param, plan)
        return await self.run_blocking(self.fit, prompt, params, max_tokens_param, plan)

    def prompt_ids(self, prompt: PromptSource) -> list[int]:
        """Token ids of a prompt (a worker thread's work for text and chat templates); ValueError if it has none."""
        if callable(prompt):
            return prompt()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send the prompt as token ids")
            try:
                return self.tokenizer.encode(prompt)
            except (TypeError, UnicodeError) as e:  # e.g. an unpaired UTF-16 surrogate from a JSON client
                raise ValueError(f"the prompt is not valid text: {e}") from e
        return list(prompt)

    def fit(self, prompt: PromptSource, params: SamplingParams, max_tokens_param: str | None,
            plan: OutputPlan | None = None) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the request's SamplingParams checked against the model length (vLLM's rule: a
        max_tokens the client set that does not fit is a 400, never silently lowered; a default is lowered), and
        completed by `plan` (reasoning phase, tool-call grammar, gate), its grammar compiled (a RequestError
        naming the field that asked for it when it is not valid)."""
        ids = self.prompt_ids(prompt)
        n, limit = len(ids), self.engine.max_model_len
        if not ids:
            raise RequestError("the prompt is empty")
        if n >= limit:
            raise RequestError(f"the prompt has {n} tokens; this server's model length is {limit} (prompt plus "
                               "at least one generated token)", num_prompt_tokens=n)
        room = limit - n
        if max_tokens_param is None:
            if params.max_tokens > room:
                params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise RequestError(f"`{max_tokens_param}` is too large: {params.max_tokens}. This model's maximum "
                               f"context length is {limit} tokens and your request has {n} input tokens "
                               f"({params.max_tokens} > {limit} - {n})", max_tokens_param, n)
        if plan is not None:
            params = self._apply_plan(plan, ids, params)
        return ids, params

    def chat_plan(self, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool = True,
                  keep_special: bool = False, structured_param: str | None = None) -> OutputPlan:
        """The OutputPlan of a chat request from its fields (RequestError naming the field at fault)."""
        checked = check_tools(tools)
        mode, name = check_tool_choice(tool_choice, checked)
        parsed = None
        if checked is not None and mode != "none":
            if not self.tool_call_parser:
                raise RequestError(f"tool calling is turned off on this server ({flag('tool_call_parser')} none): "
                                   "send `tool_choice: \"none\"` or no tools", "tool_choice")
            parsed = inline_tool_refs(checked)
        if structured_param is not None and parsed is not None and mode in ("required", "function"):
            raise RequestError(f"`{structured_param}` and a forced tool call (`tool_choice` {tool_choice!r}) both "
                               "constrain the reply; send one of them", structured_param)
        plan = OutputPlan(reasoning=self.reasoning_parser, tools=parsed, tool_choice=mode, function=name,
                          parallel_tool_calls=parallel_tool_calls, keep_special=keep_special,
                          structured_param=structured_param)
        if plan.forced:
            try:  # a schema no call can satisfy is the request's fault: found now, before anything runs
                tool_call_grammar(plan.tools or [], function=name, special_tokens=self.special_tokens)
            except ValueError as e:
                raise RequestError(f"tools: {e}", "tools") from None
        return plan

    def _apply_plan(self, plan: OutputPlan, ids: list[int], params: SamplingParams) -> SamplingParams:
        """Complete `plan` for the rendered prompt `ids` and return the SamplingParams that carry it out."""
        changes: dict[str, Any] = {}
        if plan.reasoning:
            plan.phase = initial_phase_from_ids(ids, self.tokenizer)
        if plan.parses:
            changes["skip_special_tokens"] = False  # the parsers read the markers
            if not plan.keep_special:
                plan.strip = tuple(self.special_tokens)
        structured = params.structured_outputs
        if plan.forced:
            grammar = tool_call_grammar(plan.tools or [], function=plan.function,
                                        parallel=plan.parallel_tool_calls, special_tokens=self.special_tokens,
                                        optional_thinking=plan.phase is ReasoningPhase.UNDECIDED)
            structured = StructuredOutputsParams(grammar=grammar)
        if structured is not None and plan.phase is ReasoningPhase.REASONING:
            # The prompt opened a thinking block: the grammar constrains the reply after it.
            structured = dataclasses.replace(structured, start_after_token=self.special_tokens[THINK_END])
        changes["structured_outputs"] = structured
        if plan.tools is not None and plan.tool_choice == "auto" and not plan.parallel_tool_calls:
            # At most one call: generation stops where the first invoke closes (the parser closes the call).
            plan.internal_stop = INVOKE_END
            changes["stop"] = [*params.stops, INVOKE_END]
        params = dataclasses.replace(params, **changes)
        if structured is not None:
            self._check_grammar(params, plan.structured_param or "tools")
        return params

    def _check_grammar(self, params: SamplingParams, param: str) -> None:
        """Compile the request's grammar here, on a worker thread: an invalid one is refused naming the field
        that asked for it, and the engine's prepare (on the event loop) then copies the compiled grammar from
        its cache instead of building it."""
        try:
            self.engine.compile_grammar(params)
        except ValueError as e:
            raise RequestError(str(e), param) from None

    def _release(self, stream: RequestStream) -> None:
        if self.active.get(stream.request_id) is stream:
            del self.active[stream.request_id]
            reason = stream.finish_reason or "unknown"
            if stream.reached_engine and reason != "invalid":
                end = stream._last if stream._last is not None else time.monotonic()
                decode = end - stream._first if stream._first is not None else None
                self.metrics.finished(stream.api, reason, e2e=end - stream.arrival, decode=decode,
                                      prompt_tokens=stream.num_prompt_tokens, generated=stream.num_tokens,
                                      max_tokens=stream.params.max_tokens)
            else:
                self.metrics.finished(stream.api, reason)

    def encode_chat(self, messages: Any, **template_kwargs: Any) -> list[int]:
        """Prompt ids of a conversation through the checkpoint's chat template (ValueError for a bad one). Run
        it on a worker thread (`run_blocking`, or hand `functools.partial(core.encode_chat, ...)` to `open`)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template: send token ids")
        template_kwargs.setdefault("add_generation_prompt", True)
        try:
            return self.tokenizer.encode_chat(messages, **template_kwargs)
        except TypeError as e:  # a wrong argument type from a client's JSON
            raise ValueError(str(e)) from None

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
        facts = e.facts
        return {
            "model": self.model_name,
            "path": self.model_path,
            "max_model_len": facts.max_model_len,
            "vocab_size": facts.vocab_size,
            "eos_token_ids": sorted(facts.eos_token_ids),
            "has_tokenizer": e.tokenizer is not None,
            "dtype": facts.dtype,
            "tensor_parallel_size": facts.tensor_parallel_size,
            "device": facts.device,
            "page_size": facts.page_size,
            "num_pages": e.num_pages,
            "pages_in_use": e.pages_in_use,
            "num_waiting": e.num_waiting,
            "num_running": e.num_running,
            "requests_in_flight": len(self.active),
            "max_queue": self.max_queue,
        }


def version() -> str:
    from m3jax.cli import version as m3jax_version

    return m3jax_version()


# ---- logging ----------------------------------------------------------------------------------------------------

# LogRecord's own attributes; anything else on a record came through `extra=` and goes into a JSON line.
_RECORD_FIELDS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's `extra` fields (stage, request
    id, status, tokens/s, ...), for log collectors."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Log lines to stderr, one per event, whether or not it is a terminal (systemd, docker, a file)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


# ---- the command -------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p)


def max_request_body(settings: Settings, max_model_len: int) -> int:
    """Bytes of the largest HTTP request body: --max-request-body-mb, else room for a prompt of the whole model
    length (32 bytes a token covers JSON-escaped text and token-id lists) plus 1 MiB for the rest."""
    if settings.max_request_body_mb is not None:
        return int(settings.max_request_body_mb * 2**20)
    return 2**20 + 32 * max_model_len


def preflight(settings: Settings) -> None:
    """What can be checked from the model's config.json alone, before any weight is read: the model exists,
    and --max-model-len is within its limit."""
    from m3jax.config import PRESETS
    from serving.core import model_len

    if settings.model in PRESETS:
        cfg = PRESETS[settings.model]
    else:
        from checkpoints.loader import read_config
        from m3jax.api import embedded_model_path

        path = Path(settings.model) if settings.model is not None else embedded_model_path()
        if not path.is_dir():
            raise FileNotFoundError(f"model {settings.model!r} is neither a checkpoint directory nor a preset "
                                    f"({', '.join(PRESETS)})")
        cfg = read_config(path)
    model_len(settings, cfg.max_position_embeddings)


@dataclasses.dataclass
class Listeners:
    """Both ports, bound before the model loads so that a port in use (or an address that is not ours) fails
    in a second, not after minutes of loading. The HTTP socket is bound and not listening (connections are
    refused, not queued, until the server starts); the gRPC port is held by a probe socket that is closed just
    before grpc binds it."""

    http: socket.socket | None
    grpc_probe: socket.socket | None

    @classmethod
    def bind(cls, s: Settings) -> Listeners:
        http = _bind(s.host, s.http_port, "HTTP") if s.http_port >= 0 else None
        try:
            probe = _bind(s.host, s.grpc_port, "gRPC") if s.grpc_port >= 0 else None
        except OSError:
            if http is not None:
                http.close()
            raise
        return cls(http, probe)

    def release_grpc(self) -> None:
        if self.grpc_probe is not None:
            self.grpc_probe.close()
            self.grpc_probe = None

    def close(self) -> None:
        self.release_grpc()
        if self.http is not None:
            self.http.close()


def _bind(host: str, port: int, what: str) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"{flag('host')} {host!r}: not an address of this machine ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:
            raise OSError(f"{flag('host')} {host!r}: not an address of this machine ({e.strerror})") from None
        port_flag = flag("grpc_port" if what == "gRPC" else "http_port")
        raise OSError(f"cannot use {_hostport(host, port)} for the {what} server ({port_flag}): "
                      f"{e.strerror or e}") from None
    return sock


# The start-up stage, for the line a signal during start-up leaves in the log.
_stage = "starting"


# In the engine process: hands each stage and its log line to the servers' process, which logs it.
stage_listener: Callable[[str, str], None] | None = None


def _set_stage(stage: str, message: str, *args: Any) -> None:
    if stage_listener is not None:
        stage_listener(stage, message % args)
    else:
        _note_stage(stage, message % args)


def _note_stage(stage: str, line: str) -> None:
    """Enter a stage, then log its line: a signal that follows the line names this stage. The engine process's
    stages are logged here too, not there, or a signal could land between its line and the news of its stage."""
    global _stage
    _stage = stage
    log.info("%s", line, extra={"stage": stage})


def _exit_during_startup(signum: int, frame: types.FrameType | None) -> None:
    """A signal before the servers run: nothing to drain, so leave now, with exit 0 (a deliberate stop). Not an
    exception: the main thread may be inside library code that catches and swallows exceptions."""
    log.warning("%s during start-up (%s): exiting", signal.Signals(signum).name, _stage,
                extra={"stage": "interrupted", "during": _stage})
    _flush_and_exit()


def _flush_and_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _on_signals(handler: Callable[[int, types.FrameType | None], None]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def build_engine(settings: Settings) -> EngineCore:
    """Load the model and build the engine (compile or load every step shape), logging each stage."""
    from serving.core import load
    from serving.runner import token_buckets

    t0 = time.perf_counter()
    _set_stage("loading", "loading %s", settings.model or "the embedded tiny model")
    model, tokenizer = load(settings)
    _set_stage("loaded", "model loaded in %.1fs: %.1fM parameters, %s, %d device(s)", time.perf_counter() - t0,
               model.cfg.param_count() / 1e6, settings.compute_dtype(), settings.tensor_parallel_size)
    t1 = time.perf_counter()
    if settings.warmup:
        buckets = token_buckets(settings.max_num_batched_tokens)
        _set_stage("compiling", "compiling %d step shapes (%s tokens), or loading them from %s",
                   len(buckets), ", ".join(map(str, buckets)),
                   settings.compilation_cache_dir if settings.enable_compilation_cache else "nowhere (cache off)")
    else:
        _set_stage("compiling", "building the engine (--no-warmup: step shapes compile on first use)")
    engine = EngineCore(settings, model, tokenizer)
    _set_stage("engine_ready", "engine ready in %.1fs: %d step executables in %.1fs, %d KV pages of %d tokens, "
               "model length %d", time.perf_counter() - t1, engine.num_executables, engine.warmup_seconds,
               engine.num_pages, model.page_size, engine.max_model_len)
    return engine


def _start_engine(settings: Settings) -> EngineCore | RemoteCore:
    """The engine, in a process of its own (`--engine-process`) or in this one (`build_engine`), built on a
    worker thread; the main thread only waits, in short slices, so a signal handler runs at once even while the
    worker is inside a long load or compile."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            if settings.engine_process:
                _set_stage("starting_engine", "starting the engine process")
                box["engine"] = RemoteCore(settings, on_stage=_note_stage)
            else:
                box["engine"] = build_engine(settings)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            box["error"] = e

    worker = threading.Thread(target=run, name="m3jax-startup", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["engine"]


def serve(args: argparse.Namespace) -> int:
    settings = Settings.from_args(args)  # every flag checked (ValueError names it)
    preflight(settings)
    try:
        listeners = Listeners.bind(settings)
    except OSError as e:  # a port in use, an address that is not ours: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    setup_logging(settings.log_level, settings.log_format)
    # From here until the event loop takes them over, a signal ends the process at once, with exit 0.
    _on_signals(_exit_during_startup)
    try:
        engine = _start_engine(settings)
    except BaseException:
        listeners.close()
        raise
    name = settings.served_model_name or (settings.model if settings.model is not None else "m3jax/tiny")
    core = ServingCore(engine, AsyncEngine(engine), name, settings.model or "embedded", settings.max_queue,
                       settings.api_key, settings.reasoning_parser, settings.tool_call_parser)
    # At high concurrency the event loop's per-token work (SSE writes, metrics) and the engine thread's share one
    # GIL. uvloop makes the loop's part cheaper (it is installed already: orbax-checkpoint requires it), and a
    # 0.5 ms switch interval (Python's is 5 ms) hands the GIL back to the engine thread sooner after each wait
    # for the device, so that the next step is dispatched on time.
    sys.setswitchinterval(0.0005)
    freeze_heap()  # after the engine (in this process or its own) is ready, before the first request
    try:
        asyncio.run(_serve_async(core, settings, listeners), loop_factory=_event_loop_factory())
    except (OSError, EngineLost) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        listeners.close()
        core.executor.shutdown(wait=False, cancel_futures=True)
        # The loop has handed the signals back: one during the rest of the teardown just ends the process.
        _on_signals(lambda signum, frame: _flush_and_exit())
    return 0


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # asyncio's own loop: correct, with more host time per token
        return None
    return uvloop.new_event_loop


async def _serve_async(core: ServingCore, args: Settings, listeners: Listeners | None = None) -> None:
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
                     sig.name, args.shutdown_timeout, extra={"stage": "draining"})
            stop.set()
        elif signals == 2:
            log.info("%s again: aborting %d in-flight requests (a third signal exits at once)", sig.name,
                     len(core.active), extra={"stage": "aborting"})
            core.abort_all()
        else:
            log.warning("%s a third time: exiting now", sig.name, extra={"stage": "exit"})
            _flush_and_exit()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    engine_lost = False

    def on_engine_exit() -> None:  # the engine process ended unasked (crashed, killed): nothing left to serve
        nonlocal engine_lost
        engine_lost = True
        log.error("the engine process is gone: shutting down", extra={"stage": "engine_lost"})
        stop.set()

    if isinstance(core.engine, RemoteCore):
        core.engine.on_exit = lambda: loop.call_soon_threadsafe(on_engine_exit)

    _set_stage("starting_servers", "starting the servers")
    grpc_server = GrpcServer(core) if args.grpc_port >= 0 else None
    max_body = max_request_body(args, core.engine.max_model_len)
    http_server = (HttpServer(core, shutdown_timeout=args.shutdown_timeout, max_body_bytes=max_body)
                   if args.http_port >= 0 else None)
    parts = []
    stats_task: asyncio.Task[None] | None = None
    try:
        if grpc_server is not None:
            if listeners is not None:
                listeners.release_grpc()
            port = await grpc_server.start(args.host, args.grpc_port)
            parts.append(f"grpc={_hostport(args.host, port)}")
        if http_server is not None:
            sock = listeners.http if listeners is not None else None
            port = await http_server.start(args.host, args.http_port, sock)
            parts.append(f"http=http://{_hostport(args.host, port)}")
        if args.throughput_log_interval > 0:
            stats_task = asyncio.create_task(_log_throughput(core, args.throughput_log_interval))
        # One line that scripts and tests wait for: the real ports (port 0 asks for any free one).
        print(f"[m3jax] ready: {' '.join(parts)} model={core.model_name}", flush=True)
        _set_stage("ready", "ready: %s model=%s", " ".join(parts), core.model_name)
        await stop.wait()
    finally:
        core.draining = True
        if stats_task is not None:
            stats_task.cancel()
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
        if engine_lost:
            raise EngineLost("the engine process exited")
        log.info("shut down cleanly", extra={"stage": "stopped"})


async def _log_throughput(core: ServingCore, interval: float) -> None:
    """vLLM's periodic line: prompt and generation tokens/s over the last interval, running and waiting
    requests, KV cache use, prefix cache hit rate. At INFO while there is work (and once more when it stops),
    at DEBUG while idle."""
    e, m = core.engine, core.metrics
    t0, p0, g0 = time.monotonic(), m.prompt_tokens_count, m.generation_tokens_count
    q0, h0 = e.prefix_cache_queries, e.prefix_cache_hits
    was_busy = False
    while True:
        await asyncio.sleep(interval)
        t1, p1, g1 = time.monotonic(), m.prompt_tokens_count, m.generation_tokens_count
        q1, h1 = e.prefix_cache_queries, e.prefix_cache_hits
        dt = max(t1 - t0, 1e-9)
        running, waiting = e.num_running, e.num_waiting
        busy = bool(p1 - p0 or g1 - g0 or running or waiting)
        fields = {
            "prompt_throughput": round((p1 - p0) / dt, 1), "generation_throughput": round((g1 - g0) / dt, 1),
            "running": running, "waiting": waiting,
            "kv_cache_usage": round(100 * e.pages_in_use / max(e.num_pages, 1), 1),
            "prefix_cache_hit_rate": round(100 * (h1 - h0) / (q1 - q0), 1) if q1 > q0 else 0.0,
        }
        stats_log.log(logging.INFO if busy or was_busy else logging.DEBUG,
                      "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d "
                      "reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                      *fields.values(), extra=fields)
        t0, p0, g0, q0, h0, was_busy = t1, p1, g1, q1, h1, busy


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def request_log_fields(stream: RequestStream | None) -> Mapping[str, Any]:
    """The per-request part of an access log line."""
    if stream is None:
        return {}
    return {"request_id": stream.request_id, "prompt_tokens": stream.num_prompt_tokens,
            "completion_tokens": stream.num_tokens, "finish_reason": stream.finish_reason}
