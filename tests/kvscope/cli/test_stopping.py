"""SIGINT and SIGTERM sent to each mode as a person or a service manager sends them: the process ends with the exit
code the README documents (130 or 143; 0 for a run that only ends when stopped, which prints its summary), at most
one line on stderr after the signal, no traceback, no warning of leaked shared memory, and nothing of it left in
/dev/shm. Each mode is a real ``kvscope`` process; each waits for a condition that says it is running before the
signal is sent."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[3]
CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "kvscope: interrupted", signal.SIGTERM: "kvscope: terminated"}


def shm_of(pid: int) -> set[str]:
    """What a kvscope process of this pid has in /dev/shm (its names start with kvscope-<pid>-)."""
    from kvscope.runtime.shm import slot_prefix

    prefix = slot_prefix(pid)
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


class Run:
    """``python -m kvscope ARGS`` with its stderr read line by line as it comes."""

    def __init__(self, args: list[str], tmp_path: Path, session: bool = False) -> None:
        env = {
            **os.environ,
            "QT_QPA_PLATFORM": "offscreen",  # a real window, drawn offscreen (no screenshot flag: it runs on)
            "XDG_CONFIG_HOME": str(tmp_path),
            "OMP_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope", *args],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=session,  # a process group of its own, as a shell gives a command
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return out
            if line is not None:
                out.append(line)

    def wait_for(self, ready, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not ready(self):
            self.seen += self.drain()
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {what}: {self.seen[-5:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} within {timeout} s: {self.seen[-5:]}")
            time.sleep(0.05)
        self.seen += self.drain()

    def stop(self, sig: int, timeout: float = 60, group: bool = False) -> list[str]:
        """Send ``sig`` (to its whole process group if ``group``, as Ctrl+C at a terminal does); the lines said
        after it (the process has ended)."""
        self.seen += self.drain()
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{signal.Signals(sig).name} did not end it within {timeout} s") from None
        time.sleep(0.2)  # the reader's last lines
        return [ln for ln in self.drain() if ln.strip()]


def said(run: Run, text: str) -> bool:
    return any(text in ln for ln in run.seen)


def has_child(run: Run) -> bool:
    """Its engine process has started (the window's source runs there)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(run.proc.pid)], capture_output=True, text=True).stdout
    return len(out.split()) >= 2  # multiprocessing's resource tracker, and the engine process


def polled(trace: Path, polls: int = 2):
    """An attach source's trace has its header and ``polls`` polls: it is polling."""
    return lambda _run: trace.exists() and trace.read_text().count('"k":"tick"') >= polls


def made_shm(run: Run) -> bool:
    return bool(shm_of(run.proc.pid))


def clean_end(run: Run, after: list[str], sig: int, code: int) -> None:
    assert run.proc.returncode == code, (run.proc.returncode, after, run.seen[-5:])
    assert len(after) <= 1, after
    assert not [ln for ln in run.seen + after if "Traceback" in ln or "leaked" in ln or "Fatal" in ln], after
    left = shm_of(run.proc.pid)
    assert not left, f"left in /dev/shm: {left}"


SIGNALS = [signal.SIGINT, signal.SIGTERM]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_the_window_on_an_engine_process(sig, tmp_path, tiny_dir):
    run = Run(["--model", tiny_dir, "--num-gpu-blocks", "32", "--block-size", "4"], tmp_path)
    run.wait_for(made_shm, "loaded (its shared memory made)")
    after = run.stop(sig)
    clean_end(run, after, sig, CODES[sig])
    assert after == [WORDS[sig]]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_the_window_waiting_for_a_probed_vllm(sig, tmp_path):
    run = Run(["--probe", f"tcp://127.0.0.1:{free_port()}", "--probe-wait", "120"], tmp_path)
    run.wait_for(has_child, "waiting (its engine process started)")
    after = run.stop(sig)
    clean_end(run, after, sig, CODES[sig])


def test_ctrl_c_at_a_terminal_while_the_engine_process_starts():
    """Ctrl+C reaches the whole process group: the engine process too, while it still imports torch (it raised
    KeyboardInterrupt there, with a traceback under the window's line), and SIGINT sent the moment the child
    exists (CI once caught the window inside ``Process.start``: the child then read half its start-up data)."""
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            run = Run(["--probe", f"tcp://127.0.0.1:{free_port()}", "--probe-wait", "120"], Path(tmp), session=True)
            run.wait_for(has_child, "its engine process started")
            after = run.stop(signal.SIGINT, group=True)
            clean_end(run, after, signal.SIGINT, CODES[signal.SIGINT])
            assert after == [WORDS[signal.SIGINT]]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_headless_run_of_the_engine(sig, tmp_path, tiny_dir):
    """A run that ends by itself, stopped mid-way: it is interrupted, not finished."""
    trace = tmp_path / "run.trace"
    prompts = [w for i in range(16) for w in ("--inject-ids", ",".join(str(10 + i + k) for k in range(8)))]
    args = ["--headless", "--model", tiny_dir, "--num-gpu-blocks", "256", "--block-size", "4", "--max-num-seqs", "1"]
    run = Run([*args, *prompts, "--max-tokens", "400", "--trace", str(trace)], tmp_path)
    run.wait_for(lambda _r: trace.exists() and trace.read_text().count("\n") > 5, "stepping")
    after = run.stop(sig)
    clean_end(run, after, sig, CODES[sig])
    assert after == [WORDS[sig]]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_headless_server_ends_with_its_summary(sig, tmp_path, tiny_dir):
    port = free_port()
    run = Run(["--headless", "--serve", "--port", str(port), "--model", tiny_dir, "--block-size", "4"], tmp_path)
    run.wait_for(lambda r: said(r, "serving "), "serving")
    after = run.stop(sig)
    clean_end(run, after, sig, 0)  # its end is a signal: the summary, exit 0
    assert len(after) == 1 and after[0].startswith("kvscope: stopped after"), after


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_headless_attach_ends_with_its_summary(sig, tmp_path):
    trace = tmp_path / "attach.jsonl"
    run = Run(["--headless", "--json", "--attach", f"tcp://127.0.0.1:{free_port()}", "--trace", str(trace)], tmp_path)
    run.wait_for(polled(trace), "polling", 60)
    after = run.stop(sig)
    clean_end(run, after, sig, 0)  # its end is a signal: the summary on stdout, exit 0


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_the_attach_window(sig, tmp_path):
    trace = tmp_path / "attach.jsonl"
    run = Run(["--attach", f"tcp://127.0.0.1:{free_port()}", "--trace", str(trace)], tmp_path)
    run.wait_for(polled(trace), "polling", 60)
    after = run.stop(sig)
    clean_end(run, after, sig, CODES[sig])
    assert after == [WORDS[sig]]


def test_a_signal_while_held_waits_for_the_end_of_the_hold_whichever_thread_takes_it():
    """SIGTERM sent while Qt imports (``signals_held``) from another thread, which may take it: nothing is raised
    inside the hold (a Terminated inside PySide6's import was a fatal error, exit -6), and it is raised once the
    hold ends, as the run's own Terminated."""
    import threading

    from kvscope.stopping import Terminated, signals_held, sigterm_as_interrupt

    with sigterm_as_interrupt():
        with pytest.raises(Terminated):
            with signals_held():
                t = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
                t.start()
                t.join()
                for _ in range(1000):  # bytecodes run: a handler that raised would raise here
                    time.sleep(0.0001)
            pytest.fail("the held signal was not delivered after the hold")
