"""``kvscope --serve`` with the engine in its own process: the server runs beside the engine there,
the window starts in Run and shows each request's client, and a client that leaves gives its blocks back."""

from __future__ import annotations

import httpx
import pytest
from ports import free_port
from PySide6.QtCore import QSettings

from engine import EngineConfig
from kvscope.runtime.build import SourceSpec
from kvscope.serve import ServeOptions
from kvscope.ui.main_window import MainWindow
from kvscope.ui.worker import ProcessBackend


@pytest.fixture
def tiny_with_tokenizer(tmp_path_factory, tiny_hf, tiny_tokenizer):
    d = tmp_path_factory.mktemp("tiny-tok")
    tiny_hf.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return str(d)


def test_the_engine_process_serves_and_the_window_watches(qtbot, tmp_path, tiny_with_tokenizer):
    port = free_port()
    spec = SourceSpec(
        EngineConfig(model=tiny_with_tokenizer, num_gpu_blocks=64, block_size=4), serve=ServeOptions(port=port)
    )
    win = MainWindow(ProcessBackend(spec), QSettings(str(tmp_path / "k.ini"), QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.show()
    win.start()
    try:
        qtbot.waitUntil(lambda: win.info is not None and win.running, timeout=90_000)  # serving starts in Run
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"prompt": "hello there", "max_tokens": 5, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 5

        # the window draws the engine's records as they come: the step that finished the request may be one more
        def finished() -> bool:
            info = win.latest.snapshot.request(body["id"])
            return info is not None and info.status == "FINISHED_LENGTH"

        qtbot.waitUntil(finished, timeout=10_000)
        info = win.latest.snapshot.request(body["id"])
        assert info.client.startswith("127.0.0.1:")
        assert win.running and win.worker.pid is not None  # idle, still in Run, in another process
        qtbot.waitUntil(lambda: win.latest.snapshot.counters["num_free_blocks"] == 64, timeout=10_000)
    finally:
        win.shutdown()
    with pytest.raises(httpx.ConnectError):  # the server went with the engine process
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
