"""Continuous batching, vLLM V1 style.

There are no prefill and decode phases: every request has ``num_computed_tokens``
catching up with ``num_tokens``, and each step spends a token budget over the
running requests first, then the waiting ones (a long prompt is prefilled in
chunks). When blocks run out, the most recently admitted request is preempted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .config import EngineConfig
from .events import RequestAborted, RequestAdmitted, RequestFinished, RequestPreempted
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    block_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so its logits are sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is preempted first
        self.num_preemptions = 0

    @property
    def _events(self) -> list:
        return self.kv.pool.events

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()  # always at index >= i: not scheduled yet
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
                budget -= num_new
                i += 1
                continue
            break

        # Admit waiting requests only in a step that preempted nothing (FCFS).
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.kv.record_prefix_query(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._events.append(RequestAdmitted(req.request_id, req.num_prompt_tokens, num_hit_tokens))
            scheduled.append(ScheduledRequest(req, num_new, num_hit_tokens))
            budget -= num_new

        for s in scheduled:
            s.block_ids = self.kv.get_block_ids(s.request.request_id)
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the blocks (they stay in the prefix cache)."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._events.append(RequestPreempted(req.request_id, "recompute", "out of free blocks"))

    # -- after the model ran ---------------------------------------------------------------
    def finish_request(self, req: Request, status: RequestStatus) -> None:
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status
        if status == RequestStatus.FINISHED_ABORTED:
            self._events.append(RequestAborted(req.request_id))
        else:
            self._events.append(RequestFinished(req.request_id, status.finish_reason or ""))
