"""One line for a user, whatever failed: the window's banner, headless's stderr and the engine process say it
the same way."""

from __future__ import annotations


def bytes_text(n: int) -> str:
    """A size as a person reads it: 7.0 MiB, 1.5 GiB, 512 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def count_text(n: int, noun: str, plural: str | None = None) -> str:
    """``1 block``, ``2 blocks``, ``1 batch``, ``3 batches`` (``plural``: when adding an s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
