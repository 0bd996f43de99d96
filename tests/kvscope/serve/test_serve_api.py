"""The OpenAI-compatible endpoints on loopback, with the official ``openai`` client and with ``httpx``.

The tiny random Llama gets text and chat from a 256-token byte-level tokenizer (``byte_tokenizer``
in conftest), so its outputs are random bytes: cut UTF-8 characters are the rule, not the exception.
The oracle is ``LLM.generate`` on a fresh engine with the same weights and parameters.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import Served

from engine import LLM, LLMEngine, SamplingParams

PROMPT = "A paged KV cache keeps"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a block table?"}]


@pytest.fixture
def served(tiny_hf, tiny_tokenizer):
    made: list[Served] = []

    def make(options=None, hooks=(), attach=True, **kw) -> Served:
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        s = Served(LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", **kw), options, hooks, attach)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def oracle(tiny_hf, tiny_tokenizer):
    def generate(prompt, params: SamplingParams, **kw):
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        engine = LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", **kw)
        return LLM.from_engine(engine).generate(prompt, params)[0]

    return generate


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent-event stream (JSON decoded, ``[DONE]`` kept as a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return events


def test_completion_greedy_equals_llm_generate(served, oracle):
    s = served()
    ref = oracle(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    c = s.client()
    r = c.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].token_ids == ref.outputs[0].token_ids
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert r.prompt_token_ids == ref.prompt_token_ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # Streamed: the chunks add up to the same text; the usage chunk counts the prefix-cache hit.
    chunks = list(
        c.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and not chunks[-1].choices
    usage = chunks[-1].usage
    cached = s.call(lambda: s.engine.snapshot().request(chunks[0].id).num_cached_tokens)
    assert usage.prompt_tokens_details.cached_tokens == cached > 0
    assert usage.completion_tokens == 12


def test_chat_greedy_equals_llm_generate(served, oracle):
    s = served()
    ref = oracle(CHAT, SamplingParams(max_tokens=10, temperature=0.0))
    c = s.client()
    r = c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.object == "chat.completion"
    chunks = list(
        c.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_httpx_stream_is_one_chunk_per_step_then_done(served, oracle):
    s = served()
    ref = oracle([5, 6, 7, 8, 9], SamplingParams(max_tokens=12, temperature=0.0))
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # One token a step, one chunk a step: twelve chunks of one token each.
    assert [len(ch["choices"][0]["token_ids"]) for ch in chunks] == [1] * 12
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == ref.outputs[0].token_ids
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7, 8, 9] and all(ch["prompt_token_ids"] is None for ch in chunks[1:])
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * 11 + ["length"]
    # Chat over httpx, non-streaming.
    r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_parallel_samples_and_seed_equal_llm_generate(served, oracle):
    s = served()
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, n=3, seed=11)
    ref = oracle(PROMPT, params)
    c = s.client()
    r = c.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.9,
        top_p=0.95,
        n=3,
        seed=11,
        extra_body={"top_k": 50},
    )
    assert [ch.text for ch in r.choices] == [o.text for o in sorted(ref.outputs, key=lambda o: o.index)]
    assert r.usage.completion_tokens == 24
    texts = {}
    for ch in c.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.9,
        top_p=0.95,
        n=3,
        seed=11,
        extra_body={"top_k": 50},
        stream=True,
    ):
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [ch.text for ch in r.choices]


def test_stop_string_streamed_and_not_equal(served, oracle):
    s = served()
    # A stop string the greedy output really contains: two printable ASCII characters from its middle.
    prompt = full = None
    for i in range(20):
        prompt = f"{PROMPT} {i}"
        full = oracle(prompt, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].text
        at = next(
            (j for j in range(3, len(full) - 2) if full[j : j + 2].isascii() and full[j : j + 2].isprintable()), None
        )
        if at is not None:
            break
    assert at is not None
    stop = full[at : at + 2]
    ref = oracle(prompt, SamplingParams(max_tokens=24, temperature=0.0, stop=[stop]))
    assert ref.outputs[0].finish_reason == "stop" and stop not in ref.outputs[0].text
    c = s.client()
    r = c.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, stop=stop)
    assert r.choices[0].text == ref.outputs[0].text and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=True
        )
    )
    assert streamed == ref.outputs[0].text  # nothing of the stop string leaked out before the cut


def test_chat_without_max_tokens_fills_the_pool(served):
    s = served(num_gpu_blocks=16)  # 64 tokens, less than the 512-token context
    r = s.client().chat.completions.create(model="tiny-llama", messages=CHAT, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 64


def test_models_and_health(served):
    s = served()
    models = s.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llama"] and models.data[0].max_model_len == 512
    assert httpx.get(f"{s.url}/health").status_code == 200


def _family(families, name):
    return next(f for f in families if f.name == name)


def test_metrics_have_vllm_names_and_match_the_engine(served):
    s = served(num_gpu_blocks=24, max_num_seqs=8)  # four long requests do not fit at once: preemptions
    c = s.client()
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(
                lambda p: c.completions.create(model="tiny-llama", prompt=p, max_tokens=30, temperature=0), prompts
            )
        )
    c.completions.create(model="tiny-llama", prompt=prompts[0], max_tokens=2, temperature=0)  # a prefix-cache hit
    s.wait_idle()
    text = httpx.get(f"{s.url}/metrics").text
    assert "vllm:prefix_cache_queries_total{" in text and "_created" not in text  # as a vLLM dashboard queries it
    families = list(text_string_to_metric_families(text))
    counters = s.call(s.engine.metrics)
    assert counters["num_preemptions"] > 0 and counters["prefix_cache_hits"] > 0
    labels = {"model_name": "tiny-llama", "engine": "0"}
    for key in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "generation_tokens", "prompt_tokens"):
        fam = _family(families, f"vllm:{key}")
        assert fam.type == "counter"
        [sample] = [x for x in fam.samples if x.name == f"vllm:{key}_total"]
        assert sample.labels == labels and sample.value == counters[key], key
    for key in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        fam = _family(families, f"vllm:{key}")
        assert fam.type == "gauge" and fam.samples[0].value == counters[key] == 0
    fam = _family(families, "kvscope:prefix_cache_blocks")  # what a fleet view checks its count against
    assert fam.type == "gauge"
    assert fam.samples[0].value == counters["num_cached_blocks"] == len(s.engine.pool.cached) > 0
    for key in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        fam = _family(families, f"vllm:{key}")
        assert fam.type == "histogram"
        [count] = [x for x in fam.samples if x.name == f"vllm:{key}_count"]
        assert count.value == 5 and count.labels == labels
    success = {
        x.labels["finished_reason"]: x.value
        for x in _family(families, "vllm:request_success").samples
        if x.name.endswith("_total")
    }
    assert success["length"] == 5 and success["abort"] == 0
    assert sum(r.usage.completion_tokens for r in results) + 2 == counters["generation_tokens"]


def test_smollm2_chat_with_its_real_template_equals_llm_generate(smollm2):
    """The embedded model's own tokenizer and chat template, through the official client."""
    model, tok, src = smollm2
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ref = LLM.from_engine(LLMEngine.from_hf_model(model, tok, name=src.name, num_gpu_blocks=64)).generate(
        chat, SamplingParams(max_tokens=16, temperature=0.0)
    )[0]
    s = Served(LLMEngine.from_hf_model(model, tok, name=src.name, num_gpu_blocks=64))
    try:
        c = s.client()
        r = c.chat.completions.create(model=src.name, messages=chat, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == ref.outputs[0].text and "Paris" in r.choices[0].message.content
        streamed = "".join(
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=src.name, messages=chat, max_tokens=16, temperature=0, stream=True
            )
        )
        assert streamed == ref.outputs[0].text
    finally:
        s.close()
