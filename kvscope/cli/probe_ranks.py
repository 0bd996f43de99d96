"""``--headless --probe``: a summary of every data-parallel rank of the probed vLLM, not only the one shown.

The rank at ``--probe ADDR`` is headless's own ``Summary``; every other rank's records come through the
source's ``on_rank_record`` into a ``Summary`` of their own. ``dp_ranks`` lists each rank's counts and audit,
``requests_seen`` counts every rank's requests (a request runs on one rank: the front end picks it).
"""

from __future__ import annotations

from collections.abc import Callable

from kvscope.sources.base import StepRecord
from kvscope.sources.summary import Summary

# what each rank's entry of dp_ranks keeps of its summary (those the summary has)
RANK_KEYS = (
    "steps",
    "num_blocks",
    "block_size",
    "kv_cache_groups",
    "blocks_used_peak",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "leaked_blocks",
    "flagged_blocks",
    "audit_problems",
    "audit_steps_with_problems",
)


class RankSummaries:
    def __init__(self, source, shown: Summary, make: Callable[[], Summary]) -> None:
        self.source = source
        self.make = make
        self.by_rank: dict[int, Summary] = {source.shown_rank: shown}
        source.on_rank_record = self.add

    def add(self, rank: int, rec: StepRecord) -> None:
        s = self.by_rank.get(rank)
        if s is None:
            s = self.by_rank[rank] = self.make()
        s.add(rec)

    def as_dict(self) -> dict:
        ranks, seen = [], set()
        for r, probe in sorted(self.source.ranks.items()):
            entry = {"rank": r, "endpoint": probe.endpoint, "answered": probe.loaded, "requests_seen": 0}
            s = self.by_rank.get(r)
            if s is not None and s.last is not None:
                full = s.as_dict()
                entry.update({k: full[k] for k in RANK_KEYS if k in full})
                entry["requests_seen"] = len(s.requests)
                seen.update(s.requests)
            ranks.append(entry)
        return {"dp_ranks": ranks, "requests_seen": len(seen)}
