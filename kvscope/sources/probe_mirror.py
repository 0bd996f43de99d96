"""A probed vLLM's block pool, rebuilt from the probe's keyframe and steps (``kvscope_vllm_probe.wire``).

The mirror applies vLLM's own operations in vLLM's order: a block's ref count as vLLM wrote it, its hash, and
where it went in the free queue (vLLM frees an unhashed block to the head, a hashed one to the tail; it is the
probe that says which, so the mirror holds no rule of vLLM's that a release could change). From them it makes
kvscope's events (allocated, hit, freed, stored, evicted, admitted, preempted, finished), the ``KVSnapshot``
every view draws (``assemble_snapshot``, as for kvscope's own engine) and the audit: every block's ref count
against every KV cache group's tables that hold it, plus vLLM's deferred frees, plus what a KV connector holds
(its pins), the free queue against ref count 0, and the hash map against the blocks' hashes.

A hybrid model's groups (``engine.inspect.kv_groups``) share the pool: a request has a table in each, and a
sliding-window or state group's table holds vLLM's null block where the group gave a block back. The null block
is reserved (never handed out, its count not kept by vLLM): it is in no count of used blocks and out of the
audit. A block hash is keyed with its group (``grouped_hash``), as vLLM keys its hash map.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.inspect.audit import AuditProblem, AuditReport, queue_problem, ref_problem, suspect_blocks
from engine.inspect.chunked_map import ChunkedMap
from engine.inspect.events import (
    BlockAllocated,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTouched,
    Event,
    RequestAborted,
    RequestAdmitted,
    RequestFinished,
    RequestPreempted,
)
from engine.inspect.kv_groups import KVCacheGroup, grouped_hash, name_of, primary_group
from engine.inspect.replay import apply_cache_event
from engine.inspect.snapshot import KVSnapshot, RequestInfo, assemble_snapshot
from kvscope_vllm_probe.wire import (
    OP_APPEND,
    OP_HASH,
    OP_MAP_CLEAR,
    OP_MAP_INSERT,
    OP_MAP_POP,
    OP_POP,
    OP_PREPEND,
    OP_REF,
    OP_REMOVE,
    OP_REQUEST,
    Keyframe,
    RequestRow,
    Step,
    group_of,
    hash64,
    parent64,
)

KEEP_FINISHED = 64  # finished requests kept in the snapshot, as kvscope's engine keeps them

# vLLM's RequestStatus names as kvscope's rows say them
STATUS = {
    "WAITING": "WAITING",
    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "WAITING",
    "WAITING_FOR_REMOTE_KVS": "WAITING",
    "WAITING_FOR_STREAMING_REQ": "WAITING",
    "RUNNING": "RUNNING",
    "PREEMPTED": "PREEMPTED",
    "FINISHED_STOPPED": "FINISHED_STOPPED",
    "FINISHED_REPETITION": "FINISHED_STOPPED",
    "FINISHED_LENGTH_CAPPED": "FINISHED_LENGTH",
    "FINISHED_ABORTED": "FINISHED_ABORTED",
    "FINISHED_IGNORED": "FINISHED_ERROR",
    "FINISHED_ERROR": "FINISHED_ERROR",
}
_REASON = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length", "FINISHED_ERROR": "error"}


class MirrorError(ValueError):
    """A step the mirror cannot apply (a gap in the sequence, a block the pool does not have): resync."""


def hex64(h: int) -> str:
    return f"{h:016x}"


def key_name(key: bytes) -> str:
    """A vLLM block key (its hash, then its group's id: the probe's ops carry them as vLLM made them) as kvscope
    names a block hash."""
    return grouped_hash(hex64(hash64(key)), group_of(key))


class FreeList:
    """vLLM's free queue as a doubly linked list over block ids (O(1) pops, removals, appends, prepends)."""

    def __init__(self, n: int, order) -> None:
        self.n = n
        head, tail = n, n + 1
        self.prev = [-1] * (n + 2)
        self.next = [-1] * (n + 2)
        self.queued = [False] * n
        last = head
        for b in order:
            self.next[last], self.prev[b] = b, last
            self.queued[b] = True
            last = b
        self.next[last], self.prev[tail] = tail, last
        self.size = len(order)

    def _unlink(self, b: int) -> None:
        if not self.queued[b]:
            raise MirrorError(f"block {b} left the free queue, but the mirror does not have it there")
        p, q = self.prev[b], self.next[b]
        self.next[p], self.prev[q] = q, p
        self.queued[b] = False
        self.size -= 1

    def remove(self, b: int) -> None:
        self._unlink(b)

    def append(self, ids) -> None:
        tail = self.n + 1
        for b in ids:
            if self.queued[b]:
                raise MirrorError(f"block {b} joined the free queue twice")
            last = self.prev[tail]
            self.next[last], self.prev[b], self.next[b], self.prev[tail] = b, last, tail, b
            self.queued[b] = True
        self.size += len(ids)

    def prepend(self, ids) -> None:
        """``ids`` at the head, in this order (``ids[0]`` is the new head), as vLLM's ``prepend_n``."""
        prev = self.n
        first = self.next[prev]
        for b in ids:
            if self.queued[b]:
                raise MirrorError(f"block {b} joined the free queue twice")
            self.next[prev], self.prev[b] = b, prev
            self.queued[b] = True
            prev = b
        self.next[prev], self.prev[first] = first, prev
        self.size += len(ids)

    def order(self) -> np.ndarray:
        out = np.empty(self.size, np.int32)
        b, nxt, end = self.next[self.n], self.next, self.n + 1
        for i in range(self.size):
            out[i] = b
            b = nxt[b]
        if b != end:
            raise MirrorError("the free queue's links do not match its size")
        return out


class _Request:
    __slots__ = (
        "rid",
        "index",
        "status",
        "vllm_status",
        "prompt",
        "tokens",
        "computed",
        "cached",
        "tables",
        "arrival",
        "group_hits",
    )

    def __init__(self, rid: str, index: int, num_groups: int) -> None:
        self.rid, self.index = rid, index
        self.status = "WAITING"
        self.vllm_status = "WAITING"
        self.prompt = 0
        self.tokens: list[int] = []
        self.computed = 0
        self.cached = 0
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]  # by KV cache group
        self.arrival = 0.0
        self.group_hits: tuple[int, ...] = ()

    @property
    def table(self) -> list[int]:
        """KV cache group 0's table (the only one of a model with one group)."""
        return self.tables[0]

    def holds_blocks(self) -> bool:
        return any(self.tables)

    def info(self, decode, primary: int = 0, connector: str = "") -> RequestInfo:
        out = self.tokens[self.prompt :]
        return RequestInfo(
            self.rid,
            self.index,
            self.status,
            self.prompt,
            len(out),
            self.cached,
            self.computed,
            tuple(self.tables[primary]),
            (decode(out) or "") if decode and out else "",
            tuple(self.tokens),
            group_block_ids=tuple(tuple(t) for t in self.tables) if len(self.tables) > 1 else (),
            group_hits=self.group_hits,
            held_by=self.held_by(connector),
        )

    def held_by(self, connector: str) -> str:
        """Why a request that is not running holds blocks for a KV connector ("" when it does not)."""
        who = connector or "the KV connector"
        if self.vllm_status == "WAITING_FOR_REMOTE_KVS" and self.holds_blocks():
            return f"{who}: its KV is being loaded into these blocks"
        if self.status.startswith("FINISHED") and self.holds_blocks():
            return f"{who}: kept after the request finished, for its KV transfer (vLLM frees them at finished_sending)"
        return ""


class VllmPoolMirror:
    def __init__(self, kf: Keyframe, decode=None) -> None:
        self.decode = decode
        self.load(kf)

    # -- applying ------------------------------------------------------------------------------------
    def load(self, kf: Keyframe) -> None:
        info = kf.info
        n = info.num_blocks
        if len(kf.ref_cnt) != n:
            raise MirrorError(f"a keyframe of {n} blocks carries {len(kf.ref_cnt)} ref counts")
        self.info = info
        self.n, self.block_size, self.null = n, info.block_size, info.null_block
        self.groups = tuple(
            KVCacheGroup(g.kind, g.block_size, g.window, g.layers, g.mode) for g in getattr(info, "groups", ())
        )
        self.num_groups = max(info.num_kv_groups, len(self.groups), 1)
        self.primary = primary_group(self.groups)
        self.connector = getattr(info, "connector", "")
        self.pinned: dict[int, int] = dict(getattr(kf, "pinned", ()) or ())
        self.group_of = np.full(n, -1, np.int8)  # the group whose table last held each block (the audit's words)
        self.ref = np.asarray(kf.ref_cnt, np.int32).copy()
        self._ref = memoryview(self.ref)
        self.last_access = np.zeros(n, np.int64)
        self._access = memoryview(self.last_access)
        self.hashes: ChunkedMap[str] = ChunkedMap(n)
        self.tokens: ChunkedMap[tuple[int, ...]] = ChunkedMap(n)
        hash_groups = getattr(kf, "hash_groups", None) or [0] * len(kf.hashes)
        for (b, h, toks), g in zip(kf.hashes, hash_groups):
            self._check(b)
            self.hashes[b] = grouped_hash(hex64(h), g)
            self.tokens[b] = tuple(toks)
        for b in kf.free_queue:
            self._check(b)
        self.free = FreeList(n, kf.free_queue)
        # vLLM's hash map as (block -> its keys); a block whose hash and entries disagree is kept in ``map_bad``,
        # looked at again only when an op touches it
        self.map_keys: dict[int, set[str]] = {}
        map_groups = getattr(kf, "map_groups", None) or [0] * len(kf.hash_map)
        for (h, b), g in zip(kf.hash_map, map_groups):
            self._check(b)
            self.map_keys.setdefault(b, set()).add(grouped_hash(hex64(h), g))
        self.map_bad: set[int] = {b for b in set(self.map_keys) | set(self.hashes) if not self._map_ok(b)}
        self.holders: dict[int, list[str]] = {}
        self.evictions = 0
        self.generated = 0
        self.run_ids: list[str] | None = None  # the decode batch's request ids a Step said last (Step.run_ids)
        self.requests: dict[str, _Request] = {}
        self.finished: deque[RequestInfo] = deque(maxlen=KEEP_FINISHED)
        self._next_index = 0
        for row in kf.requests:
            self._apply_row(row, [])
        for r in self.requests.values():
            for t in r.tables:
                for b in t:
                    if b != self.null:
                        self.holders.setdefault(b, []).append(r.rid)
        self.deferred = [list(d) for d in kf.deferred]
        # requests vLLM admitted before kvscope saw its pool: said once, with the next record, so that the miss
        # explainer and the block story know them as admitted (with the hit vLLM measured then)
        self.pending: list[Event] = [
            RequestAdmitted(r.rid, r.prompt, max(r.cached, 0)) for r in self.requests.values() if r.status == "RUNNING"
        ]
        self.seq, self.vllm_step = kf.seq, kf.step
        self.counters = dict(kf.counters)
        self.paused, self.holder = kf.paused, kf.holder

    def _apply_run(self, st: Step) -> None:
        """A decode batch's step: each request of the batch decoded one token (Step.run_tokens)."""
        if st.run_ids is not None:
            self.run_ids = list(st.run_ids)
        ids = self.run_ids
        if ids is None or not len(ids) == len(st.run_tokens) == len(st.run_computed):
            raise MirrorError(
                f"the probe's step decoded {len(st.run_tokens)} tokens for a batch of "
                f"{'no known' if ids is None else len(ids)} requests"
            )
        requests = self.requests
        for rid in ids:
            if rid not in requests:
                raise MirrorError(f"the probe's step advanced request {rid}, which the mirror does not have")
        for rid, token, computed in zip(ids, st.run_tokens, st.run_computed):
            r = requests[rid]
            r.tokens.append(token)
            if len(r.tokens) > r.prompt:
                self.generated += 1
            r.computed = computed

    def _check(self, b: int) -> None:
        if not 0 <= b < self.n:
            raise MirrorError(f"the probe named block {b}, but vLLM's pool has blocks 0..{self.n - 1}")

    def apply(self, st: Step) -> list[Event]:
        """One step's changes, in vLLM's order; returns kvscope's events for them. Raises ``MirrorError``
        (nothing applied) on a gap in the sequence."""
        if st.seq <= self.seq:
            return []  # sent before the keyframe this mirror started from
        if st.seq != self.seq + 1:
            raise MirrorError(f"the probe's step {st.seq} follows {self.seq}: {st.seq - self.seq - 1} missed")
        events, self.pending = self.pending, []
        gained, lost = self._table_changes(st)
        self._apply_ops(st.ops, st.step, events, gained, lost)
        for row in st.rows:
            self._apply_row(row, events)
        for rid, g, positions in getattr(st, "nulled", ()) or ():
            r = self.requests.get(rid)
            t = r.tables[g] if r is not None and 0 <= g < len(r.tables) else None
            if t is None or (positions and positions[-1] >= len(t)):
                raise MirrorError(
                    f"the probe put the null block in request {rid}'s table {g}, which the mirror does not have"
                )
            for i in positions:
                t[i] = self.null
        for rid, g, start, ids in getattr(st, "grown", ()) or ():
            r = self.requests.get(rid)
            if r is None or not 0 <= g < len(r.tables):
                raise MirrorError(f"the probe's step grew request {rid}'s table {g}, which the mirror does not have")
            t = r.tables[g]
            del t[start:]
            t.extend(ids)
            for b in ids:
                self._check(b)
                self.group_of[b] = g
        for rid, start, tokens, computed in st.advanced:
            r = self.requests.get(rid)
            if r is None:
                raise MirrorError(f"the probe's step advanced request {rid}, which the mirror does not have")
            before = len(r.tokens)
            del r.tokens[start:]
            r.tokens.extend(tokens)
            self.generated += max(0, len(r.tokens) - max(before, r.prompt))
            r.computed = computed
        if st.run_tokens:
            self._apply_run(st)
        elif st.run_ids is not None:
            self.run_ids = list(st.run_ids)
        for rid, status in st.gone:
            self._gone(rid, STATUS.get(status, "FINISHED_ERROR"), events)
        if st.deferred is not None:
            self.deferred = [list(d) for d in st.deferred]
        pinned = getattr(st, "pinned", None)
        if pinned is not None:
            self.pinned = dict(pinned)
        self.seq, self.vllm_step = st.seq, st.step
        self.counters = dict(st.counters)
        self.paused = st.paused
        return events

    def _table_changes(self, st: Step) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
        """Which requests' tables gained and lost which blocks in this step (from its rows, before they are
        applied): the probe names the request of a free and of an admission's hits, not of every block
        vLLM hands out (naming it cost a wrapper around each allocate_slots, 0.18 ms a step at GPU size), so
        a block taken for no named request is the one whose table gained it."""
        gained: dict[int, list[str]] = {}
        lost: dict[int, list[str]] = {}
        changed: list[tuple[str, int, int, list[int]]] = []  # (request, group, blocks_from, block ids)
        for row in st.rows:
            if row.block_ids is not None:
                changed.append((row.request_id, 0, row.blocks_from, row.block_ids))
            changed += [(row.request_id, g, start, ids) for g, start, ids in getattr(row, "groups", ()) or ()]
        changed += getattr(st, "grown", ()) or ()
        for rid, g, start, ids in changed:
            r = self.requests.get(rid)
            old = r.tables[g] if r is not None and g < len(r.tables) else []
            if old[start:] == ids:
                continue
            # the table keeps old[:start] (the probe sends a table from where it changed): only the rest can differ
            was, now = set(old[start:]), set(ids)
            keep = set(old[:start])
            for b in ids:
                if b not in was and b not in keep:
                    gained.setdefault(b, []).append(rid)
            for b in old[start:]:
                if b not in now and b not in keep:
                    lost.setdefault(b, []).append(rid)
        for rid, g, positions in getattr(st, "nulled", ()) or ():
            r = self.requests.get(rid)
            t = r.tables[g] if r is not None and 0 <= g < len(r.tables) else []
            for i in positions:
                b = t[i] if i < len(t) else self.null
                if b != self.null and rid not in lost.get(b, ()):
                    lost.setdefault(b, []).append(rid)
        for rid, _status in st.gone:
            r = self.requests.get(rid)
            for t in r.tables if r is not None else ():
                for b in t:
                    lost.setdefault(b, []).append(rid)
        return gained, lost

    def _apply_ops(
        self, ops: list[list], step: int, events: list[Event], gained: dict[int, list[str]], lost: dict[int, list[str]]
    ) -> None:
        ref, access, free, null = self._ref, self._access, self.free, self.null
        n = self.n
        request = ""
        popped: set[int] = set()
        mapped: set[int] = set()  # blocks whose hash or map entries changed: their agreement is checked after
        for op in ops:
            code = op[0]
            if code == OP_REQUEST:
                request = op[1]
            elif code == OP_REF:
                b, v = op[1], op[2]
                if not 0 <= b < n:
                    raise MirrorError(f"the probe named block {b}, but vLLM's pool has blocks 0..{n - 1}")
                old = ref[b]
                ref[b] = v
                if b == null:
                    continue  # vLLM does not keep the null block's count
                access[b] = step
                if v > old:
                    who = request or (gained[b].pop(0) if gained.get(b) else "")
                    if b in popped and old == 0:
                        popped.discard(b)
                        events.append(BlockAllocated(b, who))
                    else:
                        events.append(BlockTouched(b, who, v))
                    self.holders.setdefault(b, []).append(who)
                else:
                    holders = self.holders.get(b)
                    who = request or (lost[b].pop(0) if lost.get(b) else "")
                    if holders:
                        if who in holders:
                            holders.remove(who)
                        else:
                            who = who or holders[-1]
                            holders.pop()
                    events.append(BlockFreed(b, who, v))
            elif code == OP_HASH:
                b, key = op[1], op[2]
                self._check(b)
                old = self.hashes.get(b)
                if key is None:
                    if old is None:
                        continue
                    ev = BlockEvicted(b, old)
                    self.evictions += 1
                else:
                    parent = grouped_hash(hex64(parent64(op[4])), group_of(key)) if op[4] is not None else None
                    ev = BlockStored(b, key_name(key), request, tuple(op[3]), parent)
                apply_cache_event(ev, self.tokens, self.hashes)  # the cache's rules, as every copy of it keeps them
                events.append(ev)
                mapped.add(b)
            elif code == OP_MAP_INSERT:
                self._check(op[2])
                self.map_keys.setdefault(op[2], set()).add(key_name(op[1]))
                mapped.add(op[2])
            elif code == OP_MAP_POP:
                self._check(op[2])
                keys = self.map_keys.get(op[2])
                if keys is not None:
                    keys.discard(key_name(op[1]))
                    if not keys:
                        del self.map_keys[op[2]]
                mapped.add(op[2])
            elif code == OP_MAP_CLEAR:
                mapped.update(self.map_keys)
                self.map_keys.clear()
            elif code == OP_POP:
                for b in op[1]:
                    self._check(b)
                    free.remove(b)
                    popped.add(b)
            elif code == OP_REMOVE:
                self._check(op[1])
                free.remove(op[1])
            elif code == OP_APPEND:
                for b in op[1]:
                    self._check(b)
                free.append(op[1])
            elif code == OP_PREPEND:
                for b in op[1]:
                    self._check(b)
                free.prepend(op[1])
            else:
                raise MirrorError(f"unknown op {code} in the probe's step")
        for b in mapped:
            (self.map_bad.discard if self._map_ok(b) else self.map_bad.add)(b)

    def _map_ok(self, b: int) -> bool:
        """A hashed block is in the hash map under its hash; an unhashed one is in it under no key (a block
        may carry more keys than its own hash: vLLM keeps a second key for a block promoted in place)."""
        h = self.hashes.get(b)
        keys = self.map_keys.get(b)
        if h is None:
            return not keys
        return keys is not None and h in keys

    def _apply_row(self, row: RequestRow, events: list[Event]) -> None:
        r = self.requests.get(row.request_id)
        if r is None:
            r = self.requests[row.request_id] = _Request(row.request_id, self._next_index, self.num_groups)
            self._next_index += 1
            r.arrival = row.arrival
        before = r.status
        status = STATUS.get(row.status, "WAITING")
        r.vllm_status = row.status
        r.prompt = row.num_prompt_tokens
        old_out = max(0, len(r.tokens) - r.prompt)
        del r.tokens[row.tokens_from :]
        r.tokens.extend(row.tokens)
        self.generated += max(0, len(r.tokens) - r.prompt - old_out)
        r.computed = row.num_computed_tokens
        if row.num_cached_tokens >= 0:
            r.cached = row.num_cached_tokens
        changes = [] if row.block_ids is None else [(0, row.blocks_from, row.block_ids)]
        changes += getattr(row, "groups", ()) or ()
        for g, start, ids in changes:
            if not 0 <= g < len(r.tables):
                raise MirrorError(f"the probe named KV cache group {g}, but vLLM's pool has {len(r.tables)}")
            t = r.tables[g]
            del t[start:]
            t.extend(ids)
            for b in ids:
                self._check(b)
                self.group_of[b] = g
        if getattr(row, "group_hits", None):
            r.group_hits = tuple(row.group_hits)
        r.status = status
        if status == "RUNNING" and before != "RUNNING":
            events.append(RequestAdmitted(r.rid, r.prompt, max(r.cached, 0)))
        elif status == "PREEMPTED" and before == "RUNNING":
            events.append(RequestPreempted(r.rid, "recompute", "vLLM's pool ran out of blocks"))

    def _gone(self, rid: str, status: str, events: list[Event]) -> None:
        r = self.requests.pop(rid, None)
        if r is None:
            return
        r.status, r.tables = status, [[] for _ in r.tables]
        events.append(
            RequestAborted(rid) if status == "FINISHED_ABORTED" else RequestFinished(rid, _REASON.get(status, "stop"))
        )
        self.finished.append(r.info(self.decode, self.primary, self.connector))

    # -- reading ---------------------------------------------------------------------------------------
    def tables(self, group: int | None = None) -> dict[str, list[int]]:
        """Each request's table of ``group`` (None: the primary group's, the one a row shows first)."""
        g = self.primary if group is None else group
        return {rid: r.tables[g] for rid, r in self.requests.items()}

    def counters_now(self) -> dict[str, float]:
        c = dict(self.counters)
        n_free = self.free.size
        c.update(
            num_blocks=self.n,
            num_reserved_blocks=1 if 0 <= self.null < self.n else 0,
            num_free_blocks=n_free,
            num_cached_blocks=len(self.hashes),
            evictions=self.evictions,
            generation_tokens=self.generated,
            cow_copies=0,
            swap_outs=0,
            swap_ins=0,
            num_requests_swapped=0,
            num_cpu_blocks=0,
            num_free_cpu_blocks=0,
            step=self.vllm_step,
        )
        c.setdefault("kv_cache_usage_perc", 0.0)
        c.setdefault("prefix_cache_queries", 0)
        c.setdefault("prefix_cache_hits", 0)
        c.setdefault("num_preemptions", 0)
        return c

    def take_pending(self) -> list[Event]:
        out, self.pending = self.pending, []
        return out

    def snapshot(self, step: int) -> KVSnapshot:
        has_hash = np.zeros(self.n, bool)
        if len(self.hashes):
            has_hash[np.fromiter(self.hashes, np.int64, len(self.hashes))] = True
        rows = [r.info(self.decode, self.primary, self.connector) for r in self.requests.values()]
        rows += [f for f in self.finished if f.request_id not in self.requests]
        ref = self.ref.copy()
        reserved: tuple[int, ...] = ()
        if 0 <= self.null < self.n:
            ref[self.null] = 0  # vLLM's null block: reserved, never handed out; vLLM keeps no count of it
            reserved = (self.null,)
        return assemble_snapshot(
            step,
            self.block_size,
            ref,
            has_hash,
            self.last_access.copy(),
            self.free.order(),
            rows,
            self.tokens.freeze(),
            self.hashes.freeze(),
            self.counters_now(),
            0,
            reserved,
            self.num_groups,
            self.groups,
            model_name=self.info.model,
            pinned=dict(self.pinned),
        )

    def audit(self) -> AuditReport:
        """vLLM's pool against its tables: ref counts against every group's tables plus the deferred frees
        (blocks out of a table, freed after a later step) plus the connector's pins, the free queue against ref
        count 0, and the hash map against the blocks' hashes (``_map_ok``). The null block (reserved: vLLM keeps
        no count for it, and a sliding window's or a state group's table holds it in place of blocks given back)
        is left out."""
        n = self.n
        held = [b for r in self.requests.values() for t in r.tables for b in t]
        held += [b for d in self.deferred for b in d]
        expected = np.bincount(np.asarray(held, np.int64), minlength=n)[:n] if held else np.zeros(n, np.int64)
        for b, k in self.pinned.items():
            if 0 <= b < n:
                expected[b] += k
        queued = np.asarray(self.free.queued, bool)
        ref = self.ref
        bad = suspect_blocks(ref, expected, queued)
        if 0 <= self.null < n:
            bad[self.null] = False
        problems: list[AuditProblem] = []
        mapped = None
        for b in np.flatnonzero(bad).tolist():
            r, e = int(ref[b]), int(expected[b])
            kind = ref_problem(r, e)
            if kind is not None:
                if mapped is None:
                    mapped = {}
                    for rid, req in self.requests.items():
                        for t in req.tables:
                            for x in t:
                                mapped.setdefault(x, set()).add(rid)
                culprit = self._culprit(b, mapped.get(b, set()), r > e)
                problems.append(AuditProblem(b, kind, e, r, culprit, self._group_name(b)))
            kind = queue_problem(r, e, bool(queued[b]))
            if kind is not None:
                problems.append(AuditProblem(b, kind, e, r, self._culprit(b, set(), False), self._group_name(b)))
        for b in sorted(self.map_bad):
            r = int(ref[b])
            problems.append(
                AuditProblem(b, "hash_map", int(expected[b]), r, self._culprit(b, set(), False), self._group_name(b))
            )
        return AuditReport(tuple(problems))

    def _group_name(self, b: int) -> str:
        """The KV cache group whose table last held ``b``, in words ("" with one group)."""
        if self.num_groups < 2 or self.group_of[b] < 0:
            return ""
        return name_of(self.groups, int(self.group_of[b]))

    def _culprit(self, b: int, mapped_by: set[str], too_many: bool) -> str:
        """A holder whose table no longer has the block (a leak), else the block's last holder."""
        holders = self.holders.get(b, [])
        stray = [h for h in holders if h not in mapped_by]
        if too_many and stray:
            return stray[-1]
        return holders[-1] if holders else ""
