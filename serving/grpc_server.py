"""The gRPC front end (`m3jax.v1.M3Jax`, see serving/proto/m3jax.proto), with the standard health service and
server reflection, on grpc.aio in the engine interface's asyncio loop.

Status codes: a bad request -> INVALID_ARGUMENT (the message says what is wrong); back-pressure ->
RESOURCE_EXHAUSTED; shutting down -> UNAVAILABLE; a missing or wrong API key -> UNAUTHENTICATED; an engine
failure after tokens were sent -> INTERNAL. grpc.aio cancels the handler task when the client cancels or the
deadline passes; the handler's `async with RequestStream` then aborts the engine request and frees its pages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.core import Prompt
from serving.outputs import RequestOutput, SamplingParams
from serving.proto import m3jax_pb2 as pb
from serving.proto import m3jax_pb2_grpc as pb_grpc
from serving.server import Overloaded, RequestStream, ServingCore, ShuttingDown

log = logging.getLogger(__name__)

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

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.core.api_key is None:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization")
        if not self.core.check_api_key(header if isinstance(header, str) else None):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send metadata `authorization: Bearer <key>`")

    def _prompt(self, request: pb.GenerateRequest) -> Prompt:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise ValueError("the prompt is empty")
            return request.text
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "chat":
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            return self.core.encode_chat(messages)
        raise ValueError("the request has no prompt: set one of text, token_ids or chat")

    async def Generate(self, request: pb.GenerateRequest,  # noqa: N802 - the name comes from the proto
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await self._authorize(context)
        try:
            prompt = self._prompt(request)
            params = sampling_params(request.sampling)
            stream = self.core.open(prompt, params, "grpc", request.request_id or None, prefix="grpc")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ShuttingDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        async with stream:
            first, sent_logprobs = True, 0
            try:
                async for out in stream:
                    yield self._response(stream, out, first, sent_logprobs)
                    first = False
                    sent_logprobs = len(out.outputs[0].logprobs or ())
            except ValueError as e:  # raised before the first token: the engine refused the request
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))

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
