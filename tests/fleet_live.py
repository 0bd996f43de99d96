"""A live fleet for the fleet's test and benchmark: kvscope ``--serve --kv-events-endpoint`` processes and a vLLM-CPU
server, all serving the embedded SmolLM2 with vLLM's sha256_cbor hashes and one PYTHONHASHSEED, under chats that
share system prompts; and what each instance itself says it holds (kvscope's ``/metrics``, vLLM's hash map read
through kvscope's probe), to check the fleet view's counts against.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from ports import free_ports
from vllm_live import VllmServer, post, probe_keyframe

from kvscope.sources.fleet_metrics import parse_metrics

ROOT = Path(__file__).resolve().parent.parent
SEED = "0"
BLOCK = 32  # vLLM's CPU build wants a multiple of 32
SYSTEMS = [
    (
        "You are a careful assistant for a hardware shop. You answer questions about laptops, cables, docks and "
        "monitors in two short sentences. You never invent a price, a stock level or a delivery date; when you "
        "do not know, you say so and point to the shop's website. You always name the product line, and you "
        "keep a friendly, plain tone without exclamation marks."
    ),
    (
        "You are a tutor for first-year students of operating systems. You explain paging, page tables, "
        "caching, scheduling and file systems with one small, concrete example each. You first restate the "
        "question in one sentence, then answer in at most three sentences, and you end with one question that "
        "checks the student's understanding."
    ),
]


class KvscopeServer:
    """``kvscope --headless --serve`` with its KV events published (and a replay socket), hashing as vLLM does."""

    def __init__(self, num_blocks: int, startup_s: float = 240, ports: tuple[int, int, int] | None = None) -> None:
        """``ports``: (HTTP, KV events, replay), e.g. a stopped server's own, to start it again where it was."""
        self.port, pub, replay = ports or free_ports(3)
        self.ports = (self.port, pub, replay)
        self.events, self.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_blocks = num_blocks
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": SEED}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvscope",
                "--headless",
                "--serve",
                "--port",
                str(self.port),
                "--block-size",
                str(BLOCK),
                "--num-gpu-blocks",
                str(num_blocks),
                "--hash-algo",
                "sha256_cbor",
                "--kv-events-endpoint",
                self.events,
                "--kv-events-replay-endpoint",
                self.replay,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(
            target=lambda: [(lines.put(x), self.log.append(x)) for x in self.proc.stdout], daemon=True
        ).start()
        deadline = time.monotonic() + startup_s
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise AssertionError("kvscope --serve did not start:\n" + "".join(self.log[-20:])) from None
            if re.search(r"serving .* at http://", line):
                break
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            self.model = json.loads(r.read())["data"][0]["id"]

    def complete(self, prompt: str, max_tokens: int = 8) -> dict:
        return post(
            self.url + "/v1/completions",
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        )

    def own_blocks(self) -> int:
        """What kvscope itself counts in its prefix cache (``kvscope:prefix_cache_blocks``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return int(parse_metrics(r.read().decode())["prefix_cache_blocks"])

    def kill(self) -> None:
        """Gone at once, as a crashed engine goes (its sockets closed by the kernel)."""
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_vllm(num_blocks: int, ports: list[int] | None = None) -> VllmServer:
    """vLLM-CPU publishing its KV events (a wildcard bind, as vLLM wants), sha256_cbor, PYTHONHASHSEED fixed, and the
    probe (to read its own hash map); ``ports``: (KV events, replay, probe)."""
    pub, replay, probe_port = ports or free_ports(3)
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "",
    }
    probe = f"tcp://127.0.0.1:{probe_port}"
    s = VllmServer(
        probe=probe,
        env={"PYTHONHASHSEED": SEED},
        max_model_len=1024,
        extra=(
            "--num-gpu-blocks-override",
            str(num_blocks),
            "--kv-events-config",
            json.dumps(cfg),
            "--prefix-caching-hash-algo",
            "sha256_cbor",
        ),
    )
    s.events, s.replay, s.probe = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", probe
    return s


def vllm_own_hashes(server: VllmServer) -> set[int]:
    """Every hash in vLLM's own prefix-cache hash map now (the low 64 bits), read by kvscope's probe."""
    kf = probe_keyframe(server.probe, "kvscope fleet check", timeout=30)
    if kf is None:
        said = [line for line in server.log if "probe" in line.lower()]
        raise AssertionError("the probe sent no keyframe; vLLM's log of it:\n" + "\n".join(said[-10:]))
    return {h for h, _block in kf.hash_map}


def start_fleet(kvscope_blocks: int = 24, vllm_blocks: int = 40, kvscopes: int = 3) -> list:
    """The kvscope servers and the vLLM server (last), started side by side (vLLM's start is the long one)."""
    ports = free_ports(3 * kvscopes + 3)
    with ThreadPoolExecutor(kvscopes + 1) as pool:
        futures = [
            pool.submit(KvscopeServer, kvscope_blocks, ports=tuple(ports[3 * i : 3 * i + 3])) for i in range(kvscopes)
        ]
        futures.append(pool.submit(start_vllm, vllm_blocks, ports[-3:]))
        wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().close()
        raise failed[0]
    return [f.result() for f in futures]


def fleet_file(path: Path, servers: list, names: list[str], bytes_per_block: int | None = None) -> str:
    """The fleet file for these servers (TOML), with each one's /metrics."""
    lines = ["[defaults]", f"block_size = {BLOCK}", 'hash_algo = "sha256_cbor"', f'hash_seed = "{SEED}"']
    if bytes_per_block:
        lines.append(f"bytes_per_block = {bytes_per_block}")
    for name, s in zip(names, servers):
        lines += [
            "",
            "[[instances]]",
            f'name = "{name}"',
            f'endpoint = "{s.events}"',
            f'replay_endpoint = "{s.replay}"',
            f'metrics = "{s.url}/metrics"',
        ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def chat(system: int, i: int) -> str:
    return f"{SYSTEMS[system]}\n\nQuestion {i}: what would you say about item number {i} on the list, and why?"


def solo(name: str, i: int) -> str:
    """A prompt only one instance is sent: long enough for several blocks of its own."""
    return (
        f"Instance {name}, request {i}: summarise in one line each the history of the printing press, the "
        f"telegraph, the telephone, the transistor and the integrated circuit; then list three inventions each of "
        f"them made possible, with the year and the country of each, and end with the one you find the most "
        f"surprising and why, in two sentences at most."
    )


def shared_prefix_load(
    servers: list, names: list[str], rounds: int = 2, max_tokens: int = 8, concurrency: int = 4
) -> dict[str, str]:
    """Chats on two system prompts sent round robin to every instance (the system prompts end up on all of them),
    then one prompt of its own to each; returns {instance: its own prompt}."""
    jobs = [
        (servers[(s * rounds + i) % len(servers)], chat(s, i))
        for i in range(rounds * len(servers))
        for s in range(len(SYSTEMS))
    ]
    own = {n: solo(n, 0) for n in names}
    jobs += [(srv, own[n]) for n, srv in zip(names, servers)]
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(srv.complete, p, max_tokens) for srv, p in jobs]:
            f.result()
    return own


def settle(fleet, quiet_s: float = 1.5, timeout: float = 60.0, notices: list[str] | None = None):
    """Poll until no instance has published for ``quiet_s`` seconds; the last record (``notices``: every poll's)."""
    deadline = time.monotonic() + timeout
    last_change = time.monotonic()
    seen = None
    while time.monotonic() < deadline:
        rec = fleet.poll(0.1)
        if notices is not None:
            notices += rec.notices
        batches = tuple(m.source.counters["batches"] for m in fleet.members)
        if batches != seen:
            seen, last_change = batches, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            return rec
    raise AssertionError("the fleet never went quiet")
