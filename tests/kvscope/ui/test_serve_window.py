"""The window with the server beside it: it starts in Run, steps HTTP requests as they come, shows
each request's client, and its Abort answers the client even while paused."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PySide6.QtCore import QSettings

from engine import LLMEngine
from kvscope.serve import OpenAIServer, ServeOptions
from kvscope.sources.live import LiveSource
from kvscope.ui.qt_models import RequestTableModel

CLIENT = RequestTableModel.HEADERS.index("client")


@pytest.fixture
def window(qtbot, open_window, tmp_path, tiny_hf, tiny_tokenizer):
    server = OpenAIServer(ServeOptions(port=0))
    server.start()
    settings = QSettings(str(tmp_path / "kvscope.ini"), QSettings.Format.IniFormat)

    def factory(_scenario):
        engine = LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", num_gpu_blocks=64, block_size=4)
        return LiveSource(engine, hooks=[server.bridge])

    win = open_window(factory, settings=settings, bridge=server.bridge, loaded=None)
    qtbot.waitUntil(lambda: win.info is not None and win.running, timeout=20_000)  # serving starts in Run
    yield win, server
    win.shutdown()
    server.stop()


def post(server, **body):
    return httpx.post(f"{server.url}/v1/completions", json={"temperature": 0, **body}, timeout=30)


def test_window_serves_requests_and_shows_their_client(qtbot, window):
    win, server = window
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(post, server, prompt=f"hello {i}", max_tokens=6) for i in range(2)]
        qtbot.waitUntil(lambda: all(f.done() for f in futs), timeout=20_000)
    bodies = [f.result().json() for f in futs]
    assert [b["usage"]["completion_tokens"] for b in bodies] == [6, 6]
    assert win.running  # idle, but still in Run: the next request is stepped at once
    # The window may still be behind the engine: wait until its latest record shows both requests.
    qtbot.waitUntil(lambda: all(win.latest.snapshot.request(b["id"]) is not None for b in bodies), timeout=5000)
    win.flush()
    model = win.requests.model
    for b in bodies:
        cell = model.index(model.row_of(b["id"]), CLIENT).data()
        assert cell.startswith("127.0.0.1:")
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, server, prompt="again", max_tokens=3)
        qtbot.waitUntil(fut.done, timeout=20_000)
    assert fut.result().status_code == 200


def test_paused_window_holds_requests_and_its_abort_answers_the_client(qtbot, window):
    win, server = window
    win.act_run.trigger()
    qtbot.waitUntil(lambda: not win.running, timeout=5000)

    def stream():
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            timeout=30,
            json={"prompt": "step me", "max_tokens": 100, "temperature": 0, "stream": True},
        ) as r:
            return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream)
        qtbot.waitUntil(lambda: server.bridge.pending()[0] == 1, timeout=5000)  # held: nobody steps
        start = win.latest.step
        win.step(3)
        qtbot.waitUntil(lambda: win.latest.step >= start + 3, timeout=10_000)
        [info] = [r for r in win.latest.snapshot.requests if r.status == "RUNNING"]
        assert info.num_output_tokens == 3 and info.client.startswith("127.0.0.1:")
        win.flush()
        win.requests.select([info.request_id])
        win.act_abort.trigger()
        qtbot.waitUntil(
            lambda: fut.done() and win.latest.snapshot.request(info.request_id).status == "FINISHED_ABORTED",
            timeout=10_000,
        )
    events = fut.result()
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert win.latest.step == start + 3  # answered without another step
    assert not win.running
    snap = win.latest.snapshot
    assert snap.request(info.request_id).block_ids == () and (snap.ref_cnt == 0).all()
