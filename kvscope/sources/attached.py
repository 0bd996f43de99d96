"""Attach to a running engine's KV events (vLLM, SGLang, or a publishing kvscope); no Qt.

``AttachedSource`` subscribes to one ZeroMQ PUB endpoint per data-parallel rank, checks each
stream's sequence numbers, repairs gaps through the replay socket when there is one, and
applies every batch to a ``RemoteCacheModel`` (the prefix forest). ``poll()`` returns one
``AttachRecord`` per tick for a timeline, a trace recorder or ``--headless --json``.
``AttachReplay`` plays an attach trace back through the same code.

Both are ``base.Source``s with the one capability ``PREFIX_FOREST``: ``step()`` is one poll (waiting up
to ``AttachConfig.poll_interval`` for the first message), its record's snapshot the ``AttachRecord``;
``has_work()`` is true while subscribed (a replay: until the trace ends); every command raises
``ReadOnlyError``. Their ``poll_summary`` is what they add to a headless run's summary (``PollSummary``).

Bad input never stops it: a message that is not three frames, a payload that is not msgpack,
an event of an unknown kind or with fields of the wrong type is counted and skipped. Memory
stays bounded under a flood: ZeroMQ's receive queue holds at most ``rcvhwm`` messages (past
it the publisher drops, which shows up as gaps), one poll handles at most
``max_messages_per_poll`` messages, messages above ``max_message_bytes`` are refused, a record
carries at most ``max_log_events`` events, and the forest holds at most ``max_nodes`` blocks
(further stores are counted as overflow).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.inspect.events import Event
from engine.inspect.kv_wire import MalformedBatch, decode_batch
from kvscope.sources.attach_record import AttachRecord, Gap
from kvscope.sources.attach_trace import AttachTraceWriter, read_attach_header, read_attach_trace
from kvscope.sources.base import ATTACH_CAPABILITIES, ReadOnlyError, ReadOnlySource, SourceInfo, StepRecord
from kvscope.sources.endpoints import offset_endpoint
from kvscope.sources.remote_cache import RemoteCacheModel, RemoteEvicted, RemoteStored

CANNOT_SHOW = (
    "Attached to an engine's KV events. They name cached blocks by hash (stores, evictions, "
    "resets); they carry no block ids, block tables, ref counts, owners or free list, so those "
    "views are not shown."
)

COUNTERS = (
    "batches",
    "batches_live",
    "batches_replayed",
    "events",
    "blocks_stored",
    "blocks_removed",
    "caches_cleared",
    "malformed_messages",
    "oversized_messages",
    "unknown_event_kinds",
    "bad_events",
    "gaps_detected",
    "gaps_repaired",
    "gaps_unrepaired",
    "batches_missing",
    "replay_requests",
    "replay_timeouts",
    "duplicates",
    "publisher_restarts",
    "log_events_dropped",
)


@dataclass
class AttachConfig:
    endpoint: str  # the PUB address of rank 0, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # rank 0's replay ROUTER, e.g. tcp://10.0.0.5:5558
    topic: str = ""  # subscription prefix ("" = every topic)
    dp_size: int = 1  # ranks publish on port + rank, as vLLM and SGLang do
    block_size: int | None = None  # expected block size: events of another size are counted
    max_nodes: int = 200_000
    max_messages_per_poll: int = 2_000
    rcvhwm: int = 10_000
    max_message_bytes: int = 64 << 20
    replay_timeout: float = 1.0  # seconds to wait for a replay's end marker
    max_log_events: int = 2_000
    rate_window: float = 10.0  # seconds of history behind the store / evict rates
    # how long step() waits for the first message; 0: it never waits (a window's timer paces the polls)
    poll_interval: float = 0.1
    # Follow each publisher's connection (ZeroMQ's socket monitor, with heartbeats every ``heartbeat_s`` seconds, so
    # a publisher that vanishes without closing its socket is found too): a fleet marks an instance that went away.
    # An engine that publishes nothing while idle is silent, not gone; only the connection tells them apart.
    watch_connection: bool = False
    heartbeat_s: float = 1.0

    def validate(self) -> None:
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and "://" not in ep:
                raise ValueError(f"{ep!r} is not a ZeroMQ address (like tcp://127.0.0.1:5557)")
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if min(self.max_nodes, self.max_messages_per_poll, self.rcvhwm, self.max_log_events) < 1:
            raise ValueError("attach limits must be >= 1")
        if self.poll_interval < 0:
            raise ValueError("--poll-interval must be >= 0")


class _Applier:
    """The part live attach and trace replay share: payload -> model, counters, rates."""

    def __init__(self, config: AttachConfig, trace: AttachTraceWriter | None) -> None:
        self.config = config
        self.model = RemoteCacheModel(max_nodes=config.max_nodes)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.gaps: deque[Gap] = deque(maxlen=100)
        self.trace = trace
        self.tick = 0
        self._events: list[Event] = []
        self._batches = 0
        self._rates: deque[tuple[float, int, int]] = deque(maxlen=100_000)
        self._ops: list[tuple] = []
        self.block_size_mismatches = 0

    def apply(self, stream: int, seq: int, payload: bytes, src: str, rank: int) -> int | None:
        """Apply one batch; returns the data-parallel rank it was for (None if it was malformed)."""
        c = self.counters
        if self.trace is not None:
            self.trace.msg(self.tick, stream, seq, src, payload)
        c["batches"] += 1
        c["batches_live" if src == "live" else "batches_replayed"] += 1
        self._batches += 1
        try:
            batch = decode_batch(payload)
        except MalformedBatch:
            c["malformed_messages"] += 1
            return None
        c["unknown_event_kinds"] += batch.unknown_tags
        c["bad_events"] += batch.bad_events
        c["events"] += len(batch.events)
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else rank
        expected = self.config.block_size
        for ev in batch.events:
            if expected is not None and getattr(ev, "block_size", expected) != expected:
                self.block_size_mismatches += 1
            self._ops.append(("ev", rank, ev))
            for out in self.model.apply(ev, rank, self.tick):
                if isinstance(out, RemoteStored):
                    c["blocks_stored"] += 1
                elif isinstance(out, RemoteEvicted):
                    c["blocks_removed"] += out.known
                else:
                    c["caches_cleared"] += 1
                if len(self._events) < self.config.max_log_events:
                    self._events.append(out)
                else:
                    c["log_events_dropped"] += 1
        return rank

    def gap(self, stream: int, first: int, last: int, reason: str) -> None:
        g = Gap(stream, first, last, reason)
        self.gaps.append(g)
        self.counters["gaps_unrepaired"] += 1
        self.counters["batches_missing"] += g.size
        if self.trace is not None:
            self.trace.gap(self.tick, stream, first, last, reason)

    def restart(self, stream: int, ranks: set[int]) -> None:
        """The stream's publisher restarted: its ranks' caches restarted empty."""
        self.counters["publisher_restarts"] += 1
        for r in ranks:
            self.model.clear(r)
            self._ops.append(("clear", r))
        if self.trace is not None:
            self.trace.restart(self.tick, stream, list(ranks))

    def finish_tick(self, t: float) -> AttachRecord:
        c = self.counters
        self._rates.append((t, c["blocks_stored"], c["blocks_removed"]))
        while len(self._rates) > 1 and self._rates[0][0] < t - self.config.rate_window:
            self._rates.popleft()
        t0, s0, r0 = self._rates[0]
        span = t - t0
        rates = {
            "stored_per_s": (c["blocks_stored"] - s0) / span if span > 0 else 0.0,
            "removed_per_s": (c["blocks_removed"] - r0) / span if span > 0 else 0.0,
        }
        counters = dict(c)
        counters.update(
            overflow=self.model.overflow,
            unknown_removals=self.model.unknown_removals,
            token_mismatches=self.model.token_mismatches,
            block_size_mismatches=self.block_size_mismatches,
        )
        if self.trace is not None:
            self.trace.tick(self.tick, t, counters)
        rec = AttachRecord(
            self.tick,
            t,
            tuple(self._events),
            self.model.summary(),
            counters,
            rates,
            tuple(self.gaps),
            self._batches,
            tuple(self._ops),
        )
        self.tick += 1
        self._events, self._batches, self._ops = [], 0, []
        return rec


@dataclass
class _Stream:
    """One publisher (one data-parallel rank): its sockets and where its sequence stands."""

    index: int
    endpoint: str
    replay_endpoint: str | None
    sub: zmq.Socket
    dealer: zmq.Socket | None = None
    last_seq: int | None = None  # the last batch applied (live or replayed)
    live_high: int | None = None  # the highest sequence number seen live
    ranks: set[int] = field(default_factory=set)
    monitor: zmq.Socket | None = None  # with ``watch_connection``: the SUB socket's connection events
    connection: Connection | None = None


@dataclass
class Connection:
    """One publisher's connection as ZeroMQ saw it (``AttachConfig.watch_connection``)."""

    state: str = "connecting"  # "connecting" (never reached), "up", "down" (it was up, and went)
    since: float = 0.0  # seconds on the source's clock when it entered that state
    disconnects: int = 0
    last_batch: float | None = None  # seconds on the source's clock of its last batch


def _info(model_name: str, device: str, block_size: int | None, **extra) -> SourceInfo:
    """An attached engine's SourceInfo: its pool, dtype and model are not in the events (0 and "-")."""
    return SourceInfo(
        model_name=model_name,
        device=device,
        dtype="-",
        num_blocks=0,
        block_size=block_size or 0,
        block_bytes=0,
        max_model_len=0,
        load_seconds=0.0,
        capabilities=ATTACH_CAPABILITIES,
        extra={**extra, "block_size": block_size, "cannot_show": CANNOT_SHOW},
    )


class AttachedBase(ReadOnlySource):
    """What an attached engine and its replay share: no commands (kvscope only hears its KV events), no audit,
    no tokenizer, and the summary of a poll."""

    info: SourceInfo
    refusal = "an attached engine is read-only: kvscope hears its KV events and sends it nothing"

    def set_audit(self, on: bool) -> None:
        if on:
            raise ReadOnlyError(
                "an attached engine cannot be audited: its KV events carry no block tables or ref counts"
            )

    def decode(self, token_ids) -> str | None:
        return None  # a foreign engine's tokenizer is not here

    def describe(self) -> dict:
        """The panel's header: ``info``'s name and device, the endpoints, topic, block size, what it cannot show."""
        return {"model_name": self.info.model_name, "device": self.info.device, **self.info.extra}

    def poll_summary(self, rec: StepRecord, polls: int) -> dict:
        """What a headless run prints (``PollSummary``): the forest, the counters and the unrepaired gaps at
        the last poll, the polls taken and the seconds they spanned on the source's clock (a replay: the
        recorded run's)."""
        d, last = self.describe(), rec.cache
        s, c, seconds = last.summary, last.counters, last.t
        return {
            "attached_to": d.get("endpoints", []),
            "replay_endpoints": d.get("replay_endpoints", []),
            "topic": d.get("topic", ""),
            "polls": polls,
            "seconds": round(seconds, 3),
            "blocks": s.blocks,
            "tokens": s.tokens,
            "roots": s.roots,
            "tiers": [t.as_dict() for t in s.tiers],
            "block_sizes": sorted(self.model.block_sizes),
            "rates": {
                "stored_per_s": round(c["blocks_stored"] / seconds, 3) if seconds > 0 else 0.0,
                "removed_per_s": round(c["blocks_removed"] / seconds, 3) if seconds > 0 else 0.0,
                "window_stored_per_s": round(last.rates["stored_per_s"], 3),
                "window_removed_per_s": round(last.rates["removed_per_s"], 3),
            },
            "counters": c,
            "gaps_unrepaired": [g.as_dict() for g in last.gaps],
            "cannot_show": CANNOT_SHOW,
        }

    @staticmethod
    def _record(rec: AttachRecord, seconds: float) -> StepRecord:
        return StepRecord(rec.tick, None, list(rec.events), None, seconds, cache=rec)


class AttachedSource(AttachedBase):
    """Subscribe, keep sequences whole, and model the remote cache. Not thread-safe: one thread polls."""

    def __init__(self, config: AttachConfig, trace_path: str | None = None) -> None:
        config.validate()
        self.config = config
        self._ctx = zmq.Context()
        self.streams: list[_Stream] = []
        self.endpoints = [offset_endpoint(config.endpoint, r) for r in range(config.dp_size)]
        self.replay_endpoints = [offset_endpoint(config.replay_endpoint, r) for r in range(config.dp_size)]
        trace = None
        if trace_path:
            trace = AttachTraceWriter(
                trace_path,
                {
                    "endpoints": self.endpoints,
                    "replay_endpoints": self.replay_endpoints,
                    "topic": config.topic,
                    "block_size": config.block_size,
                    "started": time.time(),
                },
            )
        self._applier = _Applier(config, trace)
        self._t0 = time.monotonic()
        try:
            for r in range(config.dp_size):
                self.streams.append(self._open_stream(r))
        except (zmq.ZMQError, ValueError) as e:
            self.close()
            raise ValueError(f"cannot attach to {config.endpoint}: {e}") from None
        self._poller = zmq.Poller()
        for s in self.streams:
            self._poller.register(s.sub, zmq.POLLIN)
        self.info = _info(
            f"attached to {config.endpoint}",
            "KV events",
            config.block_size,
            endpoints=self.endpoints,
            replay_endpoints=self.replay_endpoints,
            topic=config.topic,
        )

    # -- sockets ---------------------------------------------------------------------------
    def _open_stream(self, rank: int) -> _Stream:
        c = self.config
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, c.rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, c.topic.encode())
        endpoint = offset_endpoint(c.endpoint, rank)
        monitor = None
        if c.watch_connection:
            ivl = max(1, int(c.heartbeat_s * 1000))
            sub.setsockopt(zmq.HEARTBEAT_IVL, ivl)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # a restarted engine is found within two seconds
            # before connect(), or the first connection's events are gone
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(endpoint)
        s = _Stream(
            rank,
            endpoint,
            offset_endpoint(c.replay_endpoint, rank),
            sub,
            monitor=monitor,
            connection=Connection(since=self._clock()) if monitor is not None else None,
        )
        if s.replay_endpoint:
            s.dealer = self._open_dealer(s.replay_endpoint)
        return s

    def _open_dealer(self, endpoint: str) -> zmq.Socket:
        d = self._ctx.socket(zmq.DEALER)  # a DEALER, not a REQ: a replay answers with many messages
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, self.config.rcvhwm)
        d.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        d.connect(endpoint)
        return d

    @property
    def model(self) -> RemoteCacheModel:
        return self._applier.model

    @property
    def counters(self) -> dict[str, int]:
        return self._applier.counters

    # -- the Source --------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._applier.tick  # polls so far

    def has_work(self) -> bool:
        return bool(self.streams)  # until closed: a live engine's events have no end

    def step(self) -> StepRecord:
        """One poll, waiting up to ``config.poll_interval`` for the first message."""
        t0 = time.perf_counter()
        rec = self.poll(self.config.poll_interval)
        return self._record(rec, time.perf_counter() - t0)

    def _clock(self) -> float:
        return time.monotonic() - self._t0

    def sockets(self) -> list[zmq.Socket]:
        """What a poll reads: a fleet waits on every instance's at once, then polls each without waiting."""
        return [s.sub for s in self.streams] + [s.monitor for s in self.streams if s.monitor is not None]

    def _watch(self) -> None:
        """The connections' news since the last poll (``watch_connection``)."""
        for s in self.streams:
            while s.monitor is not None and s.monitor.poll(0):
                ev = recv_monitor_message(s.monitor)["event"]
                con = s.connection
                if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED and con.state != "up":
                    joined = con.state == "connecting"
                    con.state, con.since = "up", self._clock()
                    if joined and s.dealer is not None and s.last_seq is None:
                        self._repair(s, 0, None)  # what it already holds, now, though it may publish nothing
                elif ev == zmq.EVENT_DISCONNECTED and con.state == "up":
                    con.state, con.since = "down", self._clock()
                    con.disconnects += 1

    # -- polling ---------------------------------------------------------------------------
    def poll(self, timeout: float = 0.1) -> AttachRecord:
        """Wait up to ``timeout`` s for the first message, take what is queued (up to the cap), return a record."""
        self._watch()
        handled = 0
        wait_ms = int(timeout * 1000)
        while handled < self.config.max_messages_per_poll:
            ready = dict(self._poller.poll(wait_ms))
            wait_ms = 0
            if not ready:
                break
            for s in self.streams:
                if s.sub in ready and handled < self.config.max_messages_per_poll:
                    try:
                        frames = s.sub.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    handled += 1
                    if s.connection is not None:
                        s.connection.last_batch = self._clock()
                    self._on_live(s, frames)
        self._watch()
        return self._applier.finish_tick(self._clock())

    def _on_live(self, s: _Stream, frames: list[bytes]) -> None:
        c = self.counters
        if len(frames) != 3 or len(frames[1]) != 8:
            c["malformed_messages"] += 1
            return
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if len(payload) > self.config.max_message_bytes:
            c["oversized_messages"] += 1
            return
        if s.live_high is not None and seq <= s.live_high:
            # A live stream never goes back: the publisher restarted, and so did its cache.
            self._applier.restart(s.index, s.ranks or {s.index})
            s.last_seq = None
        s.live_high = seq
        if s.last_seq is not None and seq <= s.last_seq:
            c["duplicates"] += 1  # a replay already brought it
            return
        expected = 0 if s.last_seq is None else s.last_seq + 1
        if seq > expected:
            c["gaps_detected"] += 1
            self._repair(s, expected, seq - 1)
            if s.last_seq is not None and seq <= s.last_seq:
                c["duplicates"] += 1
                return
        self._apply(s, seq, payload, "live")

    def _apply(self, s: _Stream, seq: int, payload: bytes, src: str) -> None:
        rank = self._applier.apply(s.index, seq, payload, src, s.index)
        if rank is not None:
            s.ranks.add(rank)
        s.last_seq = seq

    def _repair(self, s: _Stream, first: int, last: int | None) -> None:
        """Ask the replay socket for ``first..last``; what does not come back is an unrepaired gap.

        Only the missing range is applied from the replay; later batches come live as usual. ``last`` None: every
        batch it still holds (a fleet catching up with an instance it just joined, which may be idle: nothing
        live would show its gap from batch 0); only a start already gone from its buffer is a gap then.
        """
        a = self._applier
        if s.dealer is None:
            a.gap(
                s.index, first, last, "joined late, no replay endpoint" if s.last_seq is None else "no replay endpoint"
            )
            return
        a.counters["replay_requests"] += 1
        s.dealer.send_multipart((b"", first.to_bytes(8, "big")))
        deadline = time.monotonic() + self.config.replay_timeout
        ended = timed_out = lost = False
        while last is None or s.last_seq is None or s.last_seq < last:
            left = deadline - time.monotonic()
            if left <= 0 or not s.dealer.poll(int(left * 1000) + 1):
                timed_out = True
                break
            frames = s.dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) == 3:
                body = body[1:]  # vLLM >= #45177 sends the topic too
            if len(body) != 2 or len(body[0]) != 8:
                a.counters["malformed_messages"] += 1
                continue
            rseq = int.from_bytes(body[0], "big", signed=True)
            if rseq == -1 or not body[1]:
                ended = True
                break
            if s.last_seq is not None and rseq <= s.last_seq:
                continue
            if last is not None and rseq > last:
                break  # the buffer is in order: nothing more of the range will come
            nxt = 0 if s.last_seq is None else s.last_seq + 1
            if rseq > nxt:
                a.gap(s.index, nxt, rseq - 1, "no longer in the publisher's replay buffer")
                lost = True
            if len(body[1]) > self.config.max_message_bytes:
                a.counters["oversized_messages"] += 1
                s.last_seq = rseq
                continue
            self._apply(s, rseq, body[1], "replay")
        if timed_out:
            a.counters["replay_timeouts"] += 1
        if not ended:
            # The rest of this answer must not be read as the answer to the next request.
            s.dealer.close(linger=0)
            s.dealer = self._open_dealer(s.replay_endpoint)
        if last is None:
            return
        got = s.last_seq if s.last_seq is not None else first - 1
        if got < last:
            a.gap(
                s.index,
                max(got + 1, first),
                last,
                "replay timed out" if timed_out else "no longer in the publisher's replay buffer",
            )
            s.last_seq = last
        elif not lost:
            a.counters["gaps_repaired"] += 1

    def close(self) -> None:
        for s in self.streams:
            if s.monitor is not None:
                s.sub.disable_monitor()
                s.monitor.close(linger=0)
            s.sub.close(linger=0)
            if s.dealer is not None:
                s.dealer.close(linger=0)
        self.streams = []
        if self._applier.trace is not None:
            self._applier.trace.close()
        if not self._ctx.closed:
            self._ctx.term()


class AttachReplay(AttachedBase):
    """Plays an attach trace back: the same payloads through the same model; counters as recorded."""

    refusal = "a replay of an attach is read-only: it shows what was recorded"

    def __init__(self, path: str) -> None:
        self.header = read_attach_header(path)
        self.path = path
        bs = self.header.get("block_size")
        self.config = AttachConfig(
            endpoint=(self.header.get("endpoints") or ["replay://"])[0],
            topic=str(self.header.get("topic", "")),
            block_size=bs if isinstance(bs, int) and bs > 0 else None,
        )
        self._applier = _Applier(self.config, None)
        self._ticks = read_attach_trace(path)
        self._next = next(self._ticks, None)
        self.step_count = 0  # polls replayed so far
        self.info = _info(
            f"replay of an attach to {self.config.endpoint}",
            "attach trace",
            self.config.block_size,
            endpoints=self.header.get("endpoints", []),
            topic=self.config.topic,
        )

    @property
    def model(self) -> RemoteCacheModel:
        return self._applier.model

    def has_work(self) -> bool:
        return self._next is not None

    def step(self) -> StepRecord:
        """The next recorded poll (at once: a replay does not wait)."""
        t0 = time.perf_counter()
        rec = self.poll()
        return self._record(rec, time.perf_counter() - t0)

    def poll(self, timeout: float = 0.0) -> AttachRecord:
        if self._next is None:
            raise ValueError("the attach trace has ended")
        tick = self._next
        self._next = next(self._ticks, None)
        a = self._applier
        a.tick = tick.tick
        for item in tick.items:
            if item[0] == "msg":
                _, stream, seq, src, payload = item
                a.apply(stream, seq, payload, src, stream)
            elif item[0] == "gap":
                a.gaps.append(Gap(*item[1:]))
            else:
                for r in item[2]:
                    a.model.clear(r)
                    a._ops.append(("clear", r))
        rec = a.finish_tick(tick.t)
        self.step_count += 1
        a.counters.update({k: v for k, v in tick.counters.items() if k in a.counters})
        counters = {**rec.counters, **tick.counters}
        return AttachRecord(
            rec.tick, rec.t, rec.events, rec.summary, counters, rec.rates, rec.gaps, rec.batches, rec.ops
        )

    def close(self) -> None:
        pass
