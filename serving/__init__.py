"""m3jax serving: `from serving import LLM, SamplingParams`."""

from serving.api import LLM
from serving.core import EngineCore
from serving.engine import AsyncEngine
from serving.outputs import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestOutputKind", "CompletionOutput", "EngineCore",
           "AsyncEngine"]
