"""The Python API, in the style operators know from vLLM: `LLM(model=...)`, `llm.generate(prompts, params)`,
`llm.chat(messages, params)`, `llm.stream(prompt, params)`.

`LLM(**kwargs)` takes the fields of `m3jax.settings.Settings` (model, engine and kernel settings) by name. It is
a client of an `EngineCore` whose own thread does all the stepping, so `generate` from one thread and
`async_engine()` from another can run at once.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from m3jax.settings import ENGINE, KERNELS, MODEL, Settings
from serving.core import EngineCore, Prompt
from serving.engine import AsyncEngine
from serving.outputs import RequestOutput, RequestOutputKind, SamplingParams

Message = Mapping[str, Any]


def merge_choices(outputs: list[RequestOutput]) -> RequestOutput:
    """The finished outputs of one request's n choices as one RequestOutput, choices in index order."""
    if len(outputs) == 1:
        return outputs[0]
    first = min(outputs, key=lambda o: o.outputs[0].index)
    errors = [o.error for o in outputs if o.error is not None]
    return dataclasses.replace(first, outputs=sorted((o.outputs[0] for o in outputs), key=lambda c: c.index),
                               delta_text="", delta_token_ids=[], error=errors[0] if errors else None,
                               rejected=any(o.rejected for o in outputs))


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
                # Only the finished output is returned: the core makes no other (each would copy the output so far).
                p = dataclasses.replace(p or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
                prepared.append(self.core.prepare_group(prompt, p))
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
        """Yield a RequestOutput per generated token (`delta_text` is the new text; with n > 1 each carries one
        choice, `outputs[0].index` says which); the last one of each choice is finished. Leaving the loop early
        aborts the request."""
        group = self.core.prepare_group(prompt, params)
        updates: queue.Queue[RequestOutput] = queue.Queue()
        for req, text in group:
            rid = self.core.submit(req, text, sink=updates.put)
        rid = group[0][0].parent_id or rid
        left = len(group)
        try:
            while left:
                out = updates.get()
                if out.error is not None:
                    left = 0
                    raise (ValueError if out.rejected else RuntimeError)(out.error)
                left -= out.finished
                yield out
        finally:
            if left:
                self.core.abort(rid)

    def _run(self, prepared: list[list], use_tqdm: bool) -> list[RequestOutput]:
        """Submit every prepared group, wait for all; one RequestOutput per group, its choices in index order."""
        from tqdm.auto import tqdm

        finished: queue.Queue[RequestOutput] = queue.Queue()

        def sink(out: RequestOutput) -> None:
            if out.finished:
                finished.put(out)

        ids = []
        for group in prepared:
            for req, text in group:
                self.core.submit(req, text, sink)
            ids.append(group[0][0].parent_id or group[0][0].request_id)
        want = {rid: len(group) for rid, group in zip(ids, prepared, strict=True)}
        results: dict[str, list[RequestOutput]] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            done = 0
            while done < len(ids):
                out = finished.get()
                results.setdefault(out.request_id, []).append(out)
                if len(results[out.request_id]) == want[out.request_id]:
                    done += 1
                    bar.update(1)
        return [merge_choices(results[i]) for i in ids]

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
