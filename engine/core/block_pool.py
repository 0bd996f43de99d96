"""The physical block pool: ref counts, the free queue (its order is the eviction policy) and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from .eviction import make_free_queue
from .kv_cache_utils import BlockHash, KVCacheBlock
from .pool_listener import NO_LISTENER, PoolListener


class BlockPool:
    """Owns every ``KVCacheBlock``; tells its ``listener`` of every change (``pool_listener.py``).

    A free block may still be cached (ref 0, hash kept): it stays reusable until it is
    handed out again, at which point its hash is dropped (eviction). Handing out from
    the head of the free queue makes eviction "least recently freed first" (the default
    ``lru`` policy; ``lfu`` orders the queue by use counts, see eviction.py).

    Only this class changes a block's hash or the hash map. Publication is two-phase:
    ``cache_block`` stores a block as soon as the step that completes it is scheduled
    (vLLM's same-step hits: each layer stores the whole batch's K/V before attention
    reads it), and remembers it as *tentative*; the engine calls ``commit_step`` once the
    step's forward, sampling and post-processing succeeded, or ``rollback_step`` when
    anything failed, which unpublishes every tentative block (its KV may be unwritten).
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        eviction_policy: str = "lru",
        listener: PoolListener = NO_LISTENER,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # "lru" is vLLM's FreeKVCacheBlockQueue, unchanged; other policies order the same queue otherwise
        # (engine/core/eviction.py). A policy that counts uses hears of every hit (touch) through note_hit.
        self.free_queue = make_free_queue(eviction_policy, self.blocks)
        self._note_hit = getattr(self.free_queue, "note_hit", None)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.tentative: list[tuple[KVCacheBlock, BlockHash]] = []  # published since the last commit
        self.listener = listener  # set once: the KV cache manager and the scheduler tell it too
        self.num_evictions = 0
        self.tolerate_faults = False  # set when EngineConfig.fault injects a bug on purpose

    # -- queries ----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def cached_prefix(self, hashes: list[BlockHash], token_ids: list[tuple[int, ...]]) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of ``hashes`` whose tokens are ``token_ids`` (a block's each; the
        lookup ends where either list does)."""
        out: list[KVCacheBlock] = []
        get, hit = self.cached.get, out.append
        for h, tokens in zip(hashes, token_ids):
            b = get(h)
            # A hash collision must never serve wrong KV: compare the tokens too.
            if b is None or b.token_ids != tokens:
                break
            hit(b)
        return out

    # -- state changes ------------------------------------------------------------
    def get_new_blocks(self, n: int, request_id: str) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        popleft, allocated = self.free_queue.popleft, self.listener.allocated
        for _ in range(n):
            b = popleft()
            if b.block_hash is not None:
                self._evict(b, b.block_hash)
            assert b.ref_cnt == 0
            b.ref_cnt = 1
            allocated(b, request_id)
            out.append(b)
        return out

    def _evict(self, b: KVCacheBlock, h: BlockHash) -> None:
        if self.cached.get(h) is b:
            del self.cached[h]
        b.block_hash, b.token_ids = None, ()
        self.num_evictions += 1
        self.listener.evicted(b, h)

    def touch(self, blocks: Iterable[KVCacheBlock], request_id: str) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        note_hit = self._note_hit  # None under LRU
        touched = self.listener.touched
        for b in blocks:
            if note_hit is not None:
                note_hit(b)
            was_free = b.ref_cnt == 0
            if was_free:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            touched(b, request_id, was_free)

    def free_blocks(self, ordered: Iterable[KVCacheBlock], request_id: str) -> None:
        """Drop one reference on each block; at ref 0 it joins the free queue tail.

        Callers pass a request's blocks tail-first, so the end of a prefix chain is
        evicted before its start (the start is the part other requests share).
        """
        freed = self.listener.freed
        for b in ordered:
            if b.ref_cnt <= 0:
                # Only a deliberate fault (double-free) gets here; audit() reports it.
                assert self.tolerate_faults, f"block {b.block_id} freed with ref_cnt {b.ref_cnt}"
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
            freed(b, request_id)

    def cache_block(
        self,
        b: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        request_id: str,
        parent_hash: BlockHash | None = None,
    ) -> None:
        """Publish a full block under its chained hash (first writer wins).

        ``parent_hash`` is the hash ``block_hash`` was chained from (None for a first block);
        only the listener hears it, for consumers that rebuild the prefix tree.
        """
        if not self.enable_caching or b.block_hash is not None or block_hash in self.cached:
            return
        b.block_hash, b.token_ids = block_hash, token_ids
        self.cached[block_hash] = b
        self.tentative.append((b, block_hash))
        self.listener.stored(b, block_hash, token_ids, request_id, parent_hash)

    def commit_step(self) -> None:
        """The step that wrote the tentative blocks' last slots succeeded: they stay published."""
        self.tentative.clear()

    def rollback_step(self, reason: str) -> list[int]:
        """Unpublish every block published since the last commit (newest first); returns their ids.

        A block already evicted (or re-published under another hash) since is left alone:
        each entry is undone only while the block still carries the hash it was given.
        """
        undone = []
        for b, h in reversed(self.tentative):
            if b.block_hash != h or self.cached.get(h) is not b:
                continue
            del self.cached[h]
            b.block_hash, b.token_ids = None, ()
            self.listener.unpublished(b, h, reason)
            undone.append(b.block_id)
        self.tentative.clear()
        return undone

    def reset_prefix_cache(self) -> None:
        used = self.num_blocks - self.num_free_blocks
        if used:
            raise RuntimeError(
                f"cannot reset the prefix cache while {used} block(s) are in use; "
                "finish or abort the running requests first"
            )
        for b in self.blocks:
            b.block_hash, b.token_ids = None, ()
        self.cached.clear()
        self.tentative.clear()
        self.listener.cleared(self.num_blocks)
