"""KV events on vLLM's wire format: publish, attach, round trip, gaps, bad input, traces. Loopback only."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from engine import SamplingParams
from engine.inspect.events import BlockAllocated, BlockEvicted, BlockStored, CacheReset, event_from_dict
from engine.inspect.kv_events import WireCleared, WireRemoved, WireStored, external_hash, to_wire_events
from engine.inspect.kv_wire import decode_batch, encode_batch
from kvscope.runtime.build import KVEventsObserver
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
from kvscope.sources.attached import AttachConfig, AttachedSource, AttachReplay
from kvscope.sources.endpoints import connectable, offset_endpoint
from kvscope.sources.live import LiveSource

ROOT = Path(__file__).resolve().parents[3]
LOOPBACK = "tcp://127.0.0.1:*"  # ZeroMQ picks a free port; the publisher reports it


def publisher(block_size: int = 4, **kw) -> KVEventPublisher:
    kw.setdefault("endpoint", LOOPBACK)
    kw.setdefault("replay_endpoint", LOOPBACK)
    return KVEventPublisher(KVEventsConfig(**kw), block_size)


def attach(pub: KVEventPublisher, replay: bool = True, **kw) -> AttachedSource:
    return AttachedSource(
        AttachConfig(
            connectable(pub.endpoint),
            connectable(pub.replay_endpoint) if replay and pub.replay_endpoint else None,
            **kw,
        )
    )


def catch_up(src: AttachedSource, pub: KVEventPublisher, timeout: float = 20.0) -> None:
    """Poll until the subscriber has applied (or given up on) everything published so far."""
    deadline = time.monotonic() + timeout
    while pub.next_seq and (src.streams[0].last_seq is None or src.streams[0].last_seq < pub.next_seq - 1):
        src.poll(0.05)
        assert time.monotonic() < deadline, "the subscriber never caught up"


def wait_connected(src: AttachedSource, pub: KVEventPublisher, timeout: float = 20.0) -> None:
    """PUB/SUB drops whatever is sent before the subscription reaches the publisher: wait for it.

    The handshake is an empty batch: a valid message that changes nothing.
    """
    deadline = time.monotonic() + timeout
    while not src.counters["batches"]:
        pub.publish_payload(encode_batch([], 0.0))
        src.poll(0.05)
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
    catch_up(src, pub)


def delta(src: AttachedSource, base: dict) -> dict:
    return {k: v - base.get(k, 0) for k, v in src.poll(0.0).counters.items()}


def pool_hashes(engine, hash_format: str = "int") -> set:
    return {external_hash(h.hex(), hash_format) for h in engine.pool.cached}


def drive(session: LiveSource, rng: random.Random, shared: list[int], steps: int, after_step) -> None:
    """Requests that share a prefix, in a small pool (evictions), each checked by ``after_step``."""
    for i in range(steps):
        if i % 3 == 0:
            tail = [rng.randrange(256) for _ in range(rng.randrange(3, 14))]
            session.inject(
                shared + tail, SamplingParams(max_tokens=rng.randrange(2, 8), temperature=0.0, ignore_eos=True)
            )
        session.step()
        after_step()
    while session.has_work():
        session.step()
        after_step()


# --- the mapping ---------------------------------------------------------------------------


def test_mapping_merges_a_chain_keeps_order_and_drops_the_rest():
    a, b, c = "aa" * 32, "bb" * 32, "cc" * 32
    events = [
        BlockAllocated(0, "r"),
        BlockStored(0, a, "r", (1, 2), None),
        BlockStored(1, b, "r", (3, 4), a),
        BlockEvicted(7, c),
        BlockStored(2, c, "s", (5, 6), b),
        CacheReset(8),
    ]
    wire = to_wire_events(events, block_size=2)
    ha, hb, hc = (external_hash(x) for x in (a, b, c))
    assert wire == [
        WireStored((ha, hb), None, (1, 2, 3, 4), 2),
        WireRemoved((hc,)),
        WireStored((hc,), hb, (5, 6), 2),
        WireCleared(),
    ]
    assert ha == int(a[-16:], 16)  # vLLM's int hash: the digest's low 64 bits
    assert to_wire_events(events, 2, hash_format="bytes")[0].block_hashes == (bytes.fromhex(a), bytes.fromhex(b))


def test_old_traces_without_parent_hash_still_load():
    ev = event_from_dict(
        {"kind": "stored", "block_id": 3, "block_hash": "ab" * 32, "request_id": "r", "token_ids": [1, 2]}
    )
    assert ev.parent_hash is None and ev.token_ids == (1, 2)


def test_engine_events_chain_like_vllm(tiny_engine):
    engine = tiny_engine(num_gpu_blocks=32, block_size=4)
    engine.add_request(list(range(1, 14)), SamplingParams(max_tokens=1, temperature=0.0))
    stored = [e for e in engine.step().events + engine.ledger.drain_events() if isinstance(e, BlockStored)]
    assert [e.parent_hash for e in stored] == [None] + [e.block_hash for e in stored[:-1]]


# --- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format,hash_format", [("array", "int"), ("map", "bytes")])
def test_round_trip_attached_forest_equals_the_pool_after_every_step(tiny_engine, wire_format, hash_format):
    engine = tiny_engine(num_gpu_blocks=20, block_size=4)
    session = LiveSource(engine)
    pub = publisher(wire_format=wire_format, hash_format=hash_format)
    session.observers.append(KVEventsObserver(pub))
    src = attach(pub, block_size=4)
    wait_connected(src, pub)
    checks = [0]

    def check() -> None:
        catch_up(src, pub)
        assert src.model.cached(0, "GPU") == pool_hashes(engine, hash_format)
        snap = engine.snapshot()
        assert src.model.cached(0, "GPU") == {external_hash(h, hash_format) for h in snap.block_hashes.values()}
        assert src.model.summary().tokens == sum(len(t) for t in snap.cached_tokens.values())
        for b in engine.pool.cached.values():  # tokens and chain as the pool has them
            node = src.model.nodes[(0, "GPU", external_hash(b.block_hash.hex(), hash_format))]
            assert node.token_ids == b.token_ids
        checks[0] += 1

    try:
        rng = random.Random(7)
        drive(session, rng, [rng.randrange(256) for _ in range(10)], 45, check)
        session.reset_prefix_cache()
        session.current()
        check()
        assert not src.model.nodes
        drive(session, rng, [rng.randrange(256) for _ in range(8)], 9, check)
        c = src.counters
        assert c["blocks_removed"] > 0 and engine.pool.num_evictions > 0  # evictions happened and arrived
        assert c["caches_cleared"] == 1
        assert c["gaps_unrepaired"] == 0 and c["malformed_messages"] == 0 and c["bad_events"] == 0
        assert src.model.unknown_removals == 0
        # A prefix shared by several requests is one chain in the forest: every non-root has its parent cached.
        assert all(
            n.parent is None
            or (0, "GPU", n.parent) in src.model.nodes
            or n.parent not in pool_hashes(engine, hash_format)
            for n in src.model.nodes.values()
        )
        assert checks[0] > 50
    finally:
        src.close()
        session.close()


# --- an independent subscriber, written from vLLM's documented schema only -------------------


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class MBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None = None


class MAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class MKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MBlockStored | MBlockRemoved | MAllBlocksCleared]
    data_parallel_rank: int | None = None


@pytest.mark.parametrize(
    "wire_format,batch_type,hash_format", [("array", VKVEventBatch, "int"), ("map", MKVEventBatch, "bytes")]
)
def test_a_subscriber_written_from_vllms_schema_reads_kvscope(tiny_engine, wire_format, batch_type, hash_format):
    engine = tiny_engine(num_gpu_blocks=16, block_size=4)
    session = LiveSource(engine)
    pub = publisher(replay_endpoint=None, topic="kv-events", wire_format=wire_format, hash_format=hash_format)
    session.observers.append(KVEventsObserver(pub))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub.connect(connectable(pub.endpoint))
    decoder = msgspec.msgpack.Decoder(type=batch_type)
    cached: set = set()
    last_seq = -1
    try:
        while True:  # the subscription takes a moment to reach the publisher
            pub.publish_payload(encode_batch([WireCleared()], 0.0, wire_format=wire_format))
            if sub.poll(100):
                sub.recv_multipart()
                last_seq = pub.next_seq - 1
                break
        while sub.poll(100):
            last_seq = int.from_bytes(sub.recv_multipart()[1], "big")

        def read() -> None:
            nonlocal last_seq
            while last_seq < pub.next_seq - 1:
                assert sub.poll(5000)
                topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                assert topic == b"kv-events" and seq == last_seq + 1
                last_seq = seq
                batch = decoder.decode(payload)
                assert batch.data_parallel_rank == 0
                for ev in batch.events:
                    if isinstance(ev, (VBlockStored, MBlockStored)):
                        assert ev.medium == "GPU" and ev.block_size == 4
                        assert len(ev.token_ids) == 4 * len(ev.block_hashes)
                        cached.update(ev.block_hashes)
                    elif isinstance(ev, (VBlockRemoved, MBlockRemoved)):
                        cached.difference_update(ev.block_hashes)
                    else:
                        cached.clear()
            assert cached == pool_hashes(engine, hash_format)

        rng = random.Random(3)
        drive(session, rng, [rng.randrange(256) for _ in range(9)], 24, read)
        session.reset_prefix_cache()
        session.current()
        read()
        assert not cached
    finally:
        sub.close(linger=0)
        ctx.term()
        session.close()


# --- gaps ------------------------------------------------------------------------------------


def _stored(i: int, parent: int | None = None) -> bytes:
    return encode_batch([WireStored((1000 + i,), parent, (i, i, i, i), 4)], float(i))


def _drop_next_send(pub: KVEventPublisher) -> None:
    """The next batch goes into the replay buffer but never onto the wire (a lost message)."""
    real = pub._pub.send_multipart
    pub._pub.send_multipart = lambda *a, **k: setattr(pub._pub, "send_multipart", real)


def test_a_dropped_batch_is_repaired_by_replay():
    pub = publisher()
    src = attach(pub)
    try:
        wait_connected(src, pub)
        base = dict(src.counters)
        pub.publish_payload(_stored(1), 1)
        _drop_next_send(pub)
        pub.publish_payload(_stored(2, 1001), 1)
        pub.publish_payload(_stored(3, 1002), 1)
        catch_up(src, pub)
        c = delta(src, base)
        assert c["gaps_detected"] == 1 and c["gaps_repaired"] == 1 and c["gaps_unrepaired"] == 0
        assert c["batches_replayed"] >= 1 and c["replay_requests"] == 1
        assert {1001, 1002, 1003} <= src.model.cached()
        assert src.model.nodes[(0, "GPU", 1003)].parent == 1002  # the chain is whole again
    finally:
        src.close()
        pub.close()


@pytest.mark.parametrize("why", ["no replay endpoint", "no longer in the publisher's replay buffer"])
def test_an_unrepairable_gap_is_reported(why):
    pub = publisher(buffer_steps=1) if "buffer" in why else publisher(replay_endpoint=None)
    src = attach(pub)
    try:
        wait_connected(src, pub)
        base, known = dict(src.counters), len(src.poll(0.0).gaps)
        first = pub.next_seq
        _drop_next_send(pub)
        pub.publish_payload(_stored(1), 1)
        pub.publish_payload(_stored(2, 1001), 1)  # the buffer (1 batch) now holds only this one
        pub.publish_payload(_stored(3, 1002), 1)
        catch_up(src, pub)
        c = delta(src, base)
        assert c["gaps_unrepaired"] == 1 and c["gaps_repaired"] == 0 and c["batches_missing"] == 1
        (gap,) = src.poll(0.0).gaps[known:]
        assert (gap.first, gap.last, gap.size) == (first, first, 1) and gap.reason == why
        assert 1001 not in src.model.cached() and 1003 in src.model.cached()
    finally:
        src.close()
        pub.close()


def test_a_replay_that_never_answers_times_out_and_is_reported():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    rport = silent.bind_to_random_port("tcp://127.0.0.1")
    src = AttachedSource(AttachConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", replay_timeout=0.3))
    try:
        for _ in range(200):  # until the subscription is through
            pub.send_multipart((b"", (5).to_bytes(8, "big"), _stored(5)))
            if src.poll(0.05).counters["batches"]:
                break
        rec = src.poll(0.0)
        assert rec.counters["replay_timeouts"] >= 1
        assert rec.gaps[0].reason == "replay timed out" and rec.gaps[0].first == 0
        assert 1005 in src.model.cached()  # the stream goes on
    finally:
        src.close()
        for s in (pub, silent):
            s.close(linger=0)
        ctx.term()


def test_a_late_joiner_is_brought_up_to_date_from_the_replay_buffer():
    pub = publisher()
    for i in range(5):
        pub.publish_payload(_stored(i, 1000 + i - 1 if i else None), 1)  # nobody is listening yet
    src = attach(pub)
    try:
        for _ in range(400):
            pub.publish_payload(encode_batch([WireRemoved((99999,))], 0.0), 1)  # a live message shows the gap
            src.poll(0.02)
            if src.counters["gaps_repaired"]:
                break
        catch_up(src, pub)
        assert {1000, 1001, 1002, 1003, 1004} <= src.model.cached()
        assert src.counters["gaps_unrepaired"] == 0
    finally:
        src.close()
        pub.close()


def test_a_publisher_restart_clears_the_model():
    pub = publisher()
    src = attach(pub)
    try:
        wait_connected(src, pub)
        pub.publish_payload(_stored(1), 1)
        catch_up(src, pub)
        pub._next_seq = 0  # what a restarted publisher sends
        pub.publish_payload(_stored(2), 1)
        for _ in range(100):
            if src.poll(0.05).counters["publisher_restarts"]:
                break
        assert src.counters["publisher_restarts"] == 1
        assert src.model.cached() == {1002}
    finally:
        src.close()
        pub.close()


# --- bad input -------------------------------------------------------------------------------


class _RawPub:
    """A bare PUB socket, for messages no honest publisher sends."""

    def __init__(self, sndhwm: int = 100_000) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        if sndhwm < 100_000:  # a small kernel buffer too, so a flood overflows whatever the host's TCP tuning
            self.sock.setsockopt(zmq.SNDBUF, 1 << 16)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    def send(self, payload: bytes, frames: tuple | None = None) -> None:
        self.sock.send_multipart(frames or (b"", self.seq.to_bytes(8, "big"), payload))
        if frames is None:
            self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _connected(raw: _RawPub, **kw) -> AttachedSource:
    src = AttachedSource(AttachConfig(f"tcp://127.0.0.1:{raw.port}", **kw))
    raw.seq = 0
    for _ in range(400):
        raw.sock.send_multipart((b"", (0).to_bytes(8, "big"), _stored(0)))
        if src.poll(0.02).counters["batches"]:
            break
    raw.seq = src.streams[0].last_seq + 1
    return src


def test_malformed_messages_are_counted_and_skipped():
    raw = _RawPub()
    src = _connected(raw)
    try:
        base = src.counters["batches"]
        enc = msgspec.msgpack.encode
        raw.send(b"\xc1 not msgpack")  # 0xc1 is never valid msgpack
        raw.send(enc({"not": "a batch"}))
        raw.send(enc([1.0, "events should be a list", 0]))
        raw.send(
            enc(
                [
                    1.0,
                    [
                        ["BlockTeleported", [1]],
                        ["BlockStored", "not a list", None, [], 4, None, "GPU"],
                        ["BlockStored", [5], None, [1, 2, 3, 4], 4, None, "GPU", None],
                        {
                            "type": "BlockStored",
                            "block_hashes": [6],
                            "parent_block_hash": 5,
                            "token_ids": [5, 6, 7, 8],
                            "block_size": 4,
                            "medium": "GPU",
                        },
                        {"type": "Mystery"},
                        ["BlockRemoved", [b"bytes-hash"], "GPU"],
                        42,
                    ],
                    0,
                ]
            )
        )
        raw.send(b"", frames=(b"", b"two frames"))
        raw.send(b"", frames=(b"", b"short", b"seq"))
        raw.send(_stored(7, 6))
        for _ in range(100):
            if src.poll(0.05).counters["blocks_stored"] >= 4:
                break
        c = src.poll(0.0).counters
        assert c["malformed_messages"] == 3 + 2  # three payloads, two framings
        assert c["unknown_event_kinds"] == 3  # BlockTeleported, Mystery, a bare 42
        assert c["bad_events"] == 1
        assert c["unknown_removals"] == 1  # a bytes hash it never saw stored
        assert c["batches"] - base == 5
        assert {5, 6, 1007} <= src.model.cached()
        assert src.model.nodes[(0, "GPU", 6)].parent == 5
    finally:
        src.close()
        raw.close()


def test_a_flood_is_survived_with_bounded_memory():
    raw = _RawPub(sndhwm=100)  # like vLLM's PUB past its high-water mark: it drops
    src = _connected(raw, max_nodes=500, rcvhwm=200, max_messages_per_poll=300, max_log_events=100)
    try:
        junk = [b"\xc1" * 512, msgspec.msgpack.encode([0.0, [["Nope"]], 0])]
        tokens = tuple(range(256))
        tracemalloc.start()
        for round_ in range(6):
            for i in range(4000):  # about 4 MB a round, far more than one poll takes
                raw.send(
                    junk[i % 2]
                    if i % 3 == 0
                    else encode_batch([WireStored((round_ * 100_000 + i,), None, tokens, 256)], 0.0)
                )
            for _ in range(3):
                rec = src.poll(0.01)
                assert len(rec.events) <= 100
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        c = src.poll(0.0).counters
        assert len(src.model.nodes) <= 500 and c["overflow"] > 0
        assert c["malformed_messages"] > 0 and c["unknown_event_kinds"] > 0
        assert c["gaps_unrepaired"] > 0  # the receive queue overflowed: shown, not hidden
        assert peak < 64 << 20, f"peak Python allocation {peak / 2**20:.1f} MiB"
        while src.poll(0.1).batches:  # drain what is still queued
            pass
        src.model.clear(0)
        raw.send(_stored(1))  # still alive and applying
        for _ in range(100):
            if 1001 in src.model.cached():
                break
            src.poll(0.05)
        assert 1001 in src.model.cached()
    finally:
        src.close()
        raw.close()


def test_bad_attach_arguments_exit_2_with_one_line():
    for args in (
        ["--attach", "not-an-address"],
        ["--attach", "tcp://127.0.0.1:5557", "--dp-size", "0"],
        ["--attach", "tcp://127.0.0.1:5557", "--poll-interval", "0"],
        ["--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"],
    ):
        r = kvscope("--headless", *args, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvscope: "), (args, r.stderr)


# --- data-parallel ranks ---------------------------------------------------------------------


def test_each_data_parallel_rank_is_its_own_forest():
    for _ in range(50):
        port = random.randrange(20000, 60000)
        try:
            pubs = [
                KVEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{port}", data_parallel_rank=r), 4)
                for r in range(2)
            ]
            break
        except ValueError:
            continue
    assert pubs[1].endpoint.endswith(f":{port + 1}")
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    src = AttachedSource(AttachConfig(f"tcp://127.0.0.1:{port}", dp_size=2))
    try:
        for _ in range(400):
            for r, p in enumerate(pubs):
                p.publish(  # the same prefix on both ranks: two forests
                    [
                        BlockStored(0, "ab" * 32, "x", (1, 2, 3, 4)),
                        BlockStored(1, "cd" * 32, "x", (5, 6, 7, 8), "ab" * 32),
                    ]
                    if r == 0
                    else [BlockStored(0, "ab" * 32, "x", (1, 2, 3, 4))]
                )
            rec = src.poll(0.02)
            if {t.dp_rank for t in rec.summary.tiers} == {0, 1}:
                break
        tiers = {(t.dp_rank, t.medium): t.blocks for t in src.poll(0.0).summary.tiers}
        assert tiers == {(0, "GPU"): 2, (1, "GPU"): 1}
    finally:
        src.close()
        for p in pubs:
            p.close()


# --- headless and traces ---------------------------------------------------------------------


def kvscope(*args: str, timeout: int = 300, drop: tuple = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


class _Ticker(threading.Thread):
    """Publishes a new block every few milliseconds until stopped (a busy engine)."""

    def __init__(self, pub: KVEventPublisher) -> None:
        super().__init__(daemon=True)
        self.pub, self.stop, self.n = pub, threading.Event(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.pub.publish_payload(_stored(self.n, 1000 + self.n - 1 if self.n else None), 1)
            self.n += 1
            time.sleep(0.02)


def test_headless_attach_prints_counts_and_rates_as_json():
    pub = publisher()
    ticker = _Ticker(pub)
    ticker.start()
    try:
        r = kvscope(
            "--headless",
            "--json",
            "--attach",
            connectable(pub.endpoint),
            "--replay-endpoint",
            connectable(pub.replay_endpoint),
            "--block-size",
            "4",
            "--steps",
            "15",
            "--poll-interval",
            "0.1",
        )
    finally:
        ticker.stop.set()
        ticker.join()
        pub.close()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["polls"] == 15 and out["attached_to"] == [connectable(pub.endpoint)]
    c = out["counters"]
    # It joined late: the replay buffer brought everything from seq 0, so the forest is one whole chain.
    assert c["gaps_unrepaired"] == 0 and c["gaps_repaired"] >= 1
    assert out["blocks"] == c["blocks_stored"] > 0 and out["roots"] == 1
    assert out["tokens"] == 4 * out["blocks"] and out["block_sizes"] == [4]
    assert out["rates"]["stored_per_s"] > 0 and out["tiers"] == [
        {"dp_rank": 0, "medium": "GPU", "blocks": out["blocks"], "tokens": out["tokens"], "roots": 1}
    ]
    assert "ref counts" in out["cannot_show"]


def test_attach_window_screenshot_from_the_command_line(tmp_path):
    pub = publisher()
    ticker = _Ticker(pub)
    ticker.start()
    png = tmp_path / "attach.png"
    try:
        r = kvscope(
            "--attach",
            connectable(pub.endpoint),
            "--replay-endpoint",
            connectable(pub.replay_endpoint),
            "--screenshot",
            str(png),
            "--steps",
            "8",
        )
    finally:
        ticker.stop.set()
        ticker.join()
        pub.close()
    assert r.returncode == 0, r.stderr
    assert png.stat().st_size > 10_000
    no_display = kvscope("--attach", "tcp://127.0.0.1:5557", drop=("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))
    assert no_display.returncode == 2 and "no display" in no_display.stderr
    assert len(no_display.stderr.strip().splitlines()) == 1


def test_attach_trace_records_and_replays_exactly(tmp_path):
    trace = tmp_path / "attach.jsonl"
    pub = publisher()
    src = AttachedSource(
        AttachConfig(connectable(pub.endpoint), connectable(pub.replay_endpoint), block_size=4), trace_path=str(trace)
    )
    live = []
    try:
        wait_connected(src, pub)
        base = dict(src.counters)
        for i in range(1, 30):
            if i == 10:
                _drop_next_send(pub)  # a gap, repaired by replay, recorded as replayed batches
            if i == 20:
                pub.publish_payload(b"\xc1")  # a malformed batch, recorded too
            if i == 25:
                catch_up(src, pub)
                pub._next_seq, pub._buffer = 0, type(pub._buffer)(maxlen=10)  # the publisher restarts
            pub.publish_payload(
                _stored(i, 1000 + i - 1) if i % 7 else encode_batch([WireRemoved((1000 + i - 3,))], 0.0), 1
            )
            if i == 25:  # catch_up compares sequence numbers, which just went back: wait for the restart
                deadline = time.monotonic() + 20
                while not src.counters["publisher_restarts"] - base["publisher_restarts"]:
                    src.poll(0.05)
                    assert time.monotonic() < deadline, "the restart was never seen"
            if i % 4 == 0:
                catch_up(src, pub)
                live.append(src.poll(0.0))
        catch_up(src, pub)
        live.append(src.poll(0.0))
        live_nodes = {k: (n.parent, n.token_ids) for k, n in src.model.nodes.items()}
    finally:
        src.close()
        pub.close()
    assert live[-1].counters["gaps_repaired"] - base["gaps_repaired"] == 1
    assert live[-1].counters["malformed_messages"] == 1
    assert live[-1].counters["publisher_restarts"] - base["publisher_restarts"] == 1
    assert (0, "GPU", 1024) not in live_nodes and (0, "GPU", 1029) in live_nodes  # cleared at the restart
    header = json.loads(trace.read_text().splitlines()[0])
    assert header["format"] == "kvscope-attach-trace" and header["version"] == 1
    rep = AttachReplay(str(trace))
    replayed = []
    while rep.has_work():
        replayed.append(rep.poll())
    assert len(replayed) == live[-1].tick + 1
    by_tick = {r.tick: r for r in replayed}
    for r in live:
        assert by_tick[r.tick].summary == r.summary and by_tick[r.tick].counters == r.counters
    assert {k: (n.parent, n.token_ids) for k, n in rep.model.nodes.items()} == live_nodes
    # and from the command line, headless
    r = kvscope("--headless", "--json", "--replay", str(trace))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocks"] == live[-1].summary.blocks and out["counters"] == live[-1].counters


def test_a_corrupt_attach_trace_is_one_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        json.dumps({"format": "kvscope-attach-trace", "version": 1})
        + "\n{not json\n"
        + json.dumps({"k": "tick", "tick": 0, "t": 0.0, "counters": {}})
        + "\n"
    )
    r = kvscope("--headless", "--replay", str(trace))
    assert r.returncode == 2 and r.stderr.strip().startswith("kvscope: corrupt attach trace")
    assert len(r.stderr.strip().splitlines()) == 1


# --- publishing from the command line ------------------------------------------------------


def test_a_busy_publish_port_is_one_line_before_the_model_loads(tiny_dir):
    ctx = zmq.Context()
    busy = ctx.socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        r = kvscope(
            "--headless",
            "--model",
            tiny_dir,
            "--num-gpu-blocks",
            "16",
            "--block-size",
            "4",
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{port}",
        )
    finally:
        busy.close(linger=0)
        ctx.term()
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvscope: cannot bind KV events endpoint tcp://127.0.0.1:{port}")


def test_publishing_from_a_trace_replay_is_refused(tmp_path):
    r = kvscope("--headless", "--replay", str(tmp_path / "x.jsonl"), "--kv-events-endpoint", LOOPBACK)
    assert r.returncode == 2 and "not a trace replay" in r.stderr


def test_session_observers_see_every_record_and_close_with_it(tiny_engine):
    session = LiveSource(tiny_engine())
    seen = []

    class Obs:
        closed = False

        def __call__(self, rec):
            seen.append(rec.step)

        def close(self):
            Obs.closed = True

    session.observers.append(Obs())
    session.inject([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    session.current()
    while session.has_work():
        session.step()
    session.close()
    assert seen == list(range(0, seen[-1] + 1)) and Obs.closed and session.observers == []


def test_decode_batch_reads_vllm_map_batches_and_signed_sglang_hashes():
    enc = msgspec.msgpack.encode
    mapped = enc(
        {
            "ts": 1.5,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [-5, 7],
                    "parent_block_hash": None,
                    "token_ids": [[1, 2], [2, 3], [3, 4], [4, 5]],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "CPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            ],
            "data_parallel_rank": 3,
        }
    )
    b = decode_batch(mapped)
    assert b.data_parallel_rank == 3 and b.ts == 1.5
    assert b.events == [WireStored((-5, 7), None, (1, 2, 3, 4), 2, "CPU")]
    old = enc([2.0, [["BlockStored", [1], None, [1, 2], 2, None], ["BlockRemoved", [1]]]])  # vLLM 0.9: no medium
    assert decode_batch(old).events == [WireStored((1,), None, (1, 2), 2, None), WireRemoved((1,), None)]
