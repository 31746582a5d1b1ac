"""The gRPC front end (`m3jax.v1.M3Jax`, see serving/proto/m3jax.proto), with the standard health service and
server reflection, on grpc.aio in the engine interface's asyncio loop.

Status codes: a bad request -> INVALID_ARGUMENT (the message says what is wrong; a `max_tokens` that does not
fit the model length after the prompt is one, while an unset one means "what fits, at most 16");
back-pressure -> RESOURCE_EXHAUSTED (with `grpc-retry-pushback-ms` trailing metadata); shutting down ->
UNAVAILABLE; a missing or wrong API key -> UNAUTHENTICATED; an engine failure after tokens were sent ->
INTERNAL. grpc.aio cancels the handler task when the client cancels or the deadline passes; the handler's
`async with RequestStream` then aborts the engine request and frees its pages. Prompts are tokenised (chat
templates rendered) on a worker thread. One access log line per Generate call (logger `m3jax.access`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.outputs import RequestOutput, SamplingParams
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc
from serving.server import Overloaded, PromptSource, RequestStream, ServingCore, ShuttingDown, request_log_fields

log = logging.getLogger(__name__)
access_log = logging.getLogger("m3jax.access")
RETRY_AFTER_SECONDS = 1

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["M3Jax"].full_name

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}

# proto3 `optional` fields of SamplingParams map one to one onto serving.outputs.SamplingParams; unset ones
# keep that class's defaults.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens")


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """ValueError (naming the field) for values the engine cannot take."""
    kwargs: dict[str, object] = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


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

    def _prompt(self, request: pb.GenerateRequest) -> PromptSource:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise ValueError("the prompt is empty")
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            # Rendered and tokenised on a worker thread, when the stream starts.
            return functools.partial(self.core.encode_chat, messages)
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
                prompt = self._prompt(request)
                params = sampling_params(request.sampling)
                given = "max_tokens" if request.sampling.HasField("max_tokens") else None
                stream = self.core.open(prompt, params, "grpc", request.request_id or None, prefix="grpc",
                                        max_tokens_param=given)
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
                first, sent_logprobs = True, 0
                try:
                    async for out in stream:
                        yield self._response(stream, out, first, sent_logprobs)
                        first = False
                        sent_logprobs = len(out.outputs[0].logprobs or ())
                except ValueError as e:  # raised before the first token: the request is refused
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

    @staticmethod
    def _response(stream: RequestStream, out: RequestOutput, first: bool, sent_logprobs: int) -> pb.GenerateResponse:
        c = out.outputs[0]
        msg = pb.GenerateResponse(request_id=stream.request_id, token_ids=out.delta_token_ids, text=out.delta_text)
        if first:
            msg.prompt_token_ids.extend(out.prompt_token_ids)
        for lp in (c.logprobs or [])[sent_logprobs:]:
            msg.logprobs.append(pb.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top.items()]))
        if out.finished:
            msg.finish_reason = _FINISH.get(c.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
            if isinstance(c.stop_reason, str):
                msg.stop_string = c.stop_reason
            elif isinstance(c.stop_reason, int):
                msg.stop_token_id = c.stop_reason
            n_prompt, n_out = len(out.prompt_token_ids), len(c.token_ids)
            msg.usage.CopyFrom(pb.Usage(prompt_tokens=n_prompt, completion_tokens=n_out,
                                        total_tokens=n_prompt + n_out))
        return msg

    async def Abort(self, request: pb.AbortRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._authorize(context)
        return pb.AbortResponse(found=self.core.abort(request.request_id))

    async def ModelInfo(self, request: pb.ModelInfoRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        await self._authorize(context)
        return pb.ModelInfoResponse(**self.core.model_info())


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
