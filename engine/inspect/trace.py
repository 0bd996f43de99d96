"""Traces: the event stream plus what a snapshot needs, as versioned JSON lines.

Line 1 is a header (format, version, model, configuration); every further line is
one record: a step's events, the request rows that changed, the counters and the
blocks an audit flagged. Each line is flushed, so a trace stays readable after a
crash (a torn last line is dropped). Replaying rebuilds every step's snapshot with
no model and no GPU.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .events import Event, event_from_dict
from .replay import PoolReplayer
from .snapshot import KVSnapshot, RequestInfo, assemble_snapshot

FORMAT = "kvscope-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace that cannot be read; the message is one line."""


def _info_dict(r: RequestInfo) -> dict:
    return dataclasses.asdict(r)


class TraceWriter:
    def __init__(self, path: str | Path, header: dict) -> None:
        self.path = Path(path)
        self._f = self.path.open("w", encoding="utf-8")
        self._rows: dict[str, RequestInfo] = {}
        self._write({"format": FORMAT, "version": VERSION, **header})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def record(self, snap: KVSnapshot, events: list[Event], leaked: list[int] | None = None) -> None:
        changed = [_info_dict(r) for r in snap.requests if self._rows.get(r.request_id) != r]
        self._rows.update({r.request_id: r for r in snap.requests})
        self._write({"step": snap.step, "events": [e.to_dict() for e in events], "requests": changed,
                     "shown": [r.request_id for r in snap.requests], "counters": snap.counters,
                     "leaked": list(leaked or [])})

    def close(self) -> None:
        self._f.close()


@dataclasses.dataclass
class TraceRecord:
    step: int
    events: list[Event]
    snapshot: KVSnapshot
    leaked: list[int]


def read_header(path: str | Path) -> dict:
    try:
        with Path(path).open(encoding="utf-8") as f:
            first = f.readline()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    try:
        header = json.loads(first)
    except json.JSONDecodeError:
        raise TraceError(f"{path} is not a kvscope trace (its first line is not JSON)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f"{path} is not a kvscope trace (no '{FORMAT}' header)")
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise TraceError(f"{path} was written by a newer kvscope (trace version {version}); "
                         f"this one reads version {VERSION}")
    for key in ("num_blocks", "block_size"):
        if not isinstance(header.get(key), int) or header[key] < 1:
            raise TraceError(f"{path}: header field {key!r} is missing or invalid")
    return header


def replay_trace(path: str | Path) -> Iterator[TraceRecord]:
    """Yield one record per line, each with the snapshot it rebuilds. Raises ``TraceError``."""
    header = read_header(path)
    pool = PoolReplayer(header["num_blocks"])
    last_access = np.zeros(header["num_blocks"], np.int64)
    rows: dict[str, RequestInfo] = {}
    with Path(path).open(encoding="utf-8") as f:
        lines = f.readlines()[1:]
    for n, line in enumerate(lines, start=2):
        torn = n == len(lines) + 1 and not line.endswith("\n")
        try:
            rec = json.loads(line)
            step = int(rec["step"])
            events = [event_from_dict(d) for d in rec["events"]]
            for d in rec["requests"]:
                d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
                rows[d["request_id"]] = RequestInfo(**d)
            shown = [rows[i] for i in rec["shown"]]
            counters, leaked = dict(rec["counters"]), list(rec.get("leaked", []))
            for ev in events:
                pool.apply(ev)
                b = getattr(ev, "block_id", None)
                if ev.kind in ("allocated", "hit", "freed") and b is not None:
                    last_access[b] = step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if torn:  # the writer died mid-line: everything before it is good
                return
            raise TraceError(f"corrupt trace {path} at line {n}: {type(e).__name__}: {e}") from None
        has_hash = np.array([h is not None for h in pool.block_hash], bool)
        snap = assemble_snapshot(
            step, header["block_size"], ref_cnt=pool.ref_cnt.copy(), has_hash=has_hash,
            last_access=last_access.copy(), free_queue=np.array(list(pool.free_queue), np.int32), requests=shown,
            cached_tokens=dict(pool.cached_tokens), block_hashes={i: h for i, h in enumerate(pool.block_hash) if h},
            counters=counters, num_cpu_blocks=int(header.get("num_cpu_blocks", 0)),
            block_bytes=int(header.get("block_bytes", 0)), model_name=str(header.get("model", "")))
        yield TraceRecord(step, events, snap, leaked)
