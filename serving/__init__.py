"""m3jax serving: `from serving import LLM, SamplingParams`."""

from serving.api import LLM
from serving.core import EngineCore
from serving.engine import AsyncEngine
from serving.outputs import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineCore", "AsyncEngine"]
