"""Step records across the process boundary: every step decodes to the snapshot the engine made."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from engine import SamplingParams
from engine.inspect.snapshot import KVSnapshot, LiveState, PoolState, StepDigest
from kvscope.runtime import protocol as p
from kvscope.runtime.shm import ShmSlots
from kvscope.runtime.wire import RecordDecoder, RecordEncoder, decode_rows, encode_rows
from kvscope.sources.live import LiveSource
from kvscope.sysinfo import MemoryReading

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _roundtrip(enc: RecordEncoder, dec: RecordDecoder, rec) -> p.Stepped:
    """One record alone in its batch, through pickle, decoded whole."""
    enc.add(p.Stepped(rec, MemoryReading()))
    (got,) = dec.decode(pickle.loads(pickle.dumps(enc.flush(), protocol=5)))
    return got.assembled()


def test_records_decode_to_the_engines_snapshots_step_after_step(tiny_engine):
    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=40))
    enc, dec = RecordEncoder(), RecordDecoder()  # no shared memory: arrays inline
    for i, prompt in enumerate([list(range(5, 19)), list(range(5, 15)) + [2, 3], [7, 8, 9]]):
        src.inject(prompt, dataclasses.replace(GREEDY, max_tokens=4 + 3 * i))
    sent = []
    while src.has_work():
        rec = src.step()
        got = _roundtrip(enc, dec, rec).record
        snap = rec.snapshot
        assert got.snapshot.requests == snap.requests  # rows rebuilt from deltas, tokens and all
        assert got.events == rec.events
        assert dict(got.snapshot.cached_tokens) == dict(snap.cached_tokens)
        assert np.array_equal(got.snapshot.state, snap.state)
        sent.append(enc.rows_sent.copy())
    # finished rows are the same objects step after step: they travel as their id alone
    last = [r for r in rec.snapshot.requests if r.status.startswith("FINISHED")]
    assert last and all(sent[-1][r.request_id].row is r for r in last)


def _same_snapshot(got: KVSnapshot, want: KVSnapshot) -> None:
    for f in dataclasses.fields(KVSnapshot):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name


def test_an_engine_process_record_is_the_raw_state_and_decodes_to_the_whole_snapshot(tiny_engine):
    """What the engine process sends (a live state read before the next step: rows as deltas, blocks per
    state as the pool counts them, the pool's arrays through shared memory) assembles, in the window's
    process, to every field of the snapshot the engine itself builds; swaps included."""
    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, preemption_mode="swap"))
    src.raw_snapshots = True
    slots = ShmSlots.create(12)
    enc, dec, dig = RecordEncoder(), RecordDecoder(), RecordDecoder()  # dig: digests every step
    enc.attach(ShmSlots.attach(slots.spec))
    dec.slots = dig.slots = slots
    for i in range(4):
        src.inject(list(range(5 + i, 15 + i)), dataclasses.replace(GREEDY, max_tokens=12))
    # two samples: forked sequences whose first rows carry their parent's tokens
    src.inject(list(range(40, 47)), SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=3))
    swapped = 0
    try:
        while src.has_work():
            rec = src.step()
            assert isinstance(rec.snapshot, LiveState)
            want = src.engine.snapshot()
            enc.add(p.Stepped(rec, MemoryReading()))
            batch = pickle.loads(pickle.dumps(enc.flush(), protocol=5))
            assert batch.slot is not None and batch.inline is None
            (got,) = dec.decode(batch)
            assert isinstance(got.record.snapshot, PoolState)
            (d,) = dig.decode(batch, whole=False)
            d = d.record.snapshot
            assert isinstance(d, StepDigest) and d.requests == want.requests and d.counters == want.counters
            assert d.state_counts == want.state_counts and d.num_blocks == want.num_blocks
            enc.release(batch.slot)
            got = got.assembled().record.snapshot
            swapped += int((got.cpu_state != 0).sum())
            _same_snapshot(got, want)
    finally:
        enc.detach()
        slots.close()
    assert swapped  # the CPU pool's views were derived from the rows too


def test_a_batch_of_steps_decodes_to_every_steps_snapshot(tiny_engine):
    """Steps sent together: each decodes to its own rows, counters, blocks per state and events, the last
    whole from the pool's arrays as they were after it; a batch whose pool changed again before it went
    carries no arrays, and the next one brings the state up to date."""
    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=24))
    src.raw_snapshots = True
    enc, dec = RecordEncoder(), RecordDecoder()  # no slots: arrays inline
    for i in range(3):
        src.inject(list(range(5 + i, 17 + i)), dataclasses.replace(GREEDY, max_tokens=8 + 2 * i))
    enc.add(p.Stepped(src.current(), MemoryReading()))
    dec.decode(enc.flush())  # the first record after a load: the cache maps whole
    batches = 0
    while src.has_work():
        truth = []
        for _ in range(4):
            if not src.has_work():
                break
            rec = src.step()
            truth.append((src.engine.snapshot(), rec.events))
            enc.add(p.Stepped(rec, MemoryReading()))
        got = dec.decode(pickle.loads(pickle.dumps(enc.flush(), protocol=5)))
        batches += 1
        assert len(got) == len(truth)
        for res, (want, events) in zip(got, truth):
            snap = res.record.snapshot
            assert snap.step == want.step and snap.requests == want.requests and snap.counters == want.counters
            assert snap.state_counts == want.state_counts and res.events == events
        assert all(isinstance(r.record.snapshot, StepDigest) for r in got[:-1])
        _same_snapshot(got[-1].assembled().record.snapshot, truth[-1][0])
    assert batches >= 3
    # a batch flushed after the pool changed again (a step's events not yet drawn into a record): no arrays
    src.inject(list(range(60, 75)), GREEDY)
    enc.add(p.Stepped(src.step(), MemoryReading()))
    src.engine.abort(next(iter(src.engine.requests)))  # frees its blocks: events pending
    stale = enc.flush()
    assert not stale.has_arrays
    (res,) = dec.decode(stale)
    assert isinstance(res.record.snapshot, StepDigest)
    _same_snapshot(_roundtrip(enc, dec, src.current()).record.snapshot, src.engine.snapshot())


def test_a_row_travels_as_its_new_tokens_and_a_changed_block_table_only():
    from engine.inspect.snapshot import RequestInfo

    a = RequestInfo("a", 0, "RUNNING", 3, 1, 0, 3, (0,), "", (1, 2, 3, 4))
    grown = dataclasses.replace(a, num_output_tokens=2, token_ids=(1, 2, 3, 4, 5))
    moved = dataclasses.replace(grown, num_output_tokens=3, block_ids=(0, 7), token_ids=(1, 2, 3, 4, 5, 6))
    # not a continuation of the last token sent (6, the sixth): the tokens travel whole
    restarted = dataclasses.replace(moved, num_output_tokens=3, token_ids=(1, 2, 3, 4, 9, 7, 8))
    sent, rows = {}, {}
    assert decode_rows(encode_rows((a,), sent), rows) == (a,)
    blocks_at = 1 + 7  # after n: request_id, index, status, 3 token counts, num_computed, then block_ids
    items = encode_rows((grown,), sent)
    assert items[0][0] == 4 and items[0][1 + 9] == (5,)  # the 4 tokens before, then the new one
    assert items[0][blocks_at] is None  # the block table sent before
    assert decode_rows(items, rows) == (grown,)
    items = encode_rows((moved,), sent)
    assert items[0][0] == 5 and items[0][1 + 9] == (6,) and items[0][blocks_at] == (0, 7)
    assert decode_rows(items, rows) == (moved,)
    items = encode_rows((restarted,), sent)
    assert items[0][0] == 0 and items[0][1 + 9] == restarted.token_ids  # whole
    assert decode_rows(items, rows) == (restarted,)
    assert decode_rows(encode_rows((), sent), rows) == () and not sent and not rows  # gone: forgotten both sides


def test_a_new_source_starts_the_rows_again(tiny_engine):
    enc, dec = RecordEncoder(), RecordDecoder()
    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=40))
    src.inject([5, 6, 7, 8, 9], GREEDY)
    _roundtrip(enc, dec, src.step())
    enc.loaded()  # what the engine process does on Loaded: the decoder may have lost everything
    dec2 = RecordDecoder()
    rec = src.step()
    assert _roundtrip(enc, dec2, rec).record.snapshot.requests == rec.snapshot.requests


def test_a_rows_text_travels_as_what_it_gained(tiny_hf, tiny_tokenizer):
    """With a tokenizer, a running request's output text grows every step: the wire sends what it gained
    (not the whole text again), and a text that was rewritten (a stop string cut off) whole; every step
    decodes to the engine's own rows."""
    from engine import LLMEngine

    engine = LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", block_size=4, num_gpu_blocks=64)
    src = LiveSource(engine)
    src.raw_snapshots = True
    enc, dec = RecordEncoder(), RecordDecoder()
    src.inject("tell me", SamplingParams(max_tokens=24, temperature=1.0, seed=5))
    first = _roundtrip(enc, dec, src.current())  # the rows whole
    assert first.record.snapshot.requests == src.engine.snapshot().requests
    grown = []
    while src.has_work():
        rec = src.step()
        want = src.engine.snapshot()
        enc.add(p.Stepped(rec, MemoryReading()))
        batch = pickle.loads(pickle.dumps(enc.flush(), protocol=5))
        grown += [item[5] for item in batch.last.requests if isinstance(item, tuple) and isinstance(item[0], str)]
        (got,) = dec.decode(batch, whole=False)
        assert got.record.snapshot.requests == want.requests
    texts = [g for g in grown if isinstance(g, str)]
    assert texts and sum(map(len, texts)) <= len(src.engine.snapshot().requests[0].text)  # only what was new
    # a rewritten text travels whole: the decoder takes it as it is
    from engine.inspect.snapshot import LiveRow

    sent, rows = {}, {}
    engine2 = LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", block_size=4, num_gpu_blocks=64)
    engine2.add_request("abc", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine2.step()
    req = next(iter(engine2.requests.values()))
    row = LiveRow(req, engine2.kv)
    decode_rows(encode_rows((row,), sent), rows)
    req.output_text = "xyz" + req.output_text  # not a continuation of what was sent
    item = encode_rows((row,), sent)[0]
    assert item[5] == (req.output_text,)
    assert decode_rows((item,), rows)[0].text == req.output_text
