"""`AsyncEngine`: the asyncio client of an `EngineCore`, what the gRPC and HTTP servers use.

The core runs its own step thread; `generate` prepares a request on the caller's loop, hands it to the core, and
streams the core's outputs back through an asyncio queue. Cancelling the iteration (a client that went away)
aborts the request, which frees its pages at the core's next step.

A step emits one output per running request. They cross to the event loop through one `_Mailbox` per loop: one
wake-up of the loop per burst of outputs, not one per output (each wake-up is a write to the loop's self-pipe
and a hand-over of the GIL, on the step thread's time). When the loop falls behind the steps, the outputs a stream
finds waiting are merged into one (their deltas joined; `merge`), as vLLM's output collector does: the server then
sends one message per stream per turn of the loop instead of one per token, and catches up instead of falling
further behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator

from serving.core import EngineCore, Prompt
from serving.engine_process import RemoteCore
from serving.outputs import RequestOutput, RequestOutputKind, SamplingParams


class _Mailbox:
    """Outputs posted from the core's step thread to queues of one event loop. The first post of a burst
    schedules one drain on the loop; later posts before it runs only append. Per queue, outputs keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: deque[tuple[asyncio.Queue[RequestOutput], RequestOutput]] = deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[RequestOutput], out: RequestOutput) -> None:
        with self._lock:
            self._pending.append((queue, out))
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to read these outputs
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, deque()
            self._scheduled = False
        for queue, out in items:
            queue.put_nowait(out)


def merge(earlier: RequestOutput, later: RequestOutput, kind: RequestOutputKind) -> RequestOutput:
    """Two consecutive outputs of one stream (same choice) as one, with both deltas: the later's state, which is
    cumulative (text, ids, logprobs), or with RequestOutputKind.DELTA both outputs' text, ids and logprobs."""
    merged = dataclasses.replace(later, delta_text=earlier.delta_text + later.delta_text,
                                 delta_token_ids=earlier.delta_token_ids + later.delta_token_ids)
    if kind is RequestOutputKind.DELTA:
        e, c = earlier.outputs[0], later.outputs[0]
        logprobs = None if e.logprobs is None and c.logprobs is None else (e.logprobs or []) + (c.logprobs or [])
        merged.outputs = [dataclasses.replace(c, text=e.text + c.text, token_ids=e.token_ids + c.token_ids,
                                              logprobs=logprobs)]
        if merged.prompt_logprobs is None:
            merged.prompt_logprobs = earlier.prompt_logprobs  # sent once, with the first output that has them
    return merged


class AsyncEngine:
    def __init__(self, core: EngineCore | RemoteCore):
        self.core = core
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = \
            weakref.WeakKeyDictionary()
        core.start()

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of one request (with n > 1, of each choice: `outputs[0].index` says which;
        the stream ends when every choice has finished). Raises ValueError at once for a bad request and
        RuntimeError when the engine failed it."""
        box = self._mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        group = self.core.prepare_group(prompt, params, request_id)
        for req, text in group:
            self.core.submit(req, text, sink=lambda out: box.post(queue, out))
        rid = group[0][0].parent_id or group[0][0].request_id
        kind = params.output_kind if params is not None else RequestOutputKind.CUMULATIVE
        left = len(group)
        held: RequestOutput | None = None  # taken from the queue but not mergeable into the output before it
        try:
            while left:
                out, held = (held, None) if held is not None else (await queue.get(), None)
                while out.error is None and not out.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt.error is not None or nxt.outputs[0].index != out.outputs[0].index:
                        held = nxt
                        break
                    out = merge(out, nxt, kind)
                if out.error is not None:
                    left = 0  # an errored request is already finished: nothing to abort
                    # A rejected request is the client's fault; a failed step is the server's.
                    raise (ValueError if out.rejected else RuntimeError)(out.error)
                left -= out.finished
                yield out
        finally:
            if left:
                self.core.abort(rid)

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests (up to `timeout` seconds), abort the rest, stop the core's loop."""
        self.core.shutdown(timeout)
