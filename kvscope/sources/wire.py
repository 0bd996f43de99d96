"""Step records across the process boundary: arrays through shared memory, the rest pickled.

A record carries the raw pool state (``PoolState``: ref counts, hash flags, last access, the free
queue, the rows); the window's process derives the views (state, owner, filled slots, the CPU pool)
with the same ``assemble_snapshot`` as everywhere else, so the engine process does not pay for them.
The prefix cache's token and hash maps are sent once after a load; afterwards the window
keeps its own copy up to date from the events (the event stream is the contract), so a step
costs its events, its request rows and a copy of the per-block arrays. A request row travels as
a delta of the one sent before it: the same row (a finished request's) as its id alone, a running
one as its fields with only the tokens it gained (a row's token tuple was most of a step's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter

import numpy as np

from engine.inspect.chunked_map import ChunkedMap
from engine.inspect.event_codec import pack_events, unpack_events
from engine.inspect.replay import apply_cache_event
from engine.inspect.snapshot import (
    LiveRow,
    PoolState,
    RequestInfo,
    StepDigest,
    prompt_of,
    request_fields,
    state_counts,
)
from engine.outputs import StepOutput

from ..sysinfo import MemoryReading
from .base import StepRecord
from .protocol import Stepped
from .shm import FIELDS, ShmSlots

ARRAYS = tuple(name for name, _ in FIELDS)
SCALARS = ("step", "block_size", "num_cpu_blocks", "block_bytes", "model_name")
_ROW_FIELDS = tuple(f.name for f in fields(RequestInfo))
_ROW = attrgetter(*_ROW_FIELDS)
_TOKENS_AT = _ROW_FIELDS.index("token_ids")
_BLOCKS_AT = _ROW_FIELDS.index("block_ids")


@dataclass(slots=True)
class _Sent:
    """What the record before sent of a row: the row itself (None for a ``LiveRow``), its token count,
    its last token and its block table."""
    row: RequestInfo | None
    num_tokens: int
    last_token: int
    block_ids: tuple[int, ...]


def encode_rows(rows: tuple[RequestInfo | LiveRow, ...], sent: dict[str, _Sent]) -> tuple:
    """Each row as a delta of ``sent`` (what the record before sent, by request id), which is updated.

    An item is the request id alone (the very row sent before), or ``(n, *fields)`` whose token field
    holds the tokens after the first ``n`` of the row sent before (``n`` = 0: all of them) and whose
    block-id field is None when the block table is the one sent before. The tokens continue the row
    before when the row is at least as long and agrees at the last token sent: a request's token list
    only grows (a fork is a new request), the rule the window's history follows too; comparing whole
    prefixes cost O(tokens) a row a step. A ``LiveRow`` is encoded from its request directly."""
    out = []
    new: dict[str, _Sent] = {}
    for r in rows:
        rid = r.request_id
        prev = sent.get(rid)
        if isinstance(r, LiveRow):
            item, new[rid] = _live_item(r, prev)
            out.append(item)
            continue
        if prev is not None and prev.row is r:
            out.append(rid)
            new[rid] = prev
            continue
        f = list(_ROW(r))
        tokens = r.token_ids
        n = 0
        if prev is not None:
            n = prev.num_tokens
            if n and len(tokens) >= n and tokens[n - 1] == prev.last_token:
                f[_TOKENS_AT] = tokens[n:]
            else:
                n = 0
            if r.block_ids == prev.block_ids:
                f[_BLOCKS_AT] = None
        out.append((n, *f))
        new[rid] = _Sent(r, len(tokens), tokens[-1] if tokens else -1, r.block_ids)
    sent.clear()
    sent.update(new)
    return tuple(out)


def _live_item(r: LiveRow, prev: _Sent | None) -> tuple[tuple, _Sent]:
    req = r.request
    prompt, output = prompt_of(req), req.output_token_ids
    p, total = len(prompt), len(prompt) + len(output)
    blocks = tuple(r.block_ids)
    last = output[-1] if output else (prompt[-1] if prompt else -1)
    n = prev.num_tokens if prev is not None else 0
    if n and total >= n and (output[n - 1 - p] if n > p else prompt[n - 1]) == prev.last_token:
        tokens = tuple(output[n - p:]) if n >= p else prompt[n:] + tuple(output)
    else:
        n, tokens = 0, prompt + tuple(output)
    same_blocks = prev is not None and blocks == prev.block_ids
    return (n, *request_fields(req, None if same_blocks else blocks, tokens)), _Sent(None, total, last, blocks)


def decode_rows(items: tuple, rows: dict[str, RequestInfo]) -> tuple[RequestInfo, ...]:
    """The inverse of ``encode_rows``, with ``rows`` the decoded rows of the record before (updated)."""
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(rows[item])
            continue
        n, *f = item
        if n:
            f[_TOKENS_AT] = rows[f[0]].token_ids + f[_TOKENS_AT]
        if f[_BLOCKS_AT] is None:
            f[_BLOCKS_AT] = rows[f[0]].block_ids
        out.append(RequestInfo(*f))
    rows.clear()
    rows.update((r.request_id, r) for r in out)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class WireStepped:
    """A ``Stepped`` result with its arrays in shared-memory slot ``slot`` (or inline when none was free)."""
    scalars: dict
    requests: tuple  # encode_rows's items
    counters: dict
    slot: int | None
    lengths: dict[str, int] | None
    inline: dict[str, np.ndarray] | None
    cache: tuple[dict, dict] | None  # (cached_tokens, block_hashes): only the first record after a load
    events: bytes  # packed (event_codec): a third of pickling the event objects, both ways
    has_output: bool  # False for the record of a command between steps
    error: str | None
    num_scheduled_tokens: int
    seconds: float
    audit: object
    memory: MemoryReading

    def __reduce__(self):  # pickled as a tuple: half the time of a slots dataclass's state
        return WireStepped, tuple(getattr(self, f) for f in self.__slots__)

    @property
    def num_blocks(self) -> int:
        return self.lengths["ref_cnt"] if self.lengths is not None else len(self.inline["ref_cnt"])


class RecordEncoder:
    """Engine-process side."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.free: set[int] = set()
        self.cache_sent = False
        self.rows_sent: dict[str, _Sent] = {}

    def attach(self, slots: ShmSlots) -> None:
        self.detach()
        self.slots, self.free = slots, set(range(len(slots.shms)))

    def detach(self) -> None:
        if self.slots is not None:
            self.slots.close()
        self.slots, self.free = None, set()

    def release(self, slot: int) -> None:
        self.free.add(slot)

    def loaded(self) -> None:
        """A new source: the next record carries the prefix cache's maps whole."""
        self.cache_sent = False

    def encode(self, st: Stepped) -> WireStepped:
        rec, snap = st.record, st.record.snapshot  # a PoolState, or a KVSnapshot (a trace replay's)
        arrays = {name: getattr(snap, name) for name in ARRAYS}
        slot = lengths = inline = None
        if self.slots is not None and self.free and self.slots.fits(snap.num_blocks):
            slot = min(self.free)
            self.free.discard(slot)
            lengths = self.slots.write(slot, arrays)
        else:
            inline = arrays
        cache = None
        if not self.cache_sent:  # a new source: its maps whole, its rows whole
            cache = (dict(snap.cached_tokens), dict(snap.block_hashes))
            self.cache_sent = True
            self.rows_sent.clear()
        out = rec.step_output
        rows = encode_rows(snap.requests, self.rows_sent)
        return WireStepped({k: getattr(snap, k) for k in SCALARS}, rows, snap.counters, slot, lengths,
                           inline, cache, pack_events(rec.events), out is not None, out.error if out else None,
                           out.num_scheduled_tokens if out else 0, rec.seconds, rec.audit, st.memory)


class RecordDecoder:
    """Window side: rebuilds the ``Stepped`` result the engine process emitted."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.tokens: ChunkedMap = ChunkedMap(0)
        self.hashes: ChunkedMap = ChunkedMap(0)
        self.rows: dict[str, RequestInfo] = {}

    def skip(self, w: WireStepped) -> None:
        """A record not shown (its arrays are in slots already replaced): its maps and rows still
        count, since the next record's follow on from these."""
        self._follow(w)

    def _follow(self, w: WireStepped) -> tuple[list, tuple[RequestInfo, ...]]:
        """The record's events and rows, with the cache maps and the rows brought up to it."""
        events = unpack_events(w.events)
        if w.cache is not None:
            n = w.num_blocks
            self.tokens, self.hashes = ChunkedMap(n), ChunkedMap(n)
            for b, v in w.cache[0].items():
                self.tokens[b] = v
            for b, v in w.cache[1].items():
                self.hashes[b] = v
            self.rows.clear()
        else:
            for ev in events:
                apply_cache_event(ev, self.tokens, self.hashes)
        return events, decode_rows(w.requests, self.rows)

    def digest(self, w: WireStepped) -> Stepped:
        """The record with a ``StepDigest`` for its snapshot: for a record a newer one follows at once,
        which will not be drawn. Its arrays are only counted (in place), not copied or assembled."""
        events, rows = self._follow(w)
        if w.slot is not None:
            n = w.num_blocks
            ref, hashed = self.slots.view(w.slot, "ref_cnt", n), self.slots.view(w.slot, "has_hash", n)
        else:
            ref, hashed = w.inline["ref_cnt"], w.inline["has_hash"]
        sc = w.scalars
        snap = StepDigest(sc["step"], sc["block_size"], len(ref), rows, w.counters, state_counts(ref, hashed),
                          sc["num_cpu_blocks"], sc["block_bytes"], sc["model_name"])
        del ref, hashed  # the slot's memory may be released (and written again) now
        return self._stepped(w, snap, events)

    def _stepped(self, w: WireStepped, snap, events) -> Stepped:
        out = StepOutput(w.scalars["step"], [], [], w.num_scheduled_tokens, {}, w.error) if w.has_output else None
        return Stepped(StepRecord(w.scalars["step"], snap, events, out, w.seconds, w.audit), w.memory)

    def decode(self, w: WireStepped) -> Stepped:
        events, rows = self._follow(w)
        arrays = self.slots.read(w.slot, w.lengths) if w.slot is not None else dict(w.inline)
        snap = PoolState(**w.scalars, **arrays, requests=rows, counters=w.counters,
                         cached_tokens=self.tokens.freeze(), block_hashes=self.hashes.freeze()).assemble()
        return self._stepped(w, snap, events)
