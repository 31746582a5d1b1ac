"""What users pass in and get back: `SamplingParams`, `RequestOutput`, `CompletionOutput` (vLLM's names)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from serving.sampling import DEFAULT_MAX_LOGPROBS as MAX_LOGPROBS
from serving.sampling import MAX_LOGIT_BIAS, validate_sampling
from serving.structured import StructuredOutputsParams

MAX_N = 16  # choices per request


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names).

    CUMULATIVE: every output carries the whole text, token ids and logprobs so far (what `LLM.stream` users
    expect). DELTA: each carries only what its update added, in `outputs[0]` as in `delta_text` /
    `delta_token_ids`, and `prompt_logprobs` once; for streaming front ends, so that an update costs the same at
    the 8,000th token as at the first (a cumulative update copies the whole output each time). FINAL_ONLY: one
    output, the whole one, when the request finishes (`LLM.generate`).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = the chosen token's logprob and the top-k
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob, rank and the top-k
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    n: int = 1  # independent samples of the same prompt (its pages shared through the prefix cache)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each RequestOutput holds

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive integer")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"logit_bias: {tok!r} is not a token id")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias[{tok}]: must be a number in [-100, 100], got {bias!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        validate_sampling(self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty,
                          self.presence_penalty, self.frequency_penalty, self.logprobs, MAX_LOGPROBS)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be a non-negative integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not all(isinstance(s, str) and s for s in self.stop)):
            raise bad("stop", "must be a non-empty string or a list of them")
        if self.stop_token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])


@dataclasses.dataclass
class Logprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n token ids -> logprob (n = SamplingParams.logprobs)
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[Logprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


class GrowingText:
    """Text that only grows, a piece per token: appending and reading the newest tail (`since`) never copy the
    whole, as `+=` on a str would every token. The pieces are joined every MAX_PIECES (a str object per token
    would cost more than the copy saved) and when the whole is read."""

    MAX_PIECES = 64

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self.length += len(piece)
            if len(self._pieces) > self.MAX_PIECES:
                self._pieces[:] = ["".join(self._pieces)]

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def since(self, start: int) -> str:
        """The text from character `start` on, in time proportional to its length."""
        want = self.length - start
        if want <= 0:
            return ""
        tail, got, i = [], 0, len(self._pieces)
        while got < want:
            i -= 1
            tail.append(self._pieces[i])
            got += len(self._pieces[i])
        joined = "".join(reversed(tail))
        return joined[len(joined) - want:]


@dataclasses.dataclass
class CumulativeOutput:
    """One choice's output made whole from its deltas, for a client that takes deltas and needs the whole: the
    text, the ids, the logprobs, and the prompt logprobs once they came."""

    whole_text: GrowingText = dataclasses.field(default_factory=GrowingText)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None

    def add(self, text: str, token_ids: list[int], logprobs: list[Logprob] | None,
            prompt_logprobs: list[Logprob | None] | None) -> None:
        self.whole_text.append(text)
        self.token_ids.extend(token_ids)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs

    @property
    def text(self) -> str:
        return self.whole_text.text


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # What this update added (text and ids since the previous RequestOutput of this request), whatever the
    # request's output_kind.
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    rejected: bool = False  # the error is the request's fault (refused at admission), not the engine's
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no context),
    # in every output once the prompt has been computed (with RequestOutputKind.DELTA: in the first such only).
    prompt_logprobs: list[Logprob | None] | None = None
