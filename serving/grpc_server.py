"""The gRPC front end (`m3jax.v1.M3Jax`, see serving/proto/m3jax.proto), with the standard health service and
server reflection, on grpc.aio in the engine interface's asyncio loop.

Status codes: a bad request -> INVALID_ARGUMENT (the message says what is wrong; a `max_tokens` that does not
fit the model length after the prompt is one, while an unset one means "what fits, at most 16");
back-pressure -> RESOURCE_EXHAUSTED (with `grpc-retry-pushback-ms` trailing metadata); shutting down ->
UNAVAILABLE; a missing or wrong API key -> UNAUTHENTICATED; an engine failure after tokens were sent ->
INTERNAL. grpc.aio cancels the handler task when the client cancels or the deadline passes; the handler's
`async with RequestStream` then aborts the engine request and frees its pages. Prompts are tokenised (chat
templates rendered) on a worker thread. One access log line per Generate call (logger `m3jax.access`).

The same features as the HTTP server: n choices (each message carries its `index`), logit_bias, structured
outputs, and for chat requests tools / tool_choice (forced calls by grammar), the reasoning split
(`reasoning_text`) and tool calls (`tool_calls` deltas, FINISH_REASON_TOOL_CALLS), through the same
`OutputPlan` / `MessageParser` (serving/server.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.outputs import Logprob, RequestOutput, SamplingParams
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc
from serving.server import (
    MessageParser,
    OutputPlan,
    Overloaded,
    PromptSource,
    RequestError,
    RequestStream,
    ServingCore,
    ShuttingDown,
    check_template_kwargs,
    request_log_fields,
)
from serving.structured import StructuredOutputsParams

log = logging.getLogger(__name__)
access_log = logging.getLogger("m3jax.access")
RETRY_AFTER_SECONDS = 1

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["M3Jax"].full_name

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
           "tool_calls": pb.FINISH_REASON_TOOL_CALLS}

# proto3 `optional` fields of SamplingParams map one to one onto serving.outputs.SamplingParams; unset ones
# keep that class's defaults.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens", "n",
                    "prompt_logprobs")


def structured_outputs(msg: pb.StructuredOutputs) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            schema = json.loads(msg.json_schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json_schema is not valid JSON: {e}") from None
        return StructuredOutputsParams(json=schema)
    if kind == "json_object":
        if not msg.json_object:
            raise ValueError("structured_outputs.json_object: set it to true (or leave structured_outputs unset)")
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """ValueError (naming the field) for values the engine cannot take."""
    kwargs: dict[str, object] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.logit_bias:
        kwargs["logit_bias"] = {int(t): float(b) for t, b in msg.logit_bias.items()}
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs(msg.structured_outputs)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def _tools(chat: pb.Chat) -> list[dict[str, Any]] | None:
    tools = []
    for i, t in enumerate(chat.tools):
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        if t.parameters:
            try:
                fn["parameters"] = json.loads(t.parameters)
            except ValueError as e:
                raise ValueError(f"chat.tools[{i}].parameters is not valid JSON: {e}") from None
        tools.append({"type": "function", "function": fn})
    return tools or None


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        if not m.content:
            out["content"] = None
    for field in ("tool_call_id", "reasoning_content", "name"):
        if getattr(m, field):
            out[field] = getattr(m, field)
    return out


class M3JaxServicer(pb_grpc.M3JaxServicer):
    def __init__(self, core: ServingCore):
        self.core = core

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        if self.core.api_key is None:
            return True
        header = dict(context.invocation_metadata() or ()).get("authorization")
        return self.core.check_api_key(header if isinstance(header, str) else None)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send metadata `authorization: Bearer <key>`")

    def _prompt(self, request: pb.GenerateRequest) -> tuple[PromptSource, OutputPlan]:
        """The prompt, and what the output goes through (RequestError / ValueError for a bad request)."""
        kind = request.WhichOneof("prompt")
        sampling = request.sampling
        structured = "sampling.structured_outputs" if sampling.HasField("structured_outputs") else None
        if kind == "text":
            if not request.text:
                raise ValueError("the prompt is empty")
            return request.text, OutputPlan(structured_param=structured)
        if kind == "token_ids":
            return list(request.token_ids.ids), OutputPlan(structured_param=structured)
        if kind == "chat":
            chat = request.chat
            tools = _tools(chat)
            which = chat.WhichOneof("tool_choice")
            choice: Any = None
            if which == "tool_choice_mode":
                choice = chat.tool_choice_mode
            elif which == "tool_choice_function":
                choice = {"type": "function", "function": {"name": chat.tool_choice_function}}
            keep = sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
            parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
            plan = self.core.chat_plan(tools, choice, parallel, keep, structured)
            kwargs = check_template_kwargs(chat.chat_template_kwargs)
            if tools:
                kwargs["tools"] = tools
            messages = [_message(m) for m in chat.messages]
            # Rendered and tokenised on a worker thread, when the stream starts.
            return functools.partial(self.core.encode_chat, messages, **kwargs), plan
        raise ValueError("the request has no prompt: set one of text, token_ids or chat")

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 - the name comes from the proto
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        t0 = time.monotonic()
        # Read now: once the call is over (cancelled, deadline) its context must not be asked anything.
        peer = context.peer()
        code = grpc.StatusCode.OK
        stream: RequestStream | None = None
        try:
            if not self._authorized(context):
                code = grpc.StatusCode.UNAUTHENTICATED
                await self._authorize(context)
            try:
                params = sampling_params(request.sampling)
                prompt, plan = self._prompt(request)
                given = "max_tokens" if request.sampling.HasField("max_tokens") else None
                stream = self.core.open(prompt, params, "grpc", request.request_id or None, prefix="grpc",
                                        max_tokens_param=given, plan=plan)
            except ValueError as e:
                code = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(e))
            except Overloaded as e:
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
                # gRPC's own retry throttling reads this: when to try again.
                await context.abort(code, str(e), trailing_metadata=(
                    ("grpc-retry-pushback-ms", str(1000 * RETRY_AFTER_SECONDS)),))
            except ShuttingDown as e:
                code = grpc.StatusCode.UNAVAILABLE
                await context.abort(code, str(e))
            async with stream:
                answer = _Answer(stream, request.WhichOneof("prompt") == "chat")
                try:
                    async for out in stream:
                        yield answer.response(out)
                except RequestError as e:  # raised before the first token: the request is refused
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    await context.abort(code, f"{e.param}: {e}" if e.param and e.param not in str(e) else str(e))
                except ValueError as e:
                    code = grpc.StatusCode.INVALID_ARGUMENT
                    await context.abort(code, str(e))
                except RuntimeError as e:
                    code = grpc.StatusCode.INTERNAL
                    await context.abort(code, str(e))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client cancelled, or its deadline passed
            raise
        finally:
            fields = {"method": "Generate", "status": code.name, "latency": round(time.monotonic() - t0, 4),
                      **request_log_fields(stream)}
            extra = "".join(f" {k}={fields[k]}" for k in ("prompt_tokens", "completion_tokens", "finish_reason",
                                                          "request_id") if k in fields)
            access_log.info("%s gRPC Generate %s %.3fs%s", peer, code.name, fields["latency"], extra,
                            extra=fields)

    async def Abort(self, request: pb.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._authorize(context)
        return pb.AbortResponse(found=self.core.abort(request.request_id))

    async def ModelInfo(self, request: pb.ModelInfoRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        await self._authorize(context)
        return pb.ModelInfoResponse(**self.core.model_info())


def _token_logprob(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank or 0,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()])


class _Answer:
    """The GenerateResponses of one request, one per output (each a delta: RequestOutputKind.DELTA), with each
    choice's message parser and the usage so far."""

    def __init__(self, stream: RequestStream, chat: bool):
        self.stream = stream
        self.parse = chat and stream.plan.parses
        self.first = True
        self.sent_prompt_logprobs = False
        self.parsers: dict[int, MessageParser] = {}
        self.completion_tokens = 0

    def response(self, out: RequestOutput) -> pb.GenerateResponse:
        c = out.outputs[0]
        plan = self.stream.plan
        msg = pb.GenerateResponse(request_id=self.stream.request_id, token_ids=out.delta_token_ids, index=c.index)
        if self.first:
            msg.prompt_token_ids.extend(out.prompt_token_ids)
            self.first = False
        parser = None
        if self.parse:
            parser = self.parsers.setdefault(c.index, MessageParser(plan))
            parts = [parser.push(out.delta_text)] if out.delta_text else []
            if out.finished:
                parts.append(parser.finish())
            msg.text = "".join(p.content for p in parts)
            msg.reasoning_text = "".join(p.reasoning for p in parts)
            for p in parts:
                for call in p.tool_calls:
                    fn = call.get("function", {})
                    msg.tool_calls.append(pb.ToolCallDelta(index=call["index"], id=call.get("id", ""),
                                                           name=fn.get("name", ""),
                                                           arguments=fn.get("arguments", "")))
        else:
            msg.text = out.delta_text
        if out.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            self.sent_prompt_logprobs = True
            msg.prompt_logprobs.extend(_token_logprob(lp) for lp in out.prompt_logprobs[1:])
        msg.logprobs.extend(_token_logprob(lp) for lp in c.logprobs or ())
        self.completion_tokens += len(out.delta_token_ids)
        if out.finished:
            reason, stop = c.finish_reason, c.stop_reason
            if parser is not None:
                reason, stop = parser.finish_reason(reason), parser.stop_reason(stop)
            elif stop is not None and stop == plan.internal_stop:
                stop = None
            msg.finish_reason = _FINISH.get(reason or "", pb.FINISH_REASON_UNSPECIFIED)
            if isinstance(stop, str):
                msg.stop_string = stop
            elif isinstance(stop, int):
                msg.stop_token_id = stop
            if self.stream.choices_left == 0:  # the stream's last message: usage of every choice
                n_prompt = len(out.prompt_token_ids)
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=n_prompt, completion_tokens=self.completion_tokens,
                                            total_tokens=n_prompt + self.completion_tokens))
        return msg


class GrpcServer:
    def __init__(self, core: ServingCore):
        self.core = core
        # so_reuseport off: a second server asking for a port in use must fail, not silently share it.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_M3JaxServicer_to_server(M3JaxServicer(core), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)

    async def start(self, host: str, port: int) -> int:
        """Bind and start; returns the bound port (port 0 = any free one)."""
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self.server.add_insecure_port(address)
        except RuntimeError as e:  # grpcio reports a port in use as RuntimeError; it is an OS-level failure
            raise OSError(f"gRPC cannot bind {address}: {e}") from None
        if bound == 0:
            raise OSError(f"gRPC cannot bind {address}")
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return bound

    async def stop(self, grace: float) -> None:
        # NOT_SERVING first so that load balancers stop routing here while in-flight calls finish.
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
