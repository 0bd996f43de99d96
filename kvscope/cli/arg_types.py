"""The types of command-line values (argparse ``type=``): each parses one value or says in one line why not.

Shared by ``kvscope``'s parser and the demos' (``python -m kvscope.cli.demo``).
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return v


def window_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WIDTHxHEIGHT, e.g. 1280x720, got {text!r}") from None
    if w < 320 or h < 240:
        raise argparse.ArgumentTypeError(f"a window of {w}x{h} is too small (at least 320x240)")
    return w, h


def font_scale(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, e.g. 1.5, got {text!r}") from None
    if not 0.5 <= v <= 3.0:
        raise argparse.ArgumentTypeError(f"must be between 0.5 and 3, got {text}")
    return v


def token_ids(text: str) -> list[int]:
    """``--inject-ids 1,5,9`` (commas or spaces)."""
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be integers separated by commas, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be a non-empty list of integers >= 0, got {text!r}")
    return ids


def port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {n}")
    return n


def timeout_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not s > 0:
        raise argparse.ArgumentTypeError(f"the timeout must be > 0 seconds, got {text}")
    return s
