"""m3jax serving: `from serving import LLM, SamplingParams`."""

from serving.api import LLM
from serving.engine import AsyncEngine, Engine, EngineConfig
from serving.outputs import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Engine", "EngineConfig", "AsyncEngine"]
