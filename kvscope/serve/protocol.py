"""OpenAI request and response bodies as vLLM serves them, and their mapping to ``SamplingParams``.

Unknown fields are accepted and ignored (as vLLM does); fields kvscope cannot honour (logprobs,
penalties, tools, ...) are refused with a 400 when set to anything but their neutral value, so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from engine import SamplingParams

# field -> values that mean "not used": anything else is refused.
_UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None, 0),
    "min_tokens": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _SamplingRequest(OpenAIBaseModel):
    """The sampling fields the two endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids in the response
    user: str | None = None

    def check_supported(self) -> None:
        given = {**{k: getattr(self, k) for k in type(self).model_fields}, **(self.model_extra or {})}
        for name, neutral in _UNSUPPORTED.items():
            if name in given and given[name] not in neutral:
                raise ValueError(f"`{name}` is not supported by kvscope")
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` needs `stream: true`")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """``max_tokens`` None: fill the context (the bridge sets it once the prompt is tokenized)."""
        self.check_supported()
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ValueError("a stop string must not be empty")
        top_k = self.top_k if self.top_k not in (None, 0) else -1
        return SamplingParams(
            max_tokens=max_tokens or 1,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=top_k,
            n=self.n,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default; null: up to the context's end

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"send one prompt per request (got a batch of {len(p)})")
            p = p[0]
        if not p:
            raise ValueError("the prompt is empty")
        return p


class TextPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        c = self.content
        text = "".join(p.text for p in c) if isinstance(c, list) else (c or "")
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # null: up to the context's end (vLLM's default)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str = ""


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvscope"
    root: str
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, status: int, err_type: str) -> dict[str, Any]:
    """OpenAI's error shape; ``type`` and ``code`` as vLLM fills them (an exception name, the HTTP status)."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}
