"""What ``generate`` and ``step`` return (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .inspect.events import Event


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cumulative_logprob: float | None = None  # set by beam search


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class StepOutput:
    step: int
    outputs: list[RequestOutput]  # requests that got a token or finished this step
    events: list[Event]
    num_scheduled_tokens: int = 0
    new_tokens: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # a model-step failure (its requests are finished with "error")

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]
