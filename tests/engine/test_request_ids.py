"""Ids the engine makes (samples x#1, forks a+1, beams b~1, auto ids 0, 1, ...) never collide with a user's."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.request_groups import RESERVED_ID_CHARS
from tests.checked import GREEDY, Checked

OK = SamplingParams(max_tokens=4, **GREEDY)


@pytest.mark.parametrize(
    "made,user_id",
    [
        ("sample", "x#1"),
        ("fork", "a+1"),
        ("beam", "b~1"),
        ("sample", "x#2"),
        ("fork", "c+d"),
        ("beam", "~"),
    ],
)
def test_an_id_the_engine_could_make_is_refused_and_the_engines_own_is_made(tiny_engine, made, user_id):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    run = Checked(engine)
    parent = {"sample": "x", "fork": "a", "beam": "b"}[made]
    params = {
        "sample": SamplingParams(n=3, max_tokens=6, **GREEDY),
        "fork": SamplingParams(max_tokens=8, **GREEDY),
        "beam": SamplingParams(use_beam_search=True, beam_width=2, max_tokens=6, ignore_eos=True),
    }[made]
    engine.add_request([1, 2, 3, 4, 5], params, request_id=parent)
    with pytest.raises(ValueError, match=r"reserved for the ids the engine makes") as e:
        engine.add_request([7, 8, 9], OK, request_id=user_id)
    assert all(c in str(e.value) for c in RESERVED_ID_CHARS)
    assert list(engine.requests) == [parent]
    run.step()
    run.step()
    if made == "fork":
        assert engine.fork("a") == "a+1"
    run.drain()
    members = {r.request_id for r in engine.finished_log}
    assert {"sample": {"x#1", "x#2"}, "fork": {"a+1"}, "beam": {"b~1"}}[made] <= members


def test_auto_ids_skip_ids_users_took(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    run = Checked(engine)
    engine.add_request([1, 2], OK, request_id="0")
    engine.add_request([1, 2], OK, request_id="2")
    assert [engine.add_request([3, 4], OK) for _ in range(3)] == ["1", "3", "4"]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], OK, request_id="3")  # a live auto id is a user's to avoid too
    run.drain()
    assert sorted(run.outputs) == ["0", "1", "2", "3", "4"]
    # Finished ids are free again: the user may reuse one, and auto ids go on counting.
    assert engine.add_request([5, 6], OK, request_id="1") == "1"
    assert engine.add_request([5, 6], OK) == "5"
    run.outputs.clear()
    run.drain()
    assert sorted(run.outputs) == ["1", "5"]


def test_a_fork_skips_the_id_of_an_earlier_fork_still_running(tiny_engine):
    engine = tiny_engine(block_size=4, num_gpu_blocks=64)
    run = Checked(engine)
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=12, **GREEDY), request_id="a")
    run.step()
    assert engine.fork("a") == "a+1"
    run.step()
    engine.abort("a")  # "a" ends; its fork "a+1" goes on
    assert "a+1" in engine.requests
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, **GREEDY), request_id="a")
    run.step()
    assert engine.fork("a") == "a+2"
    assert engine.fork("a") == "a+3"
    run.drain()
    assert {"a", "a+1", "a+2", "a+3"} <= set(run.outputs)


@pytest.mark.parametrize("bad", ["", 7, 3.5, b"x"])
def test_a_request_id_must_be_a_non_empty_string(tiny_engine, bad):
    engine = tiny_engine()
    with pytest.raises(ValueError, match="non-empty string"):
        engine.add_request([1, 2], OK, request_id=bad)
    assert not engine.requests
