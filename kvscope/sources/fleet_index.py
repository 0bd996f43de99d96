"""Which instances of a fleet hold which block: one prefix forest over them all, and the blocks held twice.

It is what a precise prefix-aware router keeps (llm-d's KV-block index: a block hash -> the pods that hold it),
fed the same way: each instance's ``RemoteCacheModel`` tells it every node it gains or loses (``CacheListener``).
A *cache* is one instance's one data-parallel rank (each rank has its own KV cache); a block is *duplicated* when
two or more caches hold it, in any medium. Every count is kept up to date as nodes come and go, so a poll costs
what changed, not the size of the fleet. No sockets here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect.kv_events import ExternalHash
from kvscope.sources.remote_cache import CacheListener, ForestNode, RemoteCacheModel

FLEET_MEDIUM = "fleet"  # the merged forest is one tier: a node is a hash, whoever holds it and in whichever medium


@dataclass(frozen=True)
class Duplication:
    """The blocks held by two or more caches."""

    blocks: int  # distinct hashes held by >= 2 caches
    copies: int  # the caches holding them, counted over those hashes
    extra_bytes: int | None  # the memory they take beyond one copy each (None: a holder's bytes per block unknown)

    @property
    def extra_copies(self) -> int:
        return self.copies - self.blocks

    def as_dict(self) -> dict:
        return {
            "duplicated_blocks": self.blocks,
            "copies": self.copies,
            "extra_copies": self.extra_copies,
            "extra_bytes": self.extra_bytes,
        }


class FleetIndex:
    """The fleet's merged forest (``forest``: a ``RemoteCacheModel`` whose node copies count holders) and holders."""

    def __init__(self, max_nodes: int = 1_000_000) -> None:
        self.forest = RemoteCacheModel(max_nodes=max_nodes)
        self.cache_names: list[str] = []
        self.cache_owner: list[int] = []  # the instance (its place in the fleet) each cache belongs to
        self.cache_bytes: list[int | None] = []  # bytes per block of each cache
        self.holders: dict[ExternalHash, dict[int, int]] = {}  # hash -> cache -> media holding it there
        self.multi: set[ExternalHash] = set()  # hashes held by >= 2 caches
        self.shared: list[int] = []  # per cache: its blocks some other cache holds too
        self._copies_multi = 0

    def add_cache(self, name: str, bytes_per_block: int | None, owner: int = 0) -> int:
        self.cache_names.append(name)
        self.cache_owner.append(owner)
        self.cache_bytes.append(bytes_per_block)
        self.shared.append(0)
        return len(self.cache_names) - 1

    # -- what the instances' models say ------------------------------------------------------
    def added(self, cache: int, medium: str, node: ForestNode) -> None:
        h = node.block_hash
        self.forest.add_block(0, FLEET_MEDIUM, h, node.parent, node.token_ids, node.num_tokens, node.stored_tick)
        held = self.holders.setdefault(h, {})
        if cache in held:
            held[cache] += 1  # another medium of the same cache: not another holder
            return
        held[cache] = 1
        n = len(held)
        if n == 2:
            self.multi.add(h)
            self._copies_multi += 2
            for c in held:
                self.shared[c] += 1
        elif n > 2:
            self._copies_multi += 1
            self.shared[cache] += 1

    def removed(self, cache: int, medium: str, node: ForestNode) -> None:
        h = node.block_hash
        self.forest.remove_block(0, FLEET_MEDIUM, h)
        held = self.holders.get(h)
        if held is None or cache not in held:
            return
        held[cache] -= 1
        if held[cache]:
            return
        del held[cache]
        n = len(held)
        if n == 1:
            self.multi.discard(h)
            self._copies_multi -= 2
            self.shared[cache] -= 1
            for c in held:
                self.shared[c] -= 1
        elif n >= 2:
            self._copies_multi -= 1
            self.shared[cache] -= 1
        else:
            del self.holders[h]

    # -- queries ---------------------------------------------------------------------------
    def holder_names(self, h: ExternalHash) -> list[str]:
        """The caches holding ``h``, in fleet order (then by name: a data-parallel rank's after the one before it),
        not in the order their first events came, which two instances' sockets race for."""
        order = sorted(self.holders.get(h, ()), key=lambda c: (self.cache_owner[c], self.cache_names[c]))
        return [self.cache_names[c] for c in order]

    def holder_instances(self, h: ExternalHash) -> list[int]:
        """The instances (places in the fleet) holding ``h``, each once, in fleet order."""
        return sorted({self.cache_owner[c] for c in self.holders.get(h, ())})

    @property
    def distinct_blocks(self) -> int:
        return len(self.holders)

    def duplication(self) -> Duplication:
        sizes = self.cache_bytes
        if all(b is None for b in sizes) or not self.multi:
            extra = None if self.multi else 0
        elif len({b for b in sizes}) == 1:  # one model: every copy the same size
            extra = (self._copies_multi - len(self.multi)) * sizes[0]
        else:
            extra = 0
            for h in self.multi:
                held = [sizes[c] for c in self.holders[h]]
                if None in held:
                    extra = None
                    break
                extra += sum(held) - max(held)  # keep the largest copy, count the others
        return Duplication(len(self.multi), self._copies_multi, extra)


class InstanceFeed:
    """One instance's model tells the fleet's index (and ``also``, its hash check) of every node it gains or loses:
    a ``CacheListener``. Each data-parallel rank it publishes for is a cache of its own in the index."""

    def __init__(
        self,
        index: FleetIndex,
        place: int,
        name: str,
        dp_size: int = 1,
        bytes_per_block: int | None = None,
        also: CacheListener | None = None,
    ) -> None:
        self.index, self.place, self.name, self.dp_size, self.bytes_per_block = (
            index,
            place,
            name,
            dp_size,
            bytes_per_block,
        )
        self.also = also
        self.caches: dict[int, int] = {}  # data-parallel rank -> the index's cache

    def _cache(self, rank: int) -> int:
        c = self.caches.get(rank)
        if c is None:
            name = self.name if self.dp_size == 1 else f"{self.name}/dp{rank}"
            c = self.caches[rank] = self.index.add_cache(name, self.bytes_per_block, self.place)
        return c

    def block_added(self, rank: int, medium: str, node: ForestNode) -> None:
        self.index.added(self._cache(rank), medium, node)
        if self.also is not None:
            self.also.block_added(rank, medium, node)

    def block_removed(self, rank: int, medium: str, node: ForestNode) -> None:
        self.index.removed(self._cache(rank), medium, node)
        if self.also is not None:
            self.also.block_removed(rank, medium, node)

    @property
    def shared_blocks(self) -> int:
        """Its blocks that another cache holds too."""
        return sum(self.index.shared[c] for c in self.caches.values())
