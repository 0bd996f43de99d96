"""Step records across the process boundary: every record decodes to the snapshot the engine made."""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from engine import SamplingParams
from engine.inspect.snapshot import KVSnapshot, PoolState, StepDigest, block_counts
from kvscope.sources import protocol as p
from kvscope.sources.live import LiveSource
from kvscope.sources.shm import ShmSlots
from kvscope.sources.wire import RecordDecoder, RecordEncoder, decode_rows, encode_rows
from kvscope.sysinfo import MemoryReading

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _roundtrip(enc: RecordEncoder, dec: RecordDecoder, rec) -> p.Stepped:
    wire = pickle.loads(pickle.dumps(enc.encode(p.Stepped(rec, MemoryReading())), protocol=5))
    return dec.decode(wire)


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


def test_an_engine_process_record_is_the_raw_state_and_decodes_to_the_whole_snapshot(tiny_engine):
    """What the engine process sends (raw ``PoolState``, arrays through shared memory) assembles, in the
    window's process, to every field of the snapshot the engine itself builds; swaps included."""
    src = LiveSource(tiny_engine(block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, preemption_mode="swap"))
    src.raw_snapshots = True
    slots = ShmSlots.create(12)
    enc, dec, dig = RecordEncoder(), RecordDecoder(), RecordDecoder()  # dig: digests most records
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
            assert isinstance(rec.snapshot, PoolState)
            want = src.engine.snapshot()
            wire = pickle.loads(pickle.dumps(enc.encode(p.Stepped(rec, MemoryReading())), protocol=5))
            assert wire.slot is not None and wire.inline is None
            got = dec.decode(wire).record.snapshot
            if wire.scalars["step"] % 3:
                d = dig.digest(wire).record.snapshot
                assert isinstance(d, StepDigest) and d.requests == want.requests and d.counters == want.counters
                assert d.state_counts == block_counts(want) and d.num_blocks == want.num_blocks
            else:  # a digested record leaves the decoder where decoding it would have
                assert dig.decode(wire).record.snapshot.requests == want.requests
            enc.release(wire.slot)
            swapped += int((got.cpu_state != 0).sum())
            for f in dataclasses.fields(KVSnapshot):
                a, b = getattr(got, f.name), getattr(want, f.name)
                assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, f.name
    finally:
        enc.detach()
        slots.close()
    assert swapped  # the CPU pool's views were derived from the rows too


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
