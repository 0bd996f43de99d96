"""Fleet files: JSON and TOML read the same; every bad one, and every fleet flag that does not fit, is refused with
one line and exit 2 before any socket opens, the same line headless and in the window."""

from __future__ import annotations

import json

import pytest

from kvscope.cli import main
from kvscope.sources.fleet_spec import FleetError, InstanceSpec, read_fleet_file

GOOD_TOML = """
[defaults]
block_size = 32
bytes_per_block = 1179648
hash_algo = "sha256_cbor"
hash_seed = 0

[[instances]]
name = "a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
metrics = "http://10.0.0.5:8000/metrics"

[[instances]]
name = "b"
endpoint = "tcp://10.0.0.6:5557"
dp_size = 2
block_size = 16
"""

GOOD_JSON = {
    "defaults": {"block_size": 32, "bytes_per_block": 1179648, "hash_algo": "sha256_cbor", "hash_seed": "0"},
    "instances": [
        {
            "name": "a",
            "endpoint": "tcp://10.0.0.5:5557",
            "replay_endpoint": "tcp://10.0.0.5:5558",
            "metrics": "http://10.0.0.5:8000/metrics",
        },
        {"name": "b", "endpoint": "tcp://10.0.0.6:5557", "dp_size": 2, "block_size": 16},
    ],
}


def test_json_and_toml_say_the_same_fleet(tmp_path):
    (tmp_path / "f.toml").write_text(GOOD_TOML)
    (tmp_path / "f.json").write_text(json.dumps(GOOD_JSON))
    t, j = read_fleet_file(str(tmp_path / "f.toml")), read_fleet_file(str(tmp_path / "f.json"))
    assert t.instances == j.instances
    a, b = t.instances
    assert a == InstanceSpec(
        "a",
        "tcp://10.0.0.5:5557",
        "tcp://10.0.0.5:5558",
        "",
        1,
        32,
        1179648,
        "sha256_cbor",
        "0",
        "http://10.0.0.5:8000/metrics",
    )
    assert b.block_size == 16 and b.dp_size == 2 and b.hash_seed == "0" and b.replay_endpoint is None
    assert b.rank_endpoints() == ["tcp://10.0.0.6:5557", "tcp://10.0.0.6:5558"]


def inst(name: str = "a", endpoint: str = "tcp://127.0.0.1:5557", **kw) -> dict:
    return {"name": name, "endpoint": endpoint, **kw}


# (file name, its text, a part of the one line that refuses it)
BAD = [
    ("f.json", None, "no such file"),
    ("f.yaml", "instances: []", "give a .json or .toml file"),
    ("f.json", '{"instances": [', "is not valid JSON: Expecting value at line 1 column 16"),
    ("f.toml", "[[instances]\nname = 'a'", "is not valid TOML"),
    ("f.json", b"\xff\xfe{}", "is not UTF-8 text"),
    ("f.json", [inst()], "the top level must be a table with 'instances', not list"),
    ("f.json", {"instances": [inst()], "routers": 1}, "unknown key 'routers' at the top level"),
    ("f.json", {}, "'instances' must be a non-empty list"),
    ("f.json", {"instances": []}, "'instances' must be a non-empty list"),
    ("f.json", {"instances": "a"}, "'instances' must be a non-empty list"),
    ("f.json", {"instances": ["tcp://127.0.0.1:5557"]}, "instance 1 must be a table of keys"),
    ("f.json", {"instances": [inst(endpiont="tcp://127.0.0.1:1")]}, "instance 1 ('a'): unknown key 'endpiont'"),
    ("f.json", {"instances": [{"endpoint": "tcp://127.0.0.1:5557"}]}, "instance 1: no 'name'"),
    ("f.json", {"instances": [{"name": "a"}]}, "instance 1 ('a'): no 'endpoint'"),
    ("f.json", {"instances": [inst(dp_size="2")]}, "dp_size must be a whole number >= 1, not '2'"),
    ("f.json", {"instances": [inst(block_size=0)]}, "block_size must be a whole number >= 1, not 0"),
    ("f.json", {"instances": [inst(bytes_per_block=True)]}, "bytes_per_block must be a whole number >= 1, not True"),
    ("f.json", {"instances": [inst(hash_seed=1.5)]}, "hash_seed must be the instances' PYTHONHASHSEED"),
    ("f.json", {"instances": [inst(hash_algo="md5")]}, "hash_algo 'md5' is not one of auto, sha256, sha256_cbor"),
    ("f.json", {"instances": [inst(topic=5)]}, "topic must be a string, not 5"),
    ("f.json", {"instances": [inst(name="my box")]}, "name must be 1-48 letters"),
    ("f.json", {"instances": [inst(), inst("a", "tcp://127.0.0.1:6000")]}, "two instances are named 'a'"),
    ("f.json", {"instances": [inst(), inst("b")]}, "tcp://127.0.0.1:5557 is both 'a''s endpoint and 'b''s endpoint"),
    (
        "f.json",
        {"instances": [inst(replay_endpoint="tcp://127.0.0.1:6000"), inst("b", "tcp://127.0.0.1:6000")]},
        "tcp://127.0.0.1:6000 is both 'a''s replay_endpoint and 'b''s endpoint",
    ),
    (
        "f.json",
        {"instances": [inst(dp_size=2), inst("b", "tcp://127.0.0.1:5558")]},
        "tcp://127.0.0.1:5558 is both 'a''s endpoint",
    ),
    ("f.json", {"instances": [inst(endpoint="localhost:5557")]}, "'localhost:5557' is not a ZeroMQ address"),
    ("f.json", {"instances": [inst(endpoint="tcp://*:5557")]}, "that is where an engine binds"),
    ("f.json", {"instances": [inst(endpoint="tcp://10.0.0.5:70000")]}, "port 70000 is not between 1 and 65535"),
    ("f.json", {"instances": [inst(endpoint="tcp://10.0.0.5")]}, "is not a ZeroMQ address"),
    ("f.json", {"instances": [inst(replay_endpoint="5558")]}, "replay_endpoint '5558' is not a ZeroMQ address"),
    ("f.json", {"instances": [inst(metrics="ftp://10.0.0.5/metrics")]}, "is not an http:// URL"),
    ("f.json", {"defaults": {"name": "x"}, "instances": [inst()]}, "defaults: 'name' cannot be a default"),
    ("f.json", {"defaults": [], "instances": [inst()]}, "defaults must be a table of keys"),
    ("f.json", {"defaults": {"dp_size": -1}, "instances": [inst()]}, "defaults: dp_size must be a whole number"),
]


def write(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    if content is None:
        return str(path)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return str(path)


@pytest.mark.parametrize("name,content,says", BAD, ids=[b[2][:40] for b in BAD])
def test_every_bad_fleet_file_is_one_line_and_exit_2_headless_and_in_the_window(tmp_path, capsys, name, content, says):
    path = write(tmp_path, name, content)
    with pytest.raises(FleetError) as e:
        read_fleet_file(path)
    assert says in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith(f"fleet file {path}")
    lines = []
    for mode in (["--headless"], [], ["--headless", "--json"]):  # the window refuses it before it opens
        assert main([*mode, "--fleet", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        lines.append(err[0])
    assert lines[0] == lines[1] == lines[2] == f"kvscope: {e.value}"


def test_a_fleet_file_that_is_a_directory(tmp_path, capsys):
    assert main(["--headless", "--fleet", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"kvscope: fleet file {tmp_path} is a directory"


FLAG_CASES = [
    (["--fleet", "F", "--attach", "tcp://127.0.0.1:5557"], "with --attach or in --fleet FILE, not both"),
    (["--fleet", "F", "--replay-endpoint", "tcp://127.0.0.1:5558"], "--replay-endpoint is set for each instance"),
    (["--fleet", "F", "--bytes-per-block", "64"], "--bytes-per-block is set for each instance"),
    (["--fleet", "F", "--hash-seed", "0"], "--hash-seed is set for each instance"),
    (["--route-ids", "1,2"], "--route-prompt and --route-ids ask a fleet"),
    (
        [
            "--attach",
            "tcp://127.0.0.1:5557",
            "--attach",
            "tcp://127.0.0.1:5559",
            "--replay-endpoint",
            "tcp://127.0.0.1:5558",
        ],
        "2 --attach but 1 --replay-endpoint",
    ),
    (["--attach", "tcp://127.0.0.1:5557", "--route-prompt", "x", "--route-ids", "1"], "give the prompt to route once"),
    (
        ["--attach", "tcp://127.0.0.1:5557", "--attach", "tcp://127.0.0.1:5559", "--trace", "t.jsonl"],
        "a fleet is not recorded",
    ),
    (["--attach", "tcp://127.0.0.1:5557", "--attach", "tcp://127.0.0.1:5557"], "tcp://127.0.0.1:5557 is given twice"),
    (
        ["--attach", "tcp://127.0.0.1:5557", "--attach", "tcp://127.0.0.1:5558", "--dp-size", "2"],
        "tcp://127.0.0.1:5558 is both '127.0.0.1:5557''s endpoint and '127.0.0.1:5558''s endpoint",
    ),
    (["--attach", "tcp://*:5557", "--attach", "tcp://127.0.0.1:5559"], "that is where an engine binds"),
    (["--attach", "tcp://127.0.0.1:5557", "--route-prompt", ""], "the prompt is empty"),
    (["--attach", "tcp://127.0.0.1:5557", "--bytes-per-block", "64"], "--bytes-per-block is for a fleet"),
    (
        ["--attach", "tcp://127.0.0.1:5557", "--route-prompt", "hello", "--tokenizer", "/nonexistent/tokenizer"],
        "cannot load tokenizer '/nonexistent/tokenizer'",
    ),
]


@pytest.mark.parametrize("args,says", FLAG_CASES, ids=[c[1][:40] for c in FLAG_CASES])
def test_fleet_flags_that_do_not_fit_are_one_line_and_exit_2(tmp_path, capsys, args, says):
    good = write(tmp_path, "f.json", {"instances": [inst()]})
    args = [good if a == "F" else a for a in args]
    for mode in (["--headless"], []):
        assert main([*mode, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvscope: ") and says in err[0], err
