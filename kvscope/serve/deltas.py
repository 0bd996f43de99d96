"""Per-step increments of a request's text and token ids, for streaming.

The engine decodes a sequence's whole output every step, so the tail of its text can still change:
a trailing U+FFFD is a UTF-8 character cut in the middle (the next token completes it), and the
last ``len(stop) - 1`` characters may be the start of a stop string the engine will cut off. Those
are held back until the sequence ends, so every chunk sent is final and the chunks add up to the
text a non-streaming response would carry.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.outputs import RequestOutput

logger = logging.getLogger("kvscope.serve")


@dataclass(frozen=True, slots=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # set once, on the choice's last delta


class DeltaTracker:
    def __init__(self, stop: list[str], with_tokens: bool = False) -> None:
        self.with_tokens = with_tokens  # a step with new tokens but no final text yet is a delta too
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent_text: dict[int, str] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def update(self, out: RequestOutput) -> list[Delta]:
        """The new text and tokens of every choice since the last call (choices with nothing new are left out)."""
        deltas = []
        for c in out.outputs:
            if c.index in self.done:
                continue
            finished = c.finish_reason is not None
            text = c.text
            if not finished:
                text = text[: max(len(text) - self.hold, 0)].rstrip("\ufffd")
            sent = self.sent_text.get(c.index, "")
            if text.startswith(sent):
                new_text = text[len(sent) :]
                self.sent_text[c.index] = text
            else:  # a decode that changed text already sent: it cannot be taken back
                logger.warning("request %s choice %d: decoded text changed behind the stream", out.request_id, c.index)
                new_text = ""
            n = self.sent_tokens.get(c.index, 0)
            new_tokens = c.token_ids[n:]
            self.sent_tokens[c.index] = len(c.token_ids)
            if finished:
                self.done.add(c.index)
            if new_text or finished or (self.with_tokens and new_tokens):
                deltas.append(Delta(c.index, new_text, list(new_tokens), c.finish_reason))
        return deltas
