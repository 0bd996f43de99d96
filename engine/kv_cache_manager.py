"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, free."""
from __future__ import annotations

from .block_pool import BlockPool
from .kv_cache_utils import KVCacheBlock, hash_block_tokens
from .request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, extra_keys: tuple = (),
                 hash_algo: str = "sha256") -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = pool.enable_caching
        self.extra_keys = extra_keys
        self.hash_algo = hash_algo
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already published
        # vLLM's counters, in tokens
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- hashing ------------------------------------------------------------------
    def block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Chained hashes of the request's full blocks within its first ``num_tokens``."""
        bs = self.block_size
        hashes = req.block_hashes
        extra = (self.extra_keys, req.cache_salt)
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, req.token_slice(i * bs, (i + 1) * bs), extra,
                                            self.hash_algo))
        return hashes

    # -- prefix lookup ------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        The last token is never served from the cache: its logits must be computed.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hits: list[KVCacheBlock] = []
        for i, h in enumerate(self.block_hashes(req, max_blocks * bs)[:max_blocks]):
            b = self.pool.get_cached_block(h, tuple(req.token_slice(i * bs, (i + 1) * bs)))
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * bs

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req``.

        Appends into the last partly filled block before taking new ones. Returns the
        newly allocated blocks, or ``None`` (changing nothing) if the pool is too small.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Touching a cached free block takes it off the free queue too.
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(need, 0) > self.pool.num_free_blocks - reclaimed:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, blocks)
        # Touch the hits first, so that they cannot be evicted for this very request.
        self.pool.touch(new_computed_blocks, req.request_id)
        blocks.extend(new_computed_blocks)
        new = self.pool.get_new_blocks(need, req.request_id) if need > 0 else []
        blocks.extend(new)
        self._cache_full_blocks(req, num_computed + num_new_tokens)
        return new

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish every block that will be full once this step's KV is written.

        Within one forward, each layer stores the whole batch's K/V before any
        attention reads it, so a request admitted in the same step can already hit.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        start = self.num_cached_blocks.get(req.request_id, 0)
        end = num_tokens // bs
        if end <= start:
            return
        hashes = self.block_hashes(req, end * bs)
        blocks = self.req_to_blocks[req.request_id]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i], tuple(req.token_slice(i * bs, (i + 1) * bs)),
                                  req.request_id)
        self.num_cached_blocks[req.request_id] = end

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (see ``BlockPool.free_blocks``)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks), req.request_id)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
