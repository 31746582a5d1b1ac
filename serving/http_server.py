"""The OpenAI-compatible HTTP front end (aiohttp): `/v1/completions`, `/v1/chat/completions` (SSE streaming or
not), `/v1/models`, `/v1/models/{id}`, and vLLM's `/tokenize`, `/detokenize`, `/version`, plus `/health` and
`/metrics` (Prometheus).

Requests are checked field by field before anything runs, and every refusal is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON / wrong types / values the engine cannot
take / unknown fields, 401 for a missing API key, 404 for an unknown model (`model_not_found`), 413 for a body over
the limit (refused from its Content-Length, before it is read), 429 for back-pressure (with `Retry-After`), 503
while shutting down. Nothing a client asks for is silently changed: what OpenAI's API has and this server does not
(`UNSUPPORTED`: suffix, min_tokens, the legacy functions, ...) is a 400 naming the field, and so is a max_tokens
that does not fit the model length after the prompt (vLLM's rule). Large bodies are parsed, and every prompt is
tokenised, on worker threads: the event loop, and with it /health and every other stream, never waits for them.

Both endpoints take `n` (choices with their index; chunks per choice when streaming; usage sums them), `logit_bias`
and structured output (`response_format` json_object / json_schema, vLLM's `structured_outputs` and `guided_*`);
completions take `echo` (with `logprobs`, the prompt's tokens lead them). With `--enable-prompt-logprobs` both take
vLLM's `prompt_logprobs` (per choice in completions, at the top of a chat answer; the first chunk when streaming;
without the flag a 400 naming it). Chat takes `tools`, `tool_choice`, `parallel_tool_calls` and
`chat_template_kwargs` (M3's `thinking_mode`), and its replies are split into `reasoning_content`, `content` and
`tool_calls` (serving/server.py `OutputPlan`, `MessageParser`).

Extras in vLLM's spelling: top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens,
chat_template_kwargs, add_generation_prompt, return_token_ids (token ids in each choice: `token_ids`, and
`prompt_token_ids` in its first chunk).

One access log line per request (logger `m3jax.access`; /health and /metrics at DEBUG): method, path, status,
latency, and for generation requests the request id, prompt and completion tokens and finish reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from serving.core import Prompt
from serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from serving.outputs import MAX_N, CumulativeOutput, Logprob, RequestOutput, SamplingParams
from serving.sampling import MAX_LOGIT_BIAS
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
    check_tools,
    request_log_fields,
    version,
)
from serving.structured import StructuredOutputsParams

log = logging.getLogger(__name__)
access_log = logging.getLogger("m3jax.access")

# Bodies above this are parsed on a worker thread (json.loads of a few MB takes tens of milliseconds).
_PARSE_INLINE_BYTES = 64 * 1024
RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait: admission slots free as requests finish

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class APIError(Exception):
    """A request refused with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


# ---- request parsing (pure functions: tested without a server) -----------------------------------------------


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (invalid byte at offset {e.start})") from None
    try:
        # NaN / Infinity are Python's extension of JSON, not JSON: refuse them rather than sample with them.
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_json_type(body)}")
    if "\\ud" in text.lower():
        # A `\ud800`-style escape can decode to a lone surrogate: valid JSON, but not text the tokenizer can take
        # (it raises TypeError deep inside). Refuse it here as the malformed input it is.
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the request contains an unpaired UTF-16 surrogate escape (not valid Unicode text)") \
                from None
    return body


def _get(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """body[name] checked against a JSON type; absent or null gives `default`."""
    v = body.get(name)
    if v is None:
        return default
    if kind is float:
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        v = float(v) if ok else v
        want = "a number"
    elif kind is int:
        # 5.0 is an integer as far as JSON is concerned (some clients serialise every number as a float).
        ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
        v = int(v) if ok else v
        want = "an integer"
    else:
        ok = isinstance(v, kind)
        want = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}[kind]
    if not ok:
        raise APIError(f"`{name}` must be {want}, got {_json_type(v)}", param=name)
    return v


def _int_list(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def completion_prompt(v: object) -> Prompt:
    """`prompt`: a string, a list of token ids, or a batch (list) of one of those; only batches of 1."""
    if v is None:
        raise APIError("`prompt` is required", param="prompt")
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(_int_list(p) for p in v)):
        if len(v) != 1:
            raise APIError(f"this server takes one prompt per request and got a batch of {len(v)}: "
                           "send them as separate requests", param="prompt")
        return v[0]
    if _int_list(v):
        if not v:
            raise APIError("`prompt` is empty", param="prompt")
        return list(v)  # type: ignore[arg-type]
    raise APIError("`prompt` must be a string, a list of token ids, or a list holding one of those",
                   param="prompt")


def chat_messages(v: object) -> list[dict[str, Any]]:
    """`messages` with OpenAI's list-of-parts content flattened to a string (text parts only)."""
    if not isinstance(v, list) or not v:
        raise APIError("`messages` must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(v):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            texts = []
            for j, part in enumerate(m["content"]):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                    raise APIError(f"messages[{i}].content[{j}]: only text parts are supported, got {kind!r}",
                                   param="messages")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _param_named_in(message: str) -> str | None:
    """SamplingParams' messages start with the field's name ("max_tokens: ...", "temperature must ...")."""
    head = message.replace(":", " ").split(" ", 1)[0]
    return head if head in _SAMPLING_FIELDS else None


@dataclasses.dataclass
class Options:
    """How to answer, besides what to generate."""

    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    # The field in which the client set max_tokens (named in the error when it does not fit the model length),
    # or None: not set, `SamplingParams.max_tokens` is a default that is lowered to what fits.
    max_tokens_param: str | None = None
    echo: bool = False  # completions: the prompt's text before each choice's text
    # Completions with echo and logprobs: the prompt's tokens lead the logprobs, with this many top entries.
    echo_logprobs: int | None = None
    # The client's `prompt_logprobs` (vLLM's field in the answer, this many top entries). Either may have made
    # SamplingParams.prompt_logprobs larger: each takes its own top entries.
    prompt_logprobs: int | None = None
    structured_param: str | None = None  # the field that asked for structured output
    keep_special: bool = False  # the client set skip_special_tokens=false


# ---- which fields a request may carry -------------------------------------------------------------------------

# The fields each endpoint reads (besides those of UNSUPPORTED at their neutral values).
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "skip_special_tokens", "stream", "stream_options", "return_token_ids", "n", "best_of", "logit_bias",
             "prompt_logprobs", *STRUCTURED_FIELDS}
COMPLETION_FIELDS = frozenset(_SAMPLING | {"prompt", "echo"})
CHAT_FIELDS = frozenset(_SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                                     "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls"})
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_generation_prompt", "chat_template_kwargs",
                             "return_token_strs", "tools"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
# OpenAI's bookkeeping fields, which never change what is generated: accepted, not used.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def _absent(v: Any) -> bool:
    return v is None


# OpenAI and vLLM request fields this server does not implement yet: (the values that ask for nothing, what the
# field is for). A request that sets one to anything else gets a 400 naming it, rather than an answer that
# silently ignores it. Implementing one = removing its entry and reading the field in `sampling_params` (and the
# endpoint's *_FIELDS above). `echo` is read by /v1/completions only.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: v is False, "echoing the prompt: only /v1/completions echoes it"),
    "suffix": (lambda v: v == "", "insertion after a suffix"),
    "functions": (lambda v: v == [], "the legacy function calling: send `tools`"),
    "function_call": (lambda v: v == "none", "the legacy function calling: send `tool_choice`"),
    "reasoning_effort": (_absent, "reasoning effort: M3's is chat_template_kwargs.thinking_mode"),
    "include_stop_str_in_output": (lambda v: v is False, "stop strings in the output"),
    "min_tokens": (lambda v: v == 0, "a minimum output length"),
    "allowed_token_ids": (_absent, "restricting the vocabulary"),
    "bad_words": (lambda v: v == [], "banned words"),
    "use_beam_search": (lambda v: v is False, "beam search"),
    "truncate_prompt_tokens": (_absent, "prompt truncation"),
    "continue_final_message": (lambda v: v is False, "continuing the final message"),
    "chat_template": (_absent, "a chat template of the client's"),
    "documents": (_absent, "documents for the chat template"),
    "modalities": (lambda v: v == ["text"], "audio output"),
    "audio": (_absent, "audio output"),
    "prediction": (_absent, "predicted outputs"),
    "web_search_options": (_absent, "web search"),
}


def check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """APIError naming the first field this endpoint does not take: one of UNSUPPORTED set to something, or one
    it does not know at all."""
    for name, value in body.items():
        if value is None or name in known or name in IGNORED_FIELDS:
            continue
        if name in UNSUPPORTED:
            neutral, what = UNSUPPORTED[name]
            if neutral(value):
                continue
            if "{value}" in what:
                raise APIError(what.format(value=value), param=name)
            raise APIError(f"`{name}` is not supported by this server ({what}); send the request without it",
                           param=name)
        raise APIError(f"unknown field `{name}`: this endpoint does not take it", param=name)


def logit_bias(v: object) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids (as JSON object keys, so strings) -> a bias in [-100, 100]."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise APIError(f"`logit_bias` must be an object mapping token ids to biases, got {_json_type(v)}",
                       param="logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise APIError(f"`logit_bias` has {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise APIError(f"`logit_bias` key {key!r} is not a token id (a non-negative integer)", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise APIError(f"`logit_bias[{key!r}]` must be a number in [-100, 100], got {bias!r}",
                           param="logit_bias")
        out[int(key)] = float(bias)
    return out or None


_STRUCTURED_KEYS = {"json": (dict, str), "json_object": (bool,), "regex": (str,), "choice": (list,),
                    "grammar": (str,)}


def structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """(what the output must follow, the field that asked for it): OpenAI's `response_format` (json_object,
    json_schema), vLLM's `structured_outputs` object and its older `guided_*` fields. At most one of them."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise APIError('`response_format` json_schema needs `"json_schema": {"name": ..., "schema": '
                               "{...}}`", param="response_format")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise APIError("`response_format.json_schema.name` must be a string", param="response_format")
            # `strict`: the schema is always enforced by constrained decoding, strict or not.
            asked.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            raise APIError('`response_format` must be {"type": "text"}, {"type": "json_object"} or {"type": '
                           f'"json_schema", "json_schema": {{...}}}}, got {fmt!r}'[:300], param="response_format")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise APIError(f"`structured_outputs` must be an object, got {_json_type(so)}",
                           param="structured_outputs")
        given = {k: v for k, v in so.items() if v is not None and v is not False}
        for k, v in given.items():
            if k not in _STRUCTURED_KEYS:
                raise APIError(f"`structured_outputs.{k}` is not supported by this server (it takes "
                               f"{', '.join(_STRUCTURED_KEYS)})", param="structured_outputs")
            if not isinstance(v, _STRUCTURED_KEYS[k]):
                want = " or ".join(_JSON_NAMES[t] for t in _STRUCTURED_KEYS[k])
                raise APIError(f"`structured_outputs.{k}` must be {want}", param="structured_outputs")
        asked.append(("structured_outputs", given))
    for name, key, kinds in (("guided_json", "json", (dict, str)), ("guided_regex", "regex", (str,)),
                             ("guided_choice", "choice", (list,)), ("guided_grammar", "grammar", (str,))):
        v = body.get(name)
        if v is None:
            continue
        if not isinstance(v, kinds):
            raise APIError(f"`{name}` must be {' or '.join(_JSON_NAMES[t] for t in kinds)}, got {_json_type(v)}",
                           param=name)
        asked.append((name, {key: v}))
    if not asked:
        return None, None
    if len(asked) > 1:
        names = ", ".join(f"`{n}`" for n, _ in asked)
        raise APIError(f"{names} each ask for structured output: send one", param=asked[1][0])
    name, kwargs = asked[0]
    try:
        params = StructuredOutputsParams(**kwargs)
        params.validate()
    except ValueError as e:
        raise APIError(f"`{name}`: {e}", param=name) from None
    return params, name


_JSON_NAMES = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}


def sampling_params(body: dict[str, Any], *, chat: bool, max_model_len: int) -> tuple[SamplingParams, Options]:
    """OpenAI (and vLLM extra) fields -> SamplingParams, Options. APIError names the offending field."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    if chat:
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _get(body, param, int)
        if max_tokens is None:
            # OpenAI's chat default: until done, i.e. whatever room the prompt leaves (vLLM's default too).
            max_tokens, param = max_model_len, None
        want_logprobs = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int)
        if top is not None and not want_logprobs:
            raise APIError("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        logprobs = (top or 0) if want_logprobs else None
    else:
        max_tokens = _get(body, "max_tokens", int)
        param = "max_tokens"
        if max_tokens is None:
            max_tokens, param = 16, None  # OpenAI's completions default (lowered if the prompt leaves less room)
        logprobs = _get(body, "logprobs", int)

    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"`stop` must be a string or an array of strings, got {_json_type(stop)}", param="stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not _int_list(stop_ids):
        raise APIError("`stop_token_ids` must be an array of integers", param="stop_token_ids")

    stream = _get(body, "stream", bool, False)
    stream_options = _get(body, "stream_options", dict)
    if stream_options is not None and not stream:
        raise APIError("`stream_options` is only allowed with `stream: true`", param="stream_options")
    include_usage = _get(stream_options or {}, "include_usage", bool, False)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise APIError(f"`n` must be in [1, {MAX_N}], got {n}", param="n")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise APIError(f"`best_of` {best_of} differs from `n` {n}: ranking samples (best_of > n) is not supported; "
                       "this server returns every sample it draws", param="best_of")
    echo = _get(body, "echo", bool, False) if not chat else False
    prompt_logprobs = _get(body, "prompt_logprobs", int)
    asked_prompt_logprobs = prompt_logprobs
    echo_logprobs = logprobs if echo else None
    if echo_logprobs is not None:  # the echoed prompt's tokens get logprobs too (OpenAI's legacy completions)
        prompt_logprobs = max(prompt_logprobs or 0, echo_logprobs)
    structured, structured_param = structured_outputs(body)
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": _get(body, "temperature", float, 1.0),
        "top_p": _get(body, "top_p", float, 1.0),
        "top_k": _get(body, "top_k", int, 0),
        "min_p": _get(body, "min_p", float, 0.0),
        "seed": _get(body, "seed", int),
        "stop": stop or None,
        "stop_token_ids": stop_ids,
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "repetition_penalty": _get(body, "repetition_penalty", float, 1.0),
        "presence_penalty": _get(body, "presence_penalty", float, 0.0),
        "frequency_penalty": _get(body, "frequency_penalty", float, 0.0),
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        "n": n,
        "logit_bias": logit_bias(body.get("logit_bias")),
        "structured_outputs": structured,
    }
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        named = _param_named_in(str(e))
        if named == "max_tokens" and param is not None:
            named = param
        raise APIError(str(e), param=named) from None
    return params, Options(stream, include_usage, _get(body, "return_token_ids", bool, False), param, echo,
                           echo_logprobs, asked_prompt_logprobs, structured_param,
                           body.get("skip_special_tokens") is False)


# ---- responses -----------------------------------------------------------------------------------------------


# One encoder for every answer and chunk: json.dumps with non-default options builds a new one per call, a third
# of the time of encoding a streamed token's chunk.
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _dumps(obj: Any) -> bytes:
    return _ENCODER.encode(obj).encode()


class _Choice:
    """One choice of an answer: what has been sent of it, and its message parser (chat with parsers)."""

    def __init__(self, index: int, parser: MessageParser | None):
        self.index = index
        self.parser = parser
        self.num_tokens = 0  # generated so far (usage)
        self.text_offset = 0
        self.started = False
        self.whole = CumulativeOutput()  # a whole (not streamed) answer: the choice's deltas, until it finishes


class _Answer:
    """Builds the OpenAI objects of one request, streaming or not (completions or chat), for each of its
    choices. Chat replies of a request with parsers (`OutputPlan.parses`) are split into reasoning_content,
    content and tool_calls; completions may echo the prompt. Its outputs are deltas (RequestOutputKind.DELTA):
    a chunk is made of one (`chunk`); a whole answer gathers them (`gather`) and is made once all have come."""

    def __init__(self, server: HttpServer, stream: RequestStream, chat: bool, options: Options,
                 echo: str | None = None):
        self.server, self.chat, self.options = server, chat, options
        self.plan: OutputPlan = stream.plan
        self.parse = chat and self.plan.parses
        self.echo = echo
        self.id = stream.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.choices: dict[int, _Choice] = {}
        self.finals: dict[int, RequestOutput] = {}  # each choice's finished output

    def choice(self, index: int) -> _Choice:
        if index not in self.choices:
            self.choices[index] = _Choice(index, MessageParser(self.plan) if self.parse else None)
        return self.choices[index]

    def _logprobs(self, st: _Choice, entries: list[Logprob]) -> dict[str, Any]:
        tok = self.server.token_str
        if self.chat:
            return {"content": [{
                "token": tok(e.token_id), "logprob": e.logprob, "bytes": list(tok(e.token_id).encode()),
                "top_logprobs": [{"token": tok(t), "logprob": v, "bytes": list(tok(t).encode())}
                                 for t, v in e.top.items()],
            } for e in entries]}
        return self._legacy_logprobs(st, [e.token_id for e in entries], entries)

    def _legacy_logprobs(self, st: _Choice, token_ids: list[int], entries: list[Logprob | None],
                         k: int | None = None) -> dict[str, Any]:
        """Completions' logprobs arrays for these tokens (an entry None: a token with no logprob, the echoed
        prompt's first), at most `k` top entries each; text offsets continue the choice's."""
        tok = self.server.token_str
        offsets = []
        for t in token_ids:
            offsets.append(st.text_offset)
            st.text_offset += len(tok(t))
        return {"tokens": [tok(t) for t in token_ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else {tok(t): v for t, v in list(e.top.items())[:k]}
                                 for e in entries],
                "text_offset": offsets}

    def prompt_logprobs(self, entries: list[Logprob | None]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first) its id -> logprob, rank and text, with
        the top k tokens (ranks 1..k) beside it."""
        tok = self.server.token_str
        k = self.options.prompt_logprobs
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            # Logprob.top is in descending order (the device's top_k).
            d = {str(t): {"logprob": v, "rank": r, "decoded_token": tok(t)}
                 for r, (t, v) in enumerate(list(e.top.items())[:k], start=1)}
            d[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": tok(e.token_id)}
            out.append(d)
        return out

    def _choice(self, out: RequestOutput, body: dict[str, Any], token_ids: list[int], st: _Choice
                ) -> dict[str, Any]:
        """The choice object around `body` (its message, delta or text); `out` holds what the object covers (a
        chunk's delta, or a whole choice)."""
        c = out.outputs[0]
        entries = c.logprobs
        choice: dict[str, Any] = {"index": c.index, **body}
        echoed = None
        prompt_entries = out.prompt_logprobs if not st.started else None  # a choice's first object has them
        if self.options.echo_logprobs is not None and prompt_entries is not None:
            # The legacy completions logprobs of the echoed prompt (its first token has none, as OpenAI's).
            echoed = self._legacy_logprobs(st, out.prompt_token_ids, prompt_entries, self.options.echo_logprobs)
        choice["logprobs"] = self._logprobs(st, entries) if entries is not None else None
        if echoed is not None:
            choice["logprobs"] = {k: echoed[k] + (choice["logprobs"] or {}).get(k, []) for k in echoed}
        if not self.chat and self.options.prompt_logprobs is not None and prompt_entries is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(prompt_entries)
        finish, stop = (c.finish_reason, c.stop_reason) if out.finished else (None, None)
        if st.parser is not None and out.finished:
            finish, stop = st.parser.finish_reason(finish), st.parser.stop_reason(stop)
        elif stop is not None and stop == self.plan.internal_stop:
            stop = None
        choice["finish_reason"], choice["stop_reason"] = finish, stop
        if self.options.return_token_ids:
            choice["token_ids"] = token_ids
            if not st.started:
                choice["prompt_token_ids"] = out.prompt_token_ids
        st.started = True
        return choice

    def _message(self, st: _Choice, text: str) -> dict[str, Any]:
        """A whole chat message from the whole text of a choice."""
        if st.parser is None:
            return {"role": "assistant", "content": text}
        st.parser.push(text)
        st.parser.finish()
        message: dict[str, Any] = {"role": "assistant", "content": st.parser.content}
        if self.plan.reasoning:
            message["reasoning_content"] = st.parser.reasoning
        if self.plan.tools is not None:
            message["tool_calls"] = st.parser.tool_calls
        return message

    def _delta(self, st: _Choice, text: str, finished: bool) -> dict[str, Any]:
        if st.parser is None:
            return {"content": text}
        d = st.parser.push(text) if text else None
        parts = [d] if d is not None else []
        if finished:
            parts.append(st.parser.finish())
        delta: dict[str, Any] = {}
        reasoning, content = "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        calls = [c for p in parts for c in p.tool_calls]
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self.object + (".chunk" if stream and self.chat else ""),
                "created": self.created, "model": self.server.core.model_name, "choices": choices}

    def full(self) -> dict[str, Any]:
        """The whole answer from every choice's finished output (`finals`)."""
        choices = []
        for index in sorted(self.finals):
            out = self.finals[index]
            c, st = out.outputs[0], self.choice(index)
            body = ({"message": self._message(st, c.text)} if self.chat else
                    {"text": (self.echo or "") + c.text})
            choices.append(self._choice(out, body, c.token_ids, st))
        body = self._envelope(choices, stream=False)
        if self.chat and self.options.prompt_logprobs is not None and self.finals:  # vLLM: at the top of a chat answer
            body["prompt_logprobs"] = self.prompt_logprobs(self.finals[min(self.finals)].prompt_logprobs or [])
        body["usage"] = self._usage()
        return body

    def gather(self, out: RequestOutput) -> None:
        """One update of a whole answer: kept, and once its choice has finished, made whole into `finals`."""
        c = out.outputs[0]
        st = self.choice(c.index)
        st.num_tokens += len(c.token_ids)
        w = st.whole
        w.add(c.text, c.token_ids, c.logprobs, out.prompt_logprobs)
        if out.finished:
            whole = dataclasses.replace(c, text=w.text, token_ids=w.token_ids, logprobs=w.logprobs)
            self.finals[c.index] = dataclasses.replace(out, outputs=[whole], prompt_logprobs=w.prompt_logprobs)

    def _usage(self) -> dict[str, int]:
        """Usage of a request: its prompt once, the completion tokens of every choice."""
        p = len(next(iter(self.finals.values())).prompt_token_ids) if self.finals else 0
        c = sum(st.num_tokens for st in self.choices.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def role_chunk(self, n: int) -> dict[str, Any]:
        chunk = self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None} for i in range(n)], stream=True)
        if self.options.include_usage:
            chunk["usage"] = None
        return chunk

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        index = out.outputs[0].index
        st = self.choice(index)
        st.num_tokens += len(out.delta_token_ids)
        if out.finished:
            self.finals[index] = out
        if self.chat:
            body: dict[str, Any] = {"delta": self._delta(st, out.delta_text, out.finished)}
        else:
            body = {"text": (self.echo if self.echo is not None and not st.started else "") + out.delta_text}
        first = not st.started
        chunk = self._envelope([self._choice(out, body, out.delta_token_ids, st)], stream=True)
        wanted = self.chat and self.options.prompt_logprobs is not None and out.prompt_logprobs is not None
        if wanted and first and index == 0:  # vLLM: at the top of a chat answer; its first chunk when streaming
            chunk["prompt_logprobs"] = self.prompt_logprobs(out.prompt_logprobs)
        if self.options.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk has the field; only the last one fills it
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._envelope([], stream=True)
        chunk["usage"] = self._usage()
        return chunk


# ---- the server ----------------------------------------------------------------------------------------------


class HttpServer:
    def __init__(self, core: ServingCore, shutdown_timeout: float = 30.0, max_body_bytes: int = 2**20):
        self.core = core
        self.shutdown_timeout = shutdown_timeout
        self.max_body_bytes = max_body_bytes
        self.app = web.Application(middlewares=[self._access_log, self._errors, self._auth],
                                   client_max_size=max_body_bytes)
        self.app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model_id:.+}", self.model),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self.runner: web.AppRunner | None = None
        self.token_str = functools.lru_cache(maxsize=1 << 16)(self._token_str)

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Start serving on `sock` (bound, not yet listening: `serving.server.Listeners`), or bind host:port;
        returns the bound port (port 0 = any free one)."""
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family)
        # handler_cancellation: a client that disconnects cancels its handler at once, which aborts its engine
        # request, instead of the request running on until its next write fails.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=self.shutdown_timeout,
                                    access_log=None)
        await self.runner.setup()
        await web.SockSite(self.runner, sock).start()
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting; in-flight handlers get `shutdown_timeout` seconds, then are cancelled."""
        if self.runner is not None:
            await self.runner.cleanup()

    def _token_str(self, token_id: int) -> str:
        tok = self.core.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"token_id:{token_id}"

    # -- middlewares --

    @web.middleware
    async def _access_log(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.monotonic()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except asyncio.CancelledError:
            status = 499  # the client closed the connection before the answer was complete (nginx's code)
            raise
        finally:
            latency = time.monotonic() - t0
            fields = {"remote": request.remote, "method": request.method, "path": request.path, "status": status,
                      "latency": round(latency, 4), **request_log_fields(request.get("m3jax_stream"))}
            extra = "".join(f" {k}={fields[k]}" for k in ("prompt_tokens", "completion_tokens", "finish_reason",
                                                          "request_id") if k in fields)
            quiet = request.path in ("/health", "/metrics")
            access_log.log(logging.DEBUG if quiet else logging.INFO, '%s "%s %s" %d %.3fs%s', request.remote,
                           request.method, request.path, status, latency, extra, extra=fields)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except web.HTTPException as e:  # unknown route, wrong method: same error shape
            if e.status < 400:
                raise
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return APIError(f"{request.method} {request.path}: {e.reason}", e.status, kind).response()
        except Exception:  # noqa: BLE001 - one request's failure must not take the connection's error shape
            log.exception("unhandled error in %s %s", request.method, request.path)
            return APIError("internal server error", 500, "internal_server_error").response()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # /health and /metrics stay open (probes, scrapers); the API itself needs the key when one is set.
        if request.path.startswith("/v1/") and not self.core.check_api_key(request.headers.get("Authorization")):
            raise APIError("missing or wrong API key: send `Authorization: Bearer <key>`", 401,
                           "authentication_error", code="invalid_api_key")
        return await handler(request)

    async def _json(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object. A body over the limit is refused from its Content-Length before a byte of
        it is read (or, without one, as soon as the limit is passed); a large one is parsed on a worker thread."""
        limit = self.max_body_bytes
        too_large = APIError(f"the request body is larger than this server's limit of {limit} bytes "
                             f"(--max-request-body-mb; the model length is {self.core.engine.max_model_len} tokens)",
                             413, code="request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        if len(raw) > _PARSE_INLINE_BYTES:
            return await self.core.run_blocking(parse_body, raw)
        return parse_body(raw)

    # -- routes --

    async def health(self, request: web.Request) -> web.Response:
        if self.core.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.core.metrics.render())
        resp.headers["Content-Type"] = METRICS_CONTENT_TYPE
        return resp

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version()})

    def _card(self) -> dict[str, Any]:
        info = self.core.model_info()
        return {"id": self.core.model_name, "object": "model", "created": int(self.core.started),
                "owned_by": "m3jax", "root": self.core.model_path, "parent": None,
                "max_model_len": info["max_model_len"], "m3jax": info}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        self._check_model({"model": request.match_info["model_id"]})
        return web.json_response(self._card())

    def _check_model(self, body: dict[str, Any]) -> None:
        model = _get(body, "model", str)
        if model is not None and model != self.core.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{self.core.model_name}`",
                           404, "invalid_request_error", param="model", code="model_not_found")

    def _chat_prompt(self, body: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> PromptSource:
        """The conversation as a function that renders the chat template and tokenises (a worker thread's job)."""
        messages = chat_messages(body.get("messages"))
        try:
            template_kwargs = check_template_kwargs(_get(body, "chat_template_kwargs", dict, {}))
        except RequestError as e:
            raise APIError(str(e), param=e.param) from None
        kwargs = {**template_kwargs, "add_generation_prompt": _get(body, "add_generation_prompt", bool, True)}
        if tools:
            kwargs["tools"] = tools
        return functools.partial(self.core.encode_chat, messages, **kwargs)

    def _plan(self, body: dict[str, Any], options: Options) -> OutputPlan:
        try:
            return self.core.chat_plan(body.get("tools"), body.get("tool_choice"),
                                       _get(body, "parallel_tool_calls", bool, True), options.keep_special,
                                       options.structured_param)
        except RequestError as e:
            raise APIError(str(e), param=e.param) from None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        self._check_model(body)
        params, options = sampling_params(body, chat=False, max_model_len=self.core.engine.max_model_len)
        prompt = completion_prompt(body.get("prompt"))
        plan = OutputPlan(structured_param=options.structured_param)
        return await self._run(request, prompt, params, options, chat=False, plan=plan)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        self._check_model(body)
        params, options = sampling_params(body, chat=True, max_model_len=self.core.engine.max_model_len)
        plan = self._plan(body, options)
        tools = self._plan_tools(body)
        return await self._run(request, self._chat_prompt(body, tools), params, options, chat=True, plan=plan)

    @staticmethod
    def _plan_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The request's tools as the chat template gets them."""
        try:
            return check_tools(body.get("tools"))
        except RequestError as e:
            raise APIError(str(e), param=e.param) from None

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `{"prompt"}` or `{"messages"}` -> `{"count", "max_model_len", "tokens",
        "token_strs"}`, the ids /v1/completions or /v1/chat/completions would feed the model."""
        body = await self._json(request)
        self._check_model(body)
        check_fields(body, TOKENIZE_FIELDS)
        if self.core.tokenizer is None:
            raise APIError("this model has no tokenizer: nothing to tokenize with")
        chat = body.get("messages") is not None
        if chat == (body.get("prompt") is not None):
            raise APIError("send either `prompt` (a string) or `messages`", param="prompt")
        if not chat and body.get("tools") is not None:
            raise APIError("`tools` go with `messages` (the chat template renders them), not with `prompt`",
                           param="tools")
        prompt: PromptSource = (self._chat_prompt(body, self._plan_tools(body)) if chat
                                else _get(body, "prompt", str))
        try:
            ids = await self.core.run_blocking(self.core.prompt_ids, prompt)
        except ValueError as e:
            raise APIError(str(e), param="messages" if chat else "prompt") from None
        strs = [self.core.tokenizer.id_to_token(t) for t in ids] if _get(body, "return_token_strs", bool) else None
        return web.json_response({"count": len(ids), "max_model_len": self.core.engine.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: `{"tokens"}` -> `{"prompt"}`."""
        body = await self._json(request)
        self._check_model(body)
        check_fields(body, DETOKENIZE_FIELDS)
        tokens = body.get("tokens")
        vocab = self.core.engine.facts.vocab_size
        if not _int_list(tokens):
            raise APIError("`tokens` must be an array of token ids", param="tokens")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        if self.core.tokenizer is None:
            raise APIError("this model has no tokenizer: nothing to detokenize with")
        text = await self.core.run_blocking(self.core.tokenizer.decode, tokens)
        return web.json_response({"prompt": text})

    async def _run(self, request: web.Request, prompt: PromptSource, params: SamplingParams, options: Options,
                   chat: bool, plan: OutputPlan) -> web.StreamResponse:
        default_param = "messages" if chat else "prompt"
        try:
            stream = self.core.open(prompt, params, "http", prefix="chatcmpl" if chat else "cmpl",
                                    max_tokens_param=options.max_tokens_param, plan=plan)
        except Overloaded as e:
            raise APIError(str(e), 429, "rate_limit_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except ShuttingDown as e:
            raise APIError(str(e), 503, "service_unavailable", code="shutting_down") from None
        request["m3jax_stream"] = stream
        async with stream:
            try:
                # The first output: tokenising and validating happen here, so a bad prompt is still a 400 (the
                # SSE headers are not sent before it).
                first = await anext(stream)
            except RequestError as e:
                raise APIError(str(e), param=e.param or default_param) from None
            except ValueError as e:
                raise APIError(str(e), param=_param_named_in(str(e)) or default_param) from None
            except RuntimeError as e:
                raise APIError(f"generation failed: {e}", 500, "internal_server_error") from None
            echo = None
            if options.echo:
                echo = prompt if isinstance(prompt, str) else await self.core.run_blocking(
                    self._decode, first.prompt_token_ids, stream.params.skip_special_tokens)
            answer = _Answer(self, stream, chat, options, echo)
            if not options.stream:
                answer.gather(first)
                try:
                    async for out in stream:
                        answer.gather(out)
                except RuntimeError as e:
                    raise APIError(f"generation failed: {e}", 500, "internal_server_error") from None
                return web.json_response(answer.full(), dumps=lambda o: _dumps(o).decode())
            return await self._sse(request, stream, answer, first, chat, options)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        tok = self.core.tokenizer
        return tok.decode(ids, skip_special_tokens=skip_special_tokens) if tok is not None else ""

    async def _sse(self, request: web.Request, stream: RequestStream, answer: _Answer, first: RequestOutput,
                   chat: bool, options: Options) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": stream.request_id})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + _dumps(obj) + b"\n\n")

        try:
            if chat:
                await send(answer.role_chunk(stream.params.n))
            await send(answer.chunk(first))
            async for out in stream:
                await send(answer.chunk(out))
            if options.include_usage:
                await send(answer.usage_chunk())
        except RuntimeError as e:
            # Headers are gone: the error travels in the stream, as vLLM and OpenAI send it.
            await send(APIError(f"generation failed: {e}", 500, "internal_server_error").body())
        except ConnectionError:
            return resp  # the client went away: leaving the `async with` aborts the request
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
