"""A model of a remote engine's prefix cache, rebuilt from its KV events alone (no Qt).

The events name cached blocks by hash and chain them by parent hash, so the cache is a
forest: one tree per distinct first block, per medium (GPU, CPU, disk tiers) and per
data-parallel rank. What the events do not carry (block ids, ref counts, owners, the free
list) is not here and cannot be.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.inspect.events import Event
from engine.inspect.kv_events import ExternalHash, WireCleared, WireEvent, WireRemoved, WireStored

Tier = tuple[int, str]  # (data-parallel rank, medium)
NodeKey = tuple[int, str, ExternalHash]


def hash_text(h: ExternalHash | None) -> str:
    """A hash as hex: ints as their 64-bit two's complement (SGLang sends signed ints)."""
    if h is None:
        return ""
    if isinstance(h, bytes):
        return h.hex()
    return format(h & ((1 << 64) - 1), "016x")


# --- events the event log can show (kinds shared with kvscope's own, so its filters apply) -----


@dataclass(frozen=True, slots=True)
class RemoteStored(Event):
    """(Its tokens stay in the forest, where hovering a block shows them.)"""

    block_hash: str
    parent_hash: str
    dp_rank: int
    medium: str
    num_tokens: int
    kind = "stored"


@dataclass(frozen=True, slots=True)
class RemoteEvicted(Event):
    block_hash: str
    dp_rank: int
    medium: str
    known: bool  # False: the model never saw this block stored
    kind = "evicted"


@dataclass(frozen=True, slots=True)
class RemoteCleared(Event):
    dp_rank: int
    num_blocks: int
    kind = "cache_reset"


@dataclass(slots=True)
class ForestNode:
    block_hash: ExternalHash
    parent: ExternalHash | None
    token_ids: tuple[int, ...]
    num_tokens: int
    stored_tick: int
    copies: int = 1  # vLLM may cache one hash in two blocks; each is removed on its own


@dataclass(frozen=True)
class TierSummary:
    dp_rank: int
    medium: str
    blocks: int
    tokens: int
    roots: int

    def as_dict(self) -> dict:
        return {
            "dp_rank": self.dp_rank,
            "medium": self.medium,
            "blocks": self.blocks,
            "tokens": self.tokens,
            "roots": self.roots,
        }


@dataclass(frozen=True)
class ForestSummary:
    blocks: int
    tokens: int
    roots: int
    tiers: tuple[TierSummary, ...]

    def as_dict(self) -> dict:
        return {
            "blocks": self.blocks,
            "tokens": self.tokens,
            "roots": self.roots,
            "tiers": [t.as_dict() for t in self.tiers],
        }


@dataclass(frozen=True)
class DrawNode:
    key: NodeKey
    parent: NodeKey | None  # None: a root (no parent, or its parent is not cached)
    depth: int
    token_ids: tuple[int, ...]
    num_tokens: int
    orphan: bool  # its parent hash is named but not cached (evicted first, or stored before we attached)


@dataclass(frozen=True)
class ForestSnapshot:
    """A bounded, immutable copy for drawing: nodes breadth-first from the roots, per tier."""

    tiers: dict[Tier, tuple[DrawNode, ...]]
    total_blocks: int
    shown: int

    @property
    def truncated(self) -> bool:
        return self.shown < self.total_blocks


class CacheListener(Protocol):
    """Told of every node a model gains or loses (a second copy of a hash is not a node): a fleet's index of which
    instances hold which block, and the check that an instance's hashes can be reproduced, follow a model this way."""

    def block_added(self, rank: int, medium: str, node: ForestNode) -> None: ...

    def block_removed(self, rank: int, medium: str, node: ForestNode) -> None: ...


@dataclass
class RemoteCacheModel:
    """The prefix forest. ``max_nodes`` caps memory: stores past it are dropped and counted."""

    max_nodes: int = 200_000
    nodes: dict[NodeKey, ForestNode] = field(default_factory=dict)
    children: dict[NodeKey, set[ExternalHash]] = field(default_factory=dict)  # parent key -> cached children
    roots: dict[Tier, set[ExternalHash]] = field(default_factory=dict)
    tier_blocks: dict[Tier, int] = field(default_factory=dict)
    tier_tokens: dict[Tier, int] = field(default_factory=dict)
    overflow: int = 0  # stores dropped at the cap
    unknown_removals: int = 0  # removals of hashes never seen stored (missed, or before we attached)
    token_mismatches: int = 0  # events whose token count does not fit their blocks
    block_sizes: set[int] = field(default_factory=set)
    listener: CacheListener | None = field(default=None, compare=False, repr=False)  # not copied by ``copy``

    # -- changes --------------------------------------------------------------------------
    def apply(self, ev: WireEvent, dp_rank: int, tick: int = 0) -> list[Event]:
        if isinstance(ev, WireStored):
            return self._store(ev, dp_rank, tick)
        if isinstance(ev, WireRemoved):
            medium = ev.medium or "GPU"
            return [self.remove_block(dp_rank, medium, h) for h in ev.block_hashes]
        if isinstance(ev, WireCleared):
            return [self.clear(dp_rank)]
        return []

    def _store(self, ev: WireStored, rank: int, tick: int) -> list[Event]:
        medium = ev.medium or "GPU"  # vLLM before the field existed: its only tier was the GPU
        n, bs = len(ev.block_hashes), ev.block_size
        self.block_sizes.add(bs)
        if n == 1:
            chunks = [ev.token_ids]
        elif len(ev.token_ids) == n * bs:
            chunks = [ev.token_ids[i * bs : (i + 1) * bs] for i in range(n)]
        else:
            self.token_mismatches += 1
            chunks = [()] * n
        out: list[Event] = []
        parent = ev.parent_block_hash
        for h, toks in zip(ev.block_hashes, chunks):
            if self.add_block(rank, medium, h, parent, tuple(toks), len(toks) or bs, tick):
                out.append(RemoteStored(hash_text(h), hash_text(parent), rank, medium, len(toks) or bs))
            parent = h
        return out

    def add_block(
        self,
        rank: int,
        medium: str,
        h: ExternalHash,
        parent: ExternalHash | None,
        token_ids: tuple[int, ...],
        num_tokens: int,
        tick: int = 0,
    ) -> bool:
        """One stored block; True when it is a new node (not another copy of a cached hash, nor past the cap)."""
        key = (rank, medium, h)
        node = self.nodes.get(key)
        if node is not None:
            # Nodes are shared with timeline keyframes (``copy``): replace, never change one in place.
            self.nodes[key] = dataclasses.replace(node, copies=node.copies + 1)
            return False
        if len(self.nodes) >= self.max_nodes:
            self.overflow += 1
            return False
        self._insert(key, parent, token_ids, num_tokens, tick)
        return True

    def _insert(
        self, key: NodeKey, parent: ExternalHash | None, toks: tuple[int, ...], num_tokens: int, tick: int
    ) -> None:
        rank, medium, h = key
        tier = (rank, medium)
        if parent == h:
            parent = None  # a block cannot chain from itself
        self.nodes[key] = ForestNode(h, parent, toks, num_tokens, tick)
        roots = self.roots.setdefault(tier, set())
        if parent is None:
            roots.add(h)
        else:
            pkey = (rank, medium, parent)
            self.children.setdefault(pkey, set()).add(h)
            if pkey not in self.nodes:
                roots.add(h)  # an orphan until its parent is stored (or forever)
        # Blocks that chain from this one and were cached without it hang under it again.
        roots.difference_update(self.children.get(key, ()))
        self.tier_blocks[tier] = self.tier_blocks.get(tier, 0) + 1
        self.tier_tokens[tier] = self.tier_tokens.get(tier, 0) + num_tokens
        if self.listener is not None:
            self.listener.block_added(rank, medium, self.nodes[key])

    def remove_block(self, rank: int, medium: str, h: ExternalHash) -> Event:
        """One removed block: a copy of its hash, or its node when it was the last copy."""
        key = (rank, medium, h)
        node = self.nodes.get(key)
        if node is None:
            self.unknown_removals += 1
            return RemoteEvicted(hash_text(h), rank, medium, False)
        if node.copies > 1:
            self.nodes[key] = dataclasses.replace(node, copies=node.copies - 1)
            return RemoteEvicted(hash_text(h), rank, medium, True)
        tier = (rank, medium)
        del self.nodes[key]
        roots = self.roots[tier]
        roots.discard(h)
        if node.parent is not None:
            pkey = (rank, medium, node.parent)
            sib = self.children.get(pkey)
            if sib is not None:
                sib.discard(h)
                if not sib:
                    del self.children[pkey]
        roots.update(self.children.get(key, ()))  # its children are orphans now: roots
        self.tier_blocks[tier] -= 1
        self.tier_tokens[tier] -= node.num_tokens
        if self.listener is not None:
            self.listener.block_removed(rank, medium, node)
        return RemoteEvicted(hash_text(h), rank, medium, True)

    def clear(self, rank: int) -> Event:
        """``AllBlocksCleared``: the rank's whole cache, every medium, is gone."""
        keys = [k for k in self.nodes if k[0] == rank]
        for k in keys:
            node = self.nodes.pop(k)
            if self.listener is not None:
                self.listener.block_removed(rank, k[1], node)
        for k in [k for k in self.children if k[0] == rank]:
            del self.children[k]
        for tier in [t for t in self.roots if t[0] == rank]:
            self.roots[tier].clear()
            self.tier_blocks[tier] = 0
            self.tier_tokens[tier] = 0
        return RemoteCleared(rank, len(keys))

    def copy(self) -> RemoteCacheModel:
        """An independent model in O(nodes) dict copies: the nodes themselves are shared (never mutated)."""
        m = RemoteCacheModel(max_nodes=self.max_nodes)
        m.nodes = dict(self.nodes)
        m.children = {k: set(v) for k, v in self.children.items()}
        m.roots = {k: set(v) for k, v in self.roots.items()}
        m.tier_blocks, m.tier_tokens = dict(self.tier_blocks), dict(self.tier_tokens)
        m.overflow, m.unknown_removals, m.token_mismatches = self.overflow, self.unknown_removals, self.token_mismatches
        m.block_sizes = set(self.block_sizes)
        return m

    # -- queries --------------------------------------------------------------------------
    def cached(self, dp_rank: int = 0, medium: str = "GPU") -> set[ExternalHash]:
        return {k[2] for k in self.nodes if k[0] == dp_rank and k[1] == medium}

    def summary(self) -> ForestSummary:
        tiers = tuple(
            TierSummary(
                r, m, self.tier_blocks.get((r, m), 0), self.tier_tokens.get((r, m), 0), len(self.roots.get((r, m), ()))
            )
            for r, m in sorted(set(self.tier_blocks) | set(self.roots))
        )
        return ForestSummary(
            sum(t.blocks for t in tiers), sum(t.tokens for t in tiers), sum(t.roots for t in tiers), tiers
        )

    def snapshot(self, limit: int = 4000) -> ForestSnapshot:
        """Up to ``limit`` nodes, breadth-first from the roots, split fairly across the tiers."""
        tiers = sorted(self.roots)
        per_tier = max(1, limit // max(1, len(tiers)))
        out: dict[Tier, tuple[DrawNode, ...]] = {}
        shown = 0
        for tier in tiers:
            rank, medium = tier
            drawn: list[DrawNode] = []
            queue = deque((h, None, 0) for h in sorted(self.roots[tier], key=_sort_key))
            while queue and len(drawn) < per_tier:
                h, pkey, depth = queue.popleft()
                key = (rank, medium, h)
                n = self.nodes[key]
                orphan = pkey is None and n.parent is not None
                drawn.append(DrawNode(key, pkey, depth, n.token_ids, n.num_tokens, orphan))
                for c in sorted(self.children.get(key, ()), key=_sort_key):
                    queue.append((c, key, depth + 1))
            out[tier] = tuple(drawn)
            shown += len(drawn)
        return ForestSnapshot(out, len(self.nodes), shown)


def _sort_key(h: ExternalHash) -> tuple[int, int | bytes]:
    return (0, h) if isinstance(h, int) else (1, h)
