"""`AsyncEngine`: the asyncio client of an `EngineCore`, what the gRPC and HTTP servers use.

The core runs its own step thread; `generate` prepares a request on the caller's loop, hands it to the core, and
streams the core's outputs back through an asyncio queue. Cancelling the iteration (a client that went away)
aborts the request, which frees its pages at the core's next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serving.core import EngineCore, Prompt
from serving.outputs import RequestOutput, SamplingParams


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        core.start()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs of one request (with n > 1, of each choice: `outputs[0].index` says which;
        the stream ends when every choice has finished). Raises ValueError at once for a bad request and
        RuntimeError when the engine failed it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        group = self.core.prepare_group(prompt, params, request_id)
        for req, text in group:
            self.core.submit(req, text, sink=lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        rid = group[0][0].parent_id or group[0][0].request_id
        left = len(group)
        try:
            while left:
                out = await queue.get()
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
