"""The probe inside vLLM's engine core: the scheduler's pool as it changes, to every subscriber.

The engine core's thread runs the scheduler. Each ``update_from_output`` ends a step: the probe takes the
recorder's ops, the rows of the requests that changed, and sends one ``Step``. Everything the scheduler does
runs under the probe's lock, so the probe's own I/O thread (which answers subscribers, sends keyframes and
flushes what changed between two steps, an abort say) always reads the pool between two operations, never
in the middle of one. The engine core waits in ``schedule()`` while a subscriber holds a pause.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from . import __version__
from .faults import Faults
from .gate import Gate
from .probe_io import ProbeIO
from .recorder import Recorder
from .rows import RowTracker
from .security import Access
from .wire import Held, Keyframe, PoolInfo, Step, encode, group_of, hash64

logger = logging.getLogger("kvscope_vllm_probe")


class Probe:
    def __init__(
        self,
        scheduler,
        endpoint: str,
        vllm_version: str,
        fault: str = "",
        access: Access | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        """``endpoint``: this rank's (``endpoints.rank_endpoint``); ``access``: what subscribers may do (read-only
        by default; ``security.access_from_env`` reads it, and refuses a network endpoint without keys)."""
        self.scheduler = scheduler
        self.endpoint = endpoint
        self.vllm_version = vllm_version
        self.access = access or Access()
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.instance = uuid.uuid4().hex[:12]
        self.lock = threading.RLock()
        self.gate = Gate()
        pool = scheduler.kv_cache_manager.block_pool
        self.pool = pool
        self.managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        self.block_size = _block_size(scheduler, self.managers)
        self.recorder = Recorder(scheduler, self.block_size)
        self.faults = Faults(scheduler.kv_cache_manager)
        if fault:
            self.faults.set(fault, True)
        self.recorder.before_free = self.faults.before_free
        null = getattr(pool, "null_block", None)
        self.rows = RowTracker(scheduler, self.recorder.groups, null.block_id if null is not None else -1)
        self.seq = 0
        self.step = 0
        self.in_step = False
        self._t0 = 0.0
        self.notes = _notes(scheduler)
        self.recorder.install()
        self.io = ProbeIO(self)
        self.io.start()
        a = self.access
        logger.info(
            "kvscope probe %s: publishing vLLM %s's block pool (%d blocks of %d tokens) at %s%s (%s; %s%s)%s",
            __version__,
            vllm_version,
            len(pool.blocks),
            self.block_size,
            endpoint,
            f" for data-parallel rank {dp_rank} of {dp_size}" if dp_size > 1 else "",
            "CURVE keys" if a.keys else "loopback, no keys",
            "pause and step allowed" if a.control else "read-only",
            ", faults from subscribers allowed" if a.remote_faults else "",
            f"; fault {fault} on" if fault else "",
        )
        for note in self.notes:
            logger.warning("kvscope probe: %s", note)

    # -- the engine core's thread -----------------------------------------------------------------------
    def before_schedule(self) -> None:
        self.gate.wait_turn()
        self._t0 = time.perf_counter()
        self.in_step = True

    def end_step(self) -> None:
        """At the end of ``update_from_output`` (under the lock): one ``Step`` to every subscriber."""
        self.step += 1
        self.in_step = False
        msg = self._take_step(between=False)
        if msg is not None:
            self.io.post(encode(msg), now=False)  # may wait a few steps to go with the next (ProbeIO.post)
        if self.gate.holding:
            self.io.post(encode(Held(True, self.step, self.gate.holder)))

    def _take_step(self, between: bool) -> Step | None:
        """What changed since the last take, as a ``Step`` (None when nobody listens: the ops are dropped and
        the next subscriber starts from a keyframe)."""
        ops, touched, admissions = self.recorder.take()
        self.rows.count_admissions(admissions)  # vLLM's counters count from its start, listened to or not
        if not self.io.has_subscribers:
            self.rows.forget()
            return None
        if between and not ops and not touched and not self.rows.pending:
            return None
        rows, advanced, gone = self.rows.changed(touched, self.recorder, pool_still=not ops)
        deferred = self.rows.deferred_if_changed()
        self.seq += 1
        seconds = 0.0 if between else time.perf_counter() - self._t0
        return Step(
            self.seq,
            self.step,
            seconds,
            ops,
            rows,
            gone,
            deferred,
            self.counters(),
            self.gate.paused,
            between,
            advanced,
            self.recorder.take_pins(),
            self.rows.grown,
            self.rows.nulled,
            self.rows.run_ids,
            self.rows.run_tokens,
            self.rows.run_computed,
        )

    def counters(self) -> dict[str, float]:
        s, pool = self.scheduler, self.pool
        free = pool.free_block_queue.num_free_blocks
        total = len(pool.blocks) - 1  # vLLM does not count the null block
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.requests) - len(s.running),
            "num_free_blocks": free,
            "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
            "prefix_cache_queries": self.rows.queries,
            "prefix_cache_hits": self.rows.hits,
            "num_preemptions": self.recorder.preemptions,
            "hash_map_size": len(pool.cached_block_hash_to_block),
            "vllm_step": self.step,
        }

    # -- the I/O thread (under the lock) ----------------------------------------------------------------
    def flush_between(self) -> bytes | None:
        """Changes made between two steps (an abort, a request added), if any, as an encoded ``Step``."""
        if self.in_step:
            return None
        msg = self._take_step(between=True)
        return encode(msg) if msg is not None else None

    def keyframe(self) -> Keyframe:
        pool, rec = self.pool, self.recorder
        blocks = pool.blocks
        hashes, hash_groups = [], []
        for b in blocks:
            h = b._block_hash
            if h is not None and b.block_id >= 0:
                hashes.append((b.block_id, hash64(h), rec.tokens_of.get(b.block_id, [])))
                hash_groups.append(group_of(h))
        entries = _map_entries(pool)
        free, node = [], pool.free_block_queue.fake_free_list_head.next_free_block
        while node is not None and node.block_id >= 0:  # the fake tail has id -1
            free.append(node.block_id)
            node = node.next_free_block
        s = self.scheduler
        cfg = getattr(s, "vllm_config", None)
        info = PoolInfo(
            model=str(getattr(getattr(cfg, "model_config", None), "model", "")),
            vllm_version=self.vllm_version,
            block_size=self.block_size,
            num_blocks=len(blocks),
            null_block=pool.null_block.block_id if getattr(pool, "null_block", None) is not None else -1,
            enable_caching=bool(pool.enable_caching),
            hash_algo=str(getattr(getattr(cfg, "cache_config", None), "prefix_caching_hash_algo", "")),
            num_kv_groups=len(self.managers),
            async_scheduling=bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False)),
            max_model_len=int(getattr(getattr(cfg, "model_config", None), "max_model_len", 0) or 0),
            fault=self.faults.name,
            notes=list(self.notes),
            block_bytes=_block_bytes(s),
            dtype=str(getattr(getattr(cfg, "model_config", None), "dtype", "")).replace("torch.", ""),
            groups=list(rec.groups),
            connector=rec.connector_name,
        )
        rows = self.rows.all_rows(rec)
        return Keyframe(
            self.seq,
            self.step,
            info,
            [b.ref_cnt for b in blocks],
            hashes,
            [(h, b) for h, b, _g in entries],
            free,
            rows,
            self.rows.deferred(),
            self.gate.paused,
            self.gate.holder,
            self.counters(),
            sorted(rec.pinned.items()),
            hash_groups if any(hash_groups) else [],
            [g for _h, _b, g in entries] if any(g for _h, _b, g in entries) else [],
        )

    def close(self) -> None:
        self.gate.close()
        self.io.stop()
        self.recorder.uninstall()


def _block_bytes(scheduler) -> int:
    """A block's KV in bytes: each KV cache group's page size times its layers (0 when vLLM does not say)."""
    try:
        return sum(
            len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in scheduler.kv_cache_config.kv_cache_groups
        )
    except (AttributeError, TypeError, NotImplementedError):
        return 0


def _map_entries(pool) -> list[tuple[int, int, int]]:
    """Every (hash64, block, group) entry of vLLM's hash map (``BlockHashToBlockMap._cache``: a key maps to one
    block, or to a dict of the blocks that share it)."""
    out = []
    for key, blocks in pool.cached_block_hash_to_block._cache.items():
        h, g = hash64(key), group_of(key)
        if isinstance(blocks, dict):
            out += [(h, b, g) for b in blocks]
        else:
            out.append((h, blocks.block_id, g))
    return out


def _block_size(scheduler, managers) -> int:
    bs = getattr(managers[0], "block_size", None)
    if bs:
        return int(bs)
    cfg = getattr(scheduler, "vllm_config", None)
    return int(getattr(getattr(cfg, "cache_config", None), "block_size", 16))


def _notes(scheduler) -> list[str]:
    """What the probe cannot follow in this vLLM's configuration, said once in vLLM's log and in the window."""
    notes = []
    if getattr(scheduler.kv_cache_manager.coordinator, "enable_partial_hash_hits", False):
        notes.append("partial-block prefix hits are on: their copy-on-write retentions are not in the audit's count")
    cfg = getattr(scheduler, "vllm_config", None)
    if getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False):
        notes.append(
            "asynchronous scheduling is on: a step schedules one batch ahead, so Step is only exact with "
            "--no-async-scheduling"
        )
    return notes
