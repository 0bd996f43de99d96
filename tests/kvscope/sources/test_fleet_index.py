"""A fleet on hand-made caches (no sockets): who holds which block, the blocks held twice, whether an instance's
hashes can be reproduced, and where a prompt would go, each checked against counts made here independently."""

from __future__ import annotations

import random

import pytest

from engine.core.vllm_hashing import VllmBlockHasher, low64
from engine.inspect.kv_events import WireCleared, WireRemoved, WireStored
from kvscope.sources.fleet_index import FleetIndex, InstanceFeed
from kvscope.sources.fleet_route import RouteAnswer, score
from kvscope.sources.hash_check import HashCheck
from kvscope.sources.remote_cache import RemoteCacheModel

BS = 4
CBOR0 = VllmBlockHasher("sha256_cbor", "0")


class Instance:
    """A model of one engine's cache fed as its KV events would feed it, with its feed of the fleet's index."""

    def __init__(
        self,
        index: FleetIndex,
        place: int,
        name: str,
        hasher: VllmBlockHasher = CBOR0,
        bytes_per_block: int | None = None,
        check: HashCheck | None = None,
    ) -> None:
        self.name, self.hasher = name, hasher
        self.check = check or HashCheck("auto", "0")
        self.model = RemoteCacheModel()
        self.model.listener = InstanceFeed(index, place, name, 1, bytes_per_block, also=self.check)

    def store(self, tokens: list[int], rank: int = 0, medium: str = "GPU") -> list[int]:
        """The prompt's full blocks stored as vLLM sends them: one event, the chain merged."""
        hashes = [low64(d) for d in self.hasher.chain(tokens, BS)]
        n = len(hashes) * BS
        self.model.apply(WireStored(tuple(hashes), None, tuple(tokens[:n]), BS, medium), rank)
        return hashes

    def remove(self, hashes: list[int], medium: str = "GPU") -> None:
        self.model.apply(WireRemoved(tuple(hashes), medium), 0)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def reference_duplication(instances: list[Instance]) -> tuple[int, int]:
    """(hashes held by two or more instances, their copies), counted from the models themselves."""
    held: dict[int, set[str]] = {}
    for inst in instances:
        for _rank, _medium, h in inst.model.nodes:
            held.setdefault(h, set()).add(inst.name)
    multi = [names for names in held.values() if len(names) >= 2]
    return len(multi), sum(len(n) for n in multi)


def test_the_index_counts_the_blocks_held_twice_as_they_come_and_go():
    index = FleetIndex()
    a, b, c = (Instance(index, i, n, bytes_per_block=1000) for i, n in enumerate("abc"))
    system = prompt(1, 5 * BS)
    for inst, tail in ((a, 11), (b, 12), (c, 13)):
        inst.store(system + prompt(tail, 2 * BS))  # the same 5 blocks on all three, 2 of their own
    b.store(system + prompt(11, 2 * BS))  # b also holds a's own two
    d = index.duplication()
    assert (d.blocks, d.copies) == reference_duplication([a, b, c]) == (7, 5 * 3 + 2 * 2)
    assert d.extra_copies == 5 * 2 + 2 and d.extra_bytes == 1000 * d.extra_copies
    assert index.distinct_blocks == 5 + 3 * 2
    assert [index.shared[c] for c in range(3)] == [7, 7, 5]
    # the forest is one tree: the shared blocks once, each holder a copy of the node
    assert index.forest.summary().blocks == index.distinct_blocks and index.forest.summary().roots == 1
    assert index.holder_names(low64(CBOR0.chain(system, BS)[0])) == ["a", "b", "c"]
    # c evicts the system prompt's last block, b restarts (its cache cleared), a's blocks go one by one
    last = [low64(CBOR0.chain(system, BS)[-1])]
    c.remove(last)
    b.model.apply(WireCleared(), 0)
    d = index.duplication()
    assert (d.blocks, d.copies) == reference_duplication([a, b, c]) == (4, 8)
    assert index.holder_names(last[0]) == ["a"] and index.shared == [4, 0, 4]
    for h in list(a.model.cached()):
        a.remove([h])
    assert index.duplication().blocks == 0 and index.shared == [0, 0, 0]
    assert index.distinct_blocks == len(c.model.nodes) == index.forest.summary().blocks


def test_one_instance_holding_a_block_in_two_media_is_one_holder():
    index = FleetIndex()
    a, b = Instance(index, 0, "a"), Instance(index, 1, "b")
    hashes = a.store(prompt(2, 2 * BS))
    a.store(prompt(2, 2 * BS), medium="CPU")  # vLLM's CPU offloading publishes the same hashes on a second tier
    assert index.duplication().blocks == 0 and index.holder_names(hashes[0]) == ["a"]
    b.store(prompt(2, 2 * BS))
    assert index.duplication().blocks == 2
    a.remove(hashes)  # the GPU copies go; the CPU ones keep a a holder
    assert index.duplication().blocks == 2 and index.holder_names(hashes[0]) == ["a", "b"]


def test_holders_are_named_in_fleet_order_whichever_instance_spoke_first():
    """Each instance's cache joins the index at its first event, and two instances' sockets race for that: the
    holders are still named in fleet order (a window's "held by a, b" read "held by b, a" on one run)."""
    index = FleetIndex()
    a, b = Instance(index, 0, "a"), Instance(index, 1, "b")
    hashes = b.store(prompt(2, 2 * BS))  # b first
    a.store(prompt(2, 2 * BS))
    assert index.holder_names(hashes[0]) == ["a", "b"]


def test_bytes_of_duplicates_with_different_block_sizes_and_unknown_ones():
    index = FleetIndex()
    a, b = Instance(index, 0, "a", bytes_per_block=100), Instance(index, 1, "b", bytes_per_block=300)
    a.store(prompt(3, 2 * BS))
    b.store(prompt(3, 2 * BS))
    assert index.duplication().extra_bytes == 2 * 100  # the larger copy kept, the other counted
    Instance(index, 2, "c").store(prompt(3, 2 * BS))  # no bytes per block given
    assert index.duplication().extra_bytes is None
    empty = FleetIndex()
    assert empty.duplication().extra_bytes == 0 and empty.duplication().blocks == 0


# --- can an instance's hashes be reproduced? --------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"])
def test_auto_finds_the_algorithm_from_the_first_block(algo):
    check = HashCheck("auto", "0")
    inst = Instance(FleetIndex(), 0, "a", VllmBlockHasher(algo, "0"), check=check)
    assert check.why_not() == "no first block of a prompt seen yet: its hashing is not known"
    inst.store(prompt(4, 3 * BS))
    assert check.why_not() is None and check.scheme.algo == algo and check.reproduced == 3 and check.failed == 0
    assert check.as_dict()["reproducible"] is True


@pytest.mark.parametrize(
    "check,hasher,says",
    [
        (HashCheck("auto", "1"), CBOR0, "seed '1'"),
        (HashCheck("auto"), CBOR0, "PYTHONHASHSEED unset"),
        (HashCheck("sha256", "0"), CBOR0, "not vLLM's sha256 with seed '0'"),
        (HashCheck("auto", "0", block_size=8), CBOR0, "hold 4 tokens, not the block size 8"),
        (HashCheck("xxhash_cbor"), CBOR0, "xxhash_cbor hashes cannot be reproduced without its PYTHONHASHSEED"),
    ],
)
def test_a_setup_that_cannot_be_reproduced_is_said_in_one_line(check, hasher, says):
    inst = Instance(FleetIndex(), 0, "a", hasher, check=check)
    inst.store(prompt(5, 3 * BS))
    why = check.why_not()
    assert why and says in why and "\n" not in why
    assert check.as_dict()["reproducible"] is False
    s = score("a", inst.model, check, prompt(5, 3 * BS), True)
    assert s.blocks is None and s.note == why  # said, never scored as a miss


def test_a_block_with_extra_keys_is_counted_but_does_not_undo_the_verdict():
    check = HashCheck("auto", "0")
    inst = Instance(FleetIndex(), 0, "a", check=check)
    inst.store(prompt(6, 2 * BS))
    salted = [low64(d) for d in CBOR0.chain(prompt(7, BS), BS, cache_salt="tenant")]
    inst.model.apply(WireStored(tuple(salted), None, tuple(prompt(7, BS)), BS), 0)
    assert check.why_not() is None and (check.reproduced, check.failed) == (2, 1)
    assert "1 not (extra keys" in check.describe()


# --- where would it go ------------------------------------------------------------------------


def reference_prefix(held: set[int], tokens: list[int]) -> int:
    n = 0
    for d in CBOR0.chain(tokens, BS):
        if low64(d) not in held:
            break
        n += 1
    return n


def test_each_instance_scores_its_longest_cached_prefix_and_the_longest_wins():
    index = FleetIndex()
    a, b, c, e = (Instance(index, i, n) for i, n in enumerate("abce"))
    p = prompt(8, 6 * BS + 3)  # six full blocks and a partial one
    a.store(p[: 2 * BS])
    b.store(p[: 5 * BS])
    c.store(p)
    c.remove([low64(CBOR0.chain(p, BS)[0])])  # c lost the first block: nothing after it can be hit
    scores = {x.name: score(x.name, x.model, x.check, p, True) for x in (a, b, c, e)}
    for x in (a, b, c):
        assert scores[x.name].blocks == reference_prefix(x.model.cached(), p)
    assert [scores[n].blocks for n in "abce"] == [2, 5, 0, 0] and scores["b"].tokens == 5 * BS
    assert scores["e"].note == "" and scores["b"].prompt_blocks == 6
    ans = RouteAnswer(len(p), tuple(scores.values()))
    assert ans.best == ("b",) and ans.line().startswith("b: 5 of its 6 full blocks cached (20 of 27 prompt tokens)")
    assert ans.path == {low64(d) for d in CBOR0.chain(p, BS)}


def test_ties_an_instance_that_is_down_and_a_prompt_nobody_holds():
    index = FleetIndex()
    a, b, c = (Instance(index, i, n) for i, n in enumerate("abc"))
    p = prompt(9, 3 * BS)
    for x in (a, b, c):
        x.store(p)
    tie = RouteAnswer(
        len(p),
        (
            score("a", a.model, a.check, p, True),
            score("b", b.model, b.check, p, True),
            score("c", c.model, c.check, p, False),
        ),
    )
    assert tie.best == ("a", "b") and "a tie between a, b" in tie.line()  # c is down: not where it would go
    assert tie.scores[2].blocks == 3 and "not connected" in tie.scores[2].note
    other = prompt(10, 3 * BS)
    none = RouteAnswer(len(other), tuple(score(x.name, x.model, x.check, other, True) for x in (a, b, c)))
    assert none.best == () and "no instance holds its first block" in none.line()
    short = prompt(11, BS - 1)  # not one full block
    assert score("a", a.model, a.check, short, True).blocks == 0


def test_an_instance_on_two_data_parallel_ranks_scores_its_best_rank():
    index = FleetIndex()
    a = Instance(index, 0, "a")
    p = prompt(12, 4 * BS)
    a.store(p[:BS], rank=0)
    a.store(p[: 3 * BS], rank=1)
    assert score("a", a.model, a.check, p, True).blocks == 3
