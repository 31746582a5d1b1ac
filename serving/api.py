"""The Python API, in the style operators know from vLLM: `LLM(model=...)`, `llm.generate(prompts, params)`,
`llm.chat(messages, params)`, `llm.stream(prompt, params)`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from serving.engine import AsyncEngine, Engine, EngineConfig, Prompt
from serving.outputs import RequestOutput, SamplingParams

Message = Mapping[str, Any]


class LLM:
    """An M3 model with a serving engine behind it, driven from the calling thread."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, kv_cache_pages: int | None = None,
                 max_num_seqs: int = 16, max_num_batched_tokens: int = 256, **kwargs: Any):
        self.engine = Engine(EngineConfig(
            model=None if model is None else str(model), dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, kv_cache_pages=kv_cache_pages, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, **kwargs))
        self.tokenizer = self.engine.tokenizer

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
        tracked = []
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
            try:
                tracked.append(self.engine.prepare(prompt, p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return self._run(tracked, use_tqdm)

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
        """Yield a RequestOutput per generated token (`delta_text` is the new text); the last one is finished."""
        tracked = self.engine.prepare(prompt, params)
        rid = self.engine.submit(tracked)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise (ValueError if out.rejected else RuntimeError)(out.error)
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort(rid)
                while self.engine.has_work():
                    self.engine.step()

    def _run(self, tracked: list, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        ids = [self.engine.submit(t) for t in tracked]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id not in results:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def async_engine(self) -> AsyncEngine:
        """The asyncio interface over this LLM's engine (starts the background step loop)."""
        return AsyncEngine(self.engine)
