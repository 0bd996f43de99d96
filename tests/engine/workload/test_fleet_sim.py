"""A fleet of simulated instances behind a router (engine/workload/fleet.py, routers.py): a fleet of one is
exactly the single engine; round robin caches what the independent reference says; each policy's choice on
hand-made cases, read from the instances' real pools; session keys; the sweep; the command line's refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.workload import SimConfig, WorkloadError, read_workload, run_workload
from engine.workload.cli import main as cli_main
from engine.workload.fleet import FleetFeeder, build_fleet, run_fleet, session_keys
from engine.workload.fleet_sweep import format_fleet_table, plot_fleet, sweep_fleet
from engine.workload.reference import prefix_sharing, round_robin_sharing
from engine.workload.routers import (
    ROUTERS,
    Arrival,
    LeastLoaded,
    PrefixAware,
    PrefixLoad,
    RoundRobin,
    Router,
    Session,
    make_router,
)

ROOT = Path(__file__).resolve().parents[3]
CONVERSATION = ROOT / "resources" / "workloads" / "mooncake_conversation_200.jsonl"
SYNTHETIC = ROOT / "resources" / "workloads" / "mooncake_synthetic_200.jsonl"
EXAMPLE = ROOT / "resources" / "workloads" / "example_kvscope.jsonl"
ADDED = {"router", "load_imbalance", "instances"}  # what a fleet's workload object adds
COST_OF_THIS_MACHINE = {"wall_s", "peak_rss_mb"}


def write(tmp_path: Path, lines: list[dict], name: str = "w.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def same_object(single: dict, fleet: dict) -> dict:
    """The keys where the fleet's workload object differs from the single run's (empty: equal)."""
    assert ADDED <= set(fleet) and set(fleet) - ADDED == set(single)
    return {k: (single[k], fleet[k]) for k in single if k not in COST_OF_THIS_MACHINE and single[k] != fleet[k]}


# -- a fleet of one is the single engine -----------------------------------------------------------------
CASES = {
    # arrivals 20x faster than the trace's, a small pool: queueing, evictions and preemptions
    "full, preempting": (
        CONVERSATION,
        EngineConfig(block_size=16, num_gpu_blocks=2500, max_num_seqs=16),
        SimConfig(time_scale=0.05),
    ),
    "full, skipping": (SYNTHETIC, EngineConfig(block_size=64, num_gpu_blocks=400), SimConfig(time_scale=0.2)),
    "sequential": (CONVERSATION, EngineConfig(block_size=512, num_gpu_blocks=300), SimConfig(sequential=True)),
    "token ids": (EXAMPLE, EngineConfig(block_size=4, num_gpu_blocks=120), SimConfig()),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fleet_of_one_is_the_single_engine_under_every_policy(case):
    path, cfg, sim = CASES[case]
    w = read_workload(path, limit=80)
    single = run_workload(w, cfg, sim).summary()
    if case == "full, preempting":
        assert single["preemptions"] > 0 and single["evictions"] > 0
    if case == "full, skipping":
        assert single["skipped_too_big"] > 0
    for name in ROUTERS:
        fleet = run_fleet(w, cfg, sim, 1, name).summary()
        assert same_object(single, fleet) == {}, name
        (inst,) = fleet["instances"]
        assert inst["share"] == 1.0 and inst["requests"] == single["requests"] and fleet["load_imbalance"] == 1.0
        assert inst["cached_tokens"] == single["cached_tokens"] and inst["busy_s"] == single["busy_s"]


# -- round robin against the reference ---------------------------------------------------------------------
@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=["conversation", "synthetic"])
@pytest.mark.parametrize("bs", [16, 512])
def test_round_robin_caches_what_each_instance_of_the_reference_caches(path, bs):
    w = read_workload(path)
    for n in (2, 3, 5):
        refs = round_robin_sharing(w, n, bs, 131072)
        pool = max(r.blocks_allocated for r in refs)  # every instance's pool never evicts
        res = run_fleet(
            w, EngineConfig(block_size=bs, num_gpu_blocks=pool), SimConfig(sequential=True), n, "round-robin"
        )
        assert res.total.evictions == 0 and res.total.requests == sum(r.requests for r in refs) == 200
        assert [i.cached_tokens for i in res.instances] == [r.cached_tokens for r in refs]
        assert res.total.cached_tokens == sum(r.cached_tokens for r in refs) > 0
        assert res.shares() == [r.requests / 200 for r in refs]
    # and round robin loses what the trace shares across the instances: below one pool's hit rate
    whole = prefix_sharing(w, bs, 131072)
    assert sum(r.cached_tokens for r in round_robin_sharing(w, 4, bs)) < whole.cached_tokens


def test_round_robin_over_token_prompts_matches_its_reference():
    w = read_workload(EXAMPLE)
    refs = round_robin_sharing(w, 3, 4)
    res = run_fleet(w, EngineConfig(block_size=4, num_gpu_blocks=400), SimConfig(sequential=True), 3, "round-robin")
    assert [i.cached_tokens for i in res.instances] == [r.cached_tokens for r in refs]


# -- each policy's choice ----------------------------------------------------------------------------------
class FakeInstance:
    """An instance whose load and cache a test sets."""

    def __init__(self, running: int = 0, waiting: int = 0, cached: int = 0) -> None:
        self.running, self.queued, self.cached = running, waiting, cached

    def load(self) -> int:
        return self.running + self.queued

    def waiting(self) -> int:
        return self.queued

    def cached_prefix(self, block_hashes) -> int:
        return min(self.cached, len(block_hashes))


HASHES = tuple(bytes([i]) * 8 for i in range(10))


def test_round_robin_and_least_loaded_choices():
    fleet = [FakeInstance(5), FakeInstance(0, 2), FakeInstance(1, 1)]
    rr = RoundRobin()
    assert [rr.choose(Arrival(i, None), fleet) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    ll = LeastLoaded()
    assert ll.choose(Arrival(0, None), fleet) == 1  # loads 5, 2, 2: the first of the two least loaded
    fleet[1].running = 3
    assert ll.choose(Arrival(0, None), fleet) == 2


def test_session_sends_a_session_to_one_instance_and_spreads_sessions():
    s = Session()
    fleet = [FakeInstance() for _ in range(4)]
    for key in ("alice", 7, ("session", "bob")):
        assert len({s.choose(Arrival(i, key), fleet) for i in range(5)}) == 1
    assert len({s.choose(Arrival(0, k), fleet) for k in range(40)}) == 4  # 40 sessions over 4 instances
    assert Session().choose(Arrival(0, "alice"), fleet) == s.choose(Arrival(9, "alice"), fleet)  # stable


def test_prefix_aware_takes_the_longest_cached_prefix_ties_to_the_least_loaded():
    pa = PrefixAware()
    fleet = [FakeInstance(0, 0, 2), FakeInstance(3, 0, 5), FakeInstance(0, 1, 5), FakeInstance(0, 0, 4)]
    assert pa.choose(Arrival(0, None, HASHES), fleet) == 2  # 5 blocks on 1 and 2: 2 has fewer requests
    assert pa.choose(Arrival(0, None, ()), fleet) == 0  # nothing to match: the least loaded (0 and 3: the first)


def test_prefix_load_scores_as_llm_d_combines_its_scorers():
    pl = PrefixLoad()
    assert pl.params() == {"prefix_weight": 2.0, "load_weight": 1.0, "threshold": 128}
    assert [pl.load_score(w) for w in (0, 64, 128, 500)] == [0.5, 0.25, 0.0, 0.0]
    # prefixes 4, 3, 0 normalised to 1, 0.75, 0; queues 200, 0, 0: scores 2.0, 2.0, 0.5: a tie, to the less loaded
    fleet = [FakeInstance(10, 200, 4), FakeInstance(2, 0, 3), FakeInstance(0, 0, 0)]
    assert pl.scores(Arrival(0, None, HASHES), fleet) == [2.0, 2.0, 0.5]
    assert pl.choose(Arrival(0, None, HASHES), fleet) == 1
    fleet[1].cached = 1  # now 1, 0.25, 0: 2.0, 1.0, 0.5: the cache wins over the queue
    assert pl.choose(Arrival(0, None, HASHES), fleet) == 0
    assert PrefixAware().choose(Arrival(0, None, HASHES), fleet) == 0  # prefix-aware never looks at the queue
    fleet = [FakeInstance(0, 0, 3)] * 3  # all equal: every prefix scores 1, the first wins
    assert pl.scores(Arrival(0, None, HASHES), fleet) == [2.5] * 3 and pl.choose(Arrival(0, None, HASHES), fleet) == 0
    with pytest.raises(ValueError, match="threshold must be >= 1"):
        PrefixLoad(threshold=0)


class Planned(Router):
    """Routes by a plan: trace line -> instance."""

    name = "planned"
    needs_hashes = True

    def __init__(self, plan: dict[int, int]) -> None:
        self.plan = plan

    def choose(self, arrival: Arrival, instances) -> int:
        return self.plan[arrival.line]


def test_the_prefix_routers_read_each_instances_own_pool(tmp_path):
    """Requests placed by a plan fill three real pools; a new prompt's cached prefix on each is what its hash
    map holds, and the prefix routers follow it."""
    a = list(range(1, 13))  # three blocks of 4
    p = write(
        tmp_path,
        [
            {"arrival": 0, "prompt": a, "max_tokens": 2},
            {"arrival": 0, "prompt": a[:8] + [50, 51, 52, 53], "max_tokens": 2},
            {"arrival": 0, "prompt": [90, 91, 92, 93, 94], "max_tokens": 2},
            {"arrival": 9, "prompt": a + [7, 7, 7, 7, 7], "max_tokens": 2},
        ],
    )
    w = read_workload(p)
    fleet = build_fleet(w, EngineConfig(block_size=4, num_gpu_blocks=64), SimConfig(), 3, Planned({1: 2, 2: 1, 3: 0}))
    while fleet.next < 3 or any(i.engine.has_unfinished() for i in fleet.instances):
        fleet.step()
    assert [i.routed for i in fleet.instances] == [1, 1, 1]
    req = fleet.front.request_for(fleet.instances[0].engine, w.requests[3])
    hashes = fleet.instances[0].engine.kv.block_hashes(req, 16)  # 17 tokens: 4 blocks a hit may cover
    assert [i.cached_prefix(hashes) for i in fleet.instances] == [0, 2, 3]
    for inst in fleet.instances:  # what the pool would hit at admission is what the router read
        assert inst.engine.kv.get_computed_blocks(req)[1] == 4 * inst.cached_prefix(hashes)
    arrival = Arrival(4, None, hashes)
    assert PrefixAware().choose(arrival, fleet.instances) == 2
    assert PrefixLoad().choose(arrival, fleet.instances) == 2
    # the router of a real fleet: the last request goes where its prefix is, and hits it there
    fleet.router = PrefixAware()
    route = fleet.step()
    assert route.line == 4 and route.instance == 2 and route.cached_blocks == (0, 2, 3)
    fleet.run()
    res = fleet.finish()
    assert res.instances[2].records[-1].cached_tokens == 12


# -- session keys ------------------------------------------------------------------------------------------
def test_session_keys_skip_a_prefix_every_request_shares(tmp_path):
    p = write(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [0, 1, 2, 3]},
            {"timestamp": 0, "input_length": 1200, "output_length": 1, "hash_ids": [0, 4, 5]},
            {"timestamp": 0, "input_length": 500, "output_length": 1, "hash_ids": [0]},
        ],
    )
    assert session_keys(read_workload(p)) == [1, 1, 4, 0]  # block 0 opens everything; a request of it alone: 0
    w = read_workload(SYNTHETIC)
    assert session_keys(w) == [r.hash_ids[0] for r in w.requests]  # no block is in half the requests
    shared, other = list(range(1, 601)), list(range(2, 602))
    p = write(
        tmp_path,
        [
            {"arrival": 0, "prompt": [1, 2], "max_tokens": 1, "session": "alice"},
            {"arrival": 0, "prompt": [3, 4], "max_tokens": 1, "session": 7},
            {"arrival": 0, "prompt": shared + [9], "max_tokens": 1},
            {"arrival": 0, "prompt": shared + [8, 8], "max_tokens": 1},
            {"arrival": 0, "prompt": other, "max_tokens": 1},
        ],
    )
    keys = session_keys(read_workload(p))
    assert keys[:2] == [("session", "alice"), ("session", 7)]
    # token prompts: by 512-token blocks, the first that at most half of the requests share
    assert keys[2] == keys[3] != keys[4]  # their first block is in 2 of 5 requests: it names their session
    p = write(
        tmp_path,
        [{"arrival": 0, "prompt": shared[:512] + [i] * 10, "max_tokens": 1} for i in range(3)]
        + [{"arrival": 0, "prompt": shared[:512] + [7] * 512 + [i], "max_tokens": 1} for i in range(2)],
        "t.jsonl",
    )
    keys = session_keys(read_workload(p))
    assert len(set(keys)) == 4 and keys[3] == keys[4]  # past the block all five share: the second decides
    bad = write(tmp_path, [{"arrival": 0, "prompt": [1], "max_tokens": 1, "session": ["x"]}], "bad.jsonl")
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:1: 'session' must be a non-empty string or an integer"):
        read_workload(bad)


def test_session_affinity_keeps_a_conversation_on_one_instance():
    w = read_workload(CONVERSATION)
    res = run_fleet(w, EngineConfig(block_size=64, num_gpu_blocks=3000), SimConfig(time_scale=0.1), 4, "session")
    keys = session_keys(w)
    where = {}
    for i, inst in enumerate(res.instances):
        for rec in inst.records:
            assert where.setdefault(keys[rec.line - 1], i) == i
    assert len({i for i in where.values()}) == 4  # and the conversations spread over every instance


# -- the fleet as a whole ----------------------------------------------------------------------------------
def test_a_fleet_plays_the_trace_with_clean_pools_and_one_clock():
    w = read_workload(CONVERSATION, limit=120)
    fleet = build_fleet(
        w, EngineConfig(block_size=16, num_gpu_blocks=3000), SimConfig(time_scale=0.1), 4, "prefix-aware"
    )
    assert isinstance(fleet, FleetFeeder)
    last = 0.0
    while (event := fleet.step()) is not None:
        if isinstance(event, tuple):  # an instance's step: the earliest busy clock, never going back
            inst, out = event
            assert out.error is None
        else:
            assert event.arrival_s >= last
            last = event.arrival_s
    res = fleet.finish()
    s = res.summary()
    assert s["requests"] == sum(e["requests"] for e in s["instances"]) == 120 - s["skipped_too_big"]
    assert sum(e["share"] for e in s["instances"]) == pytest.approx(1.0)
    assert s["cached_tokens"] == sum(e["cached_tokens"] for e in s["instances"])
    assert s["virtual_s"] == max(e["virtual_s"] for e in s["instances"])
    assert s["busy_s"] == pytest.approx(sum(e["busy_s"] for e in s["instances"]))
    assert s["num_gpu_blocks"] == 4 * 3000 and s["router"] == {"name": "prefix-aware"}
    assert s["load_imbalance"] == max(e["share"] for e in s["instances"]) * 4
    for inst in fleet.instances:
        assert inst.engine.audit().ok and inst.engine.pool.num_free_blocks == 3000
        assert all(r.arrival_s <= r.arrival_s + r.ttft_s <= r.finish_s for r in inst.feeder.result.records)


def trunks_trace(tmp_path: Path, n: int = 120) -> Path:
    """Requests over six shared trunks of four blocks (a private tail each), one every 2 s."""
    rng = random.Random(3)
    trunks = [[1000 * t + k for k in range(4)] for t in range(6)]
    lines, private = [], 10_000
    for i in range(n):
        ids = trunks[rng.randrange(6)] + [private, private + 1]
        private += 2
        lines.append({"timestamp": 2000 * i, "input_length": 6 * 512 - 100, "output_length": 8, "hash_ids": ids})
    return write(tmp_path, lines, "trunks.jsonl")


def test_prefix_aware_routing_wins_back_what_round_robin_loses(tmp_path):
    w = read_workload(trunks_trace(tmp_path))
    cfg, sim = EngineConfig(block_size=64, num_gpu_blocks=2000), SimConfig()
    hit = {r: run_fleet(w, cfg, sim, 4, r).total.cached_tokens for r in ROUTERS}
    one = run_fleet(w, cfg, sim, 1, "round-robin").total.cached_tokens
    # round robin computes each trunk on every instance; the prefix routers compute it once, as one pool does
    assert hit["round-robin"] < hit["prefix-aware"] == hit["prefix-load"] == one


def test_the_fleets_capacity_split_evenly():
    w = read_workload(SYNTHETIC, limit=30)
    res = run_fleet(w, EngineConfig(block_size=64), SimConfig(), 4, "least-loaded", fleet_kv_tokens=1e6)
    assert [r.num_gpu_blocks for r in res.instances] == [int(1e6 / 4) // 64] * 4
    assert res.total.num_gpu_blocks == 4 * (int(1e6 / 4) // 64)
    with pytest.raises(ValueError, match="--instances must be an integer >= 1"):
        build_fleet(w, EngineConfig(), SimConfig(), 0)
    with pytest.raises(ValueError, match="--router takes round-robin, .* got 'fastest'"):
        make_router("fastest")


def test_sweep_rows_table_and_plot(tmp_path):
    w = read_workload(SYNTHETIC, limit=60)
    rows = sweep_fleet(
        w,
        [1, 2, 4],
        ["round-robin", "prefix-aware"],
        EngineConfig(block_size=64),
        SimConfig(kv_tokens=2e5, time_scale=0.2),
    )
    assert [(r["router"], r["instances"]) for r in rows] == [
        (p, n) for p in ("round-robin", "prefix-aware") for n in (1, 2, 4)
    ]
    assert all(r["capacity"] == "per instance" and len(r["per_instance"]) == r["instances"] for r in rows)
    one = [r for r in rows if r["instances"] == 1]
    assert one[0]["hit_rate"] == one[1]["hit_rate"] and one[0]["ttft_p99_s"] == one[1]["ttft_p99_s"]
    table = format_fleet_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| prefix-aware | 4 |" in table
    assert plot_fleet(rows, tmp_path / "fleet.png").stat().st_size > 20_000
    json.dumps(rows)


# -- the command line --------------------------------------------------------------------------------------
def test_python_m_engine_workload_plays_a_fleet_and_its_sweep(tmp_path, capsys):
    args = [str(SYNTHETIC), "--block-size", "64", "--limit", "40", "--kv-tokens", "3e5"]
    assert cli_main(args + ["--instances", "3", "--router", "prefix-aware", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["workload"]
    assert out["requests"] == 40 and len(out["instances"]) == 3 and out["router"]["name"] == "prefix-aware"
    assert cli_main(args + ["--instances", "2", "--router", "round-robin,session"]) == 0
    text = capsys.readouterr().out
    assert text.count("fleet     2 instances behind") == 2 and "behind session" in text
    png = tmp_path / "f.png"
    assert cli_main(args + ["--sweep-instances", "1,2", "--router", "least-loaded", "--png", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["instances"] for r in out["sweep"]] == [1, 2] and png.stat().st_size > 20_000


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--router", "session"], "--router is for a fleet: give --instances N (or --sweep-instances)"),
        (["--fleet-kv-tokens", "1e6"], "--fleet-kv-tokens is for a fleet: give --instances N"),
        (["--instances", "2", "--sweep-instances", "1,2"], "--sweep-instances sets the number of instances"),
        (["--instances", "2", "--sweep-kv-tokens", "1e5"], "--sweep-kv-tokens sweeps one engine's pool"),
        (["--instances", "2", "--fleet-kv-tokens", "1e6", "--kv-tokens", "1e5"], "leave out --kv-tokens"),
        (["--instances", "2", "--fleet-kv-tokens", "1e6", "--num-gpu-blocks", "9"], "leave out --num-gpu-blocks"),
        (["--instances", "2", "--router", "random"], "--router takes round-robin, least-loaded, session"),
        (["--instances", "0"], "instances must be >= 1, got 0"),
        (["--sweep-instances", "1,0"], "--sweep-instances takes instance counts >= 1"),
        (["--sweep-instances", "2", "--eviction-policy", "lru,lfu"], "--sweep-instances draws one eviction policy"),
        (["--instances", "2", "--png", "x.png"], "--png draws a sweep: give --sweep-kv-tokens or --sweep-instances"),
    ],
)
def test_every_bad_fleet_option_is_one_line_and_exit_2(argv, line, capsys):
    assert cli_main([str(SYNTHETIC), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
