"""A fleet over real sockets (loopback): kvscope engines publishing vLLM's KV events with vLLM's sha256_cbor hashes,
watched together. The fleet's counts equal each engine's own pool after every step, its duplicates equal a count
made from the pools, and where a prompt would go names the engine that holds it; an instance that goes away is
marked down and the rest go on, one that comes back with a fresh process is cleared and read again, one that loses
batches is marked; headless prints the ``fleet`` object."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ports import free_port

from engine import SamplingParams
from engine.core.vllm_hashing import VllmBlockHasher, low64
from engine.inspect.events import BlockStored
from kvscope.cli.fleet import fleet_summary_lines
from kvscope.runtime.build import KVEventsObserver
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
from kvscope.sources.base import FLEET, Source
from kvscope.sources.endpoints import connectable
from kvscope.sources.fleet import FleetSource
from kvscope.sources.fleet_spec import FleetSpec, InstanceSpec
from kvscope.sources.live import LiveSource

ROOT = Path(__file__).resolve().parents[3]
BS = 4
SEED = "0"


def publisher(endpoint: str = "tcp://127.0.0.1:*", replay: str | None = "tcp://127.0.0.1:*") -> KVEventPublisher:
    return KVEventPublisher(KVEventsConfig(endpoint=endpoint, replay_endpoint=replay), BS)


def spec_of(pubs: list[KVEventPublisher], names: str = "abcdefgh", **kw) -> FleetSpec:
    return FleetSpec(
        tuple(
            InstanceSpec(
                n,
                connectable(p.endpoint),
                connectable(p.replay_endpoint) if p.replay_endpoint else None,
                hash_seed=SEED,
                **kw,
            )
            for n, p in zip(names, pubs)
        ),
        "test",
    )


NOTICES: list[str] = []  # every notice the helpers' polls saw, in order


def poll(fleet: FleetSource, timeout: float):
    rec = fleet.poll(timeout)
    NOTICES.extend(rec.notices)
    return rec


def caught_up(fleet: FleetSource, pubs: list[KVEventPublisher], timeout: float = 20.0):
    """Poll until every instance has applied (or given up on) everything its publisher sent."""
    deadline = time.monotonic() + timeout
    while True:
        rec = poll(fleet, 0.02)
        behind = [
            m
            for m, p in zip(fleet.members, pubs)
            if p.next_seq and (m.source.streams[0].last_seq is None or m.source.streams[0].last_seq < p.next_seq - 1)
        ]
        if not behind:
            return rec
        assert time.monotonic() < deadline, f"{[m.spec.name for m in behind]} never caught up"


def until(fleet: FleetSource, cond, timeout: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        rec = poll(fleet, 0.05)
        if cond(rec):
            return rec
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def pool_low64(engine) -> set[int]:
    return {int.from_bytes(h, "big") & ((1 << 64) - 1) for h in engine.pool.cached}


@pytest.fixture
def engines(tiny_engine, monkeypatch):
    """Three kvscope engines hashing as vLLM does (sha256_cbor, PYTHONHASHSEED=0), each publishing its events."""
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    sessions, pubs = [], []
    for _ in range(3):
        s = LiveSource(tiny_engine(num_gpu_blocks=14, block_size=BS, hash_algo="sha256_cbor"))
        p = publisher()
        s.observers.append(KVEventsObserver(p))
        sessions.append(s)
        pubs.append(p)
    yield sessions, pubs
    for s in sessions:
        s.close()
    for p in pubs:
        p.close()


def test_the_fleet_counts_equal_each_engine_and_the_route_names_the_holder(engines):
    sessions, pubs = engines
    fleet = FleetSource(spec_of(pubs, bytes_per_block=512))
    assert isinstance(fleet, Source) and fleet.info.capabilities == frozenset({FLEET}) and fleet.info.read_only
    until(fleet, lambda r: all(row.state == "up" for row in r.instances), what="three connections")
    rng = random.Random(0)
    system = [rng.randrange(1, 256) for _ in range(4 * BS + 1)]
    asked: list[tuple[int, list[int]]] = []
    checked = 0
    try:
        for step in range(60):
            if step % 3 == 0 and len(asked) < 18:
                k = rng.randrange(3)  # a random router: the system prompt lands everywhere, and pools evict
                p = system + [rng.randrange(1, 256) for _ in range(rng.randrange(3, 12))]
                sessions[k].inject(p, SamplingParams(max_tokens=rng.randrange(2, 6), temperature=0.0, ignore_eos=True))
                asked.append((k, p))
            for s in sessions:
                if s.has_work():
                    s.step()
            rec = caught_up(fleet, pubs)
            pools = [pool_low64(s.engine) for s in sessions]
            assert [r.blocks for r in rec.instances] == [len(p) for p in pools], f"step {step}"
            holders: dict[int, int] = {}
            for p in pools:
                for h in p:
                    holders[h] = holders.get(h, 0) + 1
            multi = [n for n in holders.values() if n >= 2]
            assert (rec.duplication.blocks, rec.duplication.copies) == (len(multi), sum(multi))
            assert rec.distinct_blocks == len(holders) and rec.blocks == sum(len(p) for p in pools)
            assert rec.duplication.extra_bytes == 512 * (sum(multi) - len(multi))
            checked += 1
        assert rec.duplication.blocks >= 4 and sum(s.engine.pool.num_evictions for s in sessions) > 0
        assert all(r.reproducible and r.hashes.startswith("sha256_cbor, seed '0'") for r in rec.instances)
        # where would each prompt go: the engine whose pool holds the longest run of its blocks from the start
        hasher = VllmBlockHasher("sha256_cbor", SEED)
        for _k, p in asked:
            chain = [low64(d) for d in hasher.chain(p, BS)]
            want = []
            for pool in pools:
                n = 0
                while n < len(chain) and chain[n] in pool:
                    n += 1
                want.append(n)
            ans = fleet.route(p)
            assert [s.blocks for s in ans.scores] == want
            top = max(want)
            assert ans.best == (tuple(n for n, w in zip("abc", want) if w == top) if top else ())
    finally:
        fleet.close()
    assert checked == 60


def stored(hasher: VllmBlockHasher, tokens: list[int], block_id: int = 0) -> list[BlockStored]:
    """The events of a prompt's full blocks, as an engine hashing with ``hasher`` stores them."""
    out, parent = [], None
    for i, d in enumerate(hasher.chain(tokens, BS)):
        out.append(BlockStored(block_id + i, d.hex(), "r", tuple(tokens[i * BS : (i + 1) * BS]), parent))
        parent = d.hex()
    return out


def free_tcp() -> str:
    """A loopback address nothing listens on yet (so a restarted publisher can bind it again)."""
    return f"tcp://127.0.0.1:{free_port()}"


def test_an_instance_that_goes_away_is_marked_the_rest_go_on_and_it_comes_back_fresh():
    NOTICES.clear()
    hasher = VllmBlockHasher("sha256_cbor", SEED)
    addrs = [(free_tcp(), free_tcp()) for _ in range(3)]
    pubs = [publisher(e, r) for e, r in addrs]
    fleet = FleetSource(spec_of(pubs))
    try:
        until(fleet, lambda r: all(row.state == "up" for row in r.instances), what="three connections")
        shared = list(range(1, 4 * BS + 1))
        for i, p in enumerate(pubs):
            p.publish(stored(hasher, shared + [100 + i] * BS))
        rec = caught_up(fleet, pubs)
        assert [r.blocks for r in rec.instances] == [5, 5, 5] and rec.duplication.blocks == 4
        pubs[1].close()  # b goes away
        rec = until(fleet, lambda r: r.instances[1].state == "down", what="b marked down")
        assert NOTICES == [f"instance b ({addrs[1][0]}) went away: its cache is shown as last heard"]
        assert rec.instances[1].blocks == 5 and "down" in rec.instances[1].flags[0]  # as last heard
        assert [r.state for r in rec.instances] == ["up", "down", "up"] and rec.in_all()["up"] == 2
        ans = fleet.route(shared + [101] * BS)
        assert ans.scores[1].blocks == 5 and not ans.scores[1].up and ans.best == ("a", "c")  # not sent to b
        pubs[0].publish(stored(hasher, shared + [200] * BS * 2, 10))  # the others go on
        rec = caught_up(fleet, [pubs[0], pubs[2]])
        assert rec.instances[0].blocks == 7
        pubs[1] = publisher(*addrs[1])  # b's process again, from sequence number 0, with an empty cache
        rec = until(fleet, lambda r: r.instances[1].state == "up", what="b back")
        time.sleep(0.3)  # its subscription reaches the new publisher before it publishes
        pubs[1].publish(stored(hasher, [7] * BS))
        rec = until(fleet, lambda r: r.instances[1].restarts == 1 and r.instances[1].blocks == 1, what="b fresh")
        assert NOTICES[1:] == [
            f"instance b ({addrs[1][0]}) is back",
            f"instance b ({addrs[1][0]}) restarted (its sequence numbers went back): its cache was cleared",
        ]
        assert rec.instances[1].flags == ("restarted 1x",)
        assert rec.duplication.blocks == 4  # b's old copies are gone: a and c still share the system prompt
    finally:
        fleet.close()
        for p in pubs:
            p.close()


def test_an_instance_that_loses_batches_is_marked():
    NOTICES.clear()
    hasher = VllmBlockHasher("sha256_cbor", SEED)
    pubs = [publisher(), publisher(replay=None)]
    fleet = FleetSource(spec_of(pubs))
    try:
        until(fleet, lambda r: all(row.state == "up" for row in r.instances), what="connections")
        time.sleep(0.3)  # b has no replay socket: its subscription must be in place before it publishes
        pubs[1].publish(stored(hasher, [1] * BS))
        caught_up(fleet, pubs)
        real = pubs[1]._pub.send_multipart
        pubs[1]._pub.send_multipart = lambda *a, **k: setattr(pubs[1]._pub, "send_multipart", real)  # one lost
        pubs[1].publish(stored(hasher, [2] * BS))
        pubs[1].publish(stored(hasher, [3] * BS))
        pubs[0].publish(stored(hasher, [4] * BS))
        rec = caught_up(fleet, pubs)
        b = rec.instances[1]
        assert b.gaps_unrepaired == 1 and b.batches_missing == 1 and b.flags == ("1 batch missing",)
        assert [n for n in NOTICES if "instance b" in n] == [
            f"instance b ({connectable(pubs[1].endpoint)}): 1 batch missing and not repaired: its cache may miss blocks"
        ]
        assert rec.instances[0].flags == () and rec.instances[0].blocks == 1  # the rest go on
    finally:
        fleet.close()
        for p in pubs:
            p.close()


class Ticker(threading.Thread):
    """Publishes one prompt's blocks and then a block every few milliseconds until stopped (a busy engine)."""

    def __init__(self, pub: KVEventPublisher, first: list[BlockStored], base: int) -> None:
        super().__init__(daemon=True)
        self.pub, self.first, self.base, self.stop = pub, first, base, threading.Event()

    def run(self) -> None:
        self.pub.publish(self.first)
        hasher, n = VllmBlockHasher("sha256_cbor", SEED), 0
        while not self.stop.is_set():
            self.pub.publish(stored(hasher, [self.base + n] * BS, 100 + n))  # its own: never duplicated
            n += 1
            time.sleep(0.02)


def test_headless_json_prints_the_fleet_object_with_the_route():
    hasher = VllmBlockHasher("sha256_cbor", SEED)
    prompt = list(range(1, 6 * BS + 1))
    pubs = [publisher(), publisher()]
    tickers = [Ticker(pubs[0], stored(hasher, prompt[: 2 * BS]), 1000), Ticker(pubs[1], stored(hasher, prompt), 5000)]
    for t in tickers:
        t.start()
    try:
        args = [
            "--headless",
            "--json",
            "--steps",
            "20",
            "--block-size",
            str(BS),
            "--hash-seed",
            SEED,
            "--bytes-per-block",
            "64",
            "--route-ids",
            ",".join(map(str, prompt)),
        ]
        for p in pubs:
            args += ["--attach", connectable(p.endpoint), "--replay-endpoint", connectable(p.replay_endpoint)]
        r = subprocess.run(
            [sys.executable, "-m", "kvscope", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        for t in tickers:
            t.stop.set()
            t.join()
        for p in pubs:
            p.close()
    assert r.returncode == 0, r.stderr
    fleet = json.loads(r.stdout)["fleet"]
    assert fleet["polls"] == 20 and fleet["origin"] == "--attach"
    a, b = fleet["instances"]
    assert a["name"] == pubs[0].endpoint.split("://")[1] and a["state"] == "up" and b["blocks"] >= 6
    assert a["blocks"] >= 2 and a["shared_blocks"] == b["shared_blocks"] == 2 and a["stored_per_s"] > 0
    assert a["reproducible"] and a["hashes"].startswith("sha256_cbor, seed '0'") and a["metrics"] is None
    assert fleet["in_all"] == {
        "instances": 2,
        "up": 2,
        "blocks": a["blocks"] + b["blocks"],
        "distinct_blocks": a["blocks"] + b["blocks"] - 2,
        "duplicated_blocks": 2,
        "copies": 4,
        "extra_copies": 2,
        "extra_bytes": 128,
    }
    route = fleet["route"]
    assert route["best"] == [b["name"]] and route["prompt_tokens"] == len(prompt)
    assert [s["blocks"] for s in route["instances"]] == [2, 6]
    assert route["answer"].startswith(f"{b['name']}: 6 of its 6 full blocks cached")
    lines = fleet_summary_lines(fleet)  # what --headless prints without --json, from the same object
    assert lines[0] == "fleet (--attach): 2 instances, 2 up; 20 polls in " + f"{fleet['seconds']} s"
    assert f"{a['blocks']} blocks" in lines[1] and lines[2].strip().startswith("hashes: sha256_cbor, seed '0'")
    assert lines[5] == (
        f"  in all: {a['blocks'] + b['blocks']} blocks, {a['blocks'] + b['blocks'] - 2} distinct; 2 "
        f"held by two or more instances (4 copies, 2 extra, 128 B beyond one copy each)"
    )
    assert lines[6].startswith(f"  where would it go ({len(prompt)} tokens): {b['name']}: 6 of its 6")


def test_joining_an_idle_instance_shows_what_it_already_holds():
    """An engine with no traffic publishes nothing: the fleet asks its replay socket for its history on joining."""
    hasher = VllmBlockHasher("sha256_cbor", SEED)
    pubs = [publisher(), publisher(replay=None)]
    for p in pubs:
        p.publish(stored(hasher, list(range(1, 3 * BS + 1))))  # before anyone listens
    fleet = FleetSource(spec_of(pubs))
    try:
        # both connected (b's socket may come up a poll after a's history arrived), a's history in
        rec = until(fleet, lambda r: r.instances[0].blocks == 3 and r.instances[1].state == "up", what="a's history")
        assert rec.instances[0].gaps_unrepaired == 0 and rec.instances[0].reproducible
        assert rec.instances[1].blocks == 0 and rec.instances[1].state == "up"  # no replay socket: nothing to ask
        assert fleet.members[0].source.counters["replay_requests"] == 1
    finally:
        fleet.close()
        for p in pubs:
            p.close()


def test_a_text_prompt_is_routed_with_the_models_tokenizer(capsys):
    """``--route-prompt`` tokenizes as the served model does (the embedded SmolLM2's tokenizer by default)."""
    from engine.runner.models.loader import embedded_folder, load_tokenizer
    from kvscope.cli import main

    text = "Four score and seven years ago our fathers brought forth on this continent a new nation"
    ids = load_tokenizer(str(embedded_folder())).encode(text)
    pub = publisher()
    pub.publish(stored(VllmBlockHasher("sha256_cbor", SEED), ids))  # an idle instance holding the prompt
    try:
        code = main(
            [
                "--headless",
                "--json",
                "--attach",
                connectable(pub.endpoint),
                "--replay-endpoint",
                connectable(pub.replay_endpoint),
                "--block-size",
                str(BS),
                "--hash-seed",
                SEED,
                "--route-prompt",
                text,
                "--steps",
                "20",
            ]
        )
    finally:
        pub.close()
    assert code == 0
    route = json.loads(capsys.readouterr().out)["fleet"]["route"]
    assert route["prompt_tokens"] == len(ids) and route["instances"][0]["blocks"] == len(ids) // BS > 0


PUBLISHER = """
import sys, time
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), 4)
print(pub.endpoint, pub.replay_endpoint, flush=True)
time.sleep(600)
"""


def test_a_frozen_instance_is_found_by_its_missing_heartbeats_and_comes_back_as_itself():
    """A process that stops without closing its sockets (a hung host, here SIGSTOP) answers no heartbeat: it is
    marked down within the heartbeat timeout (3 s); once it runs again it is up again, not a restart."""
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        endpoint, replay = proc.stdout.readline().split()
        spec = FleetSpec((InstanceSpec("frozen", endpoint, replay),), "test")
        fleet = FleetSource(spec)
        try:
            until(fleet, lambda r: r.instances[0].state == "up", what="the connection")
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            until(fleet, lambda r: r.instances[0].state == "down", timeout=15, what="missing heartbeats")
            assert time.monotonic() - t0 < 6
            proc.send_signal(signal.SIGCONT)
            rec = until(fleet, lambda r: r.instances[0].state == "up", timeout=15, what="back")
            assert rec.instances[0].restarts == 0
        finally:
            fleet.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
