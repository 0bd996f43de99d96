"""The requests' rows as deltas: what a subscriber has not been sent yet of each request vLLM holds.

A step looks only at the requests that can have changed: the running ones, those the pool worked for (a
block handed out, hit or freed for them: admitted, grown, preempted, finished), those just added and those
gone from the scheduler. A running request that only went on sends its new tokens and its computed count; a
request the pool worked for sends its row as a delta: each KV cache group's table as its new blocks, or whole
when it changed other than by growing.

A table changes other than by growing when vLLM puts its null block in place of a block: a sliding window's
block that left the window, a Mamba group's retired state. vLLM does that inside ``allocate_slots``, which the
probe does not wrap (it runs for every scheduled request every step), but it frees the block with no request
named: the recorder keeps those blocks (``loose``), and the rows look up which requests' tables held them and
where (``holders``: the blocks sent of the groups whose tables can be rewritten, a full-attention table only
grows; each table's ``live``: block -> its position). A position that now holds the null block is sent as that
position alone (``nulled``); a table changed any other way is sent whole. The cost follows the blocks given
back, not the requests, nor the length of their tables (sending a sliding window's table whole each time a block
left it cost 1.6 ms a step at GPU size: 256 requests, a 512-token window).

Most steps of a decode batch change nothing but the running requests' tokens and computed counts: the same requests
run, in the same order, none was worked for by the pool, and a table changed at most by one more block at its end.
Such a step is read column by column (``_Batch``: vLLM's own lists of the running requests, held from the step
before), with ``map`` and list comparisons that run in C, not a Python loop over the requests, and when each decoded
one token it is sent so too: the tokens in one list, the computed counts in another, the batch's request ids once
(``Step.run_ids``). Any other step takes the loop, and builds the columns again after it.
"""

from __future__ import annotations

from operator import attrgetter, itemgetter, sub
from typing import Any

from .groups import GROWING
from .wire import RequestRow

_computed = attrgetter("num_computed_tokens")
_last = itemgetter(-1)


class _Table:
    """What was sent of one KV cache group's table of one request."""

    __slots__ = ("table", "num_blocks", "last_block", "live")

    def __init__(self, rewritable: bool) -> None:
        self.table: list | None = None  # vLLM's own list, held (see _Sent)
        self.num_blocks = 0
        self.last_block = -1
        # the non-null blocks sent, each with its position in the table (rewritable kinds only)
        self.live: dict[int, int] | None = {} if rewritable else None


class _Sent:
    __slots__ = (
        "status",
        "num_tokens",
        "num_blocks",
        "last_block",
        "computed",
        "cached",
        "request",
        "table",
        "tokens",
        "live",
        "more",
    )

    def __init__(self, request, rewritable: list[bool]) -> None:
        self.request = request
        # vLLM's own lists, held so that the hot loop reads no dict: a request's table list lives as long as it
        # holds blocks (a free pops it, and the pool's ops make the next step look at that request whole), and
        # its token list for its whole life (appended to in place)
        self.table: list | None = None  # group 0's (the fields of group 0 are _Table's, inline: the hot loop's)
        self.tokens: list[int] = request._all_token_ids
        self.status = ""
        self.num_tokens = 0
        self.num_blocks = 0
        self.last_block = -1
        self.computed = -1
        self.cached = -2
        self.live: dict[int, int] | None = {} if rewritable[0] else None
        self.more: list[_Table] | None = [_Table(r) for r in rewritable[1:]] if len(rewritable) > 1 else None


class _Batch:
    """The running requests as the last step left them, column by column (vLLM's own lists, held). While a batch is
    kept, the tokens and computed counts sent are its ``lens`` and ``computed``, not its ``_Sent``s' (``settle``)."""

    __slots__ = (
        "running",
        "ids",
        "id_set",
        "sents",
        "group_sents",
        "tables",
        "nbs",
        "tokens",
        "lens",
        "computed",
        "ids_sent",
    )

    def __init__(self, running: list, sents: list[_Sent]) -> None:
        self.running = list(running)  # a copy: vLLM changes its list in place
        self.ids = [r.request_id for r in running]
        self.id_set = set(self.ids)
        self.sents = sents
        # each group's sent tables (group 0's are the _Sents themselves), vLLM's tables and their lengths as sent
        self.group_sents: list[list[Any]] = [sents]
        for g in range(len(sents[0].more or ()) if sents else 0):
            self.group_sents.append([st.more[g] for st in sents])  # type: ignore[index]
        self.tables: list[list[Any]] = [[t.table for t in gs] for gs in self.group_sents]
        self.nbs = [[t.num_blocks for t in gs] for gs in self.group_sents]
        self.tokens = [st.tokens for st in sents]
        self.lens = [st.num_tokens for st in sents]
        self.computed = [st.computed for st in sents]
        self.ids_sent = False  # a Step's run_ids said them

    @classmethod
    def of(cls, running: list, sents: list[_Sent]) -> _Batch | None:
        """The columns of these running requests, or None if one has no table in some group (its first blocks
        come with no op for it: the loop looks at it)."""
        if any(st.table is None or (st.more is not None and any(t.table is None for t in st.more)) for st in sents):
            return None
        return cls(running, sents)

    def settle(self) -> None:
        """Give the tokens and computed counts sent back to the ``_Sent``s (the loop reads those)."""
        for st, n, c in zip(self.sents, self.lens, self.computed):
            st.num_tokens, st.computed = n, c


class RowTracker:
    def __init__(self, scheduler, groups=None, null_block: int = 0) -> None:
        self.scheduler = scheduler
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        self.tables = managers[0].req_to_blocks  # a defaultdict: read with .get only
        self.more_tables = [m.req_to_blocks for m in managers[1:]]
        kinds = [g.kind for g in groups] if groups else ["full"] * len(managers)
        self.rewritable = [k not in GROWING for k in kinds]
        self.any_rewritable = any(self.rewritable)
        self.null = null_block
        self.sent: dict[str, _Sent] = {}
        # the blocks sent in the rewritable groups' tables: block -> {(request id, group)}; a loose block's entries
        # are the tables to send whole (``rewrite``: request id -> groups)
        self.holders: dict[int, set[tuple[str, int]]] = {}
        self.rewrite: dict[str, set[int]] = {}
        self.added: set[str] = set()  # requests added since the last step
        self.queries = 0
        self.hits = 0
        self.grown: list[tuple[str, int, int, list[int]]] = []  # the last ``changed``'s tables that only grew
        # the last ``changed``'s table positions that now hold the null block: (request id, group, positions)
        self.nulled: list[tuple[str, int, list[int]]] = []
        self._last_deferred: list[list[int]] | None = None
        self._batch: _Batch | None = None
        # the last ``changed``'s decode batch, column by column (Step.run_ids, run_tokens, run_computed)
        self.run_ids: list[str] | None = None
        self.run_tokens: list[int] = []
        self.run_computed: list[int] = []

    @property
    def pending(self) -> bool:
        return bool(self.added)

    def forget(self) -> None:
        """Nobody listens: the next subscriber gets every row whole with its keyframe."""
        self._batch = None
        self.sent.clear()
        self.added.clear()
        self.holders.clear()
        self.rewrite.clear()

    def count_admissions(self, admissions: list[tuple[str, int, int]]) -> None:
        """Prefix-cache queries and hits in tokens, as vLLM's ``prefix_cache_queries``/``_hits`` count them:
        each lookup of a waiting request that was then scheduled."""
        requests = self.scheduler.requests
        for rid, asked, hit in admissions:
            r = requests.get(rid)
            if r is not None and r.status.name == "RUNNING":
                self.queries += asked
                self.hits += hit

    def _table_delta(self, table, sent, whole: bool, key: tuple[str, int]) -> tuple[int, list[int] | None]:
        """(blocks_from, block ids) of one group's table against what ``sent`` (a _Sent or a _Table) says was
        sent, which is brought up to it; (0, None) when it is as sent. ``key``: (request id, group)."""
        nb = len(table)
        k = sent.num_blocks
        out: tuple[int, list[int] | None]
        if whole or nb < k or (k and table[k - 1].block_id != sent.last_block):
            ids = [b.block_id for b in table]
            out = (0, ids)
            if sent.live is not None:
                self._unhold(sent.live, key)
                null = self.null
                sent.live = {b: i for i, b in enumerate(ids) if b != null}
                self._hold(sent.live, key)
        elif nb > k:  # it grew: the new blocks alone
            ids = [b.block_id for b in table[k:]]
            out = (k, ids)
            if sent.live is not None:
                null = self.null
                new = {b: i for i, b in enumerate(ids, start=k) if b != null}
                sent.live.update(new)
                self._hold(new, key)
        else:
            out = (0, None)
        sent.table = table if nb else None  # the list vLLM holds now (a request freed and admitted again has another)
        sent.num_blocks, sent.last_block = nb, table[-1].block_id if nb else -1
        return out

    def _row(self, r, sent: _Sent | None, recorder, whole: bool) -> tuple[RequestRow | None, _Sent]:
        rid = r.request_id
        if sent is None:
            sent = _Sent(r, self.rewritable)
            whole = True
        status = r.status.name
        n = r.num_tokens
        table = self.tables.get(rid) or ()
        computed = r.num_computed_tokens
        cached = recorder.cached_tokens.get(rid, -1)
        again = self.rewrite.pop(rid, ())  # groups whose tables held a block vLLM gave back: sent whole
        more = sent.more
        if (
            not whole
            and not again
            and (
                status == sent.status
                and n == sent.num_tokens
                and len(table) == sent.num_blocks
                and (table[-1].block_id if table else -1) == sent.last_block
                and computed == sent.computed
                and cached == sent.cached
                and (
                    more is None
                    or all(
                        len(t := (tables.get(rid) or ())) == g.num_blocks
                        and (t[-1].block_id if t else -1) == g.last_block
                        for tables, g in zip(self.more_tables, more)
                    )
                )
            )
        ):
            return None, sent
        blocks_from, block_ids = self._table_delta(table, sent, whole or 0 in again, (rid, 0))
        groups = []
        if more is not None:
            for g, (tables, gs) in enumerate(zip(self.more_tables, more), start=1):
                start, ids = self._table_delta(tables.get(rid) or (), gs, whole or g in again, (rid, g))
                if ids is not None:
                    groups.append((g, start, ids))
        start = 0 if whole else sent.num_tokens
        if start > n:
            start = 0
        tokens = list(r.all_token_ids[start:n]) if n > start else []
        row = RequestRow(
            rid,
            status,
            r.num_prompt_tokens,
            start,
            tokens,
            computed,
            cached,
            blocks_from,
            block_ids,
            float(getattr(r, "arrival_time", 0.0)),
            groups,
            recorder.group_hits.get(rid, []),
        )
        sent.status, sent.num_tokens = status, n
        sent.computed, sent.cached = computed, cached
        return row, sent

    def _grew(self, sent, rid: str, g: int, out: list) -> bool | None:
        """One group's table (``sent``: a _Sent for group 0, a _Table for the others) that only grew: its new blocks
        go to ``out`` as ``(request id, group, blocks_from, block ids)`` and ``sent`` follows (True). False: it
        changed otherwise (freed, or not what was sent before its new blocks): the row goes whole. None: as sent."""
        t = sent.table
        if t is None:
            return False
        nb, k = len(t), sent.num_blocks
        if nb == k:
            return None
        if nb < k or (k and t[k - 1].block_id != sent.last_block):
            return False
        if nb == k + 1:  # one new block (a decode step's): no slices, no comprehensions
            self._one_more(sent, rid, g, t[k].block_id, out)
            return True
        live = sent.live
        ids = [b.block_id for b in t[k:]]
        out.append((rid, g, k, ids))
        sent.num_blocks, sent.last_block = nb, ids[-1]
        if live is not None:
            null = self.null
            new = {b: i for i, b in enumerate(ids, start=k) if b != null}
            live.update(new)
            self._hold(new, (rid, g))
        return True

    def _one_more(self, sent, rid: str, g: int, b: int, out: list) -> None:
        """``sent``'s table (a _Sent for group 0, a _Table for the others) gained one block, ``b``, at its end: to
        ``out`` as ``(request id, group, blocks_from, [b])``, and ``sent`` follows."""
        k = sent.num_blocks
        out.append((rid, g, k, [b]))
        sent.num_blocks, sent.last_block = k + 1, b
        live = sent.live
        if live is not None and b != self.null:
            live[b] = k
            h = self.holders.get(b)
            if h is None:
                self.holders[b] = {(rid, g)}
            else:
                h.add((rid, g))

    def _hold(self, blocks, key: tuple[str, int]) -> None:
        holders = self.holders
        for b in blocks:
            h = holders.get(b)
            if h is None:
                holders[b] = {key}
            else:
                h.add(key)

    def _unhold(self, blocks, key: tuple[str, int]) -> None:
        holders = self.holders
        for b in blocks:
            h = holders.get(b)
            if h is not None:
                h.discard(key)
                if not h:
                    del holders[b]

    def _rewritten(self, recorder) -> None:
        """The tables that held a block freed with no request named: where vLLM put its null block in the block's
        place, that position goes to ``nulled``; a table changed otherwise goes to ``rewrite`` (sent whole); one
        that still holds the block (another table's reference was the one dropped) is as sent."""
        loose = recorder.loose
        nulled: dict[tuple[str, int], list[int]] = {}
        if loose and self.any_rewritable:
            holders, rewrite, sent, null = self.holders, self.rewrite, self.sent, self.null
            for b in loose:
                keys = holders.get(b)
                if keys is None:
                    continue
                for key in list(keys):
                    rid, g = key
                    st = sent.get(rid)
                    t: _Sent | _Table | None = st
                    if st is not None and g:
                        t = st.more[g - 1] if st.more is not None and g <= len(st.more) else None
                    live = t.live if t is not None else None
                    i = live.get(b) if live is not None else None
                    table = (self.tables if g == 0 else self.more_tables[g - 1]).get(rid) or ()
                    if i is not None and i < len(table) and table[i].block_id == b:
                        continue  # still in this table: its reference is not the one vLLM dropped
                    if t is None or live is None or i is None or i >= len(table) or table[i].block_id != null:
                        rewrite.setdefault(rid, set()).add(g)
                        continue
                    del live[b]
                    keys.discard(key)
                    if i == t.num_blocks - 1:
                        t.last_block = null  # the grow check compares the last block sent
                    nulled.setdefault(key, []).append(i)
                if not keys:
                    del holders[b]
        loose.clear()
        self.nulled = [(rid, g, sorted(pos)) for (rid, g), pos in nulled.items()]

    def _drop(self, rid: str, st: _Sent) -> None:
        """A request gone: its blocks are no longer held by its tables as sent."""
        if st.live is not None:
            self._unhold(st.live, (rid, 0))
        for g, t in enumerate(st.more or (), start=1):
            if t.live is not None:
                self._unhold(t.live, (rid, g))
        self.rewrite.pop(rid, None)

    def _loop(self, running: list, dirty: set[str], recorder, rows: list[RequestRow]) -> list[tuple]:
        """``changed``'s running requests one by one (a step the columns cannot read), then the columns again."""
        if self._batch is not None:
            self._batch.settle()
            self._batch = None
        advanced: list[tuple] = []
        sent = self.sent
        get, add = sent.get, advanced.append
        grown = self.grown = []
        for r in running:  # the hot loop: a few attribute reads a request (256 a decode step at GPU size)
            rid = r.request_id
            st = get(rid)
            # Its table changed other than by the pool's ops for it (those put it in ``dirty``): it grew, from
            # allocate_slots, which is not hooked (a wrapper there cost 0.18 ms a step): its new blocks alone (most
            # changes of most steps: 256 requests decoding give 16 a step new blocks of 16 tokens); changed
            # otherwise, the whole row's delta.
            slow = st is None or rid in dirty
            if st is not None and not slow:
                t = st.table
                if t is None or len(t) != st.num_blocks:
                    slow = self._grew(st, rid, 0, grown) is False
                more = st.more
                if not slow and more is not None:  # a hybrid model's other groups (a loop: any() costs twice)
                    for gs in more:
                        t = gs.table
                        if (t is None or len(t) != gs.num_blocks) and self._grew(
                            gs, rid, more.index(gs) + 1, grown
                        ) is False:
                            slow = True
                            break
            if slow or st is None:
                row, sent[rid] = self._row(r, st, recorder, False)
                if row is not None:
                    rows.append(row)
                continue
            tokens = st.tokens
            n, c = len(tokens), r.num_computed_tokens
            if n != st.num_tokens or c != st.computed:
                k = st.num_tokens
                add((rid, k, tokens[k:n], c))
                st.num_tokens, st.computed = n, c
        self._batch = _Batch.of(running, [sent[r.request_id] for r in running])
        return advanced

    def _advanced(self, running: list, dirty: set[str], pool_still: bool) -> list[tuple] | None:
        """The running requests' advances when they only went on (the same requests in the same order, none in
        ``dirty``, each table as sent or one block longer), read column by column; None: the loop must look.
        ``pool_still``: the pool did nothing since the last step (no op): no table can have changed, so none is
        read. At 65,536 blocks each table's length is a cache miss: 256 tables cost 40 us a group, a third of a
        plain step's end on a hybrid pool."""
        b = self._batch
        if b is None or running != b.running or not dirty.isdisjoint(b.id_set):
            return None
        grew = []
        for g, (tables, nbs) in enumerate(zip(b.tables, b.nbs) if not pool_still else ()):
            now = list(map(len, tables))
            if now != nbs:
                by = list(map(sub, now, nbs))
                if by.count(1) + by.count(0) != len(by):
                    return None  # one shrank, or grew by more than a block
                grew.append((g, now, by))
        if not grew:
            self.grown = []
        elif not self._grow(b, grew):
            return None
        lens = list(map(len, b.tokens))
        computed = list(map(_computed, running))
        was, was_computed = b.lens, b.computed
        if lens == was and computed == was_computed:
            return []
        b.lens, b.computed = lens, computed
        by = list(map(sub, lens, was))
        if by.count(1) == len(by):  # each decoded one token (a decode step's): its last token, in the batch's order
            self.run_tokens, self.run_computed = list(map(_last, b.tokens)), computed
            if not b.ids_sent:
                self.run_ids, b.ids_sent = b.ids, True
            return []
        return [
            (rid, k, t[k:n], c)
            for rid, t, k, n, c, c0 in zip(b.ids, b.tokens, was, lens, computed, was_computed)
            if n != k or c != c0
        ]

    def _grow(self, b: _Batch, grew: list[tuple[int, list[int], list[int]]]) -> bool:
        """Tables that each grew by one block (a decode batch at a block's end): their new blocks to ``self.grown``
        and to what was sent (``_one_more``, as ``_grew``'s); False, with nothing changed, if a table changed other
        than by growing (the block before its new one is not the one sent last): the loop looks."""
        todo = []
        for g, _now, by in grew:
            tables, sents = b.tables[g], b.group_sents[g]
            for i in [i for i, d in enumerate(by) if d]:
                t, st = tables[i], sents[i]
                k = st.num_blocks
                if k and t[k - 1].block_id != st.last_block:
                    return False
                todo.append((g, b.ids[i], t, st, k))
        grown = self.grown = []
        for g, rid, t, st, k in todo:
            self._one_more(st, rid, g, t[k].block_id, grown)
        for g, now, _by in grew:
            b.nbs[g] = now
        return True

    def changed(
        self, dirty: set[str], recorder, pool_still: bool = False
    ) -> tuple[list[RequestRow], list[tuple], list[tuple[str, str]]]:
        """The rows that changed: whole-row deltas for the requests in ``dirty`` (the pool worked for them: their
        table, status or prefix hit may have changed) or new; for a running request that only went on, the short
        form ``(id, tokens_from, new tokens, computed)`` (most rows of most steps: 256 a decode step at GPU size)
        with its tables' new blocks, if any, in ``self.grown``; and the requests gone from the scheduler.
        ``pool_still``: the recorder took no op since the last call. A table changes only with a ref count (a block
        handed out, hit, or given back for a null block), so then none changed."""
        s = self.scheduler
        requests = s.requests
        rows: list[RequestRow] = []
        sent = self.sent
        self._rewritten(recorder)
        dirty = dirty | self.added | self.rewrite.keys()
        running = s.running
        self.run_ids, self.run_tokens, self.run_computed = None, [], []
        advanced = self._advanced(running, dirty, pool_still)
        if advanced is None:
            advanced = self._loop(running, dirty, recorder, rows)
        for rid in dirty:
            r = requests.get(rid)
            if r is None or r.status.name == "RUNNING":
                continue  # gone (below), or done above
            row, sent[rid] = self._row(r, sent.get(rid), recorder, False)
            if row is not None:
                rows.append(row)
        self.added.clear()
        gone = []
        # Every request vLLM holds is in ``sent`` by now (a keyframe sent them all, and each one added since was
        # in ``dirty``), so a request is gone only when ``sent`` holds more: no walk over 256 ids a step.
        for rid in [rid for rid in sent if rid not in requests] if len(sent) > len(requests) else ():
            st = sent.pop(rid)
            r = st.request
            row, _ = self._row(r, st, recorder, False)  # its last tokens, then it is gone
            self._drop(rid, st)
            if row is not None:
                row.block_ids, row.blocks_from, row.groups = None, 0, []  # its tables are freed: the ops said so
                rows.append(row)
            gone.append((rid, r.status.name))
            recorder.cached_tokens.pop(rid, None)
            recorder.group_hits.pop(rid, None)
        return rows, advanced, gone

    def all_rows(self, recorder) -> list[RequestRow]:
        """Every request the scheduler holds, whole (a keyframe's); what is sent from now on follows these."""
        self._batch = None
        self.sent.clear()
        self.added.clear()
        self.holders.clear()
        self.rewrite.clear()
        recorder.loose.clear()
        out: list[RequestRow] = []
        for r in self.scheduler.requests.values():
            row, self.sent[r.request_id] = self._row(r, None, recorder, True)
            if row is not None:  # a whole row is always made; None only says a delta had nothing to send
                out.append(row)
        return out

    def deferred(self) -> list[list[int]]:
        """``scheduler.deferred_frees`` (0.32+): blocks out of their tables, back in the pool after a later step."""
        entries = getattr(self.scheduler, "deferred_frees", None) or ()
        self._last_deferred = [[b.block_id for b in blocks] for _fence, blocks in entries]
        return self._last_deferred

    def deferred_if_changed(self) -> list[list[int]] | None:
        before = self._last_deferred
        d = self.deferred()
        return None if d == before else d
