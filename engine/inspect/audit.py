"""``audit()``: recompute every block's ref count from the live tables and compare."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import islice, repeat
from operator import attrgetter, is_not

import numpy as np

from ..core.block_pool import BlockPool
from ..core.kv_cache_utils import KVCacheBlock
from .pool_ledger import PoolLedger


@dataclass(frozen=True, slots=True)
class AuditProblem:
    block_id: int
    problem: str  # leaked | use_after_free | ref_mismatch | double_free | not_in_free_queue | hash_map
    expected_ref: int
    actual_ref: int
    last_owner: str = ""  # the request to blame (see _culprit)
    group: str = ""  # a hybrid model's KV cache group whose table held the block ("group 1 (full attention)")

    def __str__(self) -> str:
        owner = f", request {self.last_owner}" if self.last_owner else ""
        owner += f", KV cache {self.group}" if self.group else ""
        if self.problem in WRITE_PROBLEMS:  # the ref count is right: what is wrong is the write into the block
            return (
                f"block {self.block_id}: {self.problem} (request {self.last_owner}: other requests read "
                f"it, or will from the prefix cache, so it needed a copy first; its ref count is right)"
            )
        return (
            f"block {self.block_id}: {self.problem} (ref count {self.actual_ref}, "
            f"tables hold {self.expected_ref}{owner})"
        )


WRITE_PROBLEMS = frozenset({"shared_write"})  # a write's problem, not a ref count's


# What each kind of problem is called where a user reads it (the window's banner and legend, --headless).
PROBLEM_NAMES = {
    "leaked": "leaked",
    "use_after_free": "used after its free",
    "ref_mismatch": "wrong ref count",
    "double_free": "freed twice",
    "not_in_free_queue": "missing from the free queue",
    "hash_map": "wrong in the hash map",
    "shared_write": "written while shared",
}


@dataclass(frozen=True, slots=True)
class AuditReport:
    problems: tuple[AuditProblem, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def leaked_blocks(self) -> list[int]:
        return sorted({p.block_id for p in self.problems if p.problem == "leaked"})

    @property
    def bad_blocks(self) -> list[int]:
        return sorted({p.block_id for p in self.problems})

    def kinds_names(self) -> str:
        """The kinds of problem alone ("written while shared", "leaked, freed twice"): the legend's red class."""
        return ", ".join(
            dict.fromkeys(PROBLEM_NAMES.get(p.problem, p.problem.replace("_", " ")) for p in self.problems)
        )

    def block_kinds(self) -> dict[int, str]:
        """Each flagged block's kinds of problem in words (what the grid writes on a red block)."""
        kinds: dict[int, dict[str, None]] = {}
        for p in self.problems:
            kinds.setdefault(p.block_id, {})[PROBLEM_NAMES.get(p.problem, p.problem.replace("_", " "))] = None
        return {b: ", ".join(k) for b, k in kinds.items()}

    def blocks_by_kind(self) -> dict[str, int]:
        """How many blocks each kind of problem flags (a block with two kinds counts in both)."""
        kinds: dict[str, set[int]] = {}
        for p in self.problems:
            kinds.setdefault(p.problem, set()).add(p.block_id)
        return {k: len(ids) for k, ids in kinds.items()}

    def kinds_text(self) -> str:
        """The problems by kind, in words: "1 block written while shared", "2 blocks leaked, 1 freed twice"."""
        return self.kinds_words(self.blocks_by_kind()) or "clean"

    @staticmethod
    def kinds_words(by_kind: dict[str, int]) -> str:
        """``blocks_by_kind`` in words (also what ``--headless`` prints from the JSON's counts)."""
        return ", ".join(
            f"{n} block{'s' if n > 1 else ''} {PROBLEM_NAMES.get(k, k.replace('_', ' '))}" for k, n in by_kind.items()
        )

    def __str__(self) -> str:
        return "audit clean" if self.ok else "\n".join(map(str, self.problems))


def ref_problem(ref: int, expected: int) -> str | None:
    """What is wrong with a block whose ref count is ``ref`` while its tables hold ``expected`` references:
    too many, one will never be dropped (a leak); too few, the block can be handed out while a table still
    reads it (use after free); negative, it was freed twice. The rule for kvscope's pool and a probed vLLM's."""
    if ref == expected:
        return None
    return "double_free" if ref < 0 else "leaked" if ref > expected else "use_after_free"


def queue_problem(ref: int, expected: int, queued: bool) -> str | None:
    """What is wrong with a block's place on the free queue: a free block must be queued, a held one not."""
    if ref == 0 and not queued:
        return "not_in_free_queue"
    if ref > 0 and queued and expected > 0:
        return "use_after_free"
    return None


def suspect_blocks(refs: np.ndarray, expected: np.ndarray, queued: np.ndarray) -> np.ndarray:
    """``ref_problem`` and ``queue_problem`` over every block at once (numpy arrays indexed by block id): where
    either could find something. kvscope's pool and a probed vLLM's mirror scan with it, then run the rules on
    those blocks alone."""
    return (refs != expected) | ((refs == 0) & ~queued) | ((refs > 0) & queued & (expected > 0))


def _culprit(ledger: PoolLedger, block_id: int, mapped_by: set[str], too_many: bool) -> str:
    """The request to blame: a holder whose table lost the block (a leak), else the last releaser."""
    if too_many:
        stray = [h for h in ledger.holders_of(block_id) if h not in mapped_by]
        return stray[-1] if stray else ledger.last_owner[block_id]
    return ledger.last_released_by[block_id] or ledger.last_owner[block_id]


def audit_pool(pool: BlockPool, tables: dict[str, list[KVCacheBlock]], ledger: PoolLedger) -> AuditReport:
    """Every block's ref count against the tables that hold it, the free queue against ref count 0, and
    the hash map against the blocks' hashes; ``ledger`` (the pool's record) names the request to blame.

    Every step audits the whole pool, so the scan is done by C loops (``map`` over the blocks' slots, numpy over
    the counts): only the blocks it finds suspect go through the rules one by one (``_audit_blocks``). A free
    queue that is not a plain list of distinct blocks (a block queued twice, a cycle) takes the walk that names
    where it breaks (``_audit_walking``)."""
    blocks = pool.blocks
    n = len(blocks)
    walk = [b.block_id for b in islice(pool.free_queue, n + 1)]  # a cycle ends after n + 1
    queued = np.bincount(np.fromiter(walk, np.int64, len(walk)), minlength=n)
    if len(walk) > n or (walk and queued.max() > 1):
        return _audit_walking(pool, tables, ledger)
    held = [b.block_id for t in tables.values() for b in t]
    expected = np.bincount(np.fromiter(held, np.int64, len(held)), minlength=n)
    refs = np.fromiter(map(_REF, blocks), np.int64, n)
    on_queue = queued > 0
    suspect = suspect_blocks(refs, expected, on_queue)
    hashes = list(map(_HASH, blocks))
    hashed = np.flatnonzero(np.fromiter(map(is_not, hashes, repeat(None)), bool, n))
    if hashed.size:
        ids = hashed.tolist()
        wrong = map(is_not, map(pool.cached.get, map(hashes.__getitem__, ids)), map(blocks.__getitem__, ids))
        suspect[hashed[np.fromiter(wrong, bool, len(ids))]] = True
    problems = _audit_blocks(pool, tables, ledger, np.flatnonzero(suspect).tolist(), expected, on_queue)
    if pool.free_queue.num_free_blocks != len(walk):
        problems.append(AuditProblem(-1, "double_free", 0, 0))
    return AuditReport(tuple(problems))


_REF, _HASH = attrgetter("ref_cnt"), attrgetter("block_hash")


def _holders(tables: dict[str, list[KVCacheBlock]], block_ids: set[int]) -> dict[int, set[str]]:
    """The requests whose tables hold each of ``block_ids``."""
    mapped_by: dict[int, set[str]] = {}
    for rid, blocks in tables.items():
        for b in blocks:
            if b.block_id in block_ids:
                mapped_by.setdefault(b.block_id, set()).add(rid)
    return mapped_by


def _audit_blocks(pool: BlockPool, tables, ledger: PoolLedger, ids: list[int], expected, queued) -> list[AuditProblem]:
    """The rules, block by block, over ``ids`` (ascending): ``expected`` and ``queued`` indexed by block id."""
    problems: list[AuditProblem] = []
    if not ids:
        return problems
    owner = ledger.last_owner
    mapped_by = _holders(tables, set(ids))
    for i in ids:
        b = pool.blocks[i]
        exp, ref = int(expected[i]), b.ref_cnt
        kind = ref_problem(ref, exp)
        if kind is not None:
            problems.append(AuditProblem(i, kind, exp, ref, _culprit(ledger, i, mapped_by.get(i, set()), ref > exp)))
        kind = queue_problem(ref, exp, bool(queued[i]))
        if kind is not None:
            problems.append(AuditProblem(i, kind, exp, ref, owner[i]))
        if b.block_hash is not None and pool.cached.get(b.block_hash) is not b:
            problems.append(AuditProblem(i, "hash_map", exp, ref, owner[i]))
    return problems


def _audit_walking(pool: BlockPool, tables: dict[str, list[KVCacheBlock]], ledger: PoolLedger) -> AuditReport:
    """The audit of a broken free queue: walked block by block up to the first block seen twice (a cycle or a
    double free), then every block by the rules."""
    expected: Counter[int] = Counter()
    for blocks in tables.values():
        for b in blocks:
            expected[b.block_id] += 1
    problems: list[AuditProblem] = []
    seen: Counter[int] = Counter()
    for b in pool.free_queue:
        seen[b.block_id] += 1
        if seen[b.block_id] > 1:  # a cycle or a block queued twice: stop walking
            problems.append(
                AuditProblem(b.block_id, "double_free", expected[b.block_id], b.ref_cnt, ledger.last_owner[b.block_id])
            )
            break
    n = len(pool.blocks)
    exp = [expected[i] for i in range(n)]
    problems += _audit_blocks(pool, tables, ledger, list(range(n)), exp, [seen[i] > 0 for i in range(n)])
    if pool.free_queue.num_free_blocks != sum(seen.values()):
        problems.append(AuditProblem(-1, "double_free", 0, 0))
    return AuditReport(tuple(problems))
