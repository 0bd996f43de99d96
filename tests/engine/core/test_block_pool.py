"""Block pool and KV cache manager: exact ids, eviction order, hash chaining, refusals."""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import hash_block_tokens
from engine.core.request import Request
from engine.inspect.events import BlockEvicted
from engine.inspect.pool_ledger import PoolLedger


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, int(rid) if rid.isdigit() else 0, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def manager(num_blocks: int = 8, bs: int = 4, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching, listener=PoolLedger(num_blocks)), bs, extra_keys=("model-a",))


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return kv.get_block_ids(r.request_id)


def test_allocation_takes_lowest_free_ids_in_order():
    kv = manager()
    assert admit(kv, req("0", range(9))) == [0, 1, 2]
    assert admit(kv, req("1", range(100, 105))) == [3, 4]


def test_free_returns_tail_first_and_eviction_is_least_recently_freed():
    kv = manager(num_blocks=6)
    a = req("0", range(12))  # 3 full blocks: 0, 1, 2
    admit(kv, a)
    kv.free(a)
    # Free queue: 3 4 5 (never used) then a's blocks tail first: 2 1 0.
    assert kv.pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    b = req("1", range(200, 216))  # 4 blocks, no hit: takes 3 4 5 then evicts 2 (a's chain end)
    assert admit(kv, b) == [3, 4, 5, 2]
    evicted = [e.block_id for e in kv.pool.listener.drain_events() if isinstance(e, BlockEvicted)]
    assert evicted == [2]
    # a's first two blocks are still cached: a repeat of a hits them.
    hits, n = kv.get_computed_blocks(req("2", range(12)))
    assert [h.block_id for h in hits] == [0, 1] and n == 8


def test_hash_chaining_names_the_whole_prefix():
    h1 = hash_block_tokens(None, [1, 2, 3, 4], ("m",))
    h2 = hash_block_tokens(h1, [5, 6, 7, 8], ("m",))
    h2_other_parent = hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4], ("m",)), [5, 6, 7, 8], ("m",))
    assert h2 != h2_other_parent
    assert hash_block_tokens(None, [1, 2, 3, 4], ("other-model",)) != h1
    kv = manager()
    r = req("0", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, r)
    assert r.block_hashes[:2] == [
        hash_block_tokens(None, [1, 2, 3, 4], (("model-a",), None)),
        hash_block_tokens(r.block_hashes[0], [5, 6, 7, 8], (("model-a",), None)),
    ]


def test_only_full_blocks_are_cached_and_last_token_is_never_a_hit():
    kv = manager()
    a = req("0", range(8))  # exactly two full blocks
    admit(kv, a)
    assert len(kv.pool.cached) == 2
    kv.free(a)
    hits, n = kv.get_computed_blocks(req("1", range(8)))
    assert n == 4  # not 8: the last token's logits must be computed
    hits, n = kv.get_computed_blocks(req("2", range(9)))
    assert n == 8
    c = req("3", range(6))
    admit(kv, c)
    assert len(kv.pool.cached) == 2  # the half-full block is not cached


def test_failed_allocation_changes_no_ref_count():
    kv = manager(num_blocks=4)
    admit(kv, req("0", range(8)))
    before = [b.ref_cnt for b in kv.pool.blocks]
    r = req("1", list(range(8)) + list(range(50, 62)))  # hits 2 blocks, needs 3 more, only 2 free
    hits, n = kv.get_computed_blocks(r)
    assert n == 8
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is None
    assert [b.ref_cnt for b in kv.pool.blocks] == before
    assert kv.get_block_ids("1") == []


def test_hit_block_is_not_evicted_for_its_own_request():
    kv = manager(num_blocks=4)
    a = req("0", range(8))
    admit(kv, a)
    kv.free(a)  # blocks 0 and 1 cached and free; queue 2 3 1 0
    r = req("1", list(range(8)) + list(range(20, 28)))  # hits 0 and 1, needs 2 more
    ids = admit(kv, r)
    assert ids == [0, 1, 2, 3]
    assert len(kv.pool.cached) == 4


def test_hash_collision_never_serves_wrong_kv(monkeypatch):
    import engine.core.kv_cache_manager as m

    monkeypatch.setattr(m, "hash_block_tokens", lambda parent, toks, extra, algo: b"same")
    kv = manager()
    admit(kv, req("0", [1, 2, 3, 4, 5]))
    hits, n = kv.get_computed_blocks(req("1", [9, 9, 9, 9, 9]))
    assert n == 0 and hits == []


def test_a_request_looked_up_again_reads_the_pool_as_it_is_now():
    """A request waiting for room is looked up every step. Its blocks' tokens are kept between lookups (they never
    change), but what hits is read from the pool each time: a block evicted since is a miss, one cached since a hit,
    and a prefix longer than the tokens kept so far is read whole."""
    kv = manager(num_blocks=40)
    a = req("0", range(64))  # 16 full blocks cached
    admit(kv, a)
    kv.free(a)
    w = req("1", list(range(64)) + [7])
    hits, n = kv.get_computed_blocks(w)
    assert n == 64 and [h.block_id for h in hits] == list(range(16))
    assert kv.get_computed_blocks(w) == (hits, 64)  # again: the same
    # the pool evicts a's last three blocks (the free queue's head after the never-used ones: a's tail first)
    admit(kv, req("2", range(1000, 1000 + 4 * 27)))
    assert kv.get_computed_blocks(w)[1] == 4 * 13
    other = req("3", [5, 5, 5, 5, 6])
    assert kv.get_computed_blocks(other)[1] == 0  # another request looked up in between
    assert kv.get_computed_blocks(w)[1] == 4 * 13
    # and a collision is refused on a second lookup too
    kv.pool.cached[kv.block_hashes(w, 4)[0]].token_ids = (9, 9, 9, 9)
    assert kv.get_computed_blocks(w) == ([], 0)


def test_cache_salt_separates_tenants():
    kv = manager()
    admit(kv, req("0", range(9), salt="alice"))
    assert kv.get_computed_blocks(req("1", range(9), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(req("2", range(9), salt="alice"))[1] == 8


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    kv = manager()
    a = req("0", range(8))
    admit(kv, a)
    with pytest.raises(RuntimeError, match="in use"):
        kv.reset_prefix_cache()
    assert len(kv.pool.cached) == 2
    kv.free(a)
    kv.reset_prefix_cache()
    assert not kv.pool.cached and all(b.block_hash is None for b in kv.pool.blocks)


def test_append_fills_partial_block_before_taking_a_new_one():
    kv = manager()
    r = req("0", range(5))
    admit(kv, r)
    assert kv.get_block_ids("0") == [0, 1]
    for t in range(3):  # decode three tokens: all go into block 1
        r.output_token_ids.append(t)
        assert kv.allocate_slots(r, 1) == []
        r.num_computed_tokens += 1
    r.output_token_ids.append(9)
    assert [b.block_id for b in kv.allocate_slots(r, 1)] == [2]


def test_pool_of_zero_blocks_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)
