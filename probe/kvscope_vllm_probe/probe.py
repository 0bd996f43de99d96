"""The probe inside vLLM's engine core: the scheduler's pool as it changes, to every subscriber.

The engine core's thread runs the scheduler. Each ``update_from_output`` ends a step: the probe takes the
recorder's ops, the rows of the requests that changed, and sends one ``Step``. Everything the scheduler does
runs under the probe's lock, so the probe's own I/O thread (which answers subscribers, sends keyframes and
flushes what changed between two steps, an abort say) always reads the pool between two operations, never
in the middle of one. The engine core waits in ``schedule()`` while a subscriber holds a pause.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import zmq

from . import __version__
from .faults import Faults
from .gate import Gate
from .recorder import Recorder
from .rows import RowTracker
from .wire import (
    PROTOCOL,
    SILENT_S,
    Bye,
    Command,
    Heartbeat,
    Held,
    Hello,
    Keyframe,
    Pong,
    PoolInfo,
    Refused,
    Resync,
    SetFault,
    Step,
    Welcome,
    decode_to_probe,
    encode,
    group_of,
)

logger = logging.getLogger("kvscope_vllm_probe")


class Probe:
    def __init__(self, scheduler, endpoint: str, vllm_version: str, fault: str = "") -> None:
        self.scheduler = scheduler
        self.endpoint = endpoint
        self.vllm_version = vllm_version
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
        logger.info(
            "kvscope probe %s: publishing vLLM %s's block pool (%d blocks of %d tokens) at %s%s",
            __version__,
            vllm_version,
            len(pool.blocks),
            self.block_size,
            endpoint,
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
            self.io.post(encode(msg))
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
        rows, advanced, gone = self.rows.changed(touched, self.recorder)
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
                hashes.append((b.block_id, _h64(h), rec.tokens_of.get(b.block_id, [])))
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
        h, g = _h64(key), group_of(key)
        if isinstance(blocks, dict):
            out += [(h, b, g) for b in blocks]
        else:
            out.append((h, blocks.block_id, g))
    return out


def _h64(key: bytes) -> int:
    return int.from_bytes(key[-12:-4], "big")


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


class _Subscriber:
    __slots__ = ("name", "last_seen")

    def __init__(self, name: str) -> None:
        self.name = name
        self.last_seen = time.monotonic()


class ProbeIO:
    """The probe's socket: one ROUTER at the endpoint, owned by this thread. The engine core's thread hands
    it encoded steps through an inproc PAIR (ZeroMQ sockets are not shared between threads)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.ctx = zmq.Context.instance()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.SNDHWM, 10_000)  # past it a slow subscriber misses steps and resyncs
        self.router.bind(probe.endpoint)
        inproc = f"inproc://kvscope-probe-{probe.instance}"
        self.inbox = self.ctx.socket(zmq.PAIR)
        self.inbox.bind(inproc)
        self.outbox = self.ctx.socket(zmq.PAIR)  # used by the engine core's thread only
        self.outbox.connect(inproc)
        self.subs: dict[bytes, _Subscriber] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-probe", daemon=True)

    @property
    def has_subscribers(self) -> bool:
        return bool(self.subs)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def post(self, data: bytes) -> None:
        """From the engine core's thread: to every subscriber."""
        self.outbox.send(data, copy=False)

    # -- the thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.inbox, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self.inbox in ready:
                    while True:
                        try:
                            data = self.inbox.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._broadcast(data)
                if self.router in ready:
                    while True:
                        try:
                            frames = self.router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(frames)
                self._housekeeping()
        except Exception:  # noqa: BLE001 - the probe must never take vLLM down
            logger.exception("kvscope probe: its I/O thread stopped; vLLM runs on unprobed")
            self.probe.gate.run()
        finally:
            self.router.close(0)
            self.inbox.close(0)

    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self.router.send_multipart([ident, data], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # full or gone: a subscriber that misses a step asks for a keyframe

    def _broadcast(self, data: bytes) -> None:
        for ident in self.subs:
            self._send(ident, data)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        ident, data = frames
        try:
            msg = decode_to_probe(data)
        except ValueError:
            self._send(ident, encode(Refused("the probe cannot read that message (not kvscope's probe wire)")))
            return
        probe = self.probe
        sub = self.subs.get(ident)
        if sub is not None:
            sub.last_seen = time.monotonic()
        match msg:
            case Hello(protocol, client):
                if protocol != PROTOCOL:
                    self._send(
                        ident,
                        encode(
                            Refused(
                                f"the probe in vLLM speaks probe protocol {PROTOCOL} "
                                f"(kvscope-vllm-probe {__version__}), "
                                f"{client or 'the subscriber'} speaks {protocol}: "
                                "install the probe from the same kvscope"
                            )
                        ),
                    )
                    return
                self._send(ident, encode(Welcome(PROTOCOL, __version__, probe.vllm_version, probe.instance)))
                self.subs[ident] = _Subscriber(client or ident.hex())
                logger.info("kvscope probe: %s subscribed", self.subs[ident].name)
                self._send_keyframe(ident)
            case Resync():
                if sub is not None:
                    self._send_keyframe(ident)
            case Heartbeat():
                if sub is not None:  # a stranger's heartbeat (one that knew a vLLM before a restart) gets silence,
                    self._send(ident, encode(Pong()))  # so it greets this one
            case Command(op, n):
                self._command(ident, op, n)
            case SetFault(name, on):
                try:
                    with probe.lock:
                        probe.faults.set(name, on)
                except ValueError as e:
                    self._send(ident, encode(Refused(str(e))))
            case Bye():
                self._drop(ident, "said goodbye")

    def _send_keyframe(self, ident: bytes) -> None:
        probe = self.probe
        with probe.lock:
            between = probe.flush_between()  # what others have not been sent yet goes first, to them
            kf = probe.keyframe()
        if between is not None:
            for other in self.subs:
                if other != ident:
                    self._send(other, between)
        self._send(ident, encode(kf))

    def _command(self, ident: bytes, op: str, n: int) -> None:
        probe = self.probe
        name = self.subs[ident].name if ident in self.subs else ident.hex()
        if op == "pause":
            probe.gate.pause(name)
        elif op == "step":
            probe.gate.step(n, name)
        elif op == "run":
            probe.gate.run()
        else:
            self._send(ident, encode(Refused(f"unknown command {op!r}: pause, step or run")))
            return
        logger.info("kvscope probe: %s: %s%s", name, op, f" {n}" if op == "step" else "")
        with probe.lock:  # between two steps: say where vLLM stands (a step in progress says it when it ends)
            if not probe.in_step:
                self._broadcast(encode(Held(probe.gate.paused, probe.step, probe.gate.holder)))

    def _drop(self, ident: bytes, why: str) -> None:
        sub = self.subs.pop(ident, None)
        if sub is None:
            return
        logger.info("kvscope probe: %s %s", sub.name, why)
        gate = self.probe.gate
        if gate.paused and gate.holder == sub.name:
            gate.run()
            logger.warning("kvscope probe: %s held vLLM paused and %s: vLLM runs on", sub.name, why)
            self._broadcast(encode(Held(False, self.probe.step, "", f"{sub.name} {why}")))

    def _housekeeping(self) -> None:
        now = time.monotonic()
        for ident in [i for i, s in self.subs.items() if now - s.last_seen > SILENT_S]:
            self._drop(ident, f"went silent for {SILENT_S:.0f} s")
        if self.subs and not self.probe.in_step:
            lock = self.probe.lock
            if lock.acquire(blocking=False):
                try:
                    data = self.probe.flush_between()
                finally:
                    lock.release()
                if data is not None:
                    self._broadcast(data)


def fault_from_env() -> str:
    return os.environ.get("KVSCOPE_PROBE_FAULT", "").strip()
