"""The probed vLLM's pool as kvscope rebuilds it, from hand-made probe messages (no vLLM needed): vLLM's free
queue order (prepends and appends), kvscope's events, the audit, gaps, and every connection trouble in one line
(a probe that is not there, a refusal, a message kvscope cannot read)."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from engine.inspect.events import BlockAllocated, BlockEvicted, BlockFreed, BlockStored, BlockTouched
from engine.inspect.snapshot import BlockState
from kvscope.sources.probe import ProbeSource
from kvscope.sources.probe_mirror import FreeList, MirrorError, VllmPoolMirror
from kvscope_vllm_probe.wire import (
    OP_APPEND,
    OP_HASH,
    OP_MAP_CLEAR,
    OP_MAP_INSERT,
    OP_MAP_POP,
    OP_POP,
    OP_PREPEND,
    OP_REF,
    OP_REMOVE,
    OP_REQUEST,
    PROTOCOL,
    Hello,
    Keyframe,
    PoolInfo,
    RequestRow,
    Resync,
    Step,
    Welcome,
    block_key,
    decode_to_probe,
    encode,
)

N = 8


def keyframe(seq: int = 0, step: int = 0) -> Keyframe:
    info = PoolInfo("m", "0.32.0", 4, N, 0, True, "sha256", 1, False, 2048, "")
    return Keyframe(seq, step, info, [0] * N, [], [], list(range(1, N)), [], [], False, "", {})


def row(
    rid: str,
    status: str,
    tokens: list[int],
    computed: int,
    blocks: list[int] | None,
    start: int = 0,
    blocks_from: int = 0,
) -> RequestRow:
    return RequestRow(rid, status, 6, start, tokens, computed, 0, blocks_from, blocks, 1.0)


def test_free_list_follows_vllms_queue_operations():
    f = FreeList(6, [0, 1, 2, 3])
    f.remove(1)
    f.prepend([5, 4])  # 5 is the new head
    f.append([1])
    assert f.order().tolist() == [5, 4, 0, 2, 3, 1]
    with pytest.raises(MirrorError):
        f.append([0])  # queued already
    with pytest.raises(MirrorError):
        FreeList(3, [0]).remove(2)  # not queued


def test_a_step_becomes_kvscopes_events_and_snapshot():
    m = VllmPoolMirror(keyframe())
    h0, h1 = 0xAB, 0xCD
    st = Step(
        1,
        1,
        0.01,
        [
            [OP_REQUEST, "a"],
            [OP_POP, [1, 2]],
            [OP_REF, 1, 1],
            [OP_REF, 2, 1],
            [OP_HASH, 1, block_key(h0), [10, 11, 12, 13], None],
            [OP_MAP_INSERT, block_key(h0), 1],
            [OP_REQUEST, "b"],
            [OP_REF, 1, 2],
            [OP_POP, [3]],
            [OP_REF, 3, 1],
        ],
        [
            row("a", "RUNNING", [10, 11, 12, 13, 14, 15], 6, [1, 2]),
            row("b", "RUNNING", [10, 11, 12, 13, 20, 21], 6, [1, 3]),
        ],
        [],
        None,
        {},
        False,
    )
    events = m.apply(st)
    kinds = [type(e) for e in events]
    assert kinds[:4] == [BlockAllocated, BlockAllocated, BlockStored, BlockTouched]
    assert events[2] == BlockStored(1, f"{h0:016x}", "a", (10, 11, 12, 13), None)
    snap = m.snapshot(1)
    assert snap.ref_cnt.tolist()[:4] == [0, 2, 1, 1]  # block 0 is vLLM's null block: reserved, no count kept
    assert snap.state[0] == BlockState.RESERVED and snap.reserved == (0,) and snap.counters["num_reserved_blocks"] == 1
    assert snap.free_queue.tolist() == [4, 5, 6, 7]
    assert snap.block_hashes == {1: f"{h0:016x}"}
    assert m.audit().ok
    # a finished request's blocks: the unhashed one to the head (LIFO), the hashed one to the tail, as vLLM frees
    st2 = Step(
        2,
        2,
        0.01,
        [
            [OP_REQUEST, "a"],
            [OP_REF, 2, 0],
            [OP_REF, 1, 1],
            [OP_PREPEND, [2]],
            [OP_REQUEST, "b"],
            [OP_REF, 3, 0],
            [OP_REF, 1, 0],
            [OP_PREPEND, [3]],
            [OP_APPEND, [1]],
            [OP_REQUEST, "c"],
            [OP_POP, [3]],
            [OP_REF, 3, 1],
            [OP_REMOVE, 1],
            [OP_REF, 1, 1],
        ],
        [row("c", "RUNNING", [1, 2, 3, 4, 5, 6], 6, [3, 1])],
        [("a", "FINISHED_STOPPED"), ("b", "FINISHED_LENGTH_CAPPED")],
        None,
        {},
        False,
    )
    events = m.apply(st2)
    assert events[0] == BlockFreed(2, "a", 0) and BlockTouched(1, "c", 1) in events  # a hit on a cached free block
    snap = m.snapshot(2)
    assert snap.free_queue.tolist() == [2, 4, 5, 6, 7]
    assert [r.request_id for r in snap.requests] == ["a", "b", "c"]  # the finished ones kept, as kvscope's engine
    assert snap.request("b").status == "FINISHED_LENGTH"
    assert m.audit().ok
    # a cached free block handed out again: its hash leaves the cache (an eviction), then it is allocated
    m.apply(Step(3, 3, 0.0, [[OP_REQUEST, "c"], [OP_REF, 1, 0], [OP_APPEND, [1]]], [], [], None, {}, False))
    order = m.snapshot(3).free_queue.tolist()
    ops = [[OP_REQUEST, "d"], [OP_POP, order], [OP_MAP_POP, block_key(h0), 1], [OP_HASH, 1, None, [], None]]
    ops += [[OP_REF, b, 1] for b in order]
    events = m.apply(Step(4, 4, 0.0, ops, [], [], None, {}, False))
    assert BlockEvicted(1, f"{h0:016x}") in events and BlockAllocated(1, "d") in events
    assert m.snapshot(4).block_hashes == {} and m.counters_now()["evictions"] == 1
    del h1


def test_a_block_handed_out_for_no_named_request_is_the_one_whose_table_gained_it():
    m = VllmPoolMirror(keyframe())
    events = m.apply(
        Step(
            1,
            1,
            0.0,
            [[OP_POP, [1, 2]], [OP_REF, 1, 1], [OP_REF, 2, 1]],
            [row("a", "RUNNING", [1] * 6, 6, [1]), row("b", "RUNNING", [2] * 6, 6, [2])],
            [],
            None,
            {},
            False,
        )
    )
    assert BlockAllocated(1, "a") in events and BlockAllocated(2, "b") in events
    events = m.apply(
        Step(2, 2, 0.0, [[OP_REF, 2, 0], [OP_PREPEND, [2]]], [], [("b", "FINISHED_STOPPED")], None, {}, False)
    )
    assert BlockFreed(2, "b", 0) in events


def test_the_audit_names_a_leaked_block_and_the_request_that_held_it():
    m = VllmPoolMirror(keyframe())
    m.apply(
        Step(
            1,
            1,
            0.0,
            [[OP_REQUEST, "a"], [OP_POP, [1, 2]], [OP_REF, 1, 1], [OP_REF, 2, 1]],
            [row("a", "RUNNING", [1, 2, 3, 4, 5, 6], 6, [1, 2])],
            [],
            None,
            {},
            False,
        )
    )
    # vLLM freed block 1 only: block 2 left the table but kept its reference
    m.apply(
        Step(
            2,
            2,
            0.0,
            [[OP_REQUEST, "a"], [OP_REF, 1, 0], [OP_PREPEND, [1]]],
            [],
            [("a", "FINISHED_STOPPED")],
            None,
            {},
            False,
        )
    )
    problems = m.audit().problems
    assert [(p.block_id, p.problem, p.last_owner) for p in problems] == [(2, "leaked", "a")]
    assert "block 2: leaked (ref count 1, tables hold 0, request a)" == str(problems[0])


def test_deferred_frees_count_as_held_and_the_hash_map_is_checked():
    m = VllmPoolMirror(keyframe())
    m.apply(
        Step(
            1,
            1,
            0.0,
            [[OP_REQUEST, "a"], [OP_POP, [1]], [OP_REF, 1, 1]],
            [],
            [("a", "FINISHED_STOPPED")],
            [[1]],
            {},
            False,
        )
    )
    assert m.audit().ok  # out of its table, waiting in vLLM's deferred frees: not a leak
    m.apply(Step(2, 2, 0.0, [], [], [], [], {}, False))
    assert [p.problem for p in m.audit().problems] == ["leaked"]
    # a hash without its map entry, and a map entry for a block without a hash: both wrong in the hash map
    m.apply(
        Step(
            3,
            3,
            0.0,
            [
                [OP_REF, 1, 0],
                [OP_APPEND, [1]],
                [OP_HASH, 1, block_key(5), [1, 2, 3, 4], None],
                [OP_MAP_INSERT, block_key(9), 2],
            ],
            [],
            [],
            None,
            {},
            False,
        )
    )
    assert sorted((p.block_id, p.problem) for p in m.audit().problems) == [(1, "hash_map"), (2, "hash_map")]
    m.apply(Step(4, 4, 0.0, [[OP_MAP_INSERT, block_key(5), 1], [OP_MAP_POP, block_key(9), 2]], [], [], None, {}, False))
    assert m.audit().ok
    m.apply(Step(5, 5, 0.0, [[OP_HASH, 1, None, [], None], [OP_MAP_CLEAR]], [], [], None, {}, False))
    assert m.audit().ok


def test_a_gap_or_a_block_out_of_range_is_refused_before_anything_changes():
    m = VllmPoolMirror(keyframe())
    with pytest.raises(MirrorError, match="1 missed"):
        m.apply(Step(2, 2, 0.0, [], [], [], None, {}, False))
    with pytest.raises(MirrorError, match="blocks 0..7"):
        m.apply(Step(1, 1, 0.0, [[OP_REF, 99, 1]], [], [], None, {}, False))
    assert m.apply(Step(0, 0, 0.0, [[OP_REF, 1, 5]], [], [], None, {}, False)) == []  # before the keyframe: skipped


class FakeProbe:
    """A probe's socket played by hand: what it sends is up to the test."""

    def __init__(self, answer) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.answer = answer
        self.got: list = []
        self.later: queue.SimpleQueue[bytes] = queue.SimpleQueue()  # sent by the socket's thread to the last client
        self._ident: bytes | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            while self._ident is not None and not self.later.empty():
                self.sock.send_multipart([self._ident, self.later.get()])
            if self.sock.poll(50):
                ident, data = self.sock.recv_multipart()
                self._ident = ident
                msg = decode_to_probe(data)
                self.got.append(msg)
                for out in self.answer(msg):
                    self.sock.send_multipart([ident, out])

    def close(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.sock.close(0)

    def __enter__(self) -> FakeProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def test_no_probe_at_the_address_is_one_line():
    with pytest.raises(
        ValueError,
        match=r"no probe answered at tcp://127.0.0.1:1 in 1 s: start vLLM with "
        r"KVSCOPE_PROBE_ENDPOINT=tcp://127.0.0.1:1",
    ):
        ProbeSource("tcp://127.0.0.1:1", wait_s=1.0)


def test_a_refusal_is_one_line():
    from kvscope_vllm_probe.wire import Refused

    with FakeProbe(
        lambda msg: [encode(Refused("the probe in vLLM speaks probe protocol 7"))] if isinstance(msg, Hello) else []
    ) as fake:
        with pytest.raises(ValueError, match="refused: the probe in vLLM speaks probe protocol 7"):
            ProbeSource(fake.endpoint, wait_s=5)


def test_a_message_kvscope_cannot_read_is_skipped_and_the_pool_read_again():
    def answer(msg):
        if isinstance(msg, Hello):
            return [
                encode(Welcome(PROTOCOL, "0.1.0", "0.32.0", "x")),
                encode(keyframe()),
                b"\x93not a message",
                encode(Step(1, 1, 0.0, [[OP_POP, [1]], [OP_REF, 1, 1]], [], [], None, {}, False)),
            ]
        if isinstance(msg, Resync):
            return [encode(keyframe(1, 1))]
        return []

    with FakeProbe(answer) as fake:
        src = ProbeSource(fake.endpoint, wait_s=5)
        notices, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline and not any(isinstance(m, Resync) for m in fake.got):
            rec = src.step()
            notices += [rec.notice] if rec.notice else []
        assert any("a message kvscope cannot read was skipped" in n for n in notices)
        assert any(isinstance(m, Resync) for m in fake.got)
        src.step()  # the fresh keyframe
        assert src.mirror.seq == 1 and src.current().audit.ok
        src.close()


def test_the_wire_refuses_what_is_not_one_of_its_messages():
    with pytest.raises(msgspec.DecodeError):
        decode_to_probe(b"\x01\x02")


def test_a_reader_that_falls_far_behind_reads_the_pool_again(monkeypatch):
    """A window paused for hours reads nothing: past ``MAX_INBOX`` messages the client drops them and says so, and
    the pool is read again from a fresh keyframe (memory stays bounded)."""
    import kvscope_vllm_probe.client as client

    monkeypatch.setattr(client, "MAX_INBOX", 5)

    def answer(msg):
        if isinstance(msg, Hello):
            return [encode(Welcome(PROTOCOL, "0.1.0", "0.32.0", "x")), encode(keyframe())]
        if isinstance(msg, Resync):
            return [encode(keyframe(20, 20))]
        return []

    with FakeProbe(answer) as fake:
        src = ProbeSource(fake.endpoint, wait_s=5)
        for i in range(1, 21):  # the pool is read; now 20 steps come that nobody reads
            fake.later.put(encode(Step(i, i, 0.0, [], [], [], None, {}, False)))
        time.sleep(1.0)  # the 20 steps arrive; nobody reads them
        assert src.client.inbox.qsize() <= 6
        notices, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline and src.mirror.seq != 20:
            rec = src.step()
            notices += [rec.notice] if rec.notice else []
        assert src.mirror.seq == 20 and src.current().audit.ok
        assert sum(isinstance(m, Resync) for m in fake.got) == 1  # one keyframe asked for, not one a dropped step
        assert any("messages behind the probe: reading its pool again" in n for n in notices), notices
        src.close()


def test_a_first_keyframe_lost_in_a_flood_is_asked_for_again(monkeypatch):
    """The steps behind the first keyframe fill the inbox before kvscope reads it (a slow start on a busy machine):
    the keyframe is dropped with them, and kvscope asks for one more rather than waiting out its deadline."""
    import kvscope_vllm_probe.client as client
    from kvscope.sources.probe import ProbeRank

    monkeypatch.setattr(client, "MAX_INBOX", 5)
    wait_keyframe = ProbeRank.wait_keyframe

    flooded = threading.Event()

    def slow_reader(self, deadline, progress=None):
        # every message arrives, and the inbox overflows, before the first is read: wait for the probe to answer
        # the hello (the first may be lost before the connection is up, and the next goes a second later), then
        # for the flood to land in the inbox
        assert flooded.wait(10)
        time.sleep(0.5)
        return wait_keyframe(self, deadline, progress)

    monkeypatch.setattr(ProbeRank, "wait_keyframe", slow_reader)

    def answer(msg):
        if isinstance(msg, Hello):
            flooded.set()
            steps = [encode(Step(i, i, 0.0, [], [], [], None, {}, False)) for i in range(1, 21)]
            return [encode(Welcome(PROTOCOL, "0.1.0", "0.32.0", "x")), encode(keyframe())] + steps
        if isinstance(msg, Resync):
            return [encode(keyframe(20, 20))]
        return []

    with FakeProbe(answer) as fake:
        src = ProbeSource(fake.endpoint, wait_s=15)
        assert src.mirror.seq == 20 and src.current().audit.ok
        assert sum(isinstance(m, Resync) for m in fake.got) == 1
        src.close()


def test_every_groups_tables_pins_and_a_delayed_free_are_audited():
    """A hybrid pool (a sliding window beside full attention): every group's table counts, the null block in a
    window's table counts for nothing, a block hashed in group 1 is keyed with its group, the connector's pins and a
    finished request's kept tables (a delayed free) are held; a leak is named with its group."""
    from kvscope_vllm_probe.wire import KVGroup

    groups = [KVGroup("sliding_window", 4, window=8), KVGroup("full", 4)]
    info = PoolInfo("m", "0.32.0", 4, N, 0, True, "sha256", 2, False, 2048, "", groups=groups, connector="X")
    m = VllmPoolMirror(Keyframe(0, 0, info, [0] * N, [], [], list(range(1, N)), [], [], False, "", {}))
    assert [g.kind for g in m.groups] == ["sliding_window", "full"] and m.primary == 1
    ops = [[OP_REQUEST, "a"], [OP_POP, [1, 2, 3]], [OP_REF, 1, 1], [OP_REF, 2, 1], [OP_REF, 3, 1]]
    ops += [[OP_HASH, 2, block_key(0xAB, 1), [1, 2, 3, 4], None], [OP_MAP_INSERT, block_key(0xAB, 1), 2]]
    a = RequestRow("a", "RUNNING", 6, 0, [1, 2, 3, 4, 5, 6], 6, 0, 0, [1], 1.0, groups=[(1, 0, [2, 3])])
    m.apply(Step(1, 1, 0.0, ops, [a], [], None, {}, False))
    snap = m.snapshot(1)
    assert snap.request("a").group_block_ids == ((1,), (2, 3)) and snap.request("a").block_ids == (2, 3)
    assert snap.block_hashes == {2: f"{0xAB:016x}/g1"} and snap.block_group.tolist()[:4] == [-1, 0, 1, 1]
    assert m.audit().ok
    # the window slid: block 1 given back (no request named), the null block in its place; a pin on block 4
    ops = [[OP_REF, 1, 0], [OP_PREPEND, [1]], [OP_REQUEST, "connector:X"], [OP_POP, [4]], [OP_REF, 4, 1]]
    a2 = RequestRow("a", "RUNNING", 6, 0, [1, 2, 3, 4, 5, 6, 7], 7, 0, 0, [0], 1.0)
    events = m.apply(Step(2, 2, 0.0, ops, [a2], [], None, {}, False, pinned=[(4, 1)]))
    assert BlockFreed(1, "a", 0) in events  # named by the table that lost it
    assert m.audit().ok and m.snapshot(2).pinned == {4: 1}
    # a finished request whose tables the connector keeps (a delayed free): held, with the reason, and audited
    fin = RequestRow("a", "FINISHED_LENGTH_CAPPED", 6, 0, [1, 2, 3, 4, 5, 6, 7], 7, 0, 0, None, 1.0)
    m.apply(Step(3, 3, 0.0, [], [fin], [], None, {}, False))
    held = m.snapshot(3).request("a")
    assert held.status == "FINISHED_LENGTH" and "X: kept after the request finished" in held.held_by
    assert m.audit().ok
    # it goes; vLLM frees block 2 but not 3 (a leak in the full-attention group)
    ops = [[OP_REQUEST, "a"], [OP_REF, 2, 0], [OP_APPEND, [2]]]
    m.apply(Step(4, 4, 0.0, ops, [], [("a", "FINISHED_LENGTH_CAPPED")], None, {}, False))
    (p,) = m.audit().problems
    assert (p.block_id, p.problem, p.last_owner, p.group) == (3, "leaked", "a", "group 1 (full attention)")


def test_a_window_that_slid_is_sent_as_the_positions_that_hold_the_null_block():
    """A sliding window's block that left the window: the probe sends its position (``Step.nulled``), not the
    table again; the mirror puts the null block there and names the request whose table lost the block (here the
    first of two that share it), and a block that grew the table in the same step lands after it."""
    from kvscope_vllm_probe.wire import KVGroup

    groups = [KVGroup("sliding_window", 4, window=8), KVGroup("full", 4)]
    info = PoolInfo("m", "0.32.0", 4, N, 0, True, "sha256", 2, False, 2048, "", groups=groups)
    m = VllmPoolMirror(Keyframe(0, 0, info, [0] * N, [], [], list(range(1, N)), [], [], False, "", {}))
    ops = [[OP_REQUEST, "b"], [OP_POP, [1, 2, 3]], [OP_REF, 1, 1], [OP_REF, 2, 1], [OP_REF, 3, 1]]
    b = RequestRow("b", "RUNNING", 8, 0, list(range(8)), 8, 0, 0, [1, 2], 1.0, groups=[(1, 0, [3])])
    m.apply(Step(1, 1, 0.0, ops, [b], [], None, {}, False))
    ops = [[OP_REQUEST, "a"], [OP_REF, 1, 2], [OP_POP, [4]], [OP_REF, 4, 1]]
    a = RequestRow("a", "RUNNING", 4, 0, list(range(4)), 4, 4, 0, [1], 2.0, groups=[(1, 0, [4])])
    m.apply(Step(2, 2, 0.0, ops, [a], [], None, {}, False))
    assert m.audit().ok
    # b's window slid: its reference to block 1 dropped with no request named, the null block at b's position 0;
    # block 5 grew b's window in the same step
    ops = [[OP_REQUEST, ""], [OP_REF, 1, 1], [OP_POP, [5]], [OP_REF, 5, 1]]
    st = Step(3, 3, 0.0, ops, [], [], None, {}, False, grown=[("b", 0, 2, [5])], nulled=[("b", 0, [0])])
    events = m.apply(st)
    assert BlockFreed(1, "b", 1) in events
    assert m.snapshot(3).request("b").group_block_ids == ((0, 2, 5), (3,)) and m.audit().ok
    with pytest.raises(MirrorError, match="null block in request c's table 0"):
        m.apply(Step(4, 4, 0.0, [], [], [], None, {}, False, nulled=[("c", 0, [0])]))


def test_a_restarted_vllms_steps_wait_for_its_keyframe():
    """vLLM restarts at the same address: its step numbers start again, and one that happens to follow the old run's
    last must not be applied to the old pool (CI once saw blocks in tables at ref 0 after a restart). Its steps wait
    for the new keyframe; from it on, the new pool's steps apply."""

    def answer(msg):
        if isinstance(msg, Hello):
            steps = [encode(Step(i, i, 0.0, [], [], [], None, {}, False)) for i in (1, 2)]
            return [encode(Welcome(PROTOCOL, "0.1.0", "0.32.0", "first")), encode(keyframe())] + steps
        return []

    with FakeProbe(answer) as fake:
        src = ProbeSource(fake.endpoint, wait_s=5)
        deadline = time.monotonic() + 10
        while src.mirror.seq != 2 and time.monotonic() < deadline:
            src.step()
        assert src.mirror.seq == 2
        rank = src.shown  # the one data-parallel rank's reader
        # the new vLLM greets, and its third step (seq 3: it follows the old run's last) comes before its keyframe
        assert rank._handle(Welcome(PROTOCOL, "0.1.0", "0.32.0", "second")) is None
        alloc = [[OP_REQUEST, "x"], [OP_POP, [1]], [OP_REF, 1, 1]]
        assert rank._handle(Step(3, 3, 0.0, alloc, [], [], None, {}, False)) is None
        assert src.mirror.seq == 2 and src.mirror.ref[1] == 0  # not applied to the old pool
        rec = rank._handle(keyframe(seq=3, step=3))  # the new pool, read whole
        assert rec is not None and rec.audit.ok and "restarted" in (rec.notice or "")
        rec = rank._handle(Step(4, 4, 0.0, alloc, [], [], None, {}, False))
        assert rec is not None and src.mirror.seq == 4 and src.mirror.ref[1] == 1
        src.close()


def test_a_version_1_traces_ops_are_read_as_the_probes_keys_now():
    """Probe traces of version 1 (protocol 4) named a block key by its two numbers; a replay reads them as the
    bytes vLLM made, which the probe sends now, and the shipped lab's recording (version 1) plays with its hashes."""
    from kvscope.sources.probe import ProbeReplay, _keyed_ops

    v1 = [
        [OP_HASH, 1, 0xAB, [1, 2], 0xCD, 1],
        [OP_HASH, 2, None, [], None, 0],
        [OP_HASH, 3, 0xEF, [3], None],  # before KV cache groups: no group
        [OP_MAP_INSERT, 0xAB, 1, 1],
        [OP_MAP_POP, 0xEF, 3],
        [OP_REF, 1, 1],
    ]
    assert _keyed_ops(v1) == [
        [OP_HASH, 1, block_key(0xAB, 1), [1, 2], (0xCD).to_bytes(8, "big")],
        [OP_HASH, 2, None, [], None],
        [OP_HASH, 3, block_key(0xEF), [3], None],
        [OP_MAP_INSERT, block_key(0xAB, 1), 1],
        [OP_MAP_POP, block_key(0xEF), 3],
        [OP_REF, 1, 1],
    ]
    src = ProbeReplay(str(Path(__file__).resolve().parents[3] / "resources" / "probe" / "vllm-leak.jsonl"))
    hashes: dict = {}
    while src.has_work() and not hashes:
        hashes = src.step().snapshot.block_hashes
    assert hashes and all(len(h) == 16 and int(h, 16) >= 0 for h in hashes.values()), hashes


def test_a_version_1_trace_whose_op_cannot_be_read_is_refused_in_one_line(tmp_path):
    """A version-1 trace with a hash op kvscope cannot convert (a parent that is not a number) is refused when read,
    naming the file and line, not applied half-way."""
    import base64
    import json

    from kvscope.sources.probe import ProbeReplay

    lines = (Path(__file__).resolve().parents[3] / "resources" / "probe" / "vllm-leak.jsonl").read_text().splitlines()
    bad = Step(1, 1, 0.0, [[OP_HASH, 1, 0xAB, [1, 2], "not a hash", 0]], [], [], None, {}, False)
    line = json.dumps({"t": 0.0, "payload": base64.b64encode(encode(bad)).decode()})
    trace = tmp_path / "v1.probe.jsonl"
    trace.write_text("\n".join([lines[0], lines[1], line, lines[2]]) + "\n")
    with pytest.raises(ValueError) as e:
        ProbeReplay(str(trace))
    assert str(e.value).startswith(f"{trace}:3: not a probe message") and "\n" not in str(e.value)
