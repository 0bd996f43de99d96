"""The run's history for the timeline and the plots (Qt-free), in O(events), not O(blocks x steps).

Every step keeps its events, its counters and, per request, a few numbers (status, tokens
out, tokens computed) in compact arrays; every ``keyframe_every`` steps (and whenever the
pool's size changes) a keyframe keeps the per-block arrays. ``at(step)`` starts from the
nearest keyframe at or before the step and replays the events in between, with the same
rules (``PoolReplayer``) and the same assembly (``assemble_snapshot``) as a trace replay, so
it rebuilds exactly the snapshot the engine had. The history has bounds (``kvscope.limits``): a
memory budget, which counts everything it holds object by object as it is added (``sys.getsizeof``,
rounded up as the allocator rounds), and a number of requests; past either, the oldest keyframe and
the steps it covers are dropped, with the requests and the prefix cache's values no step in reach
shows any more, and ``reach`` says how far back the timeline goes. Per-step numbers are kept packed
(series and time to first token in typed arrays, counters marshalled), so a long served run's steps
cost a few hundred bytes each.
"""

from __future__ import annotations

import bisect
import marshal
import sys
from array import array
from dataclasses import dataclass, field

import numpy as np

from engine.inspect.cache_rules import CacheChange, cache_change
from engine.inspect.event_codec import pack_events, unpack_events
from engine.inspect.events import Event
from engine.inspect.indexed_map import OverlayMap, StoreLog
from engine.inspect.replay import PoolReplayer
from engine.inspect.snapshot import (
    BlockState,
    KVSnapshot,
    PoolRecord,
    PoolState,
    RequestInfo,
    assemble_snapshot,
)
from kvscope.limits import LIMITS
from kvscope.malloc_policy import give_back

SERIES = (
    "free",
    "cached",
    "used",
    "hit_rate",
    "evictions_per_s",
    "running",
    "waiting",
    "swapped",
    "tokens_per_s",
    "decode_tokens_per_s",
    "nvml_used",
    "torch_allocated",
    "torch_reserved",
    "process_rss",
    "device_free",
)
DEFAULT_BUDGET = LIMITS.timeline_bytes
DEFAULT_MAX_REQUESTS = LIMITS.timeline_requests
SLACK = 0.95  # past a bound, the oldest steps go until the history is under this share of it
STATUSES = (
    "WAITING",
    "RUNNING",
    "PREEMPTED",
    "SWAPPED",
    "FINISHED_STOPPED",
    "FINISHED_LENGTH",
    "FINISHED_ABORTED",
    "FINISHED_ERROR",
    "FINISHED_PRUNED",
)
_STATUS_CODE = {s: i for i, s in enumerate(STATUSES)}
_PLAIN = (int, float, bool, str, type(None))  # values marshal gives back as they were
_SCALARS = 4 * 32  # a request's index, prompt length, arrival time and last step shown: int and float objects


def held(obj) -> int:
    """The bytes ``obj`` itself takes from the allocator: ``sys.getsizeof`` (the GC header and a container's
    spare capacity included) rounded up to pymalloc's 16-byte size classes, or with malloc's header past
    512 bytes. A numpy array that owns its data counts its data."""
    n = sys.getsizeof(obj)
    return (n + 15) & ~15 if n <= 512 else n + 16


@dataclass(slots=True)
class _Keyframe:
    """A pool's raw arrays at one step, each in the smallest integer type its values fit (a scrub widens
    them again); whether a block is hashed is ``store_of >= 0``."""

    step: int
    ref_cnt: np.ndarray  # int16 (int32 past 32,767)
    last_access: np.ndarray  # int32 (int64 past 2**31 steps)
    free_queue: np.ndarray  # uint16 up to 65,536 blocks, else int32
    store_of: np.ndarray  # int32 per block: its (tokens, hash) in the history's StoreLog, -1 if none
    num_cpu_blocks: int
    block_size: int
    block_bytes: int
    model_name: str
    # event chunks of its own step it holds already: a later record of that step kept as a digest
    # (a command between steps) is replayed over it
    chunks_in: int = 0
    reserved: tuple[int, ...] = ()  # a probed vLLM's null block, its KV cache groups, its connector's pins
    num_groups: int = 1
    kv_groups: tuple = ()
    pinned: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return held(self) + held(self.ref_cnt) + held(self.last_access) + held(self.free_queue) + held(self.store_of)


@dataclass(slots=True)
class _RequestTimeline:
    """One request across the steps it was shown: numbers per step, the rest only when it changed."""

    request_id: str
    index: int
    num_prompt_tokens: int
    group_id: str
    parent_id: str | None
    steps: array = field(default_factory=lambda: array("i"))
    status: array = field(default_factory=lambda: array("b"))
    num_output: array = field(default_factory=lambda: array("i"))
    num_computed: array = field(default_factory=lambda: array("i"))
    num_cached: array = field(default_factory=lambda: array("i"))
    # (step, blocks, error, cpu blocks, a hybrid model's group tables, held by), blocks as int32 arrays (a tuple
    # of int objects costs ~9x more), no cpu blocks as None, no group tables as ()
    changes: list[tuple[int, array, str | None, array, tuple, str]] = field(default_factory=list)
    last_key: tuple = ()  # the latest change's (blocks, error, cpu) as the snapshot gave them, to compare with
    tokens: array = field(default_factory=lambda: array("i"))  # the longest seen: earlier steps' are prefixes
    text: str = ""  # the text with ``len(tokens)`` tokens
    last: RequestInfo | None = None
    extra: dict = field(default_factory=dict)  # fields a newer RequestInfo carries (e.g. client)
    arrived: float = 0.0  # the run's clock (summed step seconds) when the request was first shown
    shown_until: int = -1  # the last step it was shown at (its last entry may be older: unchanged since)
    change_bytes: int = 0  # what ``changes``' entries hold (kept up to date as they come and go)

    def add(self, step: int, r: RequestInfo) -> None:
        self.steps.append(step)
        self.status.append(_STATUS_CODE.get(r.status, 0))
        self.num_output.append(r.num_output_tokens)
        self.num_computed.append(r.num_computed_tokens)
        self.num_cached.append(r.num_cached_tokens)
        key = (r.block_ids, r.error, r.cpu_block_ids, r.group_block_ids, r.held_by)
        if not self.changes or self.last_key != key:
            change = (
                step,
                array("i", r.block_ids),
                r.error,
                array("i", r.cpu_block_ids) if r.cpu_block_ids else None,
                tuple(array("i", t) for t in r.group_block_ids),
                r.held_by,
            )
            self.changes.append(change)
            self.change_bytes += _change_bytes(change)
            self.last_key = key
        n, new = len(self.tokens), r.token_ids
        if len(new) >= n:
            if n and new[n - 1] != self.tokens[n - 1]:  # not a continuation (never seen so far): start again
                self.tokens = array("i")
                n = 0
            self.tokens.extend(new[n:])
            self.text = r.text
        self.last = r

    def at(self, step: int, decode) -> RequestInfo | None:
        i = bisect.bisect_right(self.steps, step) - 1
        if i < 0:
            return None
        if self.last is not None and self.steps[i] == self.steps[-1]:
            return self.last
        c = self.changes[bisect.bisect_right(self.changes, step, key=lambda ch: ch[0]) - 1]
        n_out = self.num_output[i]
        tokens = tuple(self.tokens[: self.num_prompt_tokens + n_out])
        text = (
            self.text
            if len(tokens) == len(self.tokens)
            else (decode(tokens[self.num_prompt_tokens :]) if decode else "")
        )
        return RequestInfo(
            self.request_id,
            self.index,
            STATUSES[self.status[i]],
            self.num_prompt_tokens,
            n_out,
            self.num_cached[i],
            self.num_computed[i],
            tuple(c[1]),
            text,
            tokens,
            c[2],
            self.group_id,
            self.parent_id,
            tuple(c[3] or ()),
            **self.extra,
            group_block_ids=tuple(tuple(t) for t in c[4]),
            held_by=c[5],
        )

    def trim(self, first_step: int) -> None:
        # the last entry stays even when older: a row unchanged since (it is not added again) reads from it
        i = min(bisect.bisect_left(self.steps, first_step), len(self.steps) - 1)
        for name in ("steps", "status", "num_output", "num_computed", "num_cached"):
            a = getattr(self, name)
            del a[:i]
        j = max(0, bisect.bisect_right(self.changes, first_step, key=lambda ch: ch[0]) - 1)
        self.change_bytes -= sum(_change_bytes(c) for c in self.changes[:j])
        del self.changes[:j]

    @property
    def nbytes(self) -> int:
        """What it holds, object by object (the row shown now, ``last``, is the present's, not the timeline's)."""
        n = (
            held(self)
            + held(self.request_id)
            + held(self.steps)
            + held(self.status)
            + held(self.num_output)
            + held(self.num_computed)
            + held(self.num_cached)
            + held(self.changes)
            + self.change_bytes
            + held(self.tokens)
            + held(self.text)
            + _SCALARS
        )
        if self.group_id is not self.request_id:
            n += held(self.group_id)
        if self.extra:
            n += held(self.extra) + sum(held(v) for v in self.extra.values() if v is not None)
        return n


def _change_bytes(change: tuple) -> int:
    _step, blocks, error, cpu, groups, _held = change  # the step's int object is the history's (counted with its steps)
    return (
        held(change)
        + held(blocks)
        + (held(cpu) if cpu is not None else 0)
        + (held(error) if error else 0)
        + sum(held(t) for t in groups)
    )


class RunHistory:
    def __init__(
        self,
        budget_bytes: int = DEFAULT_BUDGET,
        keyframe_every: int | None = None,
        decode=None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        """``keyframe_every``: steps between keyframes; None: by the pool's size (64 steps up to 65,536
        blocks, up to 256 from 262,144: a keyframe's arrays grow with the pool, a scrub's replay does not).
        ``budget_bytes`` and ``max_requests``: the bounds (``kvscope.limits``); past either, the oldest
        steps are dropped."""
        self.budget_bytes = budget_bytes
        self.max_requests = max_requests
        self._fixed_keyframe_every = keyframe_every
        self.keyframe_every = keyframe_every or 64
        self.decode = decode  # token ids -> text, for the text of a request at an earlier step
        self.steps: list[int] = []
        # one value a step, as float64 (read-only: copy before keeping, an array that exports a view can't grow)
        self.series: dict[str, array] = {k: array("d") for k in SERIES}
        self._events: dict[int, list[bytes]] = {}  # packed (event_codec): a tenth of the objects' memory
        # marshalled values (with their keys when they are not the first counters'; a dict marshal cannot take)
        self._counters: dict[int, bytes | tuple[tuple, bytes] | dict] = {}
        self._counter_keys: tuple | None = None  # the keys of the first counters: most steps' values follow them
        self._shown: dict[int, tuple[str, ...]] = {}
        self._keyframes: list[_Keyframe] = []
        # the prefix cache's contents over time: every stored value once, and the block -> value index now
        self._store = StoreLog()
        self._store_of: np.ndarray | None = None
        self._requests: dict[str, _RequestTimeline] = {}
        self._latest: PoolRecord | None = None  # the newest whole record (assembled when read)
        self._last_tokens = 0.0
        self._last_evictions = 0.0
        # what the entries of the per-step stores, the request timelines and the keyframes hold, kept up to
        # date as they come and go (the containers themselves are measured when ``nbytes`` is read)
        self._step_bytes = 0
        self._req_bytes = 0
        self._kf_bytes = 0
        self.dropped_steps = 0
        self.dropped_requests = 0
        self.clock = 0.0  # seconds of engine steps so far: what a client would have waited
        # time to first token, one a request: its step, seconds from arrival, request id
        self._ttft_steps = array("q")
        self._ttft_s = array("d")
        self._ttft_ids: list[str] = []
        self._decode_tokens = 0

    # -- recording -------------------------------------------------------------------------
    def record(
        self,
        snap: PoolRecord,
        step_seconds: float,
        memory=None,
        events: list[Event] | None = None,
    ) -> None:
        """Keep one record; a second record of the same step (a command between steps) is folded into it.
        A ``StepDigest`` (a step the window did not draw) keeps all but a keyframe; a raw ``PoolState`` (an
        engine process's) is kept as it came, and assembled only if it is read."""
        step = snap.step
        new_step = not self.steps or step != self.steps[-1]
        whole = snap.has_arrays  # a digest has none, so no keyframe comes from it
        if self._store_of is None or len(self._store_of) != snap.num_blocks:
            if not whole:
                raise ValueError("a pool's first record must carry its whole snapshot, not a digest")
            self._store_of = self._index_of(snap)  # a first record, or a new pool: read it whole once
            if self._fixed_keyframe_every is None:
                self.keyframe_every = max(64, min(256, snap.num_blocks // 1024))
        elif events:
            self._follow_cache(events)
        if events:
            packed = pack_events(events)
            chunks = self._events.get(step)
            if chunks is None:
                chunks = self._events[step] = []
            else:
                self._step_bytes -= held(chunks)
            chunks.append(packed)
            self._step_bytes += held(chunks) + held(packed)
        self._set_counters(step, snap.counters)
        if new_step:
            self.clock += step_seconds
            self._decode_tokens = 0
            self._step_bytes += held(step)
        self._set_shown(step, tuple(r.request_id for r in snap.requests))
        for r in snap.requests:
            tl = self._requests.get(r.request_id)
            if tl is None:
                tl = self._requests[r.request_id] = _RequestTimeline(
                    r.request_id,
                    r.index,
                    r.num_prompt_tokens,
                    r.group_id,
                    r.parent_id,
                    extra=_extra_fields(r),
                    arrived=self.clock - (step_seconds if new_step else 0.0),
                )
                self._req_bytes += tl.nbytes
            tl.shown_until = step
            if tl.last is r and tl.steps:
                # the very row recorded last (a finished request's, kept on show): nothing changed, so
                # nothing is added; its last entry stands for the steps after it
                continue
            if new_step:
                self._count_output(step, tl, r)
            before = tl.nbytes
            if tl.steps and tl.steps[-1] == step:  # folded into this step: replace its numbers
                for name in ("steps", "status", "num_output", "num_computed", "num_cached"):
                    getattr(tl, name).pop()
            tl.add(step, r)
            self._req_bytes += tl.nbytes - before
        kf = self._keyframes[-1] if self._keyframes else None
        if whole:
            self._latest = snap
            if (
                kf is None
                or kf.step == step
                or step - kf.step >= self.keyframe_every
                or snap.num_blocks != len(kf.ref_cnt)
            ):
                if kf is not None and kf.step == step:
                    self._kf_bytes -= self._keyframes.pop().nbytes
                kf = _keyframe(snap, self._store_of, len(self._events.get(step, ())))
                self._keyframes.append(kf)
                self._kf_bytes += kf.nbytes
        elif self._latest is not None and self._latest.step == step:
            self._latest = None  # the step moved on from the whole snapshot kept for it
        if new_step:
            self.steps.append(step)
            self._add_series(snap, step_seconds, memory)
        self._enforce_budget()

    def _set_counters(self, step: int, counters: dict) -> None:
        keys = tuple(counters)
        if self._counter_keys is None:
            self._counter_keys = keys
        values = tuple(counters.values())
        if all(type(v) in _PLAIN for v in values):
            blob = marshal.dumps(values)
            value = blob if keys == self._counter_keys else (keys, blob)
        else:  # a value marshal would not give back as it came (a numpy scalar is marshalled as its bytes)
            value = dict(counters)
        old = self._counters.get(step)
        if old is not None:
            self._step_bytes -= _counters_bytes(old)
        self._counters[step] = value
        self._step_bytes += _counters_bytes(value)

    def _set_shown(self, step: int, shown: tuple[str, ...]) -> None:
        """The requests shown at ``step``; a step that shows the same ones as the step before shares its tuple."""
        prev_step = self.steps[-1] if self.steps else None
        old = self._shown.get(step)  # a second record of this step
        prev = old if old is not None else self._shown.get(prev_step) if prev_step is not None else None
        value = prev if prev == shown else shown
        if value is old:
            return
        if old is not None and (len(self.steps) < 2 or old is not self._shown.get(self.steps[-2])):
            self._step_bytes -= held(old)
        self._shown[step] = value
        if value is not prev:
            self._step_bytes += held(value)
        if prev and prev != shown:  # gone from view: its last row (with its whole token tuple) is rebuilt if asked
            for rid in set(prev).difference(shown):
                tl = self._requests.get(rid)
                if tl is not None:
                    tl.last, tl.last_key = None, ()

    def _index_of(self, snap: KVSnapshot | PoolState) -> np.ndarray:
        index = np.full(snap.num_blocks, -1, np.int32)
        for b, h in snap.block_hashes.items():
            index[b] = self._store.add(tuple(snap.cached_tokens.get(b, ())), h)
        return index

    def _follow_cache(self, events: list[Event]) -> None:
        """The prefix cache's changes, by ``engine.inspect.cache_rules``."""
        index = self._store_of
        for ev in events:
            change = cache_change(ev)
            if change is None:
                continue
            if change is CacheChange.STORED:
                index[ev.block_id] = self._store.add(tuple(ev.token_ids), ev.block_hash)
            elif change.removes:
                index[ev.block_id] = -1
            else:
                index[:] = -1

    def _count_output(self, step: int, tl: _RequestTimeline, r: RequestInfo) -> None:
        """A request's first output token is its time to first token; later ones are decode tokens."""
        before = tl.num_output[-1] if tl.num_output else 0
        if r.num_output_tokens <= before:
            return
        if before == 0:
            self._ttft_steps.append(step)
            self._ttft_s.append(self.clock - tl.arrived)
            self._ttft_ids.append(tl.request_id)
            self._decode_tokens += r.num_output_tokens - 1
        else:
            self._decode_tokens += r.num_output_tokens - before

    def _add_series(self, snap: PoolRecord, step_seconds: float, memory) -> None:
        c = snap.counters
        counts = snap.state_counts
        q = c.get("prefix_cache_queries", 0)
        tokens = c.get("generation_tokens", 0)
        tps = (tokens - self._last_tokens) / step_seconds if step_seconds > 0 else 0.0
        self._last_tokens = tokens
        evictions = c.get("evictions", 0)
        eps = (evictions - self._last_evictions) / step_seconds if step_seconds > 0 else 0.0
        self._last_evictions = evictions
        row = {
            "free": counts[BlockState.FREE],
            "cached": counts[BlockState.CACHED],
            "used": counts[BlockState.USED] + counts[BlockState.SHARED],
            "hit_rate": (c.get("prefix_cache_hits", 0) / q) if q else 0.0,
            "evictions_per_s": eps,
            "running": c.get("num_requests_running", 0),
            "waiting": c.get("num_requests_waiting", 0),
            "swapped": c.get("num_requests_swapped", 0),
            "tokens_per_s": tps,
            "decode_tokens_per_s": self._decode_tokens / step_seconds if step_seconds > 0 else 0.0,
            "nvml_used": getattr(memory, "nvml_used", None) or 0,
            "torch_allocated": getattr(memory, "torch_allocated", None) or 0,
            "torch_reserved": getattr(memory, "torch_reserved", None) or 0,
            "process_rss": getattr(memory, "process_rss", 0) or 0,
            "device_free": getattr(memory, "device_free", None) or 0,
        }
        for k, v in row.items():
            self.series[k].append(float(v))

    # -- bounds ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Everything the history holds, in bytes: the entries, counted as they were added, and the
        containers that hold them, measured now (``held``). The newest record (the present) is not the
        timeline's and is not counted."""
        containers = (
            self.steps,
            self._events,
            self._counters,
            self._shown,
            self._keyframes,
            self._requests,
            self._ttft_steps,
            self._ttft_s,
            self._ttft_ids,
            *self.series.values(),
        )
        return (
            self._step_bytes
            + self._req_bytes
            + self._kf_bytes
            + sum(held(c) for c in containers)
            + self._store.nbytes
            + (held(self._store_of) if self._store_of is not None else 0)
        )

    def store_lengths(self) -> dict[str, int]:
        """The length of every store of the timeline (tests and the soak benchmark read them)."""
        return {
            "steps": len(self.steps),
            "requests": len(self._requests),
            "ttft": len(self._ttft_ids),
            "keyframes": len(self._keyframes),
            "event_steps": len(self._events),
            "counters": len(self._counters),
            "shown": len(self._shown),
            "stored_values": len(self._store),
            "series": max(len(v) for v in self.series.values()),
        }

    @property
    def bound_text(self) -> str:
        """Where the timeline stands against its bounds, in one line (the timeline's tooltip)."""
        text = (
            f"history {self.nbytes / 2**20:,.0f} of {self.budget_bytes / 2**20:,.0f} MiB, rows of "
            f"{len(self._requests):,} of at most {self.max_requests:,} requests"
        )
        if self.reach:
            text = (
                f"the timeline reaches back to step {self.reach[0]:,}"
                + (f" ({self.dropped_steps:,} older steps dropped)" if self.dropped_steps else "")
                + f"; {text}"
            )
        return text

    def _enforce_budget(self) -> None:
        """Past a bound, the oldest steps go until the history is back under ``SLACK`` of it (so that a
        long run drops a batch of steps now and then, not a segment every few steps)."""
        over = max(len(self._requests) / self.max_requests, self.nbytes / self.budget_bytes)
        while len(self._keyframes) >= 2 and over > 1.0:
            # the segments to drop, as if every segment held as much (checked again after)
            k = max(1, int(len(self._keyframes) * (1.0 - SLACK / over)))
            self._drop_oldest_segments(min(k, len(self._keyframes) - 1))
            over = max(len(self._requests) / (SLACK * self.max_requests), self.nbytes / (SLACK * self.budget_bytes))

    def _drop_oldest_segments(self, k: int) -> None:
        """The first ``k`` keyframes and the steps before the next one, with what only they showed."""
        for kf in self._keyframes[:k]:
            self._kf_bytes -= kf.nbytes
        del self._keyframes[:k]
        first = self._keyframes[0].step
        i = bisect.bisect_left(self.steps, first)
        gone, self.steps = self.steps[:i], self.steps[i:]
        for v in self.series.values():
            del v[:i]
        j = bisect.bisect_left(self._ttft_steps, first)
        del self._ttft_steps[:j], self._ttft_s[:j], self._ttft_ids[:j]
        kept_shown = self._shown.get(self.steps[0]) if self.steps else None
        shown = {}
        for s in gone:
            self._step_bytes -= held(s)
            chunks = self._events.pop(s, None)
            if chunks is not None:
                self._step_bytes -= held(chunks) + sum(held(b) for b in chunks)
            counters = self._counters.pop(s, None)
            if counters is not None:
                self._step_bytes -= _counters_bytes(counters)
            t = self._shown.pop(s, None)
            if t is not None:
                shown[id(t)] = t
        self._step_bytes -= sum(held(t) for t in shown.values() if t is not kept_shown)
        live = set(self._shown[self.steps[-1]]) if self.steps else set()
        for rid in list(self._requests):
            tl = self._requests[rid]
            if not tl.steps or tl.steps[0] >= first:
                continue
            before = tl.nbytes
            if tl.shown_until < first and rid not in live:
                del self._requests[rid]
                self._req_bytes -= before
                self.dropped_requests += 1
            else:
                tl.trim(first)
                self._req_bytes += tl.nbytes - before
        self.dropped_steps += len(gone)
        self._compact_store()
        give_back()

    def _compact_store(self) -> None:
        """The prefix cache's stored values no keyframe (nor the index now) refers to any more are dropped,
        once they are most of the log: the values kept are copied to a new log and the indices remapped."""
        refs = [kf.store_of for kf in self._keyframes]
        if self._store_of is not None:
            refs.append(self._store_of)
        used = np.unique(np.concatenate(refs)) if refs else np.zeros(0, np.int32)
        used = used[used >= 0]
        if len(self._store) < 2 * len(used) + 1024:
            return
        old, new = self._store, StoreLog()
        remap = np.full(len(old), -1, np.int32)
        for i in used.tolist():
            remap[i] = new.add(old.tokens[i], old.hashes[i])
        for kf in self._keyframes:
            kf.store_of = np.where(kf.store_of >= 0, remap[kf.store_of], -1).astype(np.int32)
        if self._store_of is not None:
            self._store_of = np.where(self._store_of >= 0, remap[self._store_of], -1).astype(np.int32)
        self._store = new

    # -- reading -----------------------------------------------------------------------------------
    @property
    def latest(self) -> KVSnapshot | None:
        snap = self._latest
        if snap is not None:
            snap = self._latest = snap.assembled()
        return snap

    @property
    def requests(self) -> dict:
        """Each request's timeline (``_RequestTimeline``: index, prompt length, tokens), read-only."""
        return self._requests

    @property
    def ttft(self) -> list[tuple[int, float, str]]:
        """(step, seconds from arrival to the first output token, request id), one a request in reach."""
        return list(zip(self._ttft_steps, self._ttft_s, self._ttft_ids))

    def ttft_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The time to first token as arrays (copies): the steps, and the seconds."""
        return np.array(self._ttft_steps, np.int64), np.array(self._ttft_s, np.float64)

    @property
    def reach(self) -> tuple[int, int] | None:
        """(first, last) step the timeline can show."""
        return (self.steps[0], self.steps[-1]) if self.steps else None

    def counters_at(self, step: int) -> dict:
        """The engine's counters after ``step`` (empty outside the reach)."""
        value = self._counters.get(step)
        if value is None:
            return {}
        if isinstance(value, dict):
            return dict(value)
        keys, blob = value if isinstance(value, tuple) else (self._counter_keys, value)
        return dict(zip(keys, marshal.loads(blob)))

    def events_at(self, step: int) -> list[Event]:
        return [e for chunk in self._events.get(step, ()) for e in unpack_events(chunk)]

    def at(self, step: int) -> KVSnapshot | None:
        """The snapshot as it was after ``step`` (None outside the reach)."""
        if not self.steps or not self.steps[0] <= step <= self.steps[-1]:
            return None
        if self._latest is not None and step == self._latest.step:
            return self.latest
        i = bisect.bisect_right([k.step for k in self._keyframes], step) - 1
        if i < 0:
            return None
        kf = self._keyframes[i]
        pool = PoolReplayer.from_state(
            kf.ref_cnt,
            kf.last_access,
            kf.free_queue,
            OverlayMap(kf.store_of, self._store.hashes),
            OverlayMap(kf.store_of, self._store.tokens),
        )
        for chunk in self._events.get(kf.step, ())[kf.chunks_in :]:
            pool.apply_packed(chunk, kf.step)
        j = bisect.bisect_right(self.steps, kf.step)
        for s in self.steps[j : bisect.bisect_right(self.steps, step)]:
            for chunk in self._events.get(s, ()):
                pool.apply_packed(chunk, s)
        requests = [r for rid in self._shown.get(step, ()) if (r := self._request_at(rid, step)) is not None]
        tokens, hashes = pool.frozen_maps()
        return assemble_snapshot(
            step,
            kf.block_size,
            ref_cnt=pool.ref_cnt,
            has_hash=pool.has_hash,
            last_access=pool.last_access,
            free_queue=pool.free_queue,
            requests=requests,
            cached_tokens=tokens,
            block_hashes=hashes,
            counters=self.counters_at(step),
            num_cpu_blocks=kf.num_cpu_blocks,
            block_bytes=kf.block_bytes,
            model_name=kf.model_name,
            reserved=kf.reserved,
            num_groups=kf.num_groups,
            kv_groups=kf.kv_groups,
            pinned=kf.pinned,
        )

    def _request_at(self, rid: str, step: int) -> RequestInfo | None:
        tl = self._requests.get(rid)
        return tl.at(step, self.decode) if tl is not None else None


def _counters_bytes(value: bytes | tuple | dict) -> int:
    if isinstance(value, tuple):
        return held(value[1]) + held(value)
    if isinstance(value, dict):
        return held(value) + sum(held(v) for v in value.values())
    return held(value)


def _extra_fields(r: RequestInfo) -> dict:
    """RequestInfo fields beyond the ones the timeline stores per step (constant for a request)."""
    known = {
        "request_id",
        "index",
        "status",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "block_ids",
        "text",
        "token_ids",
        "error",
        "group_id",
        "parent_id",
        "cpu_block_ids",
        "group_block_ids",
        "held_by",
    }
    return {k: getattr(r, k) for k in r.__slots__ if k not in known}


def _keyframe(snap: KVSnapshot | PoolState, store_of: np.ndarray, chunks_in: int) -> _Keyframe:
    return _Keyframe(
        snap.step,
        _narrow(snap.ref_cnt, np.int16),
        _narrow(snap.last_access, np.int32),
        snap.free_queue.astype(np.uint16 if snap.num_blocks <= 2**16 else np.int32),
        store_of.copy(),
        snap.num_cpu_blocks,
        snap.block_size,
        snap.block_bytes,
        snap.model_name,
        chunks_in,
        tuple(getattr(snap, "reserved", ())),
        getattr(snap, "num_groups", 1),
        tuple(getattr(snap, "kv_groups", ())),
        dict(getattr(snap, "pinned", {})),
    )


def _narrow(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype`` when every value fits (a keyframe at half the bytes or less), else as it is."""
    return a.astype(dtype) if not len(a) or a.max() <= np.iinfo(dtype).max else a
