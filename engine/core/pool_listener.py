"""The one hook the bookkeeping calls: what changed, as it changes, to whoever watches the pool.

The block pool, the KV cache manager and the scheduler keep only what scheduling needs (as vLLM's and
nano-vllm's do). Everything a person looks at (events, the per-block arrays a snapshot copies, who holds a
block and who last released it) is kept by a listener that hears of every change here: the inspector's
``engine.inspect.pool_ledger.PoolLedger``. The core imports nothing of the inspector; it calls these
methods on the listener it was given once, at construction. This base class hears nothing (a pool that
nobody watches pays one empty call a change).

Block calls come after the change: ``ref_cnt`` and ``block_hash`` already hold their new values, and a
block that reached ref count 0 is already on the free queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kv_cache_utils import BlockHash, KVCacheBlock


class PoolListener:
    __slots__ = ()

    # -- the pool's blocks (BlockPool) ------------------------------------------------------------
    def allocated(self, block: KVCacheBlock, request_id: str) -> None:
        """Handed out from the free queue's head (ref count 1)."""

    def touched(self, block: KVCacheBlock, request_id: str, left_queue: bool) -> None:
        """One more reference (a prefix hit or a fork); ``left_queue``: it was free (ref count was 0)."""

    def freed(self, block: KVCacheBlock, request_id: str) -> None:
        """One reference dropped; at ref count 0 the block joined the free queue's tail."""

    def evicted(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """A cached free block about to be handed out lost its hash."""

    def stored(
        self,
        block: KVCacheBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        request_id: str,
        parent_hash: BlockHash | None,
    ) -> None:
        """A full block was published under its chained hash (tentatively until the step commits)."""

    def unpublished(self, block: KVCacheBlock, block_hash: BlockHash, reason: str) -> None:
        """A tentative publication was rolled back (its step failed)."""

    def cleared(self, num_blocks: int) -> None:
        """Every hash dropped (a prefix-cache reset)."""

    # -- tables and requests (KVCacheManager, Scheduler) -----------------------------------------
    def copied(self, src: int, dst: int, request_id: str, num_tokens: int) -> None:
        """Copy-on-write: ``request_id``'s shared partial block ``src`` copied into ``dst``."""

    def forked(self, parent_id: str, child_id: str, block_ids: Sequence[int]) -> None:
        """A child sequence took a reference on each of its parent's blocks."""

    def swapped_out(self, request_id: str, block_ids: Sequence[int], cpu_block_ids: Sequence[int]) -> None: ...

    def swapped_in(self, request_id: str, cpu_block_ids: Sequence[int], block_ids: Sequence[int]) -> None: ...

    def admitted(self, request_id: str, num_prompt_tokens: int, num_hit_tokens: int) -> None: ...

    def preempted(self, request_id: str, mode: str, reason: str) -> None: ...

    def finished(self, request_id: str, reason: str) -> None: ...

    def aborted(self, request_id: str) -> None: ...


NO_LISTENER = PoolListener()  # a pool nobody watches
