"""Real workloads (engine/workload): the reader and its every bad input, token making from hash ids, the
engine's hit count against the independent reference, the sweep, skipped requests, and the virtual clock."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from engine import EngineConfig
from engine.workload import (
    CostModel,
    HashIdTokens,
    SimConfig,
    WorkloadError,
    build_engine,
    read_workload,
    run_workload,
)
from engine.workload.cli import main as cli_main
from engine.workload.reference import prefix_sharing
from engine.workload.sweep import format_table, plot_sweep, reference_row, sweep

ROOT = Path(__file__).resolve().parents[3]
EXCERPTS = ROOT / "resources" / "workloads"
CONVERSATION = EXCERPTS / "mooncake_conversation_200.jsonl"
SYNTHETIC = EXCERPTS / "mooncake_synthetic_200.jsonl"
EXAMPLE = EXCERPTS / "example_kvscope.jsonl"
EXAMPLE_TEXT = EXCERPTS / "example_kvscope_text.jsonl"
FULL_TRACES = ROOT.parent / "shared" / "traces" / "mooncake"


def write(tmp_path: Path, lines: list, name: str = "w.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def mc(ts: int = 0, n: int = 600, out: int = 4, ids: list[int] | None = None) -> dict:
    return {
        "timestamp": ts,
        "input_length": n,
        "output_length": out,
        "hash_ids": ids if ids is not None else list(range(-(-n // 512))),
    }


class CharTokenizer:
    """A stand-in tokenizer: one token per character."""

    name_or_path = "chars"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 30000 for c in text]


# -- the reader ----------------------------------------------------------------------------------------
def test_reads_mooncake_ms_and_kvscope_seconds():
    w = read_workload(CONVERSATION)
    assert w.format == "mooncake" and len(w.requests) == 200 and w.name == "mooncake_conversation_200"
    raw = [json.loads(line) for line in CONVERSATION.read_text().splitlines()]
    for r, d in zip(w.requests, raw):
        assert r.arrival_s == d["timestamp"] / 1000 and r.prompt_len == d["input_length"]
        assert r.hash_ids == tuple(d["hash_ids"]) and r.max_tokens == max(1, d["output_length"])
    assert w.requests[-1].line == 200 and w.num_private_blocks == 0
    k = read_workload(EXAMPLE)
    assert k.format == "kvscope" and len(k.requests) == 12
    first = json.loads(EXAMPLE.read_text().splitlines()[0])
    assert k.requests[0].token_ids == first["prompt"] and k.requests[0].max_tokens == first["max_tokens"]
    assert [r.arrival_s for r in k.requests] == sorted(r.arrival_s for r in k.requests)
    t = read_workload(EXAMPLE_TEXT, tokenizer=CharTokenizer())
    assert t.requests[0].token_ids == CharTokenizer().encode(
        json.loads(EXAMPLE_TEXT.read_text().splitlines()[0])["prompt"]
    )
    assert read_workload(CONVERSATION, limit=7).requests[-1].line == 7


def test_blank_lines_are_skipped_and_fewer_ids_get_private_ones(tmp_path):
    p = write(tmp_path, [mc(0, 1100, ids=[5, 6, 7]), "", mc(1, 1100, ids=[5]), "  ", mc(2, 1100, ids=[5, 6])])
    w = read_workload(p)
    assert [r.line for r in w.requests] == [1, 3, 5]
    assert w.requests[1].hash_ids == (5, 8, 9) and w.requests[2].hash_ids == (5, 6, 10)
    assert w.num_private_blocks == 3
    # the private ids are never shared: the second request hits its first block only, the third two
    ref = prefix_sharing(w, 512)
    assert ref.cached_tokens == 512 + 1024


BAD_MOONCAKE = [
    ("{not json", "not JSON"),
    ("[1, 2]", "must be a JSON object, got list"),
    ({"timestamp": 0, "input_length": 5, "hash_ids": [1]}, "missing 'output_length'"),
    ({"input_length": 5, "output_length": 1, "hash_ids": [1]}, "missing 'timestamp'"),
    (mc(-1), "'timestamp' must be a number of milliseconds >= 0, got -1"),
    (mc(n=-5, ids=[]), "'input_length' must be an integer >= 1, got -5"),
    (mc(n=0, ids=[]), "'input_length' must be an integer >= 1, got 0"),
    (mc(out=-1), "'output_length' must be an integer >= 0, got -1"),
    ({**mc(), "input_length": "600"}, "'input_length' must be an integer >= 1, got '600'"),
    ({**mc(), "output_length": True}, "'output_length' must be an integer >= 0, got True"),
    ({**mc(), "timestamp": float("nan")}, "'timestamp' must be a number"),
    (mc(ids=[1, -3]), "'hash_ids' must hold integers >= 0, got -3"),
    (mc(ids=[1, 2.5]), "'hash_ids' must hold integers >= 0, got 2.5"),
    ({**mc(), "hash_ids": "1,2"}, "'hash_ids' must be a list of integers, got str"),
    (mc(n=600, ids=[1, 2, 3]), "3 hash ids for input_length 600, but 600 tokens make at most ceil(600 / 512) = 2"),
    ({"arrival": 0, "prompt": [1], "max_tokens": 1}, "a kvscope request in a Mooncake workload"),
]


@pytest.mark.parametrize("bad,message", BAD_MOONCAKE, ids=[m for _, m in BAD_MOONCAKE])
def test_a_bad_mooncake_line_names_file_and_line(tmp_path, bad, message):
    p = write(tmp_path, [mc(0), mc(5), bad])
    with pytest.raises(WorkloadError) as e:
        read_workload(p)
    text = str(e.value)
    assert text.startswith(f"{p}:3: ") and message in text and "\n" not in text


BAD_KVSCOPE = [
    ({"arrival": 0, "prompt": [1, 2]}, "missing 'max_tokens'"),
    ({"arrival": -0.5, "prompt": [1], "max_tokens": 1}, "'arrival' must be a number of seconds >= 0, got -0.5"),
    ({"arrival": "soon", "prompt": [1], "max_tokens": 1}, "'arrival' must be a number of seconds >= 0"),
    ({"arrival": 0, "prompt": [1], "max_tokens": 0}, "'max_tokens' must be an integer >= 1, got 0"),
    ({"arrival": 0, "prompt": [], "max_tokens": 1}, "'prompt' is an empty list"),
    ({"arrival": 0, "prompt": "   ", "max_tokens": 1}, "'prompt' is empty"),
    ({"arrival": 0, "prompt": [1, -2], "max_tokens": 1}, "a token-id prompt must hold integers >= 0, got -2"),
    ({"arrival": 0, "prompt": {"a": 1}, "max_tokens": 1}, "'prompt' must be text or a list of token ids, got dict"),
    ({"arrival": 0, "prompt": "hello", "max_tokens": 1}, "a text prompt needs a tokenizer"),
    (mc(0), "a Mooncake request in a kvscope workload"),
]


@pytest.mark.parametrize("bad,message", BAD_KVSCOPE, ids=[m for _, m in BAD_KVSCOPE])
def test_a_bad_kvscope_line_names_file_and_line(tmp_path, bad, message):
    good = {"arrival": 1.0, "prompt": [1, 2, 3], "max_tokens": 2}
    p = write(tmp_path, [good, good, bad])
    with pytest.raises(WorkloadError) as e:
        read_workload(p)
    text = str(e.value)
    assert text.startswith(f"{p}:3: ") and message in text and "\n" not in text


def test_time_going_back_is_refused(tmp_path):
    p = write(tmp_path, [mc(100), mc(100), mc(99)])
    with pytest.raises(WorkloadError, match=r"w\.jsonl:3: timestamp 99 ms goes back in time"):
        read_workload(p)
    p = write(
        tmp_path, [{"arrival": 2, "prompt": [1], "max_tokens": 1}, {"arrival": 1.5, "prompt": [1], "max_tokens": 1}]
    )
    with pytest.raises(WorkloadError, match=r"w\.jsonl:2: arrival 1\.5 s goes back in time"):
        read_workload(p)


def test_bad_files_name_the_file(tmp_path):
    with pytest.raises(WorkloadError, match=r"nope\.jsonl: cannot read it"):
        read_workload(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match=r"w\.jsonl: no requests in the file"):
        read_workload(write(tmp_path, ["", "   "]))
    with pytest.raises(WorkloadError, match=r"w\.jsonl:1: neither a Mooncake request .* nor a kvscope request"):
        read_workload(write(tmp_path, [{"hello": 1}]))
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(mc()).encode() + b"\n\xff\xfe\n")
    with pytest.raises(WorkloadError, match=r"latin1\.jsonl: not UTF-8 text"):
        read_workload(bad)
    with pytest.raises(WorkloadError, match="unknown workload format"):
        read_workload(CONVERSATION, format="csv")


def test_bad_inputs_at_run_time_name_the_line(tmp_path):
    p = write(
        tmp_path,
        [{"arrival": 0, "prompt": [1, 2], "max_tokens": 1}, {"arrival": 0, "prompt": [1, 200000], "max_tokens": 1}],
    )
    with pytest.raises(
        WorkloadError,
        match=r"w\.jsonl:2: token id 200000 is outside the simulated model's "
        r"vocabulary \(0\.\.128255\)",
    ):
        run_workload(read_workload(p), EngineConfig(num_gpu_blocks=64))
    w = read_workload(CONVERSATION, limit=3)
    with pytest.raises(WorkloadError, match="block size 48 does not divide the trace's 512-token blocks"):
        build_engine(w, EngineConfig(block_size=48, num_gpu_blocks=64))
    big = read_workload(write(tmp_path, [mc(ids=[200_000, 1])]))  # beyond the vocabulary: two digits needed
    with pytest.raises(WorkloadError, match="block size 1 is too small for hash ids up to 200000"):
        build_engine(big, EngineConfig(block_size=1, num_gpu_blocks=64))
    build_engine(big, EngineConfig(block_size=2, num_gpu_blocks=64))
    with pytest.raises(ValueError, match="sim_model must be one of llama-2-7b, .* got 'gpt-5'"):
        build_engine(w, EngineConfig(num_gpu_blocks=64), SimConfig(sim_model="gpt-5"))
    with pytest.raises(ValueError, match="unknown --sim-gpu 'tpu'"):
        CostModel.named("llama-3-8b", "tpu")
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        build_engine(w, EngineConfig(num_gpu_blocks=64), SimConfig(time_scale=0.0))


def test_the_command_line_says_one_line_and_exits_2(tmp_path, capsys):
    p = write(tmp_path, [mc(0), "{oops"])
    assert cli_main([str(p), "--num-gpu-blocks", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {p}:2: not JSON (Expecting property name enclosed in double quotes at column 2)"
    assert cli_main([str(CONVERSATION), "--eviction-policy", "mru"]) == 2
    assert "--eviction-policy takes lru, lfu" in capsys.readouterr().err
    assert cli_main([str(CONVERSATION), "--sweep-kv-tokens", "1e4,lots"]) == 2
    assert "--sweep-kv-tokens takes numbers" in capsys.readouterr().err
    assert cli_main([str(CONVERSATION), "--png", str(tmp_path / "x.png")]) == 2
    assert "--png draws a sweep" in capsys.readouterr().err
    assert cli_main([str(CONVERSATION), "--block-size", "0"]) == 2
    assert "block_size must be >= 1" in capsys.readouterr().err


# -- token making ---------------------------------------------------------------------------------
def test_same_id_same_tokens_and_every_token_in_the_vocabulary():
    tok = HashIdTokens(128256)
    a, b = tok.prompt([3, 9, 27], 1300), tok.prompt([3, 9, 44], 1100)
    assert len(a) == 1300 and len(b) == 1100 and a[:1024] == b[:1024] and a[1024:1100] != b[1024:]
    assert tok.block(9) == a[512:1024] == HashIdTokens(128256).block(9)  # a function of the id alone
    assert all(0 <= t < 128256 for t in a + b)
    assert a[1024:] == tok.block(27)[:276]  # a partial last block: the start of its id's tokens


@pytest.mark.parametrize("vocab", [2, 3, 50, 128256])
def test_different_ids_never_collide(vocab):
    """Every id below V**2 (all of them for a small vocabulary) has its own first two tokens, so a first
    block of 2 or more tokens tells any two ids apart; below V, the first token alone does."""
    tok = HashIdTokens(vocab)
    ids = range(vocab * vocab) if vocab <= 50 else random.Random(1).sample(range(tok.max_id + 1), 20000)
    heads = {tuple(tok.block(h)[:2]) for h in ids}
    assert len(heads) == len(ids)
    assert len({tok.block(h)[0] for h in range(vocab)}) == vocab
    assert tok.min_block_size(vocab - 1) == 1 and tok.min_block_size(vocab) == 2
    with pytest.raises(ValueError, match="outside"):
        tok.block(vocab * vocab)


def test_the_tokens_are_shared_int_objects():
    """Cached blocks keep their tokens: one int object per vocabulary entry, not one per token."""
    tok = HashIdTokens(1000)
    a, b = tok.prompt([7, 8], 1024), tok.prompt([9, 7], 1024)
    assert all(x is tok._ints[x] for x in a + b)


# -- the engine against the reference ------------------------------------------------------------------
def _infinite(w, bs: int, policy: str = "lru"):
    ref = prefix_sharing(w, bs, 131072)
    res = run_workload(
        w,
        EngineConfig(block_size=bs, num_gpu_blocks=ref.blocks_allocated, eviction_policy=policy),
        SimConfig(sequential=True),
    )
    return ref, res


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC], ids=["conversation", "synthetic"])
@pytest.mark.parametrize("bs", [16, 512])
def test_the_engines_hits_equal_the_reference_on_the_excerpts(path, bs):
    w = read_workload(path)
    ref, res = _infinite(w, bs)
    assert res.evictions == 0 and res.requests == ref.requests == 200 and res.skipped_too_long == 0
    assert res.prompt_tokens == ref.prompt_tokens == w.prompt_tokens
    assert res.cached_tokens == ref.cached_tokens > 0
    assert res.hit_rate == ref.hit_rate
    assert res.generated_tokens == 0  # sequential: the one sampled token is not counted


def _branchy_trace(tmp_path: Path, n: int = 60) -> Path:
    """Many requests over few prefixes, odd lengths (partial blocks everywhere), small ids."""
    rng = random.Random(5)
    trunks = [[rng.randrange(1000) for _ in range(6)] for _ in range(5)]
    lines, next_id = [], 1000
    for i in range(n):
        t = trunks[rng.randrange(5)][: rng.randint(0, 6)]
        extra = rng.randint(1, 3)
        ids = t + list(range(next_id, next_id + extra))
        next_id += extra
        length = (len(ids) - 1) * 512 + rng.randint(1, 512)
        lines.append(mc(i * 100, length, rng.randint(1, 9), ids))
    return write(tmp_path, lines, "branchy.jsonl")


@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_every_block_size_dividing_512_hits_as_the_reference(tmp_path, bs):
    w = read_workload(_branchy_trace(tmp_path, 40 if bs < 8 else 60))
    ref, res = _infinite(w, bs)
    assert res.evictions == 0 and res.cached_tokens == ref.cached_tokens > 0.3 * ref.prompt_tokens


def test_the_reference_over_token_ids_matches_the_engine():
    w = read_workload(EXAMPLE)
    for bs in (4, 16):
        ref, res = _infinite(w, bs)
        assert res.cached_tokens == ref.cached_tokens > 0


@pytest.mark.skipif(not (FULL_TRACES / "synthetic_trace.jsonl").exists(), reason="the full traces are not here")
def test_the_full_synthetic_trace_at_block_size_512_equals_its_reference():
    w = read_workload(FULL_TRACES / "synthetic_trace.jsonl")
    ref, res = _infinite(w, 512)
    assert res.skipped_too_long == 10 and res.requests == ref.requests == 3983
    assert res.cached_tokens == ref.cached_tokens and res.evictions == 0
    assert 0.64 < res.hit_rate < 0.66  # Table 2: 66 %


# -- the sweep, skipped requests, policies -----------------------------------------------------------------
def test_sweep_rows_table_and_plot(tmp_path):
    w = read_workload(CONVERSATION, limit=120)
    cfg = EngineConfig(block_size=512)
    sim = SimConfig(sequential=True)
    ref = reference_row(w, cfg, sim)
    caps = [2e4, 1e5, 1e6, 1e7]
    rows = sweep(w, caps, ["lru", "lfu"], cfg, sim, reference=ref)
    assert [(r["policy"], r["kv_tokens_asked"]) for r in rows] == [(p, c) for p in ("lru", "lfu") for c in caps]
    need = {
        "trace",
        "policy",
        "mode",
        "kv_tokens",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_rate",
        "evictions",
        "preemptions",
        "ttft_p50_s",
        "ttft_p99_s",
        "skipped",
        "of_max",
        "wall_s",
    }
    assert all(need <= set(r) for r in rows)
    assert all(r["kv_tokens"] <= r["kv_tokens_asked"] and r["mode"] == "sequential" for r in rows)
    lru = [r for r in rows if r["policy"] == "lru"]
    assert lru[0]["skipped"] > 0 and lru[-1]["skipped"] == 0  # 2e4 tokens: the longest prompts do not fit
    assert lru[-1]["hit_rate"] == pytest.approx(ref["hit_rate"]) and lru[-1]["evictions"] == 0
    whole = [r["hit_rate"] for r in lru if not r["skipped"]]  # more capacity, more hits (the same requests)
    assert len(whole) >= 2 and whole == sorted(whole)
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| lfu |" in table
    png = plot_sweep(rows, tmp_path / "sweep.png", [ref])
    assert png.stat().st_size > 10_000
    json.dumps(rows)  # the rows are plain JSON


def test_too_long_and_too_big_requests_are_counted_and_skipped(tmp_path):
    w = read_workload(CONVERSATION)
    lens = [r.prompt_len for r in w.requests]
    res = run_workload(w, EngineConfig(block_size=512, max_model_len=8192), SimConfig(kv_tokens=1e8, sequential=True))
    assert res.skipped_too_long == sum(n >= 8192 for n in lens) > 0 and res.max_model_len == 8192
    assert res.requests == 200 - res.skipped_too_long
    assert res.skipped_prompt_tokens == sum(n for n in lens if n >= 8192)
    assert res.cached_tokens == prefix_sharing(w, 512, 8192).cached_tokens
    pool = 40  # blocks of 512: a prompt of 40 x 512 tokens or more (its sampled token included) never fits
    res = run_workload(w, EngineConfig(block_size=512, num_gpu_blocks=pool), SimConfig(sequential=True))
    assert res.skipped_too_big == sum(math.ceil((n + 1) / 512) > pool for n in lens) > 0
    assert res.requests + res.skipped_too_big == 200
    # the model's own context: llama-2-7b has 4,096 tokens
    res = run_workload(w, EngineConfig(block_size=512, num_gpu_blocks=400), SimConfig(sim_model="llama-2-7b"))
    assert res.skipped_too_long == sum(n >= 4096 for n in lens) and res.max_model_len == 4096


def test_full_mode_generates_the_outputs_and_preempts_in_a_small_pool():
    w = read_workload(CONVERSATION, limit=60)
    cfg = EngineConfig(block_size=16, max_num_seqs=64)
    res = run_workload(w, cfg, SimConfig(kv_tokens=6e4, time_scale=0.01))
    assert res.mode == "full" and res.requests + res.skipped_too_big == 60 and res.failed == 0
    ran = {rec.line for rec in res.records}
    assert res.generated_tokens == sum(r.max_tokens for r in w.requests if r.line in ran)
    assert res.preemptions > 0 and res.evictions > 0 and res.peak_running > 1
    assert all(rec.ttft_s is not None and rec.finish_s >= rec.arrival_s + rec.ttft_s for rec in res.records)
    s = res.summary()
    for key in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_rate",
        "evictions",
        "preemptions",
        "ttft_p50_s",
        "ttft_p99_s",
    ):
        assert key in s
    assert 0 <= s["hit_rate"] <= 1 and s["ttft_p50_s"] <= s["ttft_p99_s"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_each_policy_runs_a_trace_with_a_clean_audit(policy):
    w = read_workload(SYNTHETIC, limit=80)
    engine, feeder = build_engine(
        w,
        EngineConfig(block_size=64, eviction_policy=policy, max_num_seqs=16),
        SimConfig(kv_tokens=3e5, time_scale=0.05),
    )
    while feeder.has_work() or engine.has_unfinished():
        feeder.before_step(engine)
        out = engine.step()
        feeder.after_step(engine, out)
        assert out.error is None
        if engine.step_count % 50 == 0:
            assert engine.audit().ok
    res = feeder.finish()
    assert engine.pool.free_queue.policy == policy and res.evictions > 0 and engine.audit().ok
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# -- the virtual clock ------------------------------------------------------------------------------------
def _burst(tmp_path: Path, gap_s: float) -> Path:
    rng = random.Random(0)
    return write(
        tmp_path,
        [
            {"arrival": round(i * gap_s, 3), "prompt": [rng.randrange(1, 30000) for _ in range(8000)], "max_tokens": 4}
            for i in range(12)
        ],
        f"burst{gap_s}.jsonl",
    )


def test_ttft_grows_when_arrivals_outpace_the_card(tmp_path):
    cfg = EngineConfig(block_size=16, max_num_batched_tokens=2048)
    sim = SimConfig(sim_model="llama-3.1-8b", sim_gpu="rtx-4090", kv_tokens=2e5)
    prefill = CostModel.named("llama-3.1-8b", "rtx-4090").step_time([(0, 8000)])
    spaced = run_workload(read_workload(_burst(tmp_path, 10.0)), cfg, sim)
    ttfts = [r.ttft_s for r in spaced.records]
    assert max(ttfts) < 1.5 * min(ttfts) and min(ttfts) == pytest.approx(prefill, rel=0.02)  # each alone
    burst = run_workload(read_workload(_burst(tmp_path, 0.05)), cfg, sim)
    ttfts = [r.ttft_s for r in burst.records]
    assert ttfts[-1] > 5 * ttfts[0] and ttfts[-1] > 8 * prefill  # queued behind the others' prefills
    assert burst.summary()["ttft_p99_s"] > 3 * spaced.summary()["ttft_p99_s"]
    faster = run_workload(
        read_workload(_burst(tmp_path, 0.05)), cfg, SimConfig(sim_model="llama-3.1-8b", sim_gpu="h200", kv_tokens=2e5)
    )
    assert faster.summary()["ttft_p99_s"] < burst.summary()["ttft_p99_s"] / 3  # 6x the compute


def test_the_cost_model():
    c = CostModel.named("llama-3-8b", "h100")
    assert c.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 and c.tp == 1
    assert CostModel.named("llama-3.1-70b", "h100").tp == 4 and CostModel.named("llama-3.1-70b", "mi300x").tp == 2
    decode = c.step_time([(4096, 1)] * 64)
    assert decode == pytest.approx((c.weight_bytes + 64 * 4097 * c.kv_bytes_per_token) / c.bandwidth)  # memory
    prefill = c.step_time([(0, 8192)])
    assert prefill > c.step_time([(0, 4096)]) * 2  # compute, and attention grows with the context
    assert prefill == pytest.approx((2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * 8192 * 8193 / 2) / c.flops)
    assert c.step_time([]) == 0.0
    text = c.describe()
    assert "llama-3-8b on h100" in text and "80% of the bandwidth" in text and len(text.splitlines()) == 6
    assert CostModel.named("llama-3-8b", "h100", kv_cache_dtype="fp8").kv_bytes_per_token == c.kv_bytes_per_token / 2


def test_an_engine_over_the_sim_runner():
    w = read_workload(EXAMPLE)
    engine, _ = build_engine(w, EngineConfig(block_size=16), SimConfig(sim_model="qwen2.5-7b", sim_gpu="h200"))
    cost = CostModel.named("qwen2.5-7b", "h200")
    assert engine.max_model_len == 131072 and engine.vocab_size == 152064 and engine.eos_token_ids == frozenset()
    assert engine.pool.num_blocks == cost.kv_capacity_tokens(0.9) // 16  # the card's memory, beside the weights
    assert engine.runner.block_bytes == 16 * cost.kv_bytes_per_token and engine.weights is None
    assert "simulated" in engine.model_name


def test_headless_json(capsys):
    assert (
        cli_main(
            [
                str(SYNTHETIC),
                "--block-size",
                "512",
                "--num-gpu-blocks",
                "4000",
                "--sequential",
                "--limit",
                "50",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)["workload"]
    for key in (
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "hit_rate",
        "evictions",
        "preemptions",
        "ttft_p50_s",
        "ttft_p99_s",
        "reference_hit_rate",
    ):
        assert key in out
    assert out["requests"] == 50 and out["hit_rate"] == out["reference_hit_rate"]


def test_the_command_lines_sweep_prints_the_table_and_draws_the_plot(tmp_path, capsys, monkeypatch):
    args = [
        str(CONVERSATION),
        "--block-size",
        "512",
        "--sequential",
        "--sweep-kv-tokens",
        "1e5,1e6",
        "--eviction-policy",
        "lru,lfu",
        "--limit",
        "50",
    ]
    assert cli_main(args + ["--json", "--png", str(tmp_path / "s.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["kv_tokens_asked"]) for r in out["sweep"]] == [
        ("lru", 1e5),
        ("lru", 1e6),
        ("lfu", 1e5),
        ("lfu", 1e6),
    ]
    assert out["reference"]["paper_table2"] == 0.40 and (tmp_path / "s.png").stat().st_size > 10_000
    monkeypatch.chdir(tmp_path)
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "| trace | policy |" in text and "reference (a pool that never evicts" in text
    assert "llama-3.1-8b on h100" in text and (tmp_path / "mooncake_conversation_200_hit_rate.png").exists()


def test_the_benchmarks_quick_run_writes_its_results(tmp_path, monkeypatch):
    """bench/workloads.py --quick (the 200-line excerpts): its JSON's shape and its two figures."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    common = importlib.import_module("common")
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    bench = importlib.import_module("workloads")
    result = bench.run(quick=True)
    data = json.loads((tmp_path / "quick" / "workloads.json").read_text())
    assert data["benchmark"] == "workloads" and data["quick"] is True
    for name in ("workloads", "workloads_arrivals"):
        assert (tmp_path / "quick" / f"{name}.png").stat().st_size > 10_000
    assert data["equality"] and all(r["equal"] for r in data["equality"])
    assert {"trace", "policy", "kv_tokens", "hit_rate", "of_max", "skipped"} <= set(data["rows"][0])
    assert {"max_num_seqs", "time_scale", "ttft_p50_s", "preemptions", "utilization"} <= set(data["arrivals"][0])
    assert {r["time_scale"] for r in data["arrivals"]} == {1.0, 4.0}
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    sys.modules.pop("workloads", None)
