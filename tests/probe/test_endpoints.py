"""Where each data-parallel rank's probe listens, and which endpoints count as this machine only."""

from __future__ import annotations

import pytest

from kvscope_vllm_probe.endpoints import base_endpoint, check_endpoint, is_loopback, rank_endpoint


def test_rank_r_listens_at_the_port_plus_r_and_back():
    assert rank_endpoint("tcp://127.0.0.1:5570", 0) == "tcp://127.0.0.1:5570"
    assert rank_endpoint("tcp://127.0.0.1:5570", 3) == "tcp://127.0.0.1:5573"
    assert rank_endpoint("tcp://[::1]:5570", 1) == "tcp://[::1]:5571"
    assert rank_endpoint("ipc:///run/kv/probe", 0) == "ipc:///run/kv/probe"
    assert rank_endpoint("ipc:///run/kv/probe", 2) == "ipc:///run/kv/probe-dp2"
    for ep in ("tcp://10.0.0.5:6000", "ipc:///tmp/p", "tcp://*:7000"):
        for r in range(4):
            assert base_endpoint(rank_endpoint(ep, r), r) == ep


@pytest.mark.parametrize(
    "bad, words",
    [
        ("tcp://127.0.0.1", "with a port number"),
        ("tcp://127.0.0.1:x", "with a port number"),
        ("tcp://:5570", "with a port number"),
        ("tcp://127.0.0.1:70000", "with a port number"),
        ("udp://127.0.0.1:5570", "tcp://HOST:PORT or ipc://PATH"),
        ("ipc://", "tcp://HOST:PORT or ipc://PATH"),
    ],
)
def test_an_endpoint_that_is_not_one_is_one_line(bad, words):
    with pytest.raises(ValueError, match=words) as e:
        check_endpoint(bad)
    assert "\n" not in str(e.value)


def test_a_rank_past_the_last_port_and_a_wrong_base_are_refused():
    with pytest.raises(ValueError, match="past port 65535"):
        rank_endpoint("tcp://127.0.0.1:65535", 1)
    with pytest.raises(ValueError, match="not where data-parallel rank 1 listens"):
        base_endpoint("ipc:///tmp/p", 1)


@pytest.mark.parametrize(
    "endpoint, local",
    [
        ("tcp://127.0.0.1:5570", True),
        ("tcp://127.8.9.1:5570", True),
        ("tcp://localhost:5570", True),
        ("tcp://[::1]:5570", True),
        ("ipc:///tmp/kvscope-probe", True),
        ("tcp://0.0.0.0:5570", False),
        ("tcp://*:5570", False),
        ("tcp://[::]:5570", False),
        ("tcp://192.168.1.20:5570", False),
        ("tcp://eth0:5570", False),
        ("tcp://vllm-host.example:5570", False),
    ],
)
def test_what_counts_as_loopback(endpoint, local):
    assert is_loopback(endpoint) is local
