"""The vLLM leak lab (resources/scenarios/lab-vllm-leak.json): a real vLLM's recording through the probe, played
anywhere with no vLLM and no model; what its notes say happens, happens at the steps they say."""

from __future__ import annotations

import json
import subprocess
import sys

from kvscope.runtime.build import SourceSpec, build_source
from kvscope.scenario import load_scenario


def test_the_lab_plays_a_real_vllms_leak_as_its_notes_tell_it():
    from engine import EngineConfig

    src = build_source(SourceSpec(EngineConfig(), scenario="lab-vllm-leak"))
    assert src.info.read_only and src.info.scenario == load_scenario("lab-vllm-leak").title
    assert src.info.model_name.startswith("vLLM 0.32") and src.info.block_size == 32 and src.info.num_blocks == 16
    records = {}
    while src.has_work():
        rec = src.step()
        records[rec.step] = rec
    first = min(records[1].snapshot.requests, key=lambda r: r.index).request_id
    assert all(records[s].audit.ok for s in range(1, 40))
    (leak,) = records[40].audit.problems  # the step the first chat finished
    assert (leak.block_id, leak.problem, leak.last_owner) == (3, "leaked", first)
    second = [r for r in records[42].snapshot.requests if r.status == "RUNNING"]
    assert len(second) == 1 and second[0].num_cached_tokens == 32 and second[0].block_ids[0] == 1
    last = records[max(records)]
    assert last.snapshot.counters["num_free_blocks"] == 14 and [p.block_id for p in last.audit.problems] == [3]
    for at, _text in load_scenario("lab-vllm-leak").notes:
        assert at in records, f"a note at step {at}, which the recording does not have"


def test_the_recorded_chats_read_as_text_on_a_machine_without_the_recorders_model_folder():
    """The recording names the model folder vLLM served from on the machine that made it (a conversion of the
    embedded GGUF, named by that machine's transformers and cache format). Here that folder does not exist; the
    same GGUF's tokenizer reads the chats (before, the lab showed bare token ids), and another model's folder
    still gets none."""
    import base64
    from pathlib import Path

    from engine import EngineConfig
    from kvscope.sources.probe import _tokenizer
    from kvscope_vllm_probe.wire import decode_from_probe

    trace = Path(__file__).resolve().parents[3] / "resources" / "probe" / "vllm-leak.jsonl"
    keyframe = decode_from_probe(base64.b64decode(json.loads(trace.read_text().splitlines()[1])["payload"]))
    recorded = keyframe.info.model  # the folder vLLM served from, on the recording's machine
    assert Path(recorded).name.startswith("SmolLM2-135M-Instruct.") and not Path(recorded).is_dir()
    src = build_source(SourceSpec(EngineConfig(), scenario="lab-vllm-leak"))
    assert src.tokenizer is not None
    rec = src.step()
    while src.has_work() and not rec.snapshot.requests:
        rec = src.step()
    text = src.decode(rec.snapshot.requests[0].token_ids)
    assert text is not None and text.startswith("You are the on-call assistant of a small web shop.")
    assert src.vocab()[1] == "<|im_start|>"
    assert _tokenizer("/elsewhere/gguf/Another-Model.Q4_0-0123456789abcdef-transformers5.25.0-f2") is None


def test_every_consumer_of_the_cache_follows_a_recorded_vllm():
    """The timeline, a KV-event subscriber (kvscope's encoder, vLLM's wire format) and the miss explainer, fed the
    events kvscope makes of vLLM's ops, keep the cache the mirror holds, step after step."""
    from engine import EngineConfig
    from engine.inspect.cache_miss import CacheMissExplainer
    from engine.inspect.kv_events import external_hash, to_wire_events
    from engine.inspect.kv_wire import decode_batch, encode_batch
    from kvscope.history import RunHistory
    from kvscope.sources.remote_cache import RemoteCacheModel

    src = build_source(SourceSpec(EngineConfig(), scenario="lab-vllm-leak"))
    history, remote, explainer = RunHistory(keyframe_every=1), RemoteCacheModel(), CacheMissExplainer(32)
    while src.has_work():
        rec = src.step()
        truth = dict(rec.snapshot.block_hashes)
        history.record(rec.snapshot, 0.0, events=rec.events)
        for ev in decode_batch(encode_batch(to_wire_events(rec.events, 32), 0.0)).events:
            remote.apply(ev, 0)
        explainer.feed_snapshot(rec.step, rec.events, rec.snapshot)
        assert dict(history.at(rec.step).block_hashes) == truth, rec.step
        assert {h for (_, _, h) in remote.nodes} == {external_hash(h, "int") for h in truth.values()}, rec.step
        assert set(explainer.mirror) == set(truth.values()), rec.step


def test_the_lab_headless_names_the_leak_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "--headless", "--json", "--scenario", "lab-vllm-leak"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["block_size"] == 32 and len(d["audit_problems"]) == 1 and "block 3: leaked" in d["audit_problems"][0]
