"""One line for a user, whatever failed: the window's banner, headless's stderr and the engine process say it
the same way."""
from __future__ import annotations


def one_line(e: BaseException) -> str:
    """An exception's first line (a refusal's message is written as one), or its type when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
