"""kvscope's paged-KV inference engine (no Qt). Public API follows vLLM's."""
from .config import EngineConfig, SamplingParams
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput, StepOutput

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "StepOutput"]
