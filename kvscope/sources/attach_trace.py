"""Attach traces: what an attached session received, as versioned JSON lines.

Line 1 is a header (format, version, endpoints, topic, block size). Every further line is
one of:

- ``{"k": "msg", "tick", "stream", "seq", "src": "live"|"replay", "payload": base64}``: a
  batch the model applied (or tried to: malformed payloads are recorded too), in the order
  it was applied, byte for byte as it came off the wire;
- ``{"k": "gap", "tick", "stream", "first", "last", "reason"}``: batches that never arrived;
- ``{"k": "restart", "tick", "stream", "ranks"}``: the publisher restarted; those ranks were cleared;
- ``{"k": "tick", "tick", "t", "counters"}``: the end of one poll, with the counters then.

Replaying applies the same payloads in the same order, so the forest, the counters and the
gaps come back exactly. Each line is flushed; a torn last line (a crash mid-write) is dropped.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engine.inspect.jsonl import JsonLinesWriter, file_format, read_versioned_header

FORMAT = "kvscope-attach-trace"
VERSION = 1


class AttachTraceError(ValueError):
    """A trace that cannot be read; the message is one line."""


class AttachTraceWriter(JsonLinesWriter):
    def __init__(self, path: str | Path, header: dict) -> None:
        super().__init__(path, FORMAT, VERSION, header)

    def msg(self, tick: int, stream: int, seq: int, src: str, payload: bytes) -> None:
        self.write(
            {
                "k": "msg",
                "tick": tick,
                "stream": stream,
                "seq": seq,
                "src": src,
                "payload": base64.b64encode(payload).decode("ascii"),
            }
        )

    def gap(self, tick: int, stream: int, first: int, last: int, reason: str) -> None:
        self.write({"k": "gap", "tick": tick, "stream": stream, "first": first, "last": last, "reason": reason})

    def restart(self, tick: int, stream: int, ranks: list[int]) -> None:
        self.write({"k": "restart", "tick": tick, "stream": stream, "ranks": sorted(ranks)})

    def tick(self, tick: int, t: float, counters: dict) -> None:
        self.write({"k": "tick", "tick": tick, "t": round(t, 6), "counters": counters})


def is_attach_trace(path: str | Path) -> bool:
    """Whether ``path`` starts with an attach-trace header (False for anything unreadable)."""
    return file_format(path) == FORMAT


def read_attach_header(path: str | Path) -> dict:
    return read_versioned_header(path, FORMAT, VERSION, "an attach trace", AttachTraceError)


@dataclass
class TraceTick:
    """One poll's lines, in order: ("msg", stream, seq, src, payload), ("gap", stream, first, last,
    reason), ("restart", stream, ranks)."""

    tick: int
    t: float
    counters: dict
    items: list[tuple] = field(default_factory=list)


def read_attach_trace(path: str | Path) -> Iterator[TraceTick]:
    """One ``TraceTick`` per recorded poll. Raises ``AttachTraceError`` on a corrupt line."""
    read_attach_header(path)
    with Path(path).open(encoding="utf-8") as f:
        lines = f.readlines()[1:]
    pending = TraceTick(0, 0.0, {})
    for n, line in enumerate(lines, start=2):
        torn = n == len(lines) + 1 and not line.endswith("\n")
        try:
            rec = json.loads(line)
            kind = rec["k"]
            if kind == "msg":
                pending.items.append(
                    (
                        "msg",
                        int(rec["stream"]),
                        int(rec["seq"]),
                        str(rec["src"]),
                        base64.b64decode(rec["payload"], validate=True),
                    )
                )
            elif kind == "gap":
                pending.items.append(
                    ("gap", int(rec["stream"]), int(rec["first"]), int(rec["last"]), str(rec["reason"]))
                )
            elif kind == "restart":
                pending.items.append(("restart", int(rec["stream"]), [int(r) for r in rec["ranks"]]))
            elif kind == "tick":
                pending.tick, pending.t, pending.counters = int(rec["tick"]), float(rec["t"]), dict(rec["counters"])
                yield pending
                pending = TraceTick(0, 0.0, {})
            else:
                raise ValueError(f"unknown line kind {kind!r}")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if torn:
                return
            raise AttachTraceError(f"corrupt attach trace {path} at line {n}: {type(e).__name__}: {e}") from None
