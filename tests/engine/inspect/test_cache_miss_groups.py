"""Which KV cache group missed (a hybrid model's prefix-cache miss): the group with the shortest own hit, told
by its kind; a full-attention group's miss told as with one group, from that group's blocks only."""

from __future__ import annotations

from types import SimpleNamespace

from engine.inspect.cache_miss import CacheMissExplainer
from engine.inspect.cache_miss_groups import GroupedMissExplainer, make_miss_explainer
from engine.inspect.events import BlockStored, RequestAdmitted
from engine.inspect.kv_groups import KVCacheGroup, grouped_hash, hash_group, hash_hex, name_of, primary_group
from engine.inspect.snapshot import RequestInfo

BS = 4
GROUPS = (KVCacheGroup("sliding_window", BS, window=8), KVCacheGroup("full", BS))  # vLLM's order: full last
A = tuple(range(5, 22))  # 4 full blocks + 1 token


def stored(tokens, group: int, first_block: int, blocks: range) -> list[BlockStored]:
    """The group's stored blocks of ``tokens`` (a sliding window's group stores only some: ``blocks``)."""
    out = []
    for j in blocks:
        parent = grouped_hash(f"{j - 1:016x}", group) if j else None
        out.append(
            BlockStored(first_block + j, grouped_hash(f"{j:016x}", group), "a", tokens[j * BS : (j + 1) * BS], parent)
        )
    return out


def snap_with(rid: str, prompt, hits: tuple[int, ...]):
    row = RequestInfo(rid, 1, "RUNNING", len(prompt), 0, 0, 0, (), "", tuple(prompt), group_hits=hits)
    return SimpleNamespace(requests=(row,), request=lambda r: row if r == rid else None, block_size=BS)


def test_a_groups_key_carries_its_group_and_group_0_stays_plain_hex():
    assert grouped_hash("00ab", 0) == "00ab" and hash_group("00ab") == 0
    assert grouped_hash("00ab", 2) == "00ab/g2" and hash_group("00ab/g2") == 2 and hash_hex("00ab/g2") == "00ab"
    assert primary_group(GROUPS) == 1 and name_of(GROUPS, 0) == "group 0 (sliding window (8 tokens))"
    assert isinstance(make_miss_explainer(BS), CacheMissExplainer)
    assert isinstance(make_miss_explainer(BS, groups=GROUPS), GroupedMissExplainer)


def test_the_group_with_the_shortest_own_hit_is_the_one_that_missed():
    ex = GroupedMissExplainer(GROUPS)
    # the full group cached all 4 blocks; the window group only its last window (blocks 2 and 3)
    ex.feed_snapshot(1, stored(A, 1, 10, range(4)) + stored(A, 0, 20, range(2, 4)), snap_with("x", (), ()))
    # the window group alone reaches 8 tokens (a window ending at block 1 is not cached), the full group 16
    ex.feed_snapshot(2, [RequestAdmitted("b", len(A), 8)], snap_with("b", A, (8, 16)))
    m = ex.misses["b"]
    assert (m.group, m.reason, m.group_hits, m.token_position) == (0, "window_not_cached", (8, 16), 8)
    assert "group 0 (sliding window (8 tokens)) missed" in m.detail and "group 1 (full attention) 16" in m.detail
    assert m.to_dict()["group"] == 0 and m.to_dict()["group_hits"] == [8, 16]


def test_a_full_attention_groups_own_miss_is_told_from_its_blocks_only():
    ex = GroupedMissExplainer(GROUPS)
    # both groups cached the first block only; group 0 also holds a block for A's third block (the window's):
    # the full group's chain ends at block 1, so its explainer says nothing cached continues there
    ex.feed_snapshot(1, stored(A, 1, 10, range(1)) + stored(A, 0, 20, range(0, 3)), snap_with("x", (), ()))
    ex.feed_snapshot(2, [RequestAdmitted("b", len(A), 4)], snap_with("b", A, (12, 4)))
    m = ex.misses["b"]
    assert (m.group, m.reason, m.block_index) == (1, "no_cached_block", 1)
