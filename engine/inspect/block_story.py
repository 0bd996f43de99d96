"""A block's life story, read from the event stream: every event that names the block, who held a
reference after it, and, for a block that leaked, the request that ended still holding it.

The story is built from events only (no engine objects), so it works the same on a live engine, a
replayed trace and the window's timeline. Holders follow the pool's own bookkeeping: a reference is
taken by ``allocated`` and ``hit`` (a prefix hit or a fork's share) and dropped by ``freed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .cache_rules import CacheChange, cache_change
from .events import (
    BlockAllocated,
    BlockCopied,
    BlockFreed,
    BlockTouched,
    Event,
    LeakFound,
    RequestAborted,
    RequestFinished,
    RequestForked,
    SwappedIn,
    SwappedOut,
)

Decode = Callable[[list[int]], "str | None"]


@dataclass(frozen=True, slots=True)
class StoryLine:
    step: int
    kind: str  # the event's kind, or "suspect" for the diagnosis of a leak
    text: str
    holders: tuple[str, ...]  # the requests holding a reference after this line
    event: Event | None = None


class BlockStory:
    """Feed it ``(step, events)`` in order; ``lines`` is the story of ``block_id`` so far."""

    def __init__(self, block_id: int, decode: Decode | None = None) -> None:
        self.block_id = block_id
        self.decode = decode
        self.lines: list[StoryLine] = []
        self.holders: list[str] = []  # in the order they took their reference
        self.last_holder: str | None = None
        self._ended: dict[str, tuple[int, Event]] = {}  # holders whose request ended this step

    def _add(self, step: int, kind: str, text: str, event: Event | None = None) -> None:
        self.lines.append(StoryLine(step, kind, text, tuple(self.holders), event))

    def _tokens(self, token_ids: tuple[int, ...]) -> str:
        text = self.decode(list(token_ids)) if self.decode and token_ids else None
        return f"{list(token_ids)}" + (f" {text!r}" if text is not None else "")

    def feed(self, step: int, events: Iterable[Event]) -> None:
        b = self.block_id
        leak_reported = False
        for event in events:
            e: Any = event  # its fields, by the kind the prefix cache's rules or isinstance gave
            change = cache_change(e)  # the prefix cache's rules: engine.inspect.cache_rules
            if change is not None:
                if change is CacheChange.CLEARED:
                    self._add(step, e.kind, "prefix cache reset (every free block's hash dropped)", e)
                elif e.block_id != b:
                    pass
                elif change is CacheChange.STORED:
                    self._add(
                        step,
                        e.kind,
                        f"stored in the prefix cache under hash {e.block_hash[:16]} by request "
                        f"{e.request_id}: tokens {self._tokens(e.token_ids)}",
                        e,
                    )
                elif change is CacheChange.EVICTED:
                    self._add(
                        step,
                        e.kind,
                        f"evicted from the prefix cache (hash {e.block_hash[:16]} dropped): handed out again",
                        e,
                    )
                else:
                    self._add(step, e.kind, f"hash {e.block_hash[:16]} withdrawn ({e.reason or 'step failed'})", e)
            elif isinstance(e, BlockAllocated) and e.block_id == b:
                self.holders = [e.request_id]
                self.last_holder = e.request_id
                self._add(step, e.kind, f"allocated to request {e.request_id}", e)
            elif isinstance(e, BlockTouched) and e.block_id == b:
                self.holders.append(e.request_id)
                self.last_holder = e.request_id
                self._add(step, e.kind, f"hit by request {e.request_id} (ref count {e.ref_cnt})", e)
            elif isinstance(e, BlockFreed) and e.block_id == b:
                if e.request_id in self.holders:
                    self.holders.remove(e.request_id)
                where = "back on the free queue" if e.ref_cnt == 0 else f"ref count {e.ref_cnt}"
                self._add(step, e.kind, f"released by request {e.request_id} ({where})", e)
            elif isinstance(e, BlockCopied) and b in (e.src_block_id, e.dst_block_id):
                other = e.dst_block_id if e.src_block_id == b else e.src_block_id
                role = (
                    f"copied on write to block {other}"
                    if e.src_block_id == b
                    else f"a copy-on-write copy of block {other}"
                )
                self._add(step, e.kind, f"{role} for request {e.request_id} ({e.num_slots} slots)", e)
            elif isinstance(e, SwappedOut) and b in e.block_ids:
                cpu = e.cpu_block_ids[e.block_ids.index(b)]
                self._add(step, e.kind, f"swapped out to CPU block {cpu} with request {e.request_id}", e)
            elif isinstance(e, SwappedIn) and b in e.block_ids:
                cpu = e.cpu_block_ids[e.block_ids.index(b)]
                self._add(step, e.kind, f"request {e.request_id} swapped in here from CPU block {cpu}", e)
            elif isinstance(e, RequestForked) and b in e.block_ids:
                self._add(step, e.kind, f"shared with fork {e.child_id} of request {e.parent_id}", e)
            elif isinstance(e, LeakFound) and e.block_id == b:
                self._add(step, e.kind, f"reported by the audit: {e.problem}", e)
                leak_reported = True
            elif isinstance(e, (RequestFinished, RequestAborted)) and e.request_id in self.holders:
                self._ended[e.request_id] = (step, e)
                how = "aborted" if isinstance(e, RequestAborted) else f"finished ({e.reason})"
                self._add(step, e.kind, f"its holder, request {e.request_id}, {how}", e)
        self._check_ended(step)
        if leak_reported:
            self._suspect(step)

    def _check_ended(self, step: int) -> None:
        """A request that ended with this step and still holds the block did not free it: say so once."""
        for rid, (s, e) in list(self._ended.items()):
            if rid in self.holders:
                self._add(
                    step,
                    "suspect",
                    f"request {rid} ended at step {s} ({e.kind}) but never released this "
                    f"block: the free that should have followed its {e.kind} is missing",
                    e,
                )
            del self._ended[rid]

    def _suspect(self, step: int) -> None:
        if any(ln.kind == "suspect" for ln in self.lines):
            return  # the diagnosis (a holder that ended without releasing it) is already in the story
        who = self.last_holder
        self._add(
            step,
            "suspect",
            f"last request that took a reference: {who}"
            if who
            else "no request ever took a reference in the recorded history",
        )


def block_story(
    block_id: int, steps: Iterable[tuple[int, Iterable[Event]]], decode: Decode | None = None
) -> list[StoryLine]:
    """The whole story of ``block_id`` over ``(step, events)`` pairs."""
    story = BlockStory(block_id, decode)
    for step, events in steps:
        story.feed(step, events)
    return story.lines


def format_story(block_id: int, lines: list[StoryLine]) -> str:
    if not lines:
        return f"block {block_id}: no event names it in the recorded history (it was never allocated)"
    out = [f"block {block_id}: {len(lines)} events"]
    for ln in lines:
        held = ", ".join(ln.holders) if ln.holders else "nobody"
        out.append(f"  step {ln.step:>5}  {ln.kind:<12} {ln.text}  [held by: {held}]")
    return "\n".join(out)
