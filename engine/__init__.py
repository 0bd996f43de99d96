"""kvscope's paged-KV inference engine (no Qt). Public API follows vLLM's.

``LLM`` and ``LLMEngine`` load torch and transformers when first used, so that a process that
only reads configurations, events and snapshots (the window, when the engine runs in its own
process) starts without them.
"""

from .config import EngineConfig, RequestOutputKind, SamplingParams
from .outputs import CompletionOutput, RequestOutput, StepOutput

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "StepOutput",
]


def __getattr__(name: str):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "LLMEngine":
        from .llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
