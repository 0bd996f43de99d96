"""Turn a prompt (text, token ids or chat messages) into validated token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard, Union

PromptType = Union[str, Sequence[int], Sequence[dict]]


def is_chat(prompt: Any) -> TypeGuard[Sequence[dict]]:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(m, dict) for m in prompt)


def is_token_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def check_text(text: str, what: str = "the prompt") -> None:
    """Refuse text a tokenizer cannot encode: a lone surrogate (an undecodable byte on a command line)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode text: a lone surrogate {text[e.start]!r} at character {e.start}"
        ) from None


def to_token_ids(prompt: PromptType, tokenizer, vocab_size: int) -> tuple[list[int], str | None]:
    """Returns (token ids, prompt text or None). Raises ``ValueError`` with a clear message."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        check_text(prompt)
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        ids = tokenizer.encode(prompt)
        text = prompt
    elif is_chat(prompt):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: pass text or token ids")
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise ValueError("a chat message needs 'role' and 'content'")
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError("a chat message's 'role' and 'content' must be strings")
            check_text(m["content"], "a chat message")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif is_token_ids(prompt):
        ids, text = list(prompt), None
    elif isinstance(prompt, (list, tuple)) and len(prompt) == 0:
        raise ValueError("the prompt is empty")
    else:
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
        )
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return ids, text
