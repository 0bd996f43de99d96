"""``kvscope --headless --serve``: flags, one-line refusals, and a real process served and stopped by SIGINT."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest

from kvscope.cli import main
from kvscope.cli.parser import build_parser, serve_options
from kvscope.serve import ServeOptions

ROOT = Path(__file__).resolve().parents[3]


def test_serve_flags_and_their_defaults(monkeypatch):
    monkeypatch.delenv("KVSCOPE_API_KEY", raising=False)
    args = build_parser().parse_args(["--serve"])
    assert serve_options(args) == ServeOptions("127.0.0.1", 8000, None, None)  # loopback unless told
    args = build_parser().parse_args(
        ["--serve", "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--request-timeout", "2.5"]
    )
    assert serve_options(args) == ServeOptions("0.0.0.0", 0, "k", 2.5)
    monkeypatch.setenv("KVSCOPE_API_KEY", "from-env")
    assert serve_options(build_parser().parse_args(["--serve"])).api_key == "from-env"
    assert "from-env" not in build_parser().format_help()  # --help never prints a key


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--port", "70000"], "a port is 0..65535"),
        (["--port", "http"], "not a port number"),
        (["--request-timeout", "0"], "must be > 0"),
    ],
)
def test_bad_serve_flags_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--serve", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err.strip().splitlines()[-1]


def test_port_in_use_and_replay_are_one_line_refusals(capsys, tiny_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--headless", "--serve", "--port", str(port), "--model", tiny_dir]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvscope: cannot listen on 127.0.0.1:{port}")
    assert main(["--headless", "--serve", "--replay", str(tmp_path / "x.jsonl")]) == 2
    assert "--replay cannot serve" in capsys.readouterr().err


@pytest.fixture
def tiny_text_dir(tmp_path, tiny_hf, tiny_tokenizer):
    """The tiny random Llama with the byte-level tokenizer saved beside it: text and chat from a folder."""
    d = tmp_path / "tiny-text"
    tiny_hf.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return str(d)


def test_headless_serve_process_serves_and_stops_cleanly_on_sigint(tiny_text_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvscope",
            "--headless",
            "--serve",
            "--port",
            "0",
            "--model",
            tiny_text_dir,
            "--num-gpu-blocks",
            "64",
            "--block-size",
            "4",
            "--audit",
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=180)
            m = re.search(r"serving .* at (http://\S+)/v1", line)
            url = m.group(1) if m else None
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = c.completions.create(model=c.models.list().data[0].id, prompt="hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5
        r = c.chat.completions.create(model=r.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        assert "vllm:generation_tokens_total" in httpx.get(f"{url}/metrics").text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert any("audit clean" in x for x in rest), rest
    assert not any("Traceback" in x for x in rest), rest
