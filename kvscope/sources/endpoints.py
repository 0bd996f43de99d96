"""ZeroMQ addresses as vLLM's data-parallel ranks use them (no sockets here)."""

from __future__ import annotations


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A rank's endpoint: ``tcp://h:p`` -> ``tcp://h:p+rank`` (``inproc://x`` -> ``inproc://x_dp{rank}``)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cannot offset {endpoint!r} by data-parallel rank {rank}: it has no port number")
    return f"{base}:{int(port) + rank}"


def connectable(endpoint: str) -> str:
    """The address a local subscriber dials for a bound endpoint (``tcp://0.0.0.0:p`` -> loopback)."""
    return endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://*:", "tcp://127.0.0.1:")
