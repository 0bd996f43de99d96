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

from .events import Event, event_from_dict
from .jsonl import JsonLinesWriter, read_versioned_header
from .replay import PoolReplayer
from .snapshot import KVSnapshot, RequestInfo, assemble_snapshot

FORMAT = "kvscope-trace"
VERSION = 1
# A header is outside input: it may not make the replayer allocate without bound. A million
# blocks (the grid's design size) is far above any pool a real GPU holds at block size 16.
MAX_TRACE_BLOCKS = 1 << 20
MAX_TRACE_BLOCK_SIZE = 1 << 14  # the snapshot's fill counts are int16


class TraceError(ValueError):
    """A trace that cannot be read; the message is one line."""


def _info_dict(r: RequestInfo) -> dict:
    return dataclasses.asdict(r)


def check_replayable(num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
    """The replay's limits, one rule for the writer and the reader: raises ``ValueError`` with one line."""
    for key, value, limit in (
        ("num_blocks", num_blocks, MAX_TRACE_BLOCKS),
        ("num_cpu_blocks", num_cpu_blocks, MAX_TRACE_BLOCKS),
        ("block_size", block_size, MAX_TRACE_BLOCK_SIZE),
    ):
        if value > limit:
            raise ValueError(f"{key} = {value:,}, above the replay limit of {limit:,}")


class TraceWriter:
    def __init__(self, path: str | Path, header: dict) -> None:
        """Refuses (``ValueError``, one line, before the file is made) a pool a replay could not rebuild: every
        trace kvscope writes, kvscope replays."""
        try:
            check_replayable(header["num_blocks"], header.get("num_cpu_blocks", 0), header["block_size"])
        except ValueError as e:
            raise ValueError(
                f"cannot record a trace: {e} (a smaller --num-cpu-blocks or --swap-space, or a smaller pool)"
            ) from None
        self.path = Path(path)
        self._rows: dict[str, RequestInfo] = {}
        self._out = JsonLinesWriter(path, FORMAT, VERSION, header)

    def record(
        self, snap: KVSnapshot, events: list[Event], leaked: list[int] | None = None, seconds: float = 0.0
    ) -> None:
        """``seconds``: what the step took, so a replay reports the recorded run's timings (TTFT, decode)."""
        changed = [_info_dict(r) for r in snap.requests if self._rows.get(r.request_id) != r]
        self._rows.update({r.request_id: r for r in snap.requests})
        self._out.write(
            {
                "step": snap.step,
                "events": [e.to_dict() for e in events],
                "requests": changed,
                "shown": [r.request_id for r in snap.requests],
                "counters": snap.counters,
                "leaked": list(leaked or []),
                "seconds": seconds,
            }
        )

    def close(self) -> None:
        self._out.close()


@dataclasses.dataclass
class TraceRecord:
    step: int
    events: list[Event]
    snapshot: KVSnapshot
    leaked: list[int]
    seconds: float = 0.0  # the step's own time (0 in traces written before it was recorded)


def read_header(path: str | Path) -> dict:
    header = read_versioned_header(path, FORMAT, VERSION, "a kvscope trace", TraceError)
    for key in ("num_blocks", "block_size"):
        if not _is_int(header.get(key)) or header[key] < 1:
            raise TraceError(f"{path}: header field {key!r} is missing or invalid")
    cpu = header.get("num_cpu_blocks", 0)
    if not _is_int(cpu) or cpu < 0:
        raise TraceError(f"{path}: header field 'num_cpu_blocks' is invalid ({cpu!r})")
    try:
        check_replayable(header["num_blocks"], cpu, header["block_size"])
    except ValueError as e:
        raise TraceError(f"{path}: header claims {e}") from None
    return header


def count_steps(path: str | Path) -> int:
    """The steps a replay of this trace shows (records of one step number fold into one), up to a bad line
    (the replay itself reports it when it gets there)."""
    steps, last = 0, None
    try:
        with Path(path).open(encoding="utf-8") as f:
            next(f, None)  # the header
            for line in f:
                step = json.loads(line)["step"]
                if step != last:
                    steps, last = steps + 1, step
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        pass
    return steps


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _request_row(d: object, num_blocks: int, num_cpu_blocks: int) -> RequestInfo:
    """One request row of a record, checked: the snapshot indexes arrays by its block ids."""
    if not isinstance(d, dict):
        raise ValueError(f"a request row must be an object, got {type(d).__name__}")
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    info = RequestInfo(**d)
    for name, limit in (("block_ids", num_blocks), ("cpu_block_ids", num_cpu_blocks)):
        ids = getattr(info, name)
        if not isinstance(ids, tuple) or not all(_is_int(b) and 0 <= b < limit for b in ids):
            raise ValueError(f"request {info.request_id!r}: {name} {ids!r} are not blocks 0..{limit - 1}")
    for name in ("index", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_computed_tokens"):
        if not _is_int(getattr(info, name)):
            raise ValueError(f"request {info.request_id!r}: {name} is not an integer")
    if not isinstance(info.request_id, str) or not isinstance(info.status, str):
        raise ValueError("a request row's request_id and status must be strings")
    return info


def replay_trace(path: str | Path) -> Iterator[TraceRecord]:
    """Yield one record per line, each with the snapshot it rebuilds. Raises ``TraceError``."""
    header = read_header(path)
    num_cpu = int(header.get("num_cpu_blocks", 0))
    pool = PoolReplayer(header["num_blocks"])
    rows: dict[str, RequestInfo] = {}
    with Path(path).open(encoding="utf-8") as f:
        lines = f.readlines()[1:]
    for n, line in enumerate(lines, start=2):
        torn = n == len(lines) + 1 and not line.endswith("\n")
        try:
            rec = json.loads(line)
            step = rec["step"]
            if not _is_int(step) or not 0 <= step < 2**62:
                raise ValueError(f"step {step!r} is not a step number")
            events = [event_from_dict(d) for d in rec["events"]]
            for d in rec["requests"]:
                info = _request_row(d, header["num_blocks"], num_cpu)
                rows[info.request_id] = info
            shown = [rows[i] for i in rec["shown"]]
            counters, leaked = dict(rec["counters"]), list(rec.get("leaked", []))
            if not all(_is_int(b) and -1 <= b < header["num_blocks"] for b in leaked):  # -1: pool-wide
                raise ValueError(f"leaked blocks {leaked!r} are not blocks of the pool")
            for ev in events:
                pool.apply(ev, step)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            if torn:  # the writer died mid-line: everything before it is good
                return
            raise TraceError(f"corrupt trace {path} at line {n}: {type(e).__name__}: {e}") from None
        tokens, hashes = pool.frozen_maps()  # O(chunks): consecutive records share what did not change
        snap = assemble_snapshot(
            step,
            header["block_size"],
            ref_cnt=pool.ref_cnt.copy(),
            has_hash=pool.has_hash,
            last_access=pool.last_access.copy(),
            free_queue=pool.free_queue,
            requests=shown,
            cached_tokens=tokens,
            block_hashes=hashes,
            counters=counters,
            num_cpu_blocks=num_cpu,
            block_bytes=int(header.get("block_bytes", 0)),
            model_name=str(header.get("model", "")),
        )
        seconds = rec.get("seconds", 0.0)
        yield TraceRecord(step, events, snap, leaked, float(seconds) if isinstance(seconds, (int, float)) else 0.0)
