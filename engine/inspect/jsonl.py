"""Versioned JSON-lines files: a header line (``format``, ``version``, the writer's fields), then one object a line.

kvscope writes three kinds (a run's trace, an attach session's, a probed vLLM's messages); each names its format
in the header. What they share lives here once: writing the header and flushing every line (a crash leaves at most
a torn last line, which readers drop), telling a file's format from its first line, and the header checks that
every reader makes before trusting a file (outside input: each mistake one line).
"""

from __future__ import annotations

import json
from pathlib import Path


class JsonLinesWriter:
    """Writes ``{"format", "version", **header}`` and then ``write``'s objects, one a line, each flushed."""

    def __init__(self, path: str | Path, format: str, version: int, header: dict) -> None:
        self.path = Path(path)
        try:
            self._f = self.path.open("w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write trace {path}: {e.strerror or e}") from None
        self.write({"format": format, "version": version, **header})

    def write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _first_line(path: str | Path) -> str:
    with Path(path).open(encoding="utf-8") as f:
        return f.readline()


def file_format(path: str | Path) -> str | None:
    """The format a file's first line names, or None (unreadable, not JSON, no header)."""
    try:
        header = json.loads(_first_line(path))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    fmt = header.get("format") if isinstance(header, dict) else None
    return fmt if isinstance(fmt, str) else None


def read_versioned_header(
    path: str | Path, format: str, version: int, what: str, error: type[ValueError] = ValueError
) -> dict:
    """The header of a ``format`` file whose version this kvscope reads (1..``version``); otherwise ``error``
    with one line naming ``what`` the file should have been ("a kvscope trace", "an attach trace")."""
    try:
        first = _first_line(path)
    except UnicodeDecodeError:
        raise error(
            f"{path} is not {what}: it is not a text file (a trace is JSON lines, written by --trace)"
        ) from None
    except OSError as e:
        raise error(f"cannot read trace {path}: {e.strerror or e}") from None
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        raise error(f"{path} is not {what}: {_what_it_is(path)}") from None
    if not isinstance(header, dict) or header.get("format") != format:
        raise error(f"{path} is not {what} (no '{format}' header)")
    v = header.get("version")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise error(f"{path}: trace version {v!r} is not a version (1..{version})")
    if v > version:
        raise error(f"{path} was written by a newer kvscope (trace version {v}); this one reads version {version}")
    return header


def _what_it_is(path: str | Path) -> str:
    """What a file that is not a trace seems to be, in the words of the flag that takes it."""
    try:
        whole = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "its first line is not JSON (a trace is JSON lines, written by --trace)"
    if isinstance(whole, dict) and "requests" in whole and ("title" in whole or "config" in whole):
        return f"it is a scenario file (run it with --scenario {path})"
    return "it is one JSON document, not JSON lines (a trace is written by --trace)"
