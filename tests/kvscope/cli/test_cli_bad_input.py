"""Bad files and command lines: one line on stderr, exit code 2, never a traceback or a hang.

Most run ``kvscope.__main__.main`` in this process (the same code path as the command, faster);
what needs a process of its own (a signal, a Qt platform, the screenshot window) runs one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import config_fields
from engine.inspect.trace import MAX_TRACE_BLOCKS, TraceError, replay_trace
from kvscope.cli import main
from kvscope.cli.parser import build_parser, engine_config
from kvscope.platform_check import XCB_PACKAGES, debian_package, missing_libraries, xcb_problem
from kvscope.sources.live import LiveSource
from tests.kvscope.cli.test_cli import ROOT, kvscope


def run_main(capsys, *argv: str) -> tuple[int, list[str]]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    # Logging and transformers' progress bars go to stderr too; the message is the rest.
    lines = [
        line for line in err.strip().splitlines() if not line.startswith(("INFO ", "WARNING ")) and "it/s]" not in line
    ]
    return code, lines


def assert_one_line_exit_2(capsys, *argv: str, says: str) -> str:
    code, lines = run_main(capsys, *argv)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("kvscope: ") and says in lines[0], lines
    assert "Traceback" not in lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory):
    """A character tokenizer with 96 ids (inside the tiny model's 256), saved like any hub tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(95)} | {"[UNK]": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    d = tmp_path_factory.mktemp("char-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    return str(d)


# -- the options come from EngineConfig -----------------------------------------------------------
def test_every_engine_field_is_a_flag_with_its_help_and_choices():
    help_text = build_parser().format_help()
    for f in config_fields():
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    for choice in ("fp8", "int4", "contiguous", "builtin", "double-free", "float64"):
        assert choice in help_text


def test_each_field_reaches_the_config_from_the_command_line():
    argv = [
        "--model",
        "m",
        "--tokenizer",
        "t",
        "--device",
        "cpu",
        "--dtype",
        "float16",
        "--block-size",
        "8",
        "--num-gpu-blocks",
        "9",
        "--kv-cache-memory-bytes",
        "1000",
        "--gpu-memory-utilization",
        "0.5",
        "--cpu-kv-cache-bytes",
        "2000",
        "--swap-space",
        "1.5",
        "--num-cpu-blocks",
        "7",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "99",
        "--max-model-len",
        "128",
        "--no-prefix-caching",
        "--preemption-mode",
        "swap",
        "--kv-cache-dtype",
        "int8",
        "--attention-backend",
        "torch",
        "--enforce-eager",
        "--no-fuse-ops",
        "--kv-layout",
        "contiguous",
        "--hash-algo",
        "builtin",
        "--seed",
        "5",
        "--fault",
        "cow-leak",
        "--eviction-policy",
        "lfu",
    ]
    cfg = engine_config(build_parser().parse_args(argv))
    expected = EngineConfig(
        model="m",
        tokenizer="t",
        device="cpu",
        dtype="float16",
        block_size=8,
        num_gpu_blocks=9,
        kv_cache_memory_bytes=1000,
        gpu_memory_utilization=0.5,
        cpu_kv_cache_bytes=2000,
        swap_space=1.5,
        num_cpu_blocks=7,
        max_num_seqs=3,
        max_num_batched_tokens=99,
        max_model_len=128,
        enable_prefix_caching=False,
        preemption_mode="swap",
        kv_cache_dtype="int8",
        attention_backend="torch",
        enforce_eager=True,
        fuse_ops=False,
        kv_layout="contiguous",
        hash_algo="builtin",
        seed=5,
        fault="cow-leak",
        eviction_policy="lfu",
    )
    assert cfg == expected
    assert {f.name for f in dataclasses.fields(expected) if getattr(expected, f.name) == f.default} == set()
    assert engine_config(build_parser().parse_args([])) == EngineConfig()
    assert not engine_config(build_parser().parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--max-tokens", "0"], "--max-tokens: must be an integer >= 1, got 0"),
        (["--max-tokens", "-3"], "--max-tokens"),
        (["--steps", "0"], "--steps"),
        (["--block-size", "0"], "block_size must be >= 1, got 0"),
        (["--num-gpu-blocks", "-1"], "num_gpu_blocks must be >= 1"),
        (["--seed", "-1"], "seed must be in 0..18446744073709551615"),
        (["--gpu-memory-utilization", "2"], "gpu_memory_utilization must be in (0, 1]"),
        (["--gpu-memory-utilization", "lots"], "'lots' is not a number"),
        (["--preemption-mode", "drop"], "invalid choice: 'drop'"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--screenshot", "shot.txt"], "must end in .png"),
    ],
)
def test_bad_flags(capsys, argv, says):
    assert_one_line_exit_2(capsys, "--headless", *argv, says=says)


def test_a_screenshot_path_that_cannot_be_written_is_refused_before_loading(capsys, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    assert_one_line_exit_2(capsys, "--screenshot", str(tmp_path / "file.txt" / "shot.png"), says="cannot be written")
    (tmp_path / "dir.png").mkdir()
    assert_one_line_exit_2(capsys, "--screenshot", str(tmp_path / "dir.png"), says="is a directory")


def test_cuda_without_cuda_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_exit_2(capsys, "--headless", "--device", "cuda", says="--device cuda was asked for")
    assert_one_line_exit_2(capsys, "--headless", "--device", "tpu", says="unknown device 'tpu'")


def test_a_prompt_with_a_lone_surrogate_is_one_line(capsys, tiny_dir, char_tokenizer):
    # An undecodable byte on a command line arrives as a lone surrogate (surrogateescape).
    assert_one_line_exit_2(
        capsys,
        "--headless",
        "--model",
        tiny_dir,
        "--tokenizer",
        char_tokenizer,
        "--inject",
        "bad \udcff byte",
        says="request refused: the prompt is not valid Unicode",
    )


def test_the_tokenizer_option_loads_that_tokenizer(capsys, tiny_dir, char_tokenizer):
    engine = LLMEngine(EngineConfig(model=tiny_dir, tokenizer=char_tokenizer, num_gpu_blocks=32, block_size=4))
    assert engine.tokenizer.name_or_path == char_tokenizer
    rid = engine.add_request("hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert engine.requests[rid].prompt_token_ids == [ord(c) - 32 for c in "hello"]
    assert char_tokenizer in engine.kv.extra_keys  # the tokenizer's identity is in every block hash
    code, lines = run_main(
        capsys,
        "--headless",
        "--json",
        "--model",
        tiny_dir,
        "--tokenizer",
        char_tokenizer,
        "--num-gpu-blocks",
        "32",
        "--block-size",
        "4",
        "--max-tokens",
        "5",
        "--inject",
        "hi there",
    )
    assert code == 0, lines
    assert_one_line_exit_2(
        capsys,
        "--headless",
        "--model",
        tiny_dir,
        "--tokenizer",
        "/no/such/tokenizer",
        says="cannot load tokenizer '/no/such/tokenizer'",
    )


# -- scenario files ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "request_spec,says",
    [
        ({"at": 0, "max_tokens": 4}, "request 0: needs a 'prompt' or a 'conversation'"),
        ({"prompt": 5}, "'prompt' must be text"),
        ({"prompt": [1, "2"]}, "'prompt' must be text"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"prompt": [1, 2], "max_tokens": "4"}, "max_tokens must be an integer"),
        ({"prompt": [1, 2], "n": -1}, "n must be an integer >= 1"),
        ({"prompt": [1, 2], "temperature": -1}, "temperature"),
        ({"prompt": [1, 2], "at": -2}, "'at' must be an integer in 0..100,000"),
        ({"prompt": [1, 2], "copies": 0}, "'copies' must be an integer in 1..4,096"),
        ({"prompt": [1, 2], "abort_at": "soon"}, "'abort_at'"),
        ({"prompt": [1, 2], "beam_width": -1}, "'beam_width' must be an integer >= 0"),
        ({"prompt": [1, 2], "max_token": 4}, "unknown key(s) ['max_token']"),
        ({"conversation": {"turns": []}}, "'conversation' needs 'turns'"),
        ({"prompt": list(range(1, 200))}, "request 0 is refused: this request can never fit"),
        ({"prompt": "text"}, "request 0 is refused: this model has no tokenizer"),
    ],
)
def test_bad_scenario_requests_are_one_line(capsys, tmp_path, tiny_dir, request_spec, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"config": {"block_size": 4, "num_gpu_blocks": 16}, "requests": [request_spec]}))
    assert_one_line_exit_2(capsys, "--headless", "--model", tiny_dir, "--scenario", str(path), says=says)


@pytest.mark.parametrize(
    "data,says",
    [
        ({"config": {"block_size": "4"}, "requests": []}, "config: block_size must be an integer, got '4'"),
        ({"config": {"device": "cuda"}, "requests": []}, "unknown config keys ['device']"),
        ({"config": [], "requests": []}, "'config' must be an object"),
        ({"steps": 0, "requests": []}, "'steps' must be an integer >= 1"),
        ({"requests": {}}, "needs a 'requests' list"),
    ],
)
def test_bad_scenario_files_are_one_line(capsys, tmp_path, data, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert_one_line_exit_2(capsys, "--headless", "--scenario", str(path), says=says)


def test_a_scenario_request_refused_mid_run_is_one_line(capsys, tmp_path, tiny_dir, char_tokenizer):
    # The first request fits; the second, due at step 3, only fails when it is added.
    path = tmp_path / "late.json"
    path.write_text(
        json.dumps(
            {
                "config": {"block_size": 4, "num_gpu_blocks": 16},
                "requests": [{"prompt": [1, 2, 3], "max_tokens": 8}, {"at": 3, "prompt": [1, 2, 3], "max_tokens": 8}],
            }
        )
    )
    from kvscope.scenario import ScenarioRunner, load_scenario

    engine = LLMEngine(EngineConfig(model=tiny_dir, block_size=4, num_gpu_blocks=16))
    runner = ScenarioRunner(load_scenario(str(path)))
    runner.check(engine)
    runner.scenario.requests[1]["prompt"] = list(range(1, 100))  # too big for the pool, after the check
    session = LiveSource(engine, runner)
    with pytest.raises(ValueError, match=r"request 1 is refused at step 3: this request can never fit"):
        for _ in range(5):
            session.step()


# -- traces -------------------------------------------------------------------------------------------
def trace_with(tmp_path, events, header=None, requests=()):
    h = {"format": "kvscope-trace", "version": 1, "num_blocks": 4, "block_size": 4, **(header or {})}
    rec = {
        "step": 1,
        "events": events,
        "requests": list(requests),
        "shown": [r["request_id"] for r in requests],
        "counters": {},
    }
    p = tmp_path / "bad.trace"
    p.write_text(json.dumps(h) + "\n" + json.dumps(rec) + "\n" + json.dumps({**rec, "step": 2}) + "\n")
    return p


ROW = {
    "request_id": "a",
    "index": 0,
    "status": "RUNNING",
    "num_prompt_tokens": 1,
    "num_output_tokens": 0,
    "num_cached_tokens": 0,
    "num_computed_tokens": 1,
    "text": "",
    "token_ids": [1],
}


@pytest.mark.parametrize(
    "events,header,requests,says",
    [
        (
            [{"kind": "allocated", "block_id": 9, "request_id": "a"}],
            None,
            (),
            "names block 9, but the pool has blocks 0..3",
        ),
        ([{"kind": "freed", "block_id": -1, "request_id": "a", "ref_cnt": 0}], None, (), "names block -1"),
        (
            [{"kind": "stored", "block_id": "0", "block_hash": "ab", "request_id": "a"}],
            None,
            (),
            "block_id = '0' is not an integer",
        ),
        ([{"kind": "allocated", "block_id": 0.0, "request_id": "a"}], None, (), "block_id = 0.0 is not an integer"),
        (
            [{"kind": "swap_out", "request_id": "a", "block_ids": [0, 7], "cpu_block_ids": []}],
            None,
            (),
            "names block 7",
        ),
        (
            [{"kind": "cow", "src_block_id": 0, "dst_block_id": 4, "request_id": "a", "num_slots": 1}],
            None,
            (),
            "names block 4",
        ),
        (["allocated"], None, (), "an event must be an object"),
        ([], None, [{**ROW, "block_ids": [0, 12]}], "block_ids (0, 12) are not blocks 0..3"),
        ([], None, [{**ROW, "block_ids": [-1]}], "are not blocks"),
        ([], None, [{**ROW, "block_ids": [], "cpu_block_ids": [0]}], "cpu_block_ids (0,) are not blocks"),
        ([], {"num_blocks": 10**9}, (), f"num_blocks = 1,000,000,000, above the replay limit of {MAX_TRACE_BLOCKS:,}"),
        ([], {"num_cpu_blocks": 10**9}, (), "num_cpu_blocks = 1,000,000,000, above the replay limit"),
        ([], {"num_blocks": True}, (), "header field 'num_blocks' is missing or invalid"),
    ],
)
def test_bad_traces_are_one_line(capsys, tmp_path, events, header, requests, says):
    p = trace_with(tmp_path, events, header, requests)
    with pytest.raises(TraceError) as e:
        list(replay_trace(p))
    assert says in str(e.value) and "\n" not in str(e.value)
    assert_one_line_exit_2(capsys, "--headless", "--replay", str(p), says=says)


def test_a_huge_header_is_refused_before_allocating(tmp_path, monkeypatch):
    import engine.inspect.trace as trace

    made = []
    monkeypatch.setattr(trace, "PoolReplayer", lambda n: made.append(n))
    with pytest.raises(TraceError, match="above the replay limit"):
        list(replay_trace(trace_with(tmp_path, [], {"num_blocks": 10**9})))
    assert made == []


# -- the window: screenshot, Ctrl+C, system libraries ---------------------------------------------
@pytest.fixture
def small_trace(tiny_hf, tmp_path):
    engine = LLMEngine.from_hf_model(tiny_hf, None, name="tiny", block_size=4, num_gpu_blocks=16)
    s = LiveSource(engine, trace_path=str(tmp_path / "t.trace"))
    s.inject([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        s.step()
    s.close()
    return tmp_path / "t.trace"


@pytest.mark.parametrize("steps", ["50", "2"])
def test_a_screenshot_of_a_replay_counts_replayed_steps_and_stops_at_the_end(small_trace, tmp_path, steps):
    shot = tmp_path / "shot.png"
    r = kvscope(
        "--screenshot",
        str(shot),
        "--replay",
        str(small_trace),
        "--steps",
        steps,
        timeout=120,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.stat().st_size > 10_000 and "saved" in r.stdout


@pytest.mark.parametrize("delay", [0.0, 0.5])  # 0: while the window is still being built
def test_ctrl_c_closes_the_window_cleanly(tiny_dir, tmp_path, delay):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "XDG_CONFIG_HOME": str(tmp_path)}
    p = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "--model", tiny_dir, "--num-gpu-blocks", "16", "--block-size", "4"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + 120
    for line in p.stderr:  # the model loads on the worker while the event loop runs
        lines.append(line)
        if "KV pool" in line or time.monotonic() > deadline:
            break
    time.sleep(delay)  # the signal at a chosen moment of the run (the parameter), not a wait for something
    p.send_signal(signal.SIGINT)
    try:
        rest = p.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("Ctrl+C did not close the window") from None
    err = "".join(lines) + rest
    assert p.returncode == 130, err[-2000:]
    assert "kvscope: interrupted" in err and "Traceback" not in err and "Fatal" not in err


def test_missing_xcb_libraries_are_named_with_their_packages():
    fake = "\tlibxcb-cursor.so.0 => not found\n\tlibc.so.6 => /lib/libc.so.6\n\tlibxcb-cursor.so.0 => not found\n"
    assert missing_libraries("plugin", ldd=lambda _p: fake) == ["libxcb-cursor.so.0"]
    msg = xcb_problem({"DISPLAY": ":0"}, plugin="plugin", ldd=lambda _p: fake)
    assert "sudo apt-get install libxcb-cursor0" in msg and "\n" not in msg
    assert xcb_problem({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, plugin="plugin", ldd=lambda _p: fake) is None
    assert xcb_problem({"WAYLAND_DISPLAY": "w", "DISPLAY": ":0"}, plugin="plugin", ldd=lambda _p: fake) is None
    assert xcb_problem({"DISPLAY": ":0"}, plugin="plugin", ldd=lambda _p: "\tlibc.so.6 => /lib/libc.so.6\n") is None
    assert [debian_package(s) for s in ("libxkbcommon-x11.so.0", "libfoo-bar.so.3", "libpng16.so.16")] == [
        "libxkbcommon-x11-0",
        "libfoo-bar3",
        "libpng16-16",
    ]


def test_this_machines_plugin_check_agrees_with_the_loader():
    from kvscope.platform_check import xcb_plugin

    plugin = xcb_plugin()
    assert plugin is not None
    missing = missing_libraries(plugin)
    msg = xcb_problem({"DISPLAY": ":0"})
    if missing:  # this machine lacks some: each is named with its package
        assert all(debian_package(s) in msg for s in missing)
    else:
        assert msg is None


def test_kvscope_says_what_to_install_instead_of_aborting(tmp_path):
    code = (
        "import sys, kvscope.platform_check as p\n"
        "p._ldd = lambda path: '\\tlibxcb-cursor.so.0 => not found\\n'\n"
        "from kvscope.cli import main\nsys.exit(main([]))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY")}
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**env, "DISPLAY": ":99"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-1000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "sudo apt-get install libxcb-cursor0" in lines[0]


def test_setup_names_the_packages():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert all(pkg in setup for pkg in XCB_PACKAGES) and "kvscope.platform_check" in setup


def test_headless_steps_count_replayed_steps(capsys, small_trace):
    code = main(["--headless", "--json", "--replay", str(small_trace), "--steps", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["steps"] == 2  # two replayed records: the trace's steps 1 and 2
    code = main(["--headless", "--json", "--replay", str(small_trace), "--steps", "500"])
    assert code == 0 and json.loads(capsys.readouterr().out)["steps"] == 4  # the whole trace, then it stops


# -- the same refusal in the window and headless -----------------------------------------------------
def _said(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("kvscope:")]


def test_a_refused_request_is_one_line_and_exit_2_in_the_window_as_headless(tiny_dir, tmp_path):
    """A pool too small for the command line's requests: headless said it once with exit 2; the window said it
    four times, exit 1, and saved a picture anyway."""
    from tests.kvscope.cli.test_cli import kvscope

    ids = ",".join(map(str, range(1, 30)))
    common = [
        "--model",
        tiny_dir,
        "--num-gpu-blocks",
        "1",
        "--block-size",
        "4",
        "--inject-ids",
        ids,
        "--inject-ids",
        ids,
    ]
    headless = kvscope("--headless", *common)
    shot = tmp_path / "never.png"
    window = kvscope(*common, "--screenshot", str(shot), "--steps", "2", QT_QPA_PLATFORM="offscreen")
    assert headless.returncode == window.returncode == 2
    assert _said(headless) == _said(window) and len(_said(window)) == 1
    assert "request refused: this request can never fit" in _said(window)[0]
    assert not shot.exists()


def test_select_names_a_request_or_a_block_that_is_there(tiny_dir, tmp_path):
    from tests.kvscope.cli.test_cli import kvscope

    shot = tmp_path / "x.png"
    base = [
        "--model",
        tiny_dir,
        "--num-gpu-blocks",
        "32",
        "--block-size",
        "4",
        "--inject-ids",
        "1,2,3,4,5",
        "--steps",
        "2",
        "--screenshot",
        str(shot),
    ]
    r = kvscope(*base, "--select", "99", QT_QPA_PLATFORM="offscreen")
    assert r.returncode == 2 and not shot.exists()
    assert _said(r) == ["kvscope: --select 99: no such request at step 2 (requests: 0)"]
    r = kvscope(*base, "--select-block", "32", QT_QPA_PLATFORM="offscreen")
    assert r.returncode == 2 and _said(r) == ["kvscope: --select-block 32: no such block (the pool has blocks 0-31)"]


@pytest.mark.parametrize(
    "name,says",
    [
        ("screenshot.png", "is not a kvscope trace: it is not a text file"),
        ("scenario", "is not a kvscope trace: it is a scenario file (run it with --scenario"),
    ],
)
def test_a_replay_of_something_else_says_what_it_is(capsys, name, says):
    path = "docs/screenshot.png" if name == "screenshot.png" else "resources/scenarios/four-score.json"
    assert_one_line_exit_2(capsys, "--headless", "--replay", path, says=says)


def test_a_model_path_that_does_not_exist_says_what_kvscope_tried(capsys):
    code, lines = run_main(capsys, "--headless", "--model", "/no/such/model")
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(
        "kvscope: cannot find model '/no/such/model'; tried: local path '/no/such/model' (does not exist); short name"
    )
    assert "Repo id" not in lines[0] and "hub id" not in lines[0]  # a path is not looked up on the hub


@pytest.mark.parametrize("flag", ["--attach", "--fleet"])
def test_steps_in_a_window_that_takes_no_steps_is_refused_not_ignored(capsys, tmp_path, flag, monkeypatch):
    """``--steps N`` means step N in every window: where a window follows another engine's events and takes no
    steps (an attached engine, a fleet), it is refused in one line, exit 2 (issue 42)."""
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    if flag == "--fleet":
        fleet = tmp_path / "fleet.json"
        fleet.write_text(json.dumps({"instances": [{"name": "a", "endpoint": "tcp://127.0.0.1:5999"}]}))
        argv = ["--fleet", str(fleet), "--steps", "5"]
    else:
        argv = ["--attach", "tcp://127.0.0.1:5999", "--steps", "5"]
    code, lines = run_main(capsys, *argv)
    assert code == 2 and len(lines) == 1 and f"--steps 5 with {flag} in a window" in lines[0], lines
