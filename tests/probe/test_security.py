"""What vLLM's environment allows the probe's subscribers, and the CURVE certificates ``keys.py`` makes."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
import zmq.auth

from kvscope_vllm_probe.keys import make_keys
from kvscope_vllm_probe.security import access_from_env, client_keys


def test_read_only_and_no_faults_unless_switched_on():
    a = access_from_env("tcp://127.0.0.1:5570", {})
    assert (a.control, a.remote_faults, a.keys) == (False, False, False)
    a = access_from_env("tcp://127.0.0.1:5570", {"KVSCOPE_PROBE_CONTROL": "1"})
    assert (a.control, a.remote_faults) == (True, False)  # faults are a switch of their own
    a = access_from_env("ipc:///tmp/p", {"KVSCOPE_PROBE_CONTROL": "0", "KVSCOPE_PROBE_REMOTE_FAULTS": "1"})
    assert (a.control, a.remote_faults) == (False, True)
    with pytest.raises(ValueError, match=r"KVSCOPE_PROBE_CONTROL='yes': give 1 \(on\) or 0 \(off\)"):
        access_from_env("tcp://127.0.0.1:5570", {"KVSCOPE_PROBE_CONTROL": "yes"})


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5570", "tcp://*:5570", "tcp://192.168.1.20:5570"])
def test_the_network_without_keys_is_refused_in_one_line(endpoint):
    with pytest.raises(ValueError) as e:
        access_from_env(endpoint, {"KVSCOPE_PROBE_CONTROL": "1"})
    text = str(e.value)
    assert "\n" not in text and f"{endpoint} is reachable from the network and the probe has no keys" in text
    assert "KVSCOPE_PROBE_SECRET_KEY" in text and "python -m kvscope_vllm_probe.keys" in text


def test_keys_let_the_probe_on_the_network(tmp_path):
    make_keys(str(tmp_path), ["kvscope"])
    env = {
        "KVSCOPE_PROBE_SECRET_KEY": str(tmp_path / "probe.key_secret"),
        "KVSCOPE_PROBE_AUTHORIZED_KEYS": str(tmp_path / "authorized"),
    }
    a = access_from_env("tcp://0.0.0.0:5570", env)
    assert a.keys and not a.control
    public, secret, server = client_keys(str(tmp_path / "kvscope.key_secret"), str(tmp_path / "probe.key"))
    assert server == zmq.auth.load_certificate(tmp_path / "probe.key")[0] and len(public) == len(secret) == 40
    assert (tmp_path / "authorized" / "kvscope.key").read_text() == (tmp_path / "kvscope.key").read_text()
    for secret_file in ("probe.key_secret", "kvscope.key_secret"):  # readable by their owner only
        assert stat.S_IMODE((tmp_path / secret_file).stat().st_mode) == 0o600
    with pytest.raises(FileExistsError, match="not overwriting"):
        make_keys(str(tmp_path), ["kvscope"])


def test_keys_given_wrong_are_one_line_each(tmp_path):
    make_keys(str(tmp_path), ["kvscope"])
    probe_secret, authorized = str(tmp_path / "probe.key_secret"), str(tmp_path / "authorized")
    cases = [
        ({"KVSCOPE_PROBE_SECRET_KEY": probe_secret}, "give both KVSCOPE_PROBE_SECRET_KEY and"),
        (
            {"KVSCOPE_PROBE_SECRET_KEY": str(tmp_path / "probe.key"), "KVSCOPE_PROBE_AUTHORIZED_KEYS": authorized},
            "a public certificate, not the probe's secret one",
        ),
        (
            {"KVSCOPE_PROBE_SECRET_KEY": str(tmp_path / "nope"), "KVSCOPE_PROBE_AUTHORIZED_KEYS": authorized},
            "not a readable ZeroMQ certificate",
        ),
        (
            {"KVSCOPE_PROBE_SECRET_KEY": probe_secret, "KVSCOPE_PROBE_AUTHORIZED_KEYS": str(tmp_path / "empty")},
            "no folder of public certificates",
        ),
    ]
    for env, words in cases:
        with pytest.raises(ValueError, match=words) as e:
            access_from_env("tcp://0.0.0.0:5570", env)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="a public certificate; give your own secret one"):
        client_keys(str(tmp_path / "kvscope.key"), str(tmp_path / "probe.key"))


def test_the_keys_command_says_what_goes_where(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvscope_vllm_probe.keys", str(tmp_path / "k"), "alice", "bob"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"KVSCOPE_PROBE_AUTHORIZED_KEYS={tmp_path / 'k' / 'authorized'}" in out.stdout
    assert f"--probe-key {tmp_path / 'k' / 'alice.key_secret'}" in out.stdout
    assert sorted(p.name for p in (tmp_path / "k" / "authorized").iterdir()) == ["alice.key", "bob.key"]
    again = subprocess.run(
        [sys.executable, "-m", "kvscope_vllm_probe.keys", str(tmp_path / "k")], capture_output=True, text=True
    )
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1 and "not overwriting" in again.stderr
