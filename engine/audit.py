"""``audit()``: recompute every block's ref count from the live tables and compare."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .kv_cache_utils import KVCacheBlock


@dataclass(frozen=True, slots=True)
class AuditProblem:
    block_id: int
    problem: str  # leaked | use_after_free | ref_mismatch | double_free | not_in_free_queue | hash_map
    expected_ref: int
    actual_ref: int
    last_owner: str = ""

    def __str__(self) -> str:
        owner = f", last owned by request {self.last_owner}" if self.last_owner else ""
        return (f"block {self.block_id}: {self.problem} (ref count {self.actual_ref}, "
                f"tables hold {self.expected_ref}{owner})")


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

    def __str__(self) -> str:
        return "audit clean" if self.ok else "\n".join(map(str, self.problems))


def audit_pool(pool: BlockPool, tables: dict[str, list[KVCacheBlock]]) -> AuditReport:
    expected: Counter[int] = Counter()
    for blocks in tables.values():
        for b in blocks:
            expected[b.block_id] += 1
    problems: list[AuditProblem] = []
    seen: Counter[int] = Counter()
    for b in pool.free_queue:
        seen[b.block_id] += 1
        if seen[b.block_id] > 1:  # a cycle or a block queued twice: stop walking
            problems.append(AuditProblem(b.block_id, "double_free", expected[b.block_id], b.ref_cnt, b.last_owner))
            break
    for b in pool.blocks:
        exp, ref = expected[b.block_id], b.ref_cnt
        if ref != exp:
            kind = ("leaked" if exp == 0 else "use_after_free" if ref == 0 else "ref_mismatch")
            problems.append(AuditProblem(b.block_id, kind, exp, ref, b.last_owner))
        queued = seen[b.block_id] > 0
        if ref == 0 and not queued:
            problems.append(AuditProblem(b.block_id, "not_in_free_queue", exp, ref, b.last_owner))
        elif ref > 0 and queued and exp > 0:
            problems.append(AuditProblem(b.block_id, "use_after_free", exp, ref, b.last_owner))
        if b.block_hash is not None and pool.cached.get(b.block_hash) is not b:
            problems.append(AuditProblem(b.block_id, "hash_map", exp, ref, b.last_owner))
    if pool.free_queue.num_free_blocks != sum(seen.values()):
        problems.append(AuditProblem(-1, "double_free", 0, 0))
    return AuditReport(tuple(problems))
