"""kvscope on real vLLM-CPU servers of hybrid models (made from configs: tests/probe_vllm/hybrid_models.py), one
server a model, and on SmolLM2 with vLLM's ExampleConnector.

Each model gives vLLM two KV cache groups in one pool: Gemma-3 style sliding window (64 tokens) + full attention,
GraniteMoeHybrid Mamba2 + attention, Qwen3-Next gated delta net + full attention. Under chats sharing a system
prompt, the audit is clean on every step; held mid-run, every group's tables, the ref counts and the free queue
kvscope shows equal vLLM's own (``single_type_managers[g].req_to_blocks``, read by a second subscriber's fresh
keyframe at the same step); the leak fault is found in a hybrid model and named with its group (last: its leak
stays). With ExampleConnector (it saves every request's KV to disk and loads it back for a repeated prompt) the
audit stays clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
from ports import free_port
from vllm_live import (
    CONTROL,
    REMOTE_FAULTS,
    VllmServer,
    first_audit_problem,
    hybrid_model,
    logged,
    need_vllm,
    probe_keyframe,
)

from kvscope.sources.probe import ProbeSource

SENTENCE = (
    "You are kvscope's test assistant. You answer every question in one short sentence, politely, "
    "and you never repeat the question. "
)  # ~33 tokens


class Model:
    def __init__(self, dtype: str, kinds: list[str], block_size: int | None, repeats: int, max_tokens: int):
        self.dtype, self.kinds, self.block_size = dtype, kinds, block_size
        self.system = SENTENCE * repeats  # the shared system prompt
        self.max_tokens = max_tokens  # enough to cross a block boundary: a window slides, a state is retired
        self.extra = ("--num-gpu-blocks-override", "64" if block_size else "32", "--max-num-seqs", "4")
        self.max_len = 512 if block_size else 1024


# vLLM's kinds of the groups in order. Gemma-3's blocks are 32 tokens on vLLM-CPU (window 64): a shared prompt of ~110
# tokens hits and slides. A Mamba hybrid's block size is vLLM's (attention blocks sized to the state's page: 128 tokens
# for granite's here, 384 or 640 for qwen3next's: ``crossing``); its prompts stay inside one block, because vLLM-CPU's
# Mamba2 prefill over more than one block fails (IndexError in mamba_mixer2's varlen_states, with or without the
# probe), and decode across the block boundary (``crossing`` sets how far), where vLLM retires the state block before
# (the null block takes its place)
MODELS = {
    "gemma3": Model("float32", ["sliding_window", "full"], 16, 4, 24),
    "granite": Model("float32", ["mamba", "full"], None, 3, 48),
    "qwen3next": Model("bfloat16", ["mamba", "full"], None, 13, 40),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hybrid(request, tmp_path_factory):
    need_vllm()
    name = request.param
    m = MODELS[name]
    folder = hybrid_model(name, tmp_path_factory.mktemp("models"))
    probe = f"tcp://127.0.0.1:{free_port()}"
    with VllmServer(
        probe=probe,
        model=folder,
        dtype=m.dtype,
        block_size=m.block_size,
        extra=m.extra,
        max_model_len=m.max_len,
        startup_s=420,  # a Mamba hybrid starts slowly on a busy 2-core machine
        env={**CONTROL, **REMOTE_FAULTS},  # these tests hold vLLM mid-run and switch the leak on from kvscope
    ) as s:
        s.name, s.probe, s.system = name, probe, m.system
        yield s


def question(server, i: int) -> str:
    return getattr(server, "system", SENTENCE * 3) + f"Question {i}: what is {i} plus {i}?"


def crossing(server, n: int, block_size: int, max_tokens: int) -> int:
    """At least ``max_tokens``, and enough that every chat decodes 16 tokens past its first block's end, where a
    window slides or a state block is retired. A Mamba hybrid's block size is vLLM's choice from the state's page
    size, which depends on the CPU: Qwen3-Next's is 384 tokens with its SSM state in bf16, 640 on a CPU with
    AVX512-BF16 or AMX, where vLLM-CPU's accelerated GDN backend resets the state to float32 (``platforms/cpu.py``).
    ``n``: the chats ``load`` asks."""
    longest = max(server.tokens(question(server, i)) for i in range(n))
    return max(max_tokens, block_size - longest + 16)


def load(server, n: int, max_tokens: int) -> list[threading.Thread]:
    def ask(i: int) -> None:
        server.complete(question(server, i), max_tokens=max_tokens)

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def tables_of(kf, groups: int) -> list[dict[str, list[int]]]:
    """Every group's tables in a keyframe (vLLM's req_to_blocks as the probe read them whole)."""
    out: list[dict[str, list[int]]] = [{} for _ in range(groups)]
    for r in kf.requests:
        out[0][r.request_id] = list(r.block_ids or [])
        for g, _start, ids in r.groups:
            out[g][r.request_id] = list(ids)
    return [{rid: t for rid, t in d.items() if t} for d in out]


def test_every_step_audited_clean_and_every_groups_tables_are_vllms(hybrid):
    src = ProbeSource(hybrid.probe, wait_s=30)
    try:
        m = src.mirror
        assert [g.kind for g in m.groups] == MODELS[hybrid.name].kinds and m.num_groups == 2 and m.primary == 1
        want = MODELS[hybrid.name]
        max_tokens = crossing(hybrid, 4, m.groups[0].block_size, want.max_tokens)
        threads = load(hybrid, 4, max_tokens=max_tokens)
        records, held = [], False
        while any(t.is_alive() for t in threads) or not records or src.mirror.requests:
            rec = src.step()
            records.append(rec)
            assert rec.audit.ok, f"{hybrid.name} step {rec.step}: {rec.audit}"
            running = [r for r in rec.snapshot.requests if r.status == "RUNNING" and r.num_output_tokens >= 2]
            if not held and len(running) >= 2:  # held mid-run: both sides read at the same step
                held = True
                src.hold(True)
                kf = probe_keyframe(hybrid.probe, "test: a second subscriber")
                assert kf is not None and kf.step == src.mirror.vllm_step
                snap = src.current().snapshot
                assert snap.ref_cnt.tolist()[1:] == kf.ref_cnt[1:] and snap.free_queue.tolist() == kf.free_queue
                vllm_tables = tables_of(kf, 2)
                assert vllm_tables[0] and vllm_tables[1], vllm_tables
                for g in range(2):
                    assert {r.request_id: list(r.tables[g]) for r in snap.requests if r.tables[g]} == vllm_tables[g]
                src.hold(False)
        assert held, "never two requests running at once"
        for t in threads:
            t.join(60)
        last = records[-1].snapshot
        assert last.counters["generation_tokens"] >= 4 * max_tokens
        if hybrid.name == "gemma3":  # a whole block of the shared prompt (the Mamba hybrids' prompts are shorter)
            assert last.counters["prefix_cache_hits"] > 0
        # a sliding window's or a state group's table held vLLM's null block in place of blocks it gave back
        assert any(0 in r.tables[0] for rec in records for r in rec.snapshot.requests if r.tables[0])
        assert last.state[0] == 6 and last.counters["num_reserved_blocks"] == 1  # BlockState.RESERVED
    finally:
        src.close()


@pytest.mark.parametrize("hybrid", ["gemma3"], indirect=True)
def test_headless_json_counts_the_groups_and_an_idle_pool_uses_no_block(hybrid):
    threads = load(hybrid, 2, max_tokens=8)
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "--headless", "--json", "--probe", hybrid.probe, "--duration", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, QT_QPA_PLATFORM="offscreen"),
    )
    for t in threads:
        t.join(60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["kv_cache_groups"] == 2 and d["audit_problems"] == [] and d["audit_steps_with_problems"] == 0
    src = ProbeSource(hybrid.probe, wait_s=30)  # idle now: vLLM's null block is reserved, not used
    try:
        deadline = time.monotonic() + 30
        while src.mirror.requests and time.monotonic() < deadline:
            src.step()
        snap = src.current().snapshot
        c = snap.counters
        assert c["num_blocks"] - c["num_free_blocks"] - c["num_reserved_blocks"] == 0 and snap.state[0] == 6
    finally:
        src.close()


@pytest.mark.parametrize("hybrid", ["gemma3"], indirect=True)
def test_the_leak_fault_is_found_in_a_hybrid_model_and_named_with_its_group(hybrid):
    src = ProbeSource(hybrid.probe, wait_s=30)
    try:
        src.client.set_fault("leak-last-block", True)
        time.sleep(0.5)  # the fault reaches the probe's thread before the request (no message acknowledges it)
        threads = load(hybrid, 1, max_tokens=6)
        found = first_audit_problem(src)
        (p,) = found.audit.problems
        assert (p.problem, p.expected_ref, p.actual_ref) == ("leaked", 0, 1)
        assert p.group == "group 1 (full attention)" and "KV cache group 1 (full attention)" in str(p)
        assert logged(hybrid, f"block {p.block_id} of request {p.last_owner} will not be freed (KV cache group 1)")
        for t in threads:
            t.join(60)
        assert hybrid.healthy()
    finally:
        src.close()


@pytest.fixture(scope="module")
def example_connector(tmp_path_factory):
    need_vllm()
    probe = f"tcp://127.0.0.1:{free_port()}"
    store = tmp_path_factory.mktemp("kv-store")
    cfg = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    with VllmServer(
        probe=probe,
        extra=("--num-gpu-blocks-override", "24", "--kv-transfer-config", json.dumps(cfg)),
        max_model_len=512,
    ) as s:
        s.probe, s.store = probe, store
        yield s


def test_example_connector_every_step_audited_clean(example_connector):
    s = example_connector
    src = ProbeSource(s.probe, wait_s=30)
    try:
        assert src.info.extra["connector"] == "ExampleConnector"
        records = []
        for _ in range(2):  # the same prompts twice: the second time ExampleConnector loads what it saved
            threads = load(s, 3, max_tokens=8)
            while any(t.is_alive() for t in threads) or src.mirror.requests:
                rec = src.step()
                records.append(rec)
                assert rec.audit.ok, f"step {rec.step}: {rec.audit}"
        assert any(s.store.iterdir()), "ExampleConnector saved nothing"
        assert records[-1].snapshot.counters["generation_tokens"] >= 6 * 8 and s.healthy()
    finally:
        src.close()
