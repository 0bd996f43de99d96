"""The prefix cache's rules on the event stream, in one table.

Only ``BlockPool`` changes the cache, and each change is one event. Everything that keeps a copy of the
cache from the stream (the pool's replay, the window's timeline, the KV-event encoder for vLLM's
subscribers, the miss explainer, a block's story) asks this module what an event did to it, so a new
kind of change (a store rolled back when its step failed) reaches every copy at once.
"""

from __future__ import annotations

import enum

from .events import BlockEvicted, BlockStored, BlockUnpublished, CacheReset, Event


class CacheChange(enum.Enum):
    STORED = "stored"  # a full block's hash entered the cache
    EVICTED = "evicted"  # a cached free block was handed out again: its hash left
    WITHDRAWN = "withdrawn"  # a store of a step that failed was rolled back: its hash left
    CLEARED = "cleared"  # every hash dropped (a reset, with every block free)

    @property
    def removes(self) -> bool:
        """The block's hash left the cache (a subscriber's ``BlockRemoved``)."""
        return self is CacheChange.EVICTED or self is CacheChange.WITHDRAWN


CACHE_CHANGES: dict[type[Event], CacheChange] = {
    BlockStored: CacheChange.STORED,
    BlockEvicted: CacheChange.EVICTED,
    BlockUnpublished: CacheChange.WITHDRAWN,
    CacheReset: CacheChange.CLEARED,
}


def cache_change(ev: Event) -> CacheChange | None:
    """What ``ev`` did to the prefix cache, or None (it changed no hash)."""
    return CACHE_CHANGES.get(type(ev))


# The rules on an event's fields (so that packed events need no Event object): a copy of the cache as two
# maps, block id -> tokens and block id -> hex hash.
def stored(tokens, hashes, block_id, block_hash, request_id, token_ids, parent_hash=None) -> None:
    tokens[block_id] = tuple(token_ids)
    hashes[block_id] = block_hash


def removed(tokens, hashes, block_id, *_) -> None:
    tokens.pop(block_id, None)
    hashes.pop(block_id, None)


def cleared(tokens, hashes, *_) -> None:
    tokens.clear()
    hashes.clear()


RULES = {
    CacheChange.STORED: stored,
    CacheChange.EVICTED: removed,
    CacheChange.WITHDRAWN: removed,
    CacheChange.CLEARED: cleared,
}
