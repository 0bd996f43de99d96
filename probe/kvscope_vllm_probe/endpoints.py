"""Where each data-parallel rank's probe listens, and which endpoints stay on this machine: one rule, both ends.

vLLM with ``--data-parallel-size N`` runs N engine cores, each with its own scheduler, so N probes. Rank ``r``
listens at ``rank_endpoint(KVSCOPE_PROBE_ENDPOINT, r)``:
- ``tcp://HOST:PORT``: ``tcp://HOST:PORT+r`` (rank 0 at PORT itself, rank 1 at PORT+1, ...);
- ``ipc://PATH``: ``ipc://PATH`` for rank 0, ``ipc://PATH-dp<r>`` for the others.
Rank 0 listens where a vLLM without data parallelism does, so ``kvscope --probe ADDR`` reads rank 0 there and
finds the others by the same rule. Imports nothing but the standard library (``kvscope --help`` needs none of it).
"""

from __future__ import annotations

import ipaddress


def _tcp(endpoint: str) -> tuple[str, int]:
    rest = endpoint[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{endpoint}: give tcp://HOST:PORT with a port number (or ipc://PATH)")
    return host, int(port)


def check_endpoint(endpoint: str) -> None:
    """Raises ``ValueError`` (one line) unless ``endpoint`` is ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if endpoint.startswith("tcp://"):
        _tcp(endpoint)
    elif not endpoint.startswith("ipc://") or len(endpoint) == len("ipc://"):
        raise ValueError(f"{endpoint}: give the probe's ZeroMQ address, tcp://HOST:PORT or ipc://PATH")


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank``'s probe listens, given ``KVSCOPE_PROBE_ENDPOINT`` (rank 0's)."""
    check_endpoint(endpoint)
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-dp{rank}"
    host, port = _tcp(endpoint)
    if port + rank > 65535:
        raise ValueError(f"{endpoint}: data-parallel rank {rank} would listen past port 65535")
    return f"tcp://{host}:{port + rank}"


def base_endpoint(endpoint: str, rank: int) -> str:
    """Rank 0's endpoint, given rank ``rank``'s (``rank_endpoint`` backwards)."""
    check_endpoint(endpoint)
    if rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        suffix = f"-dp{rank}"
        if not endpoint.endswith(suffix):
            raise ValueError(f"{endpoint} is not where data-parallel rank {rank} listens (ipc://PATH{suffix})")
        return endpoint[: -len(suffix)]
    host, port = _tcp(endpoint)
    if port - rank <= 0:
        raise ValueError(f"{endpoint} is not where data-parallel rank {rank} listens")
    return f"tcp://{host}:{port - rank}"


def is_loopback(endpoint: str) -> bool:
    """Whether only this machine can reach ``endpoint``: ``ipc://`` (a file, its folder's permissions decide),
    ``inproc://``, or TCP on a loopback address (127.0.0.0/8, ::1, localhost). ``*``, ``0.0.0.0``, an interface
    name or any other address is reachable from the network."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = _tcp(endpoint)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name (eth0), a host name: not known to stay on this machine
