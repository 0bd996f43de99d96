"""Every data-parallel rank of a probed vLLM (vLLM's real scheduler, one harness a rank, no model): rank r's probe
listens at PORT+r, kvscope given any rank's address finds and reads them all, shows one and switches to another,
and ``--headless --json`` counts every rank's requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ports import free_ports
from vllm_live import CONTROL, Harness, logged, need_vllm

from kvscope.sources.probe import ProbeSource

SYSTEM = list(range(100, 164))


@pytest.fixture(scope="module")
def ranks():
    """Two ranks' schedulers, as vLLM's engine cores for --data-parallel-size 2 (KVSCOPE_PROBE_DP_SIZE is what the
    plugin exports where vLLM starts them), each with requests of its own."""
    need_vllm()
    port = free_ports(2)[0]
    base = f"tcp://127.0.0.1:{port}"
    env = {**CONTROL, "KVSCOPE_PROBE_DP_SIZE": "2"}
    with Harness(base, num_blocks=64, env=env, args=("--dp-rank", "0")) as h0:
        with Harness(base, num_blocks=48, env=env, args=("--dp-rank", "1")) as h1:
            for r, h, n in ((0, h0, 3), (1, h1, 2)):
                h.cmd("spin", on=True, pace=0.05)
                for i in range(n):
                    h.cmd("add", id=f"rank{r}-chat{i}", prompt=SYSTEM + [300 + i] * 9, max_tokens=4000)
            yield base, port, h0, h1


def test_each_rank_listens_at_the_port_plus_its_rank(ranks):
    base, port, h0, h1 = ranks
    assert logged(h0, f"at tcp://127.0.0.1:{port} for data-parallel rank 0 of 2")
    assert logged(h1, f"at tcp://127.0.0.1:{port + 1} for data-parallel rank 1 of 2")


def test_kvscope_reads_every_rank_from_any_ranks_address_and_switches(ranks):
    base, port, h0, h1 = ranks
    src = ProbeSource(f"tcp://127.0.0.1:{port + 1}", wait_s=30)  # rank 1's address: rank 0 is found too
    try:
        assert src.shown_rank == 1 and sorted(src.ranks) == [0, 1] and all(r.loaded for r in src.ranks.values())
        assert src.info.extra["dp_ranks"] == [0, 1] and "data-parallel rank 1 of 2" in src.info.device
        assert src.info.num_blocks == 48 and src.ranks[0].info.num_blocks == 64  # each rank its own pool
        others = []
        src.on_rank_record = lambda r, rec: others.append((r, rec))
        shown = {q.request_id for q in src.step().snapshot.requests}
        for _ in range(5):
            src.step()
        assert shown == {"rank1-chat0", "rank1-chat1"}
        assert others and {r for r, _ in others} == {0}  # rank 0 read as it goes
        assert {q.request_id for q in others[-1][1].snapshot.requests} == {f"rank0-chat{i}" for i in range(3)}
        src.hold(True)  # Pause holds the rank shown
        assert src.mirror.paused and src.ranks[1].holding
        held = h1.cmd("dump")["step"]
        src.select_rank(0)  # paused: rank 1 runs on, rank 0 is held now
        assert src.info.extra["dp_rank"] == 0 and src.info.num_blocks == 64 and src.mirror.paused
        at = src.mirror.vllm_step
        rec = src.step()  # Step: one schedule of rank 0
        assert src.mirror.vllm_step == at + 1 and h0.cmd("dump")["step"] == at + 1 and rec.audit.ok
        assert {q.request_id for q in rec.snapshot.requests} == {f"rank0-chat{i}" for i in range(3)}
        src.step()
        assert h1.cmd("dump")["step"] > held  # the rank no longer shown was let go
        with pytest.raises(ValueError, match="data-parallel rank 5 is not read"):
            src.select_rank(5)
    finally:
        src.close()


def test_headless_json_has_every_ranks_summary(ranks):
    base, port, h0, h1 = ranks
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "--headless", "--json", "--probe", base, "--duration", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["requests_seen"] == 5 and d["num_blocks"] == 64  # the summary is rank 0's, the count every rank's
    assert [(r["rank"], r["endpoint"], r["answered"]) for r in d["dp_ranks"]] == [
        (0, base, True),
        (1, f"tcp://127.0.0.1:{port + 1}", True),
    ]
    assert [r["requests_seen"] for r in d["dp_ranks"]] == [3, 2] and [r["num_blocks"] for r in d["dp_ranks"]] == [
        64,
        48,
    ]
    for r in d["dp_ranks"]:
        assert r["steps"] > 0 and r["audit_problems"] == [] and r["flagged_blocks"] == 0
