"""What a step could trip over later is refused at add_request, with one line, changing nothing."""

from __future__ import annotations

import math

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import MAX_SEED, derive_seed

OK = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seed": MAX_SEED + 1}, "seed must be None or an integer in 0..18446744073709551615"),
        ({"seed": -1}, "seed must be"),
        ({"seed": True}, "seed must be"),
        ({"seed": 1.5}, "seed must be"),
        ({"seed": "3"}, "seed must be"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop": ""}, "stop must be"),
        ({"stop": ["ok", ""]}, "stop must be"),
        ({"stop": [3]}, "stop must be"),
        ({"stop": [None]}, "stop must be"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2.0}, "n must be"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"use_beam_search": True, "length_penalty": math.nan}, "length_penalty"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_changed_after_construction_are_refused_at_add_request(tiny_engine):
    engine = tiny_engine()
    for field, value in (("seed", 2**64), ("temperature", math.nan), ("stop", [""])):
        p = SamplingParams(max_tokens=3)
        setattr(p, field, value)
        with pytest.raises(ValueError, match=field):
            engine.add_request([1, 2, 3], p)
    assert not engine.requests and not engine.scheduler.waiting


def test_derived_seeds_stay_in_range():
    assert derive_seed(MAX_SEED, 0) == MAX_SEED
    assert all(0 <= derive_seed(MAX_SEED, i) <= MAX_SEED for i in range(1, 100))
    assert derive_seed(5, 2) == 5 + 2 * 1_000_003  # the streams of every seed below the top are unchanged


def test_other_add_request_arguments(tiny_engine):
    engine = tiny_engine()
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        engine.add_request([1, 2], OK, cache_salt=5)
    with pytest.raises(ValueError, match="lone surrogate"):
        engine.add_request("bad \udcff text", OK)
    assert not engine.requests


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"block_size": "16"}, "block_size must be an integer, got '16'"),
        ({"block_size": True}, "block_size must be an integer"),
        ({"seed": -1}, r"seed must be in 0\.\.18446744073709551615"),
        ({"swap_space": math.inf}, "swap_space must be a finite number"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be true or false"),
        ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap, got 'drop'"),
        ({"fault": "segfault"}, "fault must be one of abort-leak, cow-leak, double-free, shared-write or None"),
        ({"hash_algo": "md5"}, "hash_algo must be one of sha256, builtin"),
        ({"kv_layout": "ring"}, "kv_layout must be one of paged, contiguous"),
        ({"attention_backend": "cuda"}, "attention_backend must be one of auto, cpu, torch, triton"),
        ({"max_model_len": 1}, "max_model_len must be >= 2"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"num_cpu_blocks": -1}, "num_cpu_blocks must be >= 0"),
    ],
)
def test_engine_config_checks_every_field_from_its_metadata(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs).validate()


def test_an_unknown_device_is_a_bad_configuration():
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        LLMEngine(EngineConfig(device="gpu0"))
