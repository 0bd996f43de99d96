"""What an ``LLMEngine`` lets a person see: its counters (vLLM's metric names), the audit of its pool (ref
counts recomputed from the block tables, and with the write audit every write into a shared or published
block), and its state as a snapshot (copied) or a live state (what the engine process sends).
"""

from __future__ import annotations

from operator import attrgetter

from .core.request import Request
from .inspect.audit import AuditProblem, AuditReport, audit_pool
from .inspect.events import LeakFound
from .inspect.snapshot import KVSnapshot, LiveRow, LiveState, PoolState, RequestInfo, pool_state, request_info
from .request_groups import MAX_FINISHED


class EngineInspection:
    """``LLMEngine``'s inspection (a mixin over the engine's pool, KV cache manager, scheduler and runner)."""

    def metrics(self) -> dict[str, float]:
        kv = self.kv
        return {
            "kv_cache_usage_perc": self.pool.usage(),
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_blocks": len(self.pool.cached),
            "num_blocks": self.pool.num_blocks,
            "evictions": self.pool.num_evictions,
            "cow_copies": kv.num_cow_copies,
            "swap_outs": kv.num_swap_outs,
            "swap_ins": kv.num_swap_ins,
            "num_requests_swapped": len(self.scheduler.swapped),
            "num_cpu_blocks": kv.cpu_pool.num_blocks,
            "num_free_cpu_blocks": kv.cpu_pool.num_free_blocks,
            "generation_tokens": self.num_generated_tokens,
            "prompt_tokens": self.num_prompt_tokens_computed,
            "num_requests_finished": sum(self.request_groups.num_finished.values()),
            "num_failed_steps": self.num_failed_steps,
            "step": self.step_count,
        }

    def enable_write_audit(self) -> None:
        """Check every block a step writes before the forward: a write into a block with ref count > 1
        or with a hash published by an earlier step corrupts KV that others read (``audit`` reports it)."""
        self.runner.write_observer = self._check_writes

    def _check_writes(self, writes: list[tuple[str, int]]) -> None:
        # Blocks published by this very step are being filled by it (requests admitted in the same step
        # may already hold them: the forward writes every slot before any attention reads it).
        publishing = {id(b) for b, _ in self.pool.tentative}
        for rid, bid in writes:
            b = self.pool.blocks[bid]
            if id(b) in publishing:
                continue
            if b.ref_cnt > 1 or b.block_hash is not None:
                why = f"ref count {b.ref_cnt}" if b.ref_cnt > 1 else "published hash"
                self.write_problems.setdefault(
                    (bid, rid),
                    AuditProblem(
                        bid,
                        "shared_write",
                        1,
                        b.ref_cnt,
                        f"{rid}, step {self.step_count}: write into a block with {why}",
                    ),
                )

    def audit(self, emit_events: bool = False) -> AuditReport:
        """Recompute ref counts from the tables; with ``emit_events``, each new problem becomes a leak event.

        With ``enable_write_audit``, writes into shared or published blocks are problems too."""
        report = audit_pool(self.pool, self.kv.req_to_blocks, self.ledger)
        if self.write_problems:
            report = AuditReport(report.problems + tuple(self.write_problems.values()))
        if emit_events:
            for p in report.problems:
                key = (p.block_id, p.problem)
                if key not in self.reported_problems:
                    self.reported_problems.add(key)
                    self.ledger.events.append(LeakFound(p.block_id, str(p)))
        return report

    def snapshot(self, max_finished: int = MAX_FINISHED) -> KVSnapshot:
        """A copy of the pool and of the live (and last ``max_finished``, at most 64) finished requests."""
        return self.pool_state(max_finished).assembled()

    def pool_state(self, max_finished: int = MAX_FINISHED) -> PoolState:
        """What ``snapshot`` is derived from, without the derived views, copied."""
        return pool_state(
            self.step_count,
            self.config.block_size,
            self.ledger,
            [self._snapshot_row(r) for r in self._shown(max_finished)],
            self.metrics(),
            self.kv.cpu_pool.num_blocks,
            block_bytes=self.runner.block_bytes,
            model_name=self.model_name,
        )

    def live_state(self, max_finished: int = MAX_FINISHED) -> LiveState:
        """The state now, not copied (what an engine process sends): the live requests' rows as ``LiveRow``s
        (the wire sends their changes), the pool's blocks per state as it counts them, the pool itself."""
        live, rows = self._live_rows, []
        for r in self._shown(max_finished):
            if r.snapshot_row is None and not r.status.finished:
                row = live.get(r.request_id)
                if row is None or row.request is not r:
                    row = live[r.request_id] = LiveRow(r, self.kv)
                rows.append(row)
            else:
                rows.append(self._snapshot_row(r))
        if len(live) > 2 * len(self.requests) + 64:  # rows of requests that ended, dropped now and then
            self._live_rows = {rid: row for rid, row in live.items() if rid in self.requests}
        rows.sort(key=attrgetter("index"))
        return LiveState(
            self.step_count,
            self.config.block_size,
            tuple(rows),
            self.metrics(),
            self.ledger.state_counts(),
            self.kv.cpu_pool.num_blocks,
            self.runner.block_bytes,
            self.model_name,
            self.ledger,
        )

    def _shown(self, max_finished: int) -> list[Request]:
        """The requests a snapshot shows: the live ones, then the last ``max_finished`` finished."""
        finished = list(self.finished_log)
        return list(self.requests.values()) + finished[max(0, len(finished) - max_finished) :]

    def _snapshot_row(self, r: Request) -> RequestInfo:
        """A finished request's row never changes again: it is built once, not at every snapshot."""
        row = r.snapshot_row
        if row is not None:
            return row
        row = request_info(r, self.kv.block_ids_view(r.request_id))  # request_info copies it
        if r.status.finished:
            r.snapshot_row = row
        return row
