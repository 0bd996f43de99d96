"""Attach is a ``Source``: the live subscriber and the replay of its trace meet the protocol, step one poll at a
time, refuse every command in one line, and run headless through the one loop (``cli.headless.drive``)."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from engine import SamplingParams
from engine.inspect.kv_events import WireStored
from engine.inspect.kv_wire import encode_batch
from kvscope.cli import main
from kvscope.cli.attach import run_attach_headless
from kvscope.cli.headless import drive
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
from kvscope.sources.attach_record import AttachRecord
from kvscope.sources.attach_trace import AttachTraceWriter
from kvscope.sources.attached import AttachConfig, AttachedSource, AttachReplay, _Applier
from kvscope.sources.base import (
    ATTACH_CAPABILITIES,
    AUDIT,
    BLOCK_TABLES,
    COMMANDS,
    PREFIX_FOREST,
    REF_COUNTS,
    ReadOnlyError,
    Source,
    StepRecord,
)
from kvscope.sources.endpoints import connectable

# Every key of ``--headless --json`` after an attach, as before attach was a Source (docs and tests read them).
SUMMARY_KEYS = [
    "attached_to",
    "replay_endpoints",
    "topic",
    "polls",
    "seconds",
    "blocks",
    "tokens",
    "roots",
    "tiers",
    "block_sizes",
    "rates",
    "counters",
    "gaps_unrepaired",
    "cannot_show",
]


def write_trace(path, polls: int = 4) -> None:
    """An attach trace of ``polls`` polls, one stored block each, chained (no sockets)."""
    a = _Applier(AttachConfig("tcp://127.0.0.1:1"), AttachTraceWriter(path, {"endpoints": ["tcp://127.0.0.1:1"]}))
    for i in range(polls):
        a.apply(0, i, encode_batch([WireStored((10 + i,), 10 + i - 1 if i else None, (i, i), 2)], 0.0), "live", 0)
        a.finish_tick(0.5 * (i + 1))
    a.trace.close()


@pytest.fixture
def pub():
    p = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), 2)
    yield p
    p.close()


def assert_source(src) -> None:
    assert isinstance(src, Source)
    caps = src.info.capabilities
    assert caps == ATTACH_CAPABILITIES and PREFIX_FOREST in caps
    assert not caps & {COMMANDS, BLOCK_TABLES, REF_COUNTS, AUDIT} and src.info.read_only
    assert "ref counts" in src.info.extra["cannot_show"] and src.decode([1, 2]) is None


def assert_refuses_every_command(src) -> None:
    for call in (
        src.current,
        lambda: src.inject("hello", SamplingParams()),
        lambda: src.abort("r"),
        lambda: src.fork("r"),
        src.reset_prefix_cache,
        lambda: src.set_audit(True),
    ):
        with pytest.raises(ReadOnlyError) as e:
            call()
        text = str(e.value)
        assert text and "\n" not in text and ("read-only" in text or "audited" in text)
    src.set_audit(False)  # turning off what it does not have is nothing to refuse


def test_the_live_subscriber_is_a_source_and_a_step_is_one_poll(pub):
    src = AttachedSource(
        AttachConfig(connectable(pub.endpoint), connectable(pub.replay_endpoint), block_size=2, poll_interval=0.0)
    )
    try:
        assert_source(src)
        assert src.info.model_name == f"attached to {connectable(pub.endpoint)}" and src.info.block_size == 2
        assert src.describe()["endpoints"] == [connectable(pub.endpoint)]
        assert_refuses_every_command(src)
        records: list[StepRecord] = []
        deadline = time.monotonic() + 20
        while not records or not records[-1].cache.summary.blocks:
            pub.publish_payload(encode_batch([WireStored((1,), None, (7, 8), 2)], 0.0), 1)
            assert src.has_work()
            records.append(src.step())
            assert time.monotonic() < deadline, "nothing arrived"
            time.sleep(0.02)
        assert [r.step for r in records] == list(range(len(records))) and src.step_count == len(records)
        rec = records[-1]
        assert isinstance(rec.cache, AttachRecord) and rec.cache.tick == rec.step and rec.snapshot is None
        assert rec.step_output is None and rec.audit is None and rec.error is None
        assert any(e.kind == "stored" for r in records for e in r.events)
        src.config.poll_interval = 0.2  # with nothing queued, a step waits the poll interval
        while src.step().cache.batches:
            pass  # drain
        t0 = time.monotonic()
        assert src.step().cache.batches == 0 and time.monotonic() - t0 >= 0.15
    finally:
        src.close()
    assert not src.has_work()


def test_the_replay_of_an_attach_is_a_source_until_its_end(tmp_path):
    trace = tmp_path / "attach.jsonl"
    write_trace(trace)
    rep = AttachReplay(str(trace))
    assert_source(rep)
    assert rep.info.model_name == "replay of an attach to tcp://127.0.0.1:1" and rep.info.device == "attach trace"
    assert_refuses_every_command(rep)
    steps = []
    while rep.has_work():
        steps.append(rep.step())
    assert [r.step for r in steps] == [0, 1, 2, 3] and rep.step_count == 4
    assert steps[-1].cache.summary.blocks == 4 and steps[-1].cache.t == 2.0
    with pytest.raises(ValueError, match="ended"):
        rep.step()


def test_headless_replay_of_an_attach_keeps_its_summary(tmp_path, capsys):
    trace = tmp_path / "attach.jsonl"
    write_trace(trace)
    assert main(["--headless", "--json", "--replay", str(trace)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == SUMMARY_KEYS
    assert out["polls"] == 4 and out["seconds"] == 2.0 and out["blocks"] == 4 and out["roots"] == 1
    assert out["rates"]["stored_per_s"] == 2.0 and out["block_sizes"] == [2]
    assert main(["--headless", "--replay", str(trace), "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "attached to tcp://127.0.0.1:1: 2 polls in 1.0 s"
    assert lines[1] == "  cache: 2 blocks, 4 tokens, 1 prefix trees" and lines[2].startswith("    dp 0 GPU: 2 blocks")
    assert lines[3].startswith("  2 batches, 2 blocks stored (2.0/s)") and lines[4].startswith("  gaps: 0 detected")


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"steps": None, "duration": None, "json": True, **kw})


def test_ctrl_c_ends_a_headless_attach_with_its_summary(pub, capsys):
    src = AttachedSource(AttachConfig(connectable(pub.endpoint), poll_interval=0.0))
    real, n = src.poll, [0]

    def poll(timeout):
        n[0] += 1
        if n[0] == 4:
            raise KeyboardInterrupt
        return real(timeout)

    src.poll = poll
    assert run_attach_headless(src, _args()) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["polls"] == 3 and list(out) == SUMMARY_KEYS and not src.has_work()  # closed


def test_a_headless_attach_stops_at_its_duration(pub, capsys):
    src = AttachedSource(AttachConfig(connectable(pub.endpoint), poll_interval=0.05))
    t0 = time.monotonic()
    assert run_attach_headless(src, _args(duration=0.3)) == 0
    took = time.monotonic() - t0
    out = json.loads(capsys.readouterr().out)
    assert 0.3 <= took < 2.0 and 2 <= out["polls"] <= 7 and out["blocks"] == 0


def test_the_one_loop_says_a_failure_in_one_line(capsys):
    class Failing:
        closed = False

        def has_work(self):
            return True

        def step(self):
            raise ValueError("corrupt attach trace line 3: not JSON\nmore detail")

        def close(self):
            Failing.closed = True

    assert drive(Failing(), lambda rec: None) == 2 and Failing.closed
    assert capsys.readouterr().err == "kvscope: corrupt attach trace line 3: not JSON\n"

    class Interrupted(Failing):
        def step(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a run that ends by itself: Ctrl+C is not its end
        drive(Interrupted(), lambda rec: None)
    assert drive(Interrupted(), lambda rec: None, until_interrupted=True) is None
