"""Clients that leave, time out or are cut off: their requests are aborted and every block comes back.

Each test checks the bridge's record of the abort (asked for after step s, carried out before step
s + 2 at the latest: at most the step in flight still ran the request), the engine's audit, the
request's empty block table, and a pool of free or cached-free blocks only.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from serving import Served, SlowSteps

from engine import LLMEngine
from engine.inspect.snapshot import BlockState
from kvscope.serve import ServeOptions

PROMPT = "A paged KV cache keeps"
LONG = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}


@pytest.fixture
def served(tiny_hf, tiny_tokenizer):
    made: list[Served] = []

    def make(options=None, hooks=None, **kw) -> Served:
        hooks = (SlowSteps(0.02),) if hooks is None else hooks  # time for a client to leave mid-request
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        s = Served(LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", **kw), options, hooks)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def take(lines, n: int) -> list[dict]:
    """The next ``n`` chunks of a stream's ``iter_lines()`` (keep the iterator: dropping it closes the stream)."""
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(json.loads(line[6:]))
            if len(got) == n:
                return got
    raise AssertionError(f"the stream ended after {len(got)} chunks")


def rest(lines) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def abort_record(s: Served, reason: str, rid: str | None = None):
    s.wait_for(lambda: any(r.reason.endswith(reason) and rid in (None, r.request_id) for r in s.bridge.abort_log))
    [rec] = [r for r in s.bridge.abort_log if rid in (None, r.request_id)]
    assert rec.done_after - rec.requested_after <= 1  # at most the step in flight ran it again
    return rec


def assert_blocks_back(s: Served, rid: str) -> None:
    s.wait_idle()
    snap = s.call(s.engine.snapshot)
    info = snap.request(rid)
    assert info.status == "FINISHED_ABORTED" and info.block_ids == ()
    assert info.client.startswith("127.0.0.1:")
    assert s.call(s.engine.audit).ok
    assert (snap.ref_cnt == 0).all()
    assert set(np.unique(snap.state).tolist()) <= {BlockState.FREE, BlockState.CACHED}


def test_disconnect_mid_stream_aborts_and_frees(served):
    s = served()
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        chunks = take(r.iter_lines(), 3)
    rid = chunks[0]["id"]
    rec = abort_record(s, "client disconnected", rid)
    assert rec.admitted
    assert_blocks_back(s, rid)
    assert s.call(lambda: s.engine.snapshot().request(rid).num_output_tokens) < 200


def test_disconnect_of_a_chat_stream_through_the_openai_client(served):
    s = served()
    stream = s.client().chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=200, temperature=0, stream=True
    )
    it = iter(stream)
    rid = next(it).id
    next(it)
    stream.close()
    abort_record(s, "client disconnected", rid)
    assert_blocks_back(s, rid)


def test_disconnect_while_waiting_for_a_non_streaming_answer(served):
    s = served()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    rec = abort_record(s, "client disconnected")
    assert_blocks_back(s, rec.request_id)


def test_disconnect_of_a_request_still_in_the_waiting_queue(served):
    s = served(max_num_seqs=1)  # the first request runs, the second waits behind it
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as first:
        lines = first.iter_lines()
        take(lines, 1)
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as second:
            assert second.status_code == 200  # accepted: queued in the engine, no token yet
        rec = abort_record(s, "client disconnected")
        info = s.call(lambda: s.engine.snapshot().request(rec.request_id))
        assert info.status == "FINISHED_ABORTED" and info.num_computed_tokens == 0
        assert s.call(s.engine.audit).ok
        assert json.loads(rest(lines)[-2])["choices"][0]["finish_reason"] == "length"  # the first one went on
    s.wait_idle()
    assert (s.call(s.engine.snapshot).ref_cnt == 0).all()


class Gate:
    """Holds the engine's thread inside a step until opened: a request can arrive and leave in between."""

    def __init__(self) -> None:
        self.armed = False
        self.inside = threading.Event()
        self.open = threading.Event()

    def before_step(self, engine) -> None:
        if self.armed:
            self.inside.set()
            self.open.wait(20)
            self.armed = False

    def after_step(self, engine, out) -> None:
        pass

    def has_work(self, engine) -> bool:
        return self.armed


def test_a_client_gone_before_its_request_reached_the_engine(served):
    gate = Gate()
    s = served(hooks=(gate,))
    gate.armed = True
    s.loop.wake()
    assert gate.inside.wait(10)  # the engine's thread is held in a step, after the bridge's turn
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.3))
    s.wait_for(lambda: s.bridge.pending() == (1, 1))  # submitted, then aborted, both still queued
    gate.open.set()
    rec = abort_record(s, "client disconnected")
    assert not rec.admitted
    s.wait_idle()
    assert s.call(lambda: s.engine.snapshot().request(rec.request_id)) is None  # the engine never saw it
    assert s.call(s.engine.audit).ok


def test_request_timeout_aborts_non_streaming_and_streaming(served):
    s = served(ServeOptions(port=0, request_timeout=1.0))  # LONG needs 200 steps of >= 20 ms
    r = httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=30)
    assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
    rec = abort_record(s, "timeout")
    assert_blocks_back(s, rec.request_id)
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        events = rest(r.iter_lines())
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 504 and "choices" in json.loads(events[0])  # tokens, then the error
    rid = json.loads(events[0])["id"]
    abort_record(s, "timeout", rid)
    assert_blocks_back(s, rid)
    with pytest.raises(openai.APIError, match="request-timeout"):
        for _ in s.client().completions.create(model="tiny-llama", stream=True, **LONG):
            pass
    # A short request still fits in the time.
    assert httpx.post(f"{s.url}/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200


def test_an_abort_from_the_window_ends_the_http_request(served):
    s = served()
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        rid = take(lines, 1)[0]["id"]
        assert s.call(lambda: s.engine.abort(rid))  # what the window's Abort button does
        events = rest(lines)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(httpx.post, f"{s.url}/v1/completions", json=LONG, timeout=30)
        s.wait_for(
            lambda: any(r.status == "RUNNING" and r.num_output_tokens > 0 for r in s.call(s.engine.snapshot).requests)
        )
        running = [r.request_id for r in s.call(s.engine.snapshot).requests if r.status == "RUNNING"]
        s.call(lambda: s.engine.abort(running[0]))
        body = fut.result().json()
    assert body["choices"][0]["finish_reason"] == "abort" and 0 < body["usage"]["completion_tokens"] < 200
    s.wait_idle()
    assert s.call(s.engine.audit).ok


def test_a_reloaded_engine_ends_open_requests_with_503(served):
    s = served()
    with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        take(lines, 1)
        s.call(lambda: s.bridge.detach("the engine is being reloaded"))
        events = rest(lines)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503
    r = httpx.post(f"{s.url}/v1/completions", json=LONG)
    assert r.status_code == 503 and "reloaded" in r.json()["error"]["message"]
    s.attach()
    assert httpx.post(f"{s.url}/v1/completions", json={**LONG, "max_tokens": 2}).status_code == 200
