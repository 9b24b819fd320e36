"""fairgate-package: engine

fairgate's inference engine: continuous batching on a paged KV cache.
"""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepOutput
from engine.request import FinishReason, Request, RequestStatus, SamplingParams

__all__ = ["EngineConfig", "FinishReason", "LLMEngine", "Request", "RequestStatus",
           "SamplingParams", "StepOutput"]
