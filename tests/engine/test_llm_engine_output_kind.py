"""``SamplingParams.output_kind``: every step's cumulative output, or the final one only (what
``LLM.generate`` asks for), with the same tokens either way."""

from __future__ import annotations

import pytest

from engine import LLM, RequestOutputKind, SamplingParams


def run(engine, kind: RequestOutputKind, n: int = 1):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=n, output_kind=kind)
    rid = engine.add_request([1, 2, 3, 4, 5], params)
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step().outputs if o.request_id == rid]
    return seen


def test_final_only_reports_once_with_the_same_tokens(tiny_engine):
    every = run(tiny_engine(), RequestOutputKind.CUMULATIVE)
    final = run(tiny_engine(), RequestOutputKind.FINAL_ONLY)
    assert len(every) == 6 and [len(o.outputs[0].token_ids) for o in every] == [1, 2, 3, 4, 5, 6]
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == every[-1].outputs[0].token_ids


def test_final_only_waits_for_every_sample_of_a_group(tiny_engine):
    final = run(tiny_engine(), RequestOutputKind.FINAL_ONLY, n=3)
    assert len(final) == 1 and final[0].finished and len(final[0].outputs) == 3


def test_generate_asks_for_final_outputs_and_leaves_the_callers_params_alone(tiny_engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = LLM.from_engine(tiny_engine()).generate([[1, 2, 3], [4, 5, 6, 7]], params)
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5] and all(o.finished for o in out)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_a_bad_output_kind_is_refused():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)
