"""Step records across the process boundary, in batches: per-block arrays through shared memory, the rest pickled.

A step travels light (``WireStep``): its events packed, its counters, its blocks per state (counted
by the pool as they change) and its request rows as deltas of the ones sent before: the same row (a
finished request's) as its id alone, a running one as its fields with only the tokens it gained. At
full speed the engine process sends its steps in batches (``WireBatch``, one every ``BATCH_S``: one
pickling, one write and one wake-up of the window's reader for several steps), and only a batch's
last step carries the pool's raw per-block arrays (ref counts, hash flags, last access, the free
queue), copied from the pool straight into a shared-memory slot: the window draws the newest step,
and its timeline rebuilds the steps before from their events. The window's process derives the views
(state, owner, filled slots, the CPU pool) with the same ``assemble_snapshot`` as everywhere else,
when it draws them. The prefix cache's token and hash maps travel whole once after a load; afterwards
the window keeps its own copy up to date from the events (the event stream is the contract).
"""

from __future__ import annotations

import time
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
)
from engine.outputs import StepOutput
from kvscope.runtime.protocol import Stepped
from kvscope.runtime.shm import ShmSlots
from kvscope.sources.base import StepRecord
from kvscope.sysinfo import MemoryReading

# sent with each batch (the last three: a probed vLLM's null block, KV cache groups and a connector's pins)
SCALARS = (
    "block_size",
    "num_blocks",
    "num_cpu_blocks",
    "block_bytes",
    "model_name",
    "reserved",
    "num_groups",
    "pinned",
    "kv_groups",
)
BATCH_S = 0.02  # at full speed, steps are sent together for this long (the window redraws at most every 33 ms)
_ROW_FIELDS = tuple(f.name for f in fields(RequestInfo))
_ROW = attrgetter(*_ROW_FIELDS)
_TOKENS_AT = _ROW_FIELDS.index("token_ids")
_BLOCKS_AT = _ROW_FIELDS.index("block_ids")


@dataclass(slots=True)
class _Sent:
    """What the record before sent of a row: the row itself (None for a ``LiveRow``), its token count,
    its last token and its block table; for a ``LiveRow`` also the fields that change seldom and its text."""

    row: RequestInfo | None
    num_tokens: int
    last_token: int
    block_ids: tuple[int, ...]
    slow: tuple = ()
    text: str = ""


def encode_rows(rows: tuple[RequestInfo | LiveRow, ...], sent: dict[str, _Sent]) -> tuple:
    """Each row as a delta of ``sent`` (what the record before sent, by request id), which is updated.

    An item is the request id alone (the very row sent before), or ``(n, *fields)`` whose token field
    holds the tokens after the first ``n`` of the row sent before (``n`` = 0: all of them) and whose
    block-id field is None when the block table is the one sent before. The tokens continue the row
    before when the row is at least as long and agrees at the last token sent: a request's token list
    only grows (a fork is a new request), the rule the window's history follows too; comparing whole
    prefixes cost O(tokens) a row a step. A ``LiveRow`` is encoded from its request directly, and a
    running request that only went on (its status, cached tokens, error, swap blocks and client as sent
    before: most rows of most steps) as ``(id, n, tokens, computed, block ids or None, text)``, its text
    None when unchanged, a str when it grew by that str (the output text of a long request, sent whole
    every step, was most of a record's bytes), a 1-tuple when it is the whole new text."""
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


_SLOW = attrgetter("status", "num_cached_tokens", "error", "client")  # with the swap blocks: seldom changed


def _live_item(r: LiveRow, prev: _Sent | None) -> tuple[tuple, _Sent]:
    req = r.request
    prompt, output = req.prompt_tuple or prompt_of(req), req.output_token_ids
    p = len(prompt)
    total = p + len(output)
    blocks = tuple(r.block_ids)
    last = output[-1] if output else (prompt[-1] if prompt else -1)
    slow = (*_SLOW(req), tuple(req.cpu_block_ids))
    text = req.output_text
    n = prev.num_tokens if prev is not None else 0
    if n and total >= n and (output[n - 1 - p] if n > p else prompt[n - 1]) == prev.last_token:
        tokens = tuple(output[n - p :]) if n >= p else prompt[n:] + tuple(output)
        if prev.row is None and slow == prev.slow:  # it only went on: the short form, the record kept
            was = prev.text
            grown = None if text == was else text[len(was) :] if text.startswith(was) else (text,)
            item = (
                req.request_id,
                n,
                tokens,
                req.num_computed_tokens,
                None if blocks == prev.block_ids else blocks,
                grown,
            )
            prev.num_tokens, prev.last_token, prev.block_ids, prev.text = total, last, blocks, text
            return item, prev
    else:
        n, tokens = 0, prompt + tuple(output)
    same_blocks = prev is not None and blocks == prev.block_ids
    return (
        (n, *request_fields(req, None if same_blocks else blocks, tokens)),
        _Sent(None, total, last, blocks, slow, text),
    )


def decode_rows(items: tuple, rows: dict[str, RequestInfo]) -> tuple[RequestInfo, ...]:
    """The inverse of ``encode_rows``, with ``rows`` the decoded rows of the record before (updated)."""
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(rows[item])
            continue
        if type(item[0]) is str:  # a running request that only went on
            rid, _, tokens, computed, blocks, text = item
            b = rows[rid]
            tokens = b.token_ids + tokens  # it continues the whole row sent before
            text = b.text if text is None else b.text + text if type(text) is str else text[0]
            out.append(
                RequestInfo(
                    rid,
                    b.index,
                    b.status,
                    b.num_prompt_tokens,
                    len(tokens) - b.num_prompt_tokens,
                    b.num_cached_tokens,
                    computed,
                    b.block_ids if blocks is None else blocks,
                    text,
                    tokens,
                    b.error,
                    b.group_id,
                    b.parent_id,
                    b.cpu_block_ids,
                    b.client,
                )
            )
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
class WireStep:
    """One step (or one command between steps), light: no per-block arrays."""

    step: int
    requests: tuple  # encode_rows's items
    counters: dict
    counts: tuple[int, ...]  # blocks per BlockState
    cache: tuple[dict, dict] | None  # (cached_tokens, block_hashes) whole: only the first record after a load
    events: bytes  # packed (event_codec): a third of pickling the event objects, both ways
    has_output: bool  # False for the record of a command between steps
    error: str | None
    num_scheduled_tokens: int
    seconds: float
    audit: object
    memory: MemoryReading

    def __reduce__(self):  # pickled as a tuple: half the time of a slots dataclass's state
        return WireStep, tuple(getattr(self, f) for f in self.__slots__)


@dataclass(frozen=True, slots=True)
class WireBatch:
    """Steps sent together; the pool's arrays after the last of them in shared-memory slot ``slot``, or
    ``inline`` when no slot was free, or neither when the pool had changed again before the batch went."""

    steps: tuple[WireStep, ...]
    scalars: dict  # SCALARS
    slot: int | None
    lengths: dict[str, int] | None
    inline: dict[str, np.ndarray] | None

    def __reduce__(self):
        return WireBatch, tuple(getattr(self, f) for f in self.__slots__)

    @property
    def has_arrays(self) -> bool:
        return self.slot is not None or self.inline is not None

    @property
    def last(self) -> WireStep:
        return self.steps[-1]


class RecordEncoder:
    """Engine-process side: ``add`` each record as it is made (its rows must be read before the engine
    goes on), ``flush`` the batch when it is ``due``, before anything else is sent, and before waiting."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.free: set[int] = set()
        self.cache_sent = False
        self.rows_sent: dict[str, _Sent] = {}
        self.pending: list[WireStep] = []
        self._last = None  # the state of the last pending record
        self._flushed = 0.0  # when the last batch went
        self._now = False  # the batch must go at once (it starts a source)

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

    def add(self, st: Stepped) -> None:
        rec, snap = st.record, st.record.snapshot  # a LiveState, a PoolState, or a replay's KVSnapshot
        cache = None
        if not self.cache_sent:  # a new source: its maps whole, its rows whole, at once
            cache, self.cache_sent, self._now = snap.cache_maps(), True, True
            self.rows_sent.clear()
        out = rec.step_output
        self.pending.append(
            WireStep(
                rec.step,
                encode_rows(snap.requests, self.rows_sent),
                snap.counters,
                snap.state_counts,
                cache,
                pack_events(rec.events),
                out is not None,
                out.error if out else None,
                out.num_scheduled_tokens if out else 0,
                rec.seconds,
                rec.audit,
                st.memory,
            )
        )
        self._last = snap

    @property
    def due(self) -> bool:
        """A batch goes ``BATCH_S`` after the one before: at once after a slow step, every few steps of fast ones."""
        return bool(self.pending) and (self._now or time.monotonic() - self._flushed >= BATCH_S)

    def flush(self) -> WireBatch | None:
        """The pending steps as one batch (None if there are none), with the pool's arrays as they are now
        if nothing has changed since the last of them."""
        if not self.pending:
            return None
        snap, steps = self._last, tuple(self.pending)
        self.pending, self._last, self._now, self._flushed = [], None, False, time.monotonic()
        arrays = snap.arrays()  # None: a live state that changed since (a newer record carries them)
        slot = lengths = inline = None
        if arrays is not None:
            if self.slots is not None and self.free and self.slots.fits(snap.num_blocks):
                slot = min(self.free)
                self.free.discard(slot)
                lengths = self.slots.write(slot, arrays)
            else:  # copied: a live state's arrays are the pool's own
                inline = {k: np.array(v) for k, v in arrays.items()}
        return WireBatch(steps, {k: getattr(snap, k) for k in SCALARS}, slot, lengths, inline)


class RecordDecoder:
    """Window side: rebuilds the ``Stepped`` results the engine process emitted."""

    def __init__(self) -> None:
        self.slots: ShmSlots | None = None
        self.tokens: ChunkedMap = ChunkedMap(0)
        self.hashes: ChunkedMap = ChunkedMap(0)
        self.rows: dict[str, RequestInfo] = {}

    def skip(self, batch: WireBatch) -> None:
        """A batch not shown (its arrays are in slots already replaced): its maps and rows still count,
        since the next batch's follow on from these."""
        for w in batch.steps:
            self._follow(w, batch.scalars)

    def _follow(self, w: WireStep, scalars: dict) -> tuple[list, tuple[RequestInfo, ...]]:
        """The step's events and rows, with the cache maps and the rows brought up to it."""
        events = unpack_events(w.events)
        if w.cache is not None:
            n = scalars["num_blocks"]
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

    def decode(self, batch: WireBatch, whole: bool = True) -> list[Stepped]:
        """Every step of the batch: a ``StepDigest`` for each (rows, counters, blocks per state), except the
        last when ``whole`` and the batch carries arrays: a ``PoolState`` (its arrays copied out of the slot,
        which may then be released; the views are assembled where it is drawn)."""
        sc = batch.scalars
        out = [self._digest(w, sc) for w in batch.steps[:-1]]
        last = batch.last
        if not (whole and batch.has_arrays):
            out.append(self._digest(last, sc))
            return out
        events, rows = self._follow(last, sc)
        arrays = self.slots.read(batch.slot, batch.lengths) if batch.slot is not None else dict(batch.inline)
        snap = PoolState(
            last.step,
            sc["block_size"],
            **arrays,
            requests=rows,
            counters=last.counters,
            cached_tokens=self.tokens.freeze(),
            block_hashes=self.hashes.freeze(),
            num_cpu_blocks=sc["num_cpu_blocks"],
            block_bytes=sc["block_bytes"],
            model_name=sc["model_name"],
            counts=last.counts,
            reserved=sc.get("reserved", ()),
            num_groups=sc.get("num_groups", 1),
            pinned=sc.get("pinned", {}),
            kv_groups=sc.get("kv_groups", ()),
        )
        out.append(_stepped(last, snap, events))
        return out

    def _digest(self, w: WireStep, sc: dict) -> Stepped:
        events, rows = self._follow(w, sc)
        snap = StepDigest(
            w.step,
            sc["block_size"],
            sc["num_blocks"],
            rows,
            w.counters,
            w.counts,
            sc["num_cpu_blocks"],
            sc["block_bytes"],
            sc["model_name"],
        )
        return _stepped(w, snap, events)


def _stepped(w: WireStep, snap: PoolState | StepDigest, events: list) -> Stepped:
    out = StepOutput(w.step, [], [], w.num_scheduled_tokens, {}, w.error) if w.has_output else None
    return Stepped(StepRecord(w.step, snap, events, out, w.seconds, w.audit), w.memory)
