"""Which KV cache group missed: the miss explainer for a hybrid model (a probed vLLM with several groups).

vLLM's hybrid coordinator looks a prompt up in every group and takes the shortest hit: a full-attention group
needs every block before the hit cached, a sliding-window group only the blocks of the window before it (it
caches no others), a Mamba group the state at the hit's position (one a block boundary, some retired). The
probe measures each group's own hit at admission (``RequestInfo.group_hits``); the group with the shortest is
the one that missed. A full-attention group's miss is explained as with one group (``CacheMissExplainer``, fed
that group's blocks only: a block hash carries its group); another group's by its kind's rule, with both groups'
reach.

``make_miss_explainer`` gives the plain explainer for a pool of one group and this one for several: the window
and ``--headless`` ask it alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from .cache_miss import CacheMiss, CacheMissExplainer, Decode
from .events import Event, RequestAdmitted
from .kv_groups import KVCacheGroup, name_of, primary_group


class GroupedMissExplainer:
    """One ``CacheMissExplainer`` a group; ``misses`` holds each admitted request's first miss, with the group
    that missed (``CacheMiss.group``) and every group's own hit (``group_hits``)."""

    def __init__(
        self,
        groups: tuple[KVCacheGroup, ...],
        decode: Decode | None = None,
        max_requests: int | None = None,
        max_evicted: int | None = None,
    ) -> None:
        self.groups = tuple(groups)
        self.primary = primary_group(self.groups)
        self.per_group = [
            CacheMissExplainer(g.block_size, decode, max_requests, max_evicted, group=i) for i, g in enumerate(groups)
        ]
        self.misses: dict[str, CacheMiss | None] = {}
        self.max_requests = max_requests
        self.dropped = 0

    @property
    def keep(self) -> set[str]:
        return self.per_group[0].keep

    @keep.setter
    def keep(self, ids: set[str]) -> None:
        for ex in self.per_group:
            ex.keep = set(ids)

    def feed_snapshot(self, step: int, events: Iterable[Event], snap) -> None:
        events = list(events)
        admitted = [e.request_id for e in events if isinstance(e, RequestAdmitted) and e.request_id not in self.misses]
        for ex in self.per_group:
            ex.feed_snapshot(step, events, snap)
        for rid in admitted:
            r = snap.request(rid)
            self.misses[rid] = self._decide(rid, tuple(r.group_hits) if r is not None else (), snap)
        excess = len(self.misses) - self.max_requests if self.max_requests is not None else 0
        if excess > 0:
            for rid in [rid for rid in self.misses if rid not in self.keep][:excess]:
                del self.misses[rid]
                self.dropped += 1

    def _decide(self, rid: str, hits: tuple[int, ...], snap) -> CacheMiss | None:
        own = self.per_group[self.primary].misses.get(rid)
        if len(hits) != len(self.groups) or own is None:
            return replace(own, group=self.primary, group_hits=hits) if own is not None else None
        full = hits[self.primary]
        missed = min(range(len(hits)), key=lambda g: (hits[g], g != self.primary))
        if hits[missed] >= full:  # the full-attention group ran out first (or as soon): its chain tells why
            return replace(own, group=self.primary, group_hits=hits)
        g = self.groups[missed]
        where = name_of(self.groups, missed)
        others = ", ".join(f"{name_of(self.groups, i)} {h}" for i, h in enumerate(hits) if i != missed)
        reach = f"on its own it reaches token {hits[missed]} of the prompt ({others})"
        if g.kind in ("sliding_window", "chunked_local"):
            reason = "window_not_cached"
            detail = (
                f"{where} missed: a hit up to token p needs the blocks of the window before p cached in that group, "
                f"which keeps only the blocks a later hit can use; {reach}, and the hit is the shortest of them"
            )
        elif g.kind == "mamba":
            reason = "state_not_cached"
            detail = (
                f"{where} missed: a hit up to token p needs the state at p cached (a state a block boundary, "
                f"earlier ones retired); {reach}, and the hit is the shortest of them"
            )
        else:
            reason = "group_missed"
            detail = f"{where} missed: {reach}, and the hit is the shortest of them"
        bs = g.block_size or snap.block_size
        return CacheMiss(hits[missed] // bs, reason, hits[missed], detail, group=missed, group_hits=hits)


def make_miss_explainer(
    block_size: int,
    decode: Decode | None = None,
    max_requests: int | None = None,
    max_evicted: int | None = None,
    groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup] = (),
) -> CacheMissExplainer | GroupedMissExplainer:
    """The miss explainer for a pool: one group, the plain one; several (a hybrid model), one a group."""
    if len(groups) > 1:
        return GroupedMissExplainer(tuple(groups), decode, max_requests, max_evicted)
    return CacheMissExplainer(block_size, decode, max_requests, max_evicted)
