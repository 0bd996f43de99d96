"""Ports for servers a test starts a moment later (vLLM, kvscope --serve, a probe's endpoint).

A port found free by binding to port 0 comes from the kernel's ephemeral range, and it is free only until someone
else takes it: with two xdist workers, one worker's vLLM (or a connection, or vLLM's own internal sockets) took the
port the other had just picked ("Address already in use"). So ports here come from below the ephemeral range, where
the kernel never hands one out, from a slice that is this worker's own, each handed out once per session, and
checked free before it is given.
"""

from __future__ import annotations

import os
import socket

FIRST, LAST = 10_000, 20_000  # below Linux's ephemeral range (32768 and up) and clear of torch's and vLLM's 29500s


def _slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    span = (LAST - FIRST) // count
    return range(FIRST + index * span, FIRST + (index + 1) * span)


_next = _slice().start


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free ports (a data-parallel vLLM's probes listen at PORT+rank)."""
    global _next
    mine = _slice()
    while _next + n <= mine.stop:
        first, _next = _next, _next + n
        if all(_bindable(first + k) for k in range(n)):
            return list(range(first, first + n))
    raise AssertionError(f"this worker's ports {mine.start}-{mine.stop - 1} are all used")


def free_port() -> int:
    return free_ports(1)[0]
