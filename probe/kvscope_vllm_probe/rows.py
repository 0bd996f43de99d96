"""The requests' rows as deltas: what a subscriber has not been sent yet of each request vLLM holds.

A step looks only at the requests that can have changed: the running ones, those the pool worked for (a
block handed out, hit or freed for them: admitted, grown, preempted, finished), those just added and those
gone from the scheduler. A running request that only went on sends its new tokens and its computed count; a
request the pool worked for sends its row as a delta (its table's new blocks, or the whole table when it
changed other than by growing: a sliding window's null blocks).
"""

from __future__ import annotations

from .wire import RequestRow


class _Sent:
    __slots__ = ("status", "num_tokens", "num_blocks", "last_block", "computed", "cached", "request", "table", "tokens")

    def __init__(self, request) -> None:
        self.request = request
        # vLLM's own lists, held so that the hot loop reads no dict: a request's table list lives as long as it
        # holds blocks (a free pops it, and the pool's ops make the next step look at that request whole), and
        # its token list for its whole life (appended to in place)
        self.table: list | None = None
        self.tokens: list[int] = request._all_token_ids
        self.status = ""
        self.num_tokens = 0
        self.num_blocks = 0
        self.last_block = -1
        self.computed = -1
        self.cached = -2


class RowTracker:
    def __init__(self, scheduler, manager0) -> None:
        self.scheduler = scheduler
        self.tables = manager0.req_to_blocks  # a defaultdict: read with .get only
        self.sent: dict[str, _Sent] = {}
        self.added: set[str] = set()  # requests added since the last step
        self.queries = 0
        self.hits = 0
        self._last_deferred: list[list[int]] | None = None

    @property
    def pending(self) -> bool:
        return bool(self.added)

    def forget(self) -> None:
        """Nobody listens: the next subscriber gets every row whole with its keyframe."""
        self.sent.clear()
        self.added.clear()

    def count_admissions(self, admissions: list[tuple[str, int, int]]) -> None:
        """Prefix-cache queries and hits in tokens, as vLLM's ``prefix_cache_queries``/``_hits`` count them:
        each lookup of a waiting request that was then scheduled."""
        requests = self.scheduler.requests
        for rid, asked, hit in admissions:
            r = requests.get(rid)
            if r is not None and r.status.name == "RUNNING":
                self.queries += asked
                self.hits += hit

    def _row(self, r, sent: _Sent | None, recorder, whole: bool) -> tuple[RequestRow | None, _Sent]:
        rid = r.request_id
        if sent is None:
            sent = _Sent(r)
            whole = True
        status = r.status.name
        n = r.num_tokens
        table = self.tables.get(rid) or ()
        nb = len(table)
        sent.table = table if nb else None  # the list vLLM holds now (a request freed and admitted again has another)
        last = table[-1].block_id if nb else -1
        computed = r.num_computed_tokens
        cached = recorder.cached_tokens.get(rid, -1)
        if not whole and (
            status == sent.status
            and n == sent.num_tokens
            and nb == sent.num_blocks
            and last == sent.last_block
            and computed == sent.computed
            and cached == sent.cached
        ):
            return None, sent
        k = sent.num_blocks
        blocks_from = 0
        if whole or rid in recorder.whole_table or nb < k or (k and table[k - 1].block_id != sent.last_block):
            recorder.whole_table.discard(rid)
            block_ids = [b.block_id for b in table]
        elif nb > k:  # it grew: the new blocks alone
            blocks_from, block_ids = k, [b.block_id for b in table[k:]]
        else:
            block_ids = None
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
        )
        sent.status, sent.num_tokens, sent.num_blocks, sent.last_block = status, n, nb, last
        sent.computed, sent.cached = computed, cached
        return row, sent

    def changed(self, dirty: set[str], recorder) -> tuple[list[RequestRow], list[tuple], list[tuple[str, str]]]:
        """The rows that changed: whole-row deltas for the requests in ``dirty`` (the pool worked for them: their
        table, status or prefix hit may have changed) or new; for a running request that only went on, the short
        form ``(id, tokens_from, new tokens, computed)`` (most rows of most steps: 256 a decode step at GPU size);
        and the requests gone from the scheduler."""
        s = self.scheduler
        requests = s.requests
        rows: list[RequestRow] = []
        advanced: list[tuple] = []
        sent = self.sent
        dirty = dirty | self.added | recorder.whole_table
        get, add = sent.get, advanced.append
        for r in s.running:  # the hot loop: a few attribute reads a request (256 a decode step at GPU size)
            rid = r.request_id
            st = get(rid)
            # Its table changed other than by the pool's ops for it (those put it in ``dirty``): it grew, from
            # allocate_slots, which is not hooked (a wrapper there cost 0.18 ms a step). The whole row's delta.
            if st is None or rid in dirty or st.table is None or len(st.table) != st.num_blocks:
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
            r = sent[rid].request
            row, _ = self._row(r, sent.pop(rid), recorder, False)  # its last tokens, then it is gone
            if row is not None:
                row.block_ids, row.blocks_from = None, 0  # its table is freed: the pool's ops said so
                rows.append(row)
            gone.append((rid, r.status.name))
            recorder.cached_tokens.pop(rid, None)
        return rows, advanced, gone

    def all_rows(self, recorder) -> list[RequestRow]:
        """Every request the scheduler holds, whole (a keyframe's); what is sent from now on follows these."""
        self.sent.clear()
        self.added.clear()
        out = []
        for r in self.scheduler.requests.values():
            row, self.sent[r.request_id] = self._row(r, None, recorder, True)
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
