"""Request state as the scheduler sees it: plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS / stop token or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # the client went away or asked to stop
    ERROR = "error"  # the request could not be served (the message says why)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    sampling: Any = None  # serving.api.SamplingParams, opaque to the scheduler
    arrival: float = dataclasses.field(default_factory=time.monotonic)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose K/V (and index-K) are in this request's pages. Reset to 0 on preemption: the request is
    # recomputed from prompt + output so far, which gives the same state and, greedy or seeded, the same output.
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
