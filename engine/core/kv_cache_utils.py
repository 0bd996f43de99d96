"""Chained block hashes and the block object itself."""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes
NONE_HASH: BlockHash = b"\x00" * 32  # the parent of a prompt's first block


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
    algo: str = "sha256",
) -> BlockHash:
    """Hash of one full block: covers its parent's hash, so one hash names a whole prefix.

    ``extra_keys`` carries the model and tokenizer identity and the cache salt:
    two models (or two salts) never share a block.

    The hashed bytes are the pickled extra keys (pickled once per distinct key, not once per block;
    a pickle ends itself), then the parent's length, the token count, the token ids as int64s, and
    the parent hash: one unambiguous string. vLLM pickles the whole tuple each time, which was most
    of the cost of publishing a block (a decode step publishes one for every 16 running requests).
    """
    parent = parent_hash or NONE_HASH
    n = len(token_ids)
    packer = _PACKERS.get(n) or _PACKERS.setdefault(n, struct.Struct(f"<HH{n}q"))
    payload = b"".join((_pickled(extra_keys), packer.pack(len(parent), n, *token_ids), parent))
    if algo == "sha256":
        return hashlib.sha256(payload).digest()
    # "builtin": fast and non-cryptographic, for benchmarks; collisions are still
    # harmless because a hit compares the stored tokens too.
    return hash(payload).to_bytes(8, "little", signed=True)


_PACKERS: dict[int, struct.Struct] = {}


@functools.lru_cache(maxsize=256)
def _pickled(extra_keys: tuple) -> bytes:
    return pickle.dumps(extra_keys, protocol=5)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block: vLLM's fields (its ``is_null`` aside: this pool keeps no null block) and the tokens
    its hash was computed from, which a hit compares (a hash collision must never serve wrong KV).
    ``prev_free``/``next_free`` link it into the free queue. Who holds it and when it was last used are the
    inspector's (engine/inspect/pool_ledger.py), not the block's."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # stored with the hash: a hit compares them
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly-linked free list in eviction order (least recently freed first).

    A deque cannot remove from the middle in O(1); a cached free block that is hit
    again must leave the queue wherever it is, so the links live in the blocks.
    """

    policy = "lru"  # the EngineConfig.eviction_policy this order is

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head: KVCacheBlock | None = None
        self.tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        b = self.head
        if b is None:
            raise ValueError("no free block")
        self.remove(b)
        return b

    def queued(self, b: KVCacheBlock) -> bool:
        """Whether ``b`` is on the queue: linked, or its only (head) block."""
        return b.prev_free is not None or self.head is b

    def remove(self, b: KVCacheBlock) -> None:
        assert self.queued(b), f"block {b.block_id} is not on the free queue"
        if b.prev_free is None:
            self.head = b.next_free
        else:
            b.prev_free.next_free = b.next_free
        if b.next_free is None:
            self.tail = b.prev_free
        else:
            b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: KVCacheBlock) -> None:
        assert not self.queued(b), f"block {b.block_id} is already on the free queue"
        b.prev_free, b.next_free = self.tail, None
        if self.tail is None:
            self.head = b
        else:
            self.tail.next_free = b
        self.tail = b
        self.num_free_blocks += 1

    def __iter__(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next_free

    def ids(self) -> list[int]:
        return [b.block_id for b in self]
