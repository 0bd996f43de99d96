"""``Summary``: what a run did, the same from a live run and from its trace (``--headless``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.inspect.cache_miss import CacheMissExplainer
from engine.inspect.cache_miss_groups import GroupedMissExplainer, make_miss_explainer
from engine.inspect.fragmentation import layouts, pool_counts
from engine.inspect.kv_groups import KVCacheGroup
from kvscope.run_audit import RunAudit
from kvscope.sources.base import StepRecord


@dataclass
class Summary:
    requests: dict[str, dict] = field(default_factory=dict)
    peak_usage: float = 0.0
    peak_blocks_used: int = 0
    last: StepRecord | None = None
    decode: Callable[[list[int]], str | None] | None = None  # for the text in the miss explanations
    misses: CacheMissExplainer | GroupedMissExplainer | None = None
    kv_groups: tuple[KVCacheGroup, ...] = ()  # a hybrid model's KV cache groups (a probed vLLM's): who missed
    max_model_len: int = 0  # for the contiguous layout's reservation in ``fragmentation``
    clock: float = 0.0  # seconds of steps so far
    timing: dict[str, list[float]] = field(default_factory=dict)  # rid -> [arrived, first token, last token]
    fragmentation: dict | None = None  # at the step that held the most blocks
    prefix_caching: bool = True  # off: no lookup, so no miss to explain (a "miss" would be a false story)
    run_audit: RunAudit = field(default_factory=RunAudit)  # every step's audit, not the last one's alone

    def _time(self, rec: StepRecord) -> None:
        """Time to first token and decode speed per request, on the clock of summed step seconds."""
        start = self.clock  # a request first seen after a step was there when the step began
        self.clock += rec.seconds
        for r in rec.snapshot.requests:
            t = self.timing.setdefault(r.request_id, [start, -1.0, -1.0, 0])
            if r.num_output_tokens > t[3]:
                if t[3] == 0:
                    t[1] = self.clock
                t[2], t[3] = self.clock, r.num_output_tokens

    def _fragments(self, rec: StepRecord) -> None:
        held = int((rec.snapshot.ref_cnt > 0).sum())
        if self.fragmentation is not None and held <= self.fragmentation["blocks_held"]:
            return
        contiguous, paged = layouts(rec.snapshot, self.max_model_len or rec.snapshot.block_size)
        self.fragmentation = {
            **pool_counts(rec.snapshot),
            "step": rec.step,
            "layouts": {lay.name: lay.counts() for lay in (contiguous, paged)},
        }

    def add(self, rec: StepRecord) -> None:
        self.last = rec
        self.run_audit.add(rec.step, rec.audit)
        self._time(rec)
        self._fragments(rec)
        if self.prefix_caching:
            if self.misses is None:
                self.misses = make_miss_explainer(rec.snapshot.block_size, self.decode, groups=self.kv_groups)
            self.misses.feed_snapshot(rec.step, rec.events, rec.snapshot)
        c = rec.snapshot.counters
        self.peak_usage = max(self.peak_usage, float(c["kv_cache_usage_perc"]))
        used = c["num_blocks"] - c["num_free_blocks"] - c.get("num_reserved_blocks", 0)  # vLLM's null block: not used
        self.peak_blocks_used = max(self.peak_blocks_used, int(used))
        for r in rec.snapshot.requests:
            self.requests[r.request_id] = {
                "request_id": r.request_id,
                "status": r.status.lower(),
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "cached_tokens": r.num_cached_tokens,
                "text": r.text,
            }

    def as_dict(self) -> dict:
        snap = self.last.snapshot
        c = snap.counters
        return {
            "model": snap.model_name,
            "steps": snap.step,
            "num_blocks": snap.num_blocks,
            "block_size": snap.block_size,
            "kv_cache_groups": snap.num_groups,
            "requests": [self._with_miss(r) for r in self.requests.values()],
            "kv_cache_usage_perc": c["kv_cache_usage_perc"],
            "kv_cache_usage_perc_peak": self.peak_usage,
            "blocks_used_peak": self.peak_blocks_used,  # a probed vLLM's null block is reserved, not used
            "num_reserved_blocks": int(c.get("num_reserved_blocks", 0)),
            "prefix_cache_queries": c["prefix_cache_queries"],
            "prefix_cache_hits": c["prefix_cache_hits"],
            "num_preemptions": c["num_preemptions"],
            "cow_copies": c["cow_copies"],
            "evictions": c["evictions"],
            "swap_outs": c["swap_outs"],
            "swap_ins": c["swap_ins"],
            **self._audit_counts(),
            **self._group_counts(),
            "generation_tokens": c["generation_tokens"],
            # every step's: each problem once, with the step it was first seen at (the first 100)
            "audit_problems": self.run_audit.listed(),
            "audit_steps_with_problems": self.run_audit.steps_with_problems,
            "fragmentation": self.fragmentation,
            "prefix_caching": self.prefix_caching,
        }

    def _audit_counts(self) -> dict:
        """``leaked_blocks`` counts leaks only; every flagged block is in ``flagged_blocks`` and each kind of
        problem (a write into a shared block, a wrong ref count, ...) in ``audit_blocks_by_kind``. A trace's
        replay knows the flagged blocks but not their kinds: its ``leaked_blocks`` is then unknown (None)."""
        audit, flagged = self.last.audit, len(self.last.leaked)
        kinds = audit.blocks_by_kind() if audit is not None and audit.problems else {}
        leaked = kinds.get("leaked", 0) if kinds or not flagged else None
        return {"leaked_blocks": leaked, "flagged_blocks": flagged, "audit_blocks_by_kind": kinds}

    def _group_counts(self) -> dict:
        """A hybrid model's: how many requests' first miss each group made (the group with the shortest hit)."""
        if len(self.kv_groups) < 2 or self.misses is None:
            return {}
        missed = [0] * len(self.kv_groups)
        for m in self.misses.misses.values():
            if m is not None and m.group is not None and 0 <= m.group < len(missed):
                missed[m.group] += 1
        return {"prefix_cache_misses_by_group": missed}

    def _with_miss(self, r: dict) -> dict:
        """The request's first prefix-cache miss and its reason (None: not admitted yet, or nothing missed)."""
        miss = self.misses.misses.get(r["request_id"]) if self.misses else None
        arrived, first, last, n = self.timing.get(r["request_id"], (0.0, -1.0, -1.0, 0))
        ttft = first - arrived if first >= 0 else None
        decode = (n - 1) / (last - first) if n > 1 and last > first else None
        return {
            **r,
            "prefix_cache_miss": miss.to_dict() if miss else None,
            "ttft_s": ttft,
            "decode_tokens_per_s": decode,
        }
