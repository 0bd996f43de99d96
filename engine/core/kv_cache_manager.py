"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, free."""

from __future__ import annotations

import weakref
from operator import attrgetter
from typing import Any

from .block_pool import BlockPool
from .cpu_pool import CpuBlockPool
from .kv_cache_utils import KVCacheBlock, hash_block_tokens
from .request import Request
from .vllm_hashing import VllmBlockHasher, seed_from_env, vllm_extra_keys


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_BLOCK_ID = attrgetter("block_id")


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        extra_keys: tuple = (),
        hash_algo: str = "sha256",
        cpu_pool: CpuBlockPool | None = None,
        fault: str | None = None,
        reserve_tokens: int = 0,
    ) -> None:
        self.pool = pool
        self.reserve_tokens = reserve_tokens  # contiguous layout: a request's whole reservation, up front
        self.cpu_pool = cpu_pool or CpuBlockPool(0)
        self.fault = fault
        pool.tolerate_faults = fault is not None
        # Device work the model runner does before the next forward, in this order.
        self.pending_swap_out: list[tuple[int, int]] = []  # (device block, cpu block)
        self.pending_swap_in: list[tuple[int, int]] = []  # (cpu block, device block)
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst)
        self.num_cow_copies = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.block_size = block_size
        self.enable_caching = pool.enable_caching
        self.extra_keys = extra_keys
        self.hash_algo = hash_algo
        # sha256_cbor: vLLM's own hashes (no model identity in them, the seed from PYTHONHASHSEED), so a router
        # computes a kvscope instance's hashes as it does a vLLM's ("sha256" is kvscope's own, not vLLM's pickle)
        self.vllm_hasher = VllmBlockHasher("sha256_cbor", seed_from_env()) if hash_algo == "sha256_cbor" else None
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as block ids, kept in step with req_to_blocks (appended, not rebuilt every
        # step): the runner's block tables and the snapshot read them.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # each decoding request's scheduler entry (a ScheduledRequest), made once and updated each step: no new
        # object a request a step. Kept here, not on the Request (a 30th attribute costs every Request its
        # shared-key dict: docs/performance.md), and dropped with the request's blocks in free()
        self.decode_entries: dict[str, Any] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks already published
        # the last request the prefix lookup read and its full blocks' tokens (get_computed_blocks)
        self._looked_up: weakref.ref[Request] | None = None
        self._looked_up_tokens: list[tuple[int, ...]] = []
        # vLLM's counters, in tokens
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- hashing ------------------------------------------------------------------
    def block_hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        """Chained hashes of the request's full blocks within its first ``num_tokens``."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            self._chain_hash(req, req.token_slice(i * bs, (i + 1) * bs))
        return req.block_hashes

    def _chain_hash(self, req: Request, tokens) -> None:
        """Hash the request's next full block (``tokens``) onto its chain."""
        hashes = req.block_hashes
        if self.vllm_hasher is not None:
            hashes.append(
                self.vllm_hasher.hash_block(
                    hashes[-1] if hashes else None, tokens, vllm_extra_keys(len(hashes), req.cache_salt)
                )
            )
            return
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, tokens, (self.extra_keys, req.cache_salt), self.hash_algo)
        )

    # -- prefix lookup ------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks.

        The last token is never served from the cache: its logits must be computed.
        """
        if not self.enable_caching:
            return [], 0
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        hashes = self.block_hashes(req, max_blocks * bs)
        # The full blocks' tokens, as tuples, kept for the last request looked up: a request that waits for room
        # is looked up again every step, its whole cached prefix each time (a fleet replay with a small pool
        # looked up 9,854 times, 580 blocks a time: 4.3 s of its 13 under cProfile made the same tuples again).
        # A request's full blocks never change (its outputs only grow), as its cached hashes assume too. They are
        # made as the lookup needs them, a few blocks more each round (a new prompt misses at its first block).
        looked_up = self._looked_up
        if looked_up is None or looked_up() is not req:  # held weakly: a request that ends goes with its last reference
            self._looked_up, self._looked_up_tokens = weakref.ref(req), []
        tokens = self._looked_up_tokens
        hits: list[KVCacheBlock] = []
        while True:
            n = len(hits)
            hits += self.pool.cached_prefix(hashes[n:max_blocks], tokens[n:])
            if len(hits) < len(tokens) or len(hits) == max_blocks:
                break  # a miss, or the whole prefix that may hit
            for i in range(len(tokens), min(max_blocks, 2 * len(tokens) + 4)):
                tokens.append(tuple(req.token_slice(i * bs, (i + 1) * bs)))
        return hits, len(hits) * bs

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``req``.

        Appends into the last partly filled block before taking new ones. Returns the
        newly allocated blocks, or ``None`` (changing nothing) if the pool is too small.
        """
        blocks = self.req_to_blocks.get(req.request_id, [])
        if not new_computed_blocks:
            had = len(blocks)
            if (
                num_new_tokens == 1
                and req.num_tokens - req.num_computed_tokens == 1
                and self.append_decode_slots([req], 0, 1)
            ):
                return blocks[had:]  # the one new block, if the last was full
            new_computed_blocks = []
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        if self.reserve_tokens and not blocks:
            need = max(need, cdiv(self.reserve_tokens, self.block_size))
        cow = self._shared_tail(req, blocks) if num_new_tokens > 0 and not new_computed_blocks else None
        # Touching a cached free block takes it off the free queue too.
        reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(need, 0) + (cow is not None) > self.pool.num_free_blocks - reclaimed:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, blocks)
        ids = self.req_to_block_ids.setdefault(req.request_id, [])
        if cow is not None:
            self._copy_on_write(req, blocks, cow)
        # Touch the hits first, so that they cannot be evicted for this very request.
        self.pool.touch(new_computed_blocks, req.request_id)
        blocks.extend(new_computed_blocks)
        ids.extend(map(_BLOCK_ID, new_computed_blocks))
        new = self.pool.get_new_blocks(need, req.request_id) if need > 0 else []
        blocks.extend(new)
        ids.extend(map(_BLOCK_ID, new))
        self._cache_full_blocks(req, num_computed + num_new_tokens)
        return new

    def append_decode_slots(self, reqs: list[Request], start: int, stop: int) -> int:
        """The decode fast path, for a run of requests: room for one more token each, without the
        general allocation. Returns the index of the first request in ``reqs[start:stop]`` that needs
        ``allocate_slots`` (``stop`` when none does); every one before it has its slot.

        A token lands in the request's last block when it owns that block alone, or in one new block
        when the last is full. The general path decides the rest: more than one token to compute
        (a prefill), a shared tail to copy, the pool out of blocks, an up-front reservation. A block
        a token fills is published. The scheduler calls this for every running request every step,
        so the loop is kept to a few lookups.
        """
        if self.reserve_tokens:
            return start
        tables, ids_of, bs = self.req_to_blocks, self.req_to_block_ids, self.block_size
        free_queue = self.pool.free_queue
        for k in range(start, stop):
            req = reqs[k]
            nc = req.num_computed_tokens
            blocks = tables.get(req.request_id)
            if blocks is None or len(req.prompt_token_ids) + len(req.output_token_ids) - nc != 1:
                return k
            i, offset = divmod(nc, bs)
            if offset:
                if i >= len(blocks) or blocks[i].ref_cnt != 1:
                    return k
            elif i == len(blocks) and free_queue.num_free_blocks:
                (b,) = self.pool.get_new_blocks(1, req.request_id)
                blocks.append(b)
                ids_of[req.request_id].append(b.block_id)
            else:
                return k
            if offset + 1 == bs:
                self._cache_full_blocks(req, nc + 1)
        return stop

    # -- copy-on-write and fork ---------------------------------------------------------------
    def _shared_tail(self, req: Request, blocks: list[KVCacheBlock]) -> int | None:
        """Index of the partly filled block the next token lands in, if another sequence shares it."""
        i, offset = divmod(req.num_computed_tokens, self.block_size)
        if offset and i < len(blocks) and blocks[i].ref_cnt > 1:
            return i
        return None

    def _copy_on_write(self, req: Request, blocks: list[KVCacheBlock], i: int) -> None:
        src = blocks[i]
        (dst,) = self.pool.get_new_blocks(1, req.request_id)
        n = req.num_computed_tokens % self.block_size
        self.pending_copies.append((src.block_id, dst.block_id))
        self.pool.listener.copied(src.block_id, dst.block_id, req.request_id, n)
        self.num_cow_copies += 1
        blocks[i] = dst
        self.req_to_block_ids[req.request_id][i] = dst.block_id
        if self.fault != "cow-leak":  # the fault: forget to drop the reference on the source
            self.pool.free_blocks([src], req.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (ref + 1 each); writes diverge by CoW."""
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.pool.touch(blocks, child.request_id)
        self.req_to_blocks[child.request_id] = blocks
        self.req_to_block_ids[child.request_id] = list(map(_BLOCK_ID, blocks))
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)
        self.pool.listener.forked(parent.request_id, child.request_id, self.req_to_block_ids[child.request_id])

    # -- swap -------------------------------------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Copy the request's blocks to the CPU pool and free them on the device; False if it is full."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        cpu = self.cpu_pool.allocate(len(blocks), req.request_id)
        if cpu is None:
            return False
        self.pending_swap_out += [(b.block_id, c) for b, c in zip(blocks, cpu)]
        self.pool.listener.swapped_out(req.request_id, [b.block_id for b in blocks], cpu)
        self.num_swap_outs += 1
        self.free(req)
        req.cpu_block_ids = cpu  # after free(), which would release them
        return True

    def can_swap_in(self, req: Request, num_new_tokens: int) -> bool:
        return cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) <= self.pool.num_free_blocks

    def swap_in(self, req: Request) -> None:
        cpu = req.cpu_block_ids
        blocks = self.pool.get_new_blocks(len(cpu), req.request_id)
        self.pending_swap_in += [(c, b.block_id) for c, b in zip(cpu, blocks)]
        self.cpu_pool.release(cpu)
        req.cpu_block_ids = []
        self.req_to_blocks[req.request_id] = blocks
        self.req_to_block_ids[req.request_id] = list(map(_BLOCK_ID, blocks))
        self.num_cached_blocks[req.request_id] = 0  # new ids: publish them again
        self.pool.listener.swapped_in(req.request_id, cpu, self.req_to_block_ids[req.request_id])
        self.num_swap_ins += 1

    def take_device_work(self) -> tuple[list, list, list]:
        work = (self.pending_swap_out, self.pending_swap_in, self.pending_copies)
        self.pending_swap_out, self.pending_swap_in, self.pending_copies = [], [], []
        return work

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish every block that will be full once this step's KV is written.

        Within one forward, each layer stores the whole batch's K/V before any
        attention reads it, so a request admitted in the same step can already hit.
        """
        if not self.enable_caching:
            return
        bs = self.block_size
        rid = req.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = num_tokens // bs
        if end <= start:
            return
        hashes = self.block_hashes(req, start * bs)
        blocks = self.req_to_blocks[rid]
        for i in range(start, end):
            tokens = tuple(req.token_slice(i * bs, (i + 1) * bs))  # once: hashed (if not yet) and stored
            if i == len(hashes):
                self._chain_hash(req, tokens)
            self.pool.cache_block(blocks[i], hashes[i], tokens, rid, hashes[i - 1] if i else None)
        self.num_cached_blocks[rid] = end

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (see ``BlockPool.free_blocks``)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self.req_to_block_ids.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        self.decode_entries.pop(req.request_id, None)
        if req.cpu_block_ids:
            self.cpu_pool.release(req.cpu_block_ids)
            req.cpu_block_ids = []
        if self.fault == "double-free" and len(blocks) > 1 and blocks[0].ref_cnt > 1:
            # The fault: a shared prefix block is released twice, so it can be handed out
            # while its other owner still reads it (a use-after-free that audit() reports).
            blocks = blocks + [blocks[0]]
        self.pool.free_blocks(reversed(blocks), req.request_id)

    def forget(self, req: Request) -> None:
        """The ``abort-leak`` fault: drop the table but keep every reference (a leak)."""
        self.req_to_blocks.pop(req.request_id, None)
        self.req_to_block_ids.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids (a copy: the caller may keep it)."""
        return list(self.req_to_block_ids.get(request_id, ()))

    def block_ids_view(self, request_id: str) -> list[int]:
        """The same, without the copy: valid until the table next changes (the scheduler's step)."""
        return self.req_to_block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
