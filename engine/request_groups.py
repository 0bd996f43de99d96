"""Request groups: who belongs with whom, and the ids the engine makes.

A user request is a *group* of sequences (``Request``\\s) under the user's id: its ``n > 1``
samples (``x#1``, ``x#2``, ... made after the prompt's prefill, sharing its blocks), a beam
search's beams (``b~1``, ...; ``beam_search.py`` is the algorithm), and on-demand forks
(``a+1``, each a group of its own). The characters ``# + ~`` are reserved for these ids, so an
id the engine makes never equals one a user can pass; auto ids ("0", "1", ...) and every child
id skip ids that are live.

Finished sequences are kept only as far as the inspector shows them (the last
``max_finished``) plus counters; a group leaves ``groups`` (after ``max_finished`` more groups
ended) and ``beam_groups`` (at once) when it has ended, so a long run stays bounded.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

import torch

from .beam_search import BeamGroup, BeamRound
from .config import SamplingParams, derive_seed
from .core.kv_cache_manager import KVCacheManager
from .core.request import Request, RequestStatus
from .core.scheduler import Scheduler
from .output_processor import OutputProcessor
from .request_ids import BEAM_SEP, FORK_SEP, MAX_FINISHED, SAMPLE_SEP

RESERVED_ID_CHARS = SAMPLE_SEP + FORK_SEP + BEAM_SEP


def check_user_request_id(request_id: object) -> None:
    """Refuse ids the engine could make itself (or that are not ids at all)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"a request id must be a non-empty string, got {request_id!r}")
    bad = sorted({c for c in request_id if c in RESERVED_ID_CHARS})
    if bad:
        raise ValueError(
            f"request id {request_id!r} contains {' '.join(bad)}: the characters "
            f"{' '.join(RESERVED_ID_CHARS)} are reserved for the ids the engine makes "
            "(samples x#1, forks a+1, beams b~1)"
        )


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """Per-sequence generator: sample ``index`` of a seeded request draws from its own stream."""
    if seed is None:
        return None
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, index))


class RequestGroups:
    def __init__(
        self, scheduler: Scheduler, kv: KVCacheManager, output: OutputProcessor, max_finished: int = MAX_FINISHED
    ) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.output = output
        self.max_finished = max_finished
        self.requests: dict[str, Request] = {}  # every unfinished sequence
        self.groups: dict[str, list[Request]] = {}  # group id -> members: live, and the last ended ones
        self.beam_groups: dict[str, BeamGroup] = {}  # live beam searches
        self.finished_log: deque[Request] = deque(maxlen=max_finished)  # the last finished sequences
        self.num_finished: Counter[str] = Counter()  # every finished sequence, by finish reason
        self.created: list[Request] = []  # sequences made during the current step (the engine clears it)
        self._ended: OrderedDict[str, None] = OrderedDict()  # ended groups still in ``groups``, oldest first
        self._maybe_ended: set[str] = set()
        self._next_auto = 0
        self._next_index = 0

    # -- ids ----------------------------------------------------------------------------
    def is_live(self, request_id: str) -> bool:
        """A sequence or a group that has not ended owns its id."""
        return request_id in self.requests or (request_id in self.groups and request_id not in self._ended)

    def auto_id(self) -> str:
        while self.is_live(str(self._next_auto)):
            self._next_auto += 1
        rid = str(self._next_auto)
        self._next_auto += 1
        return rid

    def _child_id(self, base: str, sep: str, k: int) -> tuple[str, int]:
        """``base + sep + k``, counting ``k`` up past live ids; returns the id and the ``k`` used."""
        while self.is_live(f"{base}{sep}{k}"):
            k += 1
        return f"{base}{sep}{k}", k

    def next_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    # -- admission ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Register a user request (its first sequence) as a new group; the caller checked the id."""
        rid = req.request_id
        self._ended.pop(rid, None)  # an ended group of the same id is forgotten
        self.requests[rid] = req
        self.groups[rid] = [req]
        p = req.sampling_params
        if p.use_beam_search:
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
            group = BeamGroup(rid, p.beam_width, p.max_tokens, p.length_penalty, p.early_stopping, frozenset(stop))
            group.add_beam(req, 0.0)
            self.beam_groups[rid] = group
        self.scheduler.add_request(req)

    def spawn(
        self, parent: Request, child_id: str, group_id: str | None, sample_index: int, generator_index: int
    ) -> Request:
        """A new sequence that continues ``parent``: it shares every device block (CoW on its first write)."""
        p: SamplingParams = parent.sampling_params
        child = Request(
            child_id,
            self.next_index(),
            list(parent.prompt_token_ids),
            p,
            prompt=parent.prompt,
            eos_token_ids=parent.eos_token_ids,
            cache_salt=parent.cache_salt,
            generator=make_generator(p.seed, generator_index),
            group_id=group_id or "",
            sample_index=sample_index,
            parent_id=parent.request_id,
            client=parent.client,
        )
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        self.created.append(child)
        if parent.status != RequestStatus.RUNNING:
            # A preempted or swapped beam has no device blocks to share: the child
            # recomputes (mostly from the prefix cache), ahead of newer requests.
            child.status = RequestStatus.PREEMPTED
            self.scheduler.waiting.appendleft(child)
            return child
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.scheduler.running.append(child)
        return child

    def fork(self, request_id: str) -> str:
        """Fork a running sequence on demand: the copy shares every block until it writes (CoW)."""
        parent = self.requests.get(request_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"request {request_id} is not running: only a running sequence can fork")
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"request {request_id} is still prefilling its prompt")
        if parent.group_id in self.beam_groups:
            raise ValueError(f"request {request_id} is a beam: beam search forks its beams itself")
        child_id, parent.num_forks = self._child_id(request_id, FORK_SEP, parent.num_forks + 1)
        child = self.spawn(parent, child_id, group_id=None, sample_index=0, generator_index=len(child_id))
        self.created.pop()  # made between steps, not by one: a later step's failure is not its own
        child.output_token_ids = list(parent.output_token_ids)
        child.output_text = parent.output_text
        self._ended.pop(child_id, None)
        self.groups[child_id] = [child]
        return child_id

    def spawn_samples(self, parent: Request) -> list[Request]:
        """n > 1: after the prompt's prefill, the other n - 1 samples share its blocks (ref count n)."""
        children, k = [], 1
        for i in range(1, parent.pending_forks + 1):
            child_id, k = self._child_id(parent.group_id, SAMPLE_SEP, k)
            children.append(self.spawn(parent, child_id, parent.group_id, i, i))
            k += 1
        parent.pending_forks = 0
        self.groups[parent.group_id] += children
        return children

    def beam_round(self, group: BeamGroup, length_limit: int) -> list[Request]:
        """Apply one round of beam search: fork the beams chosen more than once, prune the others."""
        members = self.groups[group.group_id]
        rnd: BeamRound = group.advance(length_limit - members[0].num_prompt_tokens)
        for req in rnd.pruned:
            self.finish(req, RequestStatus.FINISHED_STOPPED if rnd.done else RequestStatus.FINISHED_PRUNED)
        touched = list(rnd.pruned)
        for parent, choices in rnd.continuations:
            for tok, score in choices[1:]:
                child_id, _ = self._child_id(group.group_id, BEAM_SEP, len(members))
                child = self.spawn(parent, child_id, group.group_id, len(members), len(members))
                child.output_token_ids = list(parent.output_token_ids)
                members.append(child)
                self._push_beam_token(child, tok)
                group.add_beam(child, score)
                touched.append(child)
            tok, score = choices[0]
            self._push_beam_token(parent, tok)
            group.add_beam(parent, score)
            touched.append(parent)
        group.sort_beams()
        return touched

    def _push_beam_token(self, req: Request, tok: int) -> None:
        """Beam search decides when a beam ends, so no stop rule applies here."""
        req.awaiting_round = False
        self.output.push_token(req, tok)

    # -- endings --------------------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        self.requests.pop(req.request_id, None)
        self.finished_log.append(req)
        self.num_finished[status.finish_reason or ""] += 1
        self._maybe_ended.add(req.group_id)

    def abort(self, request_id: str) -> bool:
        """Abort one sequence, or every sequence of a user request (its n samples, its beams)."""
        req = self.requests.get(request_id)
        group_id = req.group_id if req is not None else request_id
        if req is None or group_id == request_id or group_id in self.beam_groups:
            # A beam search cannot go on without one of its beams: it ends as a whole.
            targets = self.groups.get(group_id, []) if self.is_live(group_id) else []
        else:
            targets = [req]
        if group_id in self.beam_groups:
            self.beam_groups[group_id].done = True
        live = [r for r in targets if not r.is_finished]
        for r in live:
            r.pending_forks = 0
            self.finish(r, RequestStatus.FINISHED_ABORTED)
        self.sweep()
        return bool(live)

    def fail(self, victims: list[Request], error: str) -> list[Request]:
        """Finish ``victims`` with ``error``, and every beam of a search one of them belongs to."""
        failed = []
        for r in victims:
            group = self.beam_groups.get(r.group_id)
            for m in [r] if group is None else self.groups.get(r.group_id, [r]):
                if group is not None:
                    group.done = True
                if not m.is_finished:
                    m.error = error
                    m.pending_forks = 0  # n > 1: the samples are never made
                    self.finish(m, RequestStatus.FINISHED_ERROR)
                    failed.append(m)
        return failed

    def group_ended(self, group_id: str) -> bool:
        members = self.groups.get(group_id)
        return members is not None and not members[0].pending_forks and all(r.is_finished for r in members)

    def sweep(self) -> None:
        """Retire the groups that ended: out of ``beam_groups`` now, out of ``groups`` after the last few."""
        for gid in self._maybe_ended:
            if gid in self._ended or not self.group_ended(gid):
                continue
            self.beam_groups.pop(gid, None)
            self._ended[gid] = None
        self._maybe_ended.clear()
        while len(self._ended) > self.max_finished:
            gid, _ = self._ended.popitem(last=False)
            self.groups.pop(gid, None)
