"""One line for a person, whatever failed: the engine's step errors, the window's banner, ``--headless``'s stderr
and the engine process all say a failure this way (the probe, installed alone inside vLLM, keeps its own copy)."""

from __future__ import annotations


def one_line(e: BaseException | str, *, with_type: bool = False) -> str:
    """The first line of an exception's message (a refusal is written as one line), or its type's name when it
    says nothing; ``with_type`` puts the type first (``ValueError: ...``: a failed step, where the type is news).
    Empty or blank text never raises (an ``IndexError`` here would hide the failure it reports)."""
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    if isinstance(e, str):
        return first
    name = type(e).__name__
    if not first:
        return name
    return f"{name}: {first}" if with_type else first
