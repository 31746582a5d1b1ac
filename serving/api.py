"""The Python API, in the style operators know from vLLM: `LLM(model=...)`, `llm.generate(prompts, params)`,
`llm.chat(messages, params)`, `llm.stream(prompt, params)`.

`LLM(**kwargs)` takes the fields of `m3jax.settings.Settings` (model, engine and kernel settings) by name. It is
a client of an `EngineCore` whose own thread does all the stepping, so `generate` from one thread and
`async_engine()` from another can run at once.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from m3jax.settings import ENGINE, KERNELS, MODEL, Settings
from serving.core import EngineCore, Prompt
from serving.engine import AsyncEngine
from serving.outputs import RequestOutput, SamplingParams

Message = Mapping[str, Any]


class LLM:
    """An M3 model with a serving engine behind it."""

    def __init__(self, model: str | None = None, **settings: Any):
        self.settings = Settings.from_kwargs((MODEL, ENGINE, KERNELS), model=None if model is None else str(model),
                                             **settings)
        self.core = EngineCore(self.settings)
        self.core.start()
        self.tokenizer = self.core.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order. `prompts`: strings or token-id lists.

        Every request is validated before any runs: a bad one raises ValueError (naming its index) and nothing
        is started.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, Sequence):
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(prompts)
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            try:
                prepared.append(self.core.prepare(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return self._run(prepared, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation (a list of messages) or several."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [self.tokenizer.encode_chat(conv, add_generation_prompt=True, **template_kwargs)
                   for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput per generated token (`delta_text` is the new text); the last one is finished.
        Leaving the loop early aborts the request."""
        req, text = self.core.prepare(prompt, params)
        updates: queue.Queue[RequestOutput] = queue.Queue()
        rid = self.core.submit(req, text, sink=updates.put)
        done = False
        try:
            while not done:
                out = updates.get()
                if out.error is not None:
                    done = True
                    raise (ValueError if out.rejected else RuntimeError)(out.error)
                done = out.finished
                yield out
        finally:
            if not done:
                self.core.abort(rid)

    def _run(self, prepared: list, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        finished: queue.Queue[RequestOutput] = queue.Queue()

        def sink(out: RequestOutput) -> None:
            if out.finished:
                finished.put(out)

        ids = [self.core.submit(req, text, sink) for req, text in prepared]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(results) < len(ids):
                out = finished.get()
                results[out.request_id] = out
                bar.update(1)
        return [results[i] for i in ids]

    def async_engine(self) -> AsyncEngine:
        """The asyncio interface over this LLM's engine core (same core, same thread)."""
        return AsyncEngine(self.core)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Finish in-flight requests (up to `timeout` seconds) and stop the core's thread."""
        self.core.shutdown(timeout)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
