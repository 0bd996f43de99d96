"""Continuous batching, vLLM V1 style.

There are no prefill and decode phases: every request has ``num_computed_tokens``
catching up with ``num_tokens``, and each step spends a token budget over the
running requests first, then the waiting ones (a long prompt is prefilled in
chunks). When blocks run out, the most recently admitted request is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from ..config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    block_ids: list[int]  # the request's table: a view, valid until the next schedule()
    # Whether this step reaches the request's last token, so its logits are sampled.
    samples: bool = False

    @classmethod
    def of(cls, req: Request, num_new_tokens: int, num_computed_tokens: int, block_ids: list[int]) -> ScheduledRequest:
        return cls(
            req, num_new_tokens, num_computed_tokens, block_ids, num_computed_tokens + num_new_tokens == req.num_tokens
        )


_NUM_NEW_TOKENS = attrgetter("num_new_tokens")


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    # Device work before the forward, in this order (see KVCacheManager.take_device_work).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(map(_NUM_NEW_TOKENS, self.scheduled))


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.swapped: deque[Request] = deque()
        self.num_preemptions = 0

    @property
    def _listener(self):
        return self.kv.pool.listener

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        # The running loop is the per-step hot path (hundreds of decoding requests): a run of requests
        # each decoding one token that fits without the general allocation is handled in one call.
        kv = self.kv
        running = self.running
        ids_of = kv.req_to_block_ids
        add = scheduled.append
        entries = kv.decode_entries
        entry = entries.get
        i = 0
        while i < len(running) and budget > 0:
            j = kv.append_decode_slots(running, i, min(len(running), i + budget))
            if j > i:
                # a decode step's entry is made once per request and updated (KVCacheManager.decode_entries)
                # (the constructor and the collector cost about 4% of the bookkeeping at 256 running)
                for k in range(i, j):
                    r = running[k]
                    rid = r.request_id
                    e = entry(rid)
                    if e is None:
                        e = entries[rid] = ScheduledRequest(r, 1, r.num_computed_tokens, ids_of[rid], True)
                    else:
                        e.num_computed_tokens, e.block_ids = r.num_computed_tokens, ids_of[rid]
                    add(e)
                budget -= j - i
                i = j
                continue
            req = running[i]
            nc = req.num_computed_tokens
            num_new = min(req.num_tokens - nc, budget)
            if num_new == 0:  # a beam waiting for its siblings' logits: nothing to compute
                i += 1
                continue
            while kv.allocate_slots(req, num_new) is None:
                victim = running.pop()  # always at index >= i: not scheduled yet
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest.of(req, num_new, nc, ids_of[req.request_id]))
                budget -= num_new
                i += 1
                continue
            break

        # Swapped requests were admitted before any waiting one: they come back first.
        # A parked beam (its logits already reported) waits where it is: it has nothing to compute.
        for req in [r for r in self.swapped if not r.awaiting_round]:
            if preempted or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.can_swap_in(req, num_new):
                break
            self.swapped.remove(req)
            self.kv.swap_in(req)
            assert self.kv.allocate_slots(req, num_new) is not None
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest.of(req, num_new, req.num_computed_tokens, ids_of[req.request_id]))
            budget -= num_new

        # Admit waiting requests only in a step that preempted nothing (FCFS).
        blocked = any(not r.awaiting_round for r in self.swapped)
        for req in [r for r in self.waiting if not r.awaiting_round]:
            if preempted or blocked or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.remove(req)
            self.kv.record_prefix_query(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._listener.admitted(req.request_id, req.num_prompt_tokens, num_hit_tokens)
            scheduled.append(ScheduledRequest.of(req, num_new, num_hit_tokens, ids_of[req.request_id]))
            budget -= num_new

        if not scheduled and not preempted:
            # Beams waiting for a sibling hold blocks that the sibling may need to come
            # back: park the newest of them (preempt it) so the search cannot deadlock.
            queued = any(not r.awaiting_round for q in (self.waiting, self.swapped) for r in q)
            paused = [r for r in self.running if r.awaiting_round]
            if queued and paused:
                self.running.remove(paused[-1])
                self._preempt(paused[-1])
                preempted.append(paused[-1])

        return SchedulerOutput(scheduled, preempted, *self.kv.take_device_work())

    def _preempt(self, req: Request) -> None:
        """Swap the request's KV to the CPU pool, or drop it to be recomputed.

        Recompute keeps the blocks in the prefix cache, so the re-prefill often hits.
        """
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            if self.kv.swap_out(req):
                req.status = RequestStatus.SWAPPED
                self.swapped.appendleft(req)
                self._listener.preempted(req.request_id, "swap", "out of free blocks")
                return
            reason = "out of free blocks; the CPU swap pool is full too, so fell back to recompute"
        else:
            reason = "out of free blocks"
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self._listener.preempted(req.request_id, "recompute", reason)

    def recompute_swapped(self, req: Request, reason: str) -> None:
        """A request swapped out whose KV never reached the CPU pool: it must not resume on it.

        Its CPU blocks are released and it goes back to the front of the waiting queue to be
        recomputed (its device blocks were freed at the swap-out, so their cached prefix may
        still hit); the preemption was already counted.
        """
        if req in self.swapped:
            self.swapped.remove(req)
        self.kv.free(req)  # releases the CPU blocks; the device table is already gone
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self._listener.preempted(req.request_id, "recompute", reason)

    # -- after the model ran ---------------------------------------------------------------
    def finish_request(self, req: Request, status: RequestStatus) -> None:
        assert status.finished
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        if status == RequestStatus.FINISHED_ABORTED and self.kv.fault == "abort-leak":
            self.kv.forget(req)  # the fault: an abort path that forgets to free
        else:
            self.kv.free(req)
        req.status = status
        if status == RequestStatus.FINISHED_ABORTED:
            self._listener.aborted(req.request_id)
        else:
            self._listener.finished(req.request_id, status.finish_reason or "")
