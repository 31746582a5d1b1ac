"""Request state as the engine core sees it: plain Python, no JAX.

With async scheduling the core schedules step N+1 before step N's tokens reach the host: a token sampled by a
step still in flight is a *placeholder*, counted in `num_tokens` but not yet in `output_ids`. The executor feeds
a placeholder to the model straight from the previous step's device output, so the host never waits for it.
"""

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


PLACEHOLDER = -1  # a token id the host does not know yet: sampled by the step in flight


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    sampling: Any = None  # serving.outputs.SamplingParams, opaque to the scheduler
    # Text state (serving.stopping.TextState): detokeniser and stop strings; None for id-only models.
    text: Any = None
    # serving.structured.GrammarState when the output must follow a grammar.
    grammar: Any = None
    # The client's request id and this request's choice among its n (`request_id` is then "<parent>#<index>").
    parent_id: str | None = None
    index: int = 0
    arrival: float = dataclasses.field(default_factory=time.monotonic)

    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_placeholders: int = 0  # tokens sampled by steps still in flight
    status: Status = Status.WAITING
    # Tokens whose K/V (and index-K) are in this request's pages or are being written by a scheduled step.
    # Reset to 0 on preemption: the request is recomputed from prompt + output so far, which gives the same state
    # and, greedy or seeded, the same output.
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    # Per-running-request slot (0 .. max_num_seqs - 1) of device-side state such as the penalty history.
    slot: int = -1
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    num_preemptions: int = 0
    # When the scheduler first admitted it (time.monotonic), before its first step's inputs are built and
    # dispatched: queue time is arrival to here, prefill time here to the first token.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # Unique per admission (client request ids may be reused once a request ends): what steps in flight and
    # their results are keyed by, so a late result never lands on a newer request of the same id.
    seq: int = -1
    # Prefix caching: the hash-chain names of the request's full pages of known tokens (kv_cache.page_hash), how
    # many of its pages are named in the pool, and whether it may start from cached pages (not when the device
    # must see its whole prompt, as the penalty history does).
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_named_pages: int = 0
    use_prefix_cache: bool = True
    # Speculative decoding: whether this request is drafted for, the draft tokens proposed for its next row, and
    # how many of them the row in flight carries (rolled back by how many were rejected).
    use_spec: bool = True
    draft_tokens: list[int] = dataclasses.field(default_factory=list)
    num_drafts_in_flight: int = 0
    last_num_drafts: int = 0  # drafts the last collected row verified (the acceptance counters)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        """Generated tokens, placeholders included."""
        return len(self.output_ids) + self.num_placeholders

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, placeholders included."""
        return len(self.prompt_ids) + self.num_output

    @property
    def num_known(self) -> int:
        """Prompt plus generated tokens the host knows (placeholders excluded)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions start .. end - 1, PLACEHOLDER where the host does not know them yet (sliced from
        prompt and output separately: a decode row must not copy the whole context)."""
        p = len(self.prompt_ids)
        out = self.prompt_ids[start:min(end, p)] if start < p else []
        if end > p:
            out = out + self.output_ids[max(start - p, 0):end - p]
        return out + [PLACEHOLDER] * max(0, end - max(start, self.num_known))

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
