"""Every error the server answers, OpenAI-style, and after each one the server still serves."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving import Served

from engine import LLMEngine
from kvscope.serve import ServeOptions

GOOD = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture
def served(tiny_hf, tiny_tokenizer):
    made: list[Served] = []

    def make(options=None, attach=True, **kw) -> Served:
        kw.setdefault("num_gpu_blocks", 64)
        kw.setdefault("block_size", 4)
        s = Served(LLMEngine.from_hf_model(tiny_hf, tiny_tokenizer, name="tiny-llama", **kw), options, attach=attach)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == status
    assert all(w in err["message"] for w in words), err["message"]


def still_serves(s: Served, headers: dict | None = None) -> None:
    r = httpx.post(f"{s.url}/v1/completions", json=GOOD, headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_bad_json_is_400(served):
    s = served()
    json_header = {"content-type": "application/json"}
    r = httpx.post(f"{s.url}/v1/completions", content=b'{"prompt": "hi", ', headers=json_header)
    assert_error(r, 400, "invalid JSON")
    assert_error(httpx.post(f"{s.url}/v1/chat/completions", content=b"[1, 2"), 400)
    assert_error(httpx.post(f"{s.url}/v1/completions", content=b"not json"), 400, "JSON object")
    still_serves(s)


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("completions", {"prompt": "x", "temperature": -1}, ("temperature",)),
        ("completions", {"prompt": "x", "top_p": 0}, ("top_p",)),
        ("completions", {"prompt": "x", "top_k": -5}, ("top_k",)),
        ("completions", {"prompt": "x", "n": 0}, ("n must be",)),
        ("completions", {"prompt": "x", "max_tokens": 0}, ("max_tokens",)),
        ("completions", {"prompt": "x", "max_tokens": "many"}, ("max_tokens",)),
        ("completions", {"prompt": "x", "logprobs": 2}, ("`logprobs` is not supported",)),
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, ("stream: true",)),
        ("completions", {"prompt": ["a", "b"]}, ("one prompt per request",)),
        ("completions", {"prompt": ""}, ("empty",)),
        ("completions", {"prompt": [300, 1]}, ("outside the vocabulary",)),
        ("completions", {"prompt": {"text": "x"}}, ("prompt",)),
        ("completions", {"max_tokens": 3}, ("prompt", "Field required")),
        ("completions", {"prompt": "x", "stop": [""]}, ("stop string",)),
        ("chat/completions", {"messages": []}, ("messages",)),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            ("messages",),
        ),
        ("chat/completions", {"messages": [{"content": "no role"}]}, ("role",)),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5},
            ("`presence_penalty` is not supported",),
        ),
    ],
)
def test_bad_parameters_are_400(served, path, body, words):
    s = served()
    assert_error(httpx.post(f"{s.url}/v1/{path}", json=body), 400, *words)
    still_serves(s)


def test_prompts_longer_than_the_context_or_the_pool_are_400(served):
    s = served(num_gpu_blocks=8)  # 32 tokens of pool, 512 of context
    assert_error(httpx.post(f"{s.url}/v1/completions", json={"prompt": "x" * 600}), 400, "context is 512 tokens")
    assert_error(
        httpx.post(f"{s.url}/v1/completions", json={"prompt": "x" * 20, "max_tokens": 40}),
        400,
        "can never fit",
        "the whole pool has 8",
    )
    with pytest.raises(openai.BadRequestError, match="can never fit"):
        s.client().chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "y" * 40}], max_tokens=4
        )
    still_serves(s)


def test_unknown_model_is_404(served):
    s = served()
    assert_error(httpx.post(f"{s.url}/v1/completions", json={**GOOD, "model": "gpt-9"}), 404, "`gpt-9`")
    with pytest.raises(openai.NotFoundError):
        s.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert_error(httpx.get(f"{s.url}/v1/nothing-here"), 404)
    assert_error(httpx.get(f"{s.url}/v1/completions"), 405)
    still_serves(s)


def test_503_while_the_model_loads_then_serves(served):
    s = served(attach=False)
    assert_error(httpx.post(f"{s.url}/v1/completions", json=GOOD), 503, "loading")
    assert_error(
        httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
        503,
        "loading",
    )
    assert_error(httpx.get(f"{s.url}/v1/models"), 503)
    assert_error(httpx.get(f"{s.url}/health"), 503)
    assert httpx.get(f"{s.url}/metrics").status_code == 200
    s.attach()
    assert httpx.get(f"{s.url}/health").status_code == 200
    still_serves(s)


def test_api_key_is_required_on_v1(served):
    s = served(ServeOptions(port=0, api_key="s3cret"))
    assert_error(httpx.post(f"{s.url}/v1/completions", json=GOOD), 401, "API key")
    assert_error(httpx.post(f"{s.url}/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(f"{s.url}/v1/completions", json=GOOD, headers={"Authorization": "s3cret"}), 401)
    assert_error(httpx.get(f"{s.url}/v1/models"), 401)
    # Unauthenticated junk is refused as unauthenticated, before its body is looked at.
    assert_error(httpx.post(f"{s.url}/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
    with pytest.raises(openai.AuthenticationError):
        s.client(api_key="wrong").completions.create(model="tiny-llama", prompt="x", max_tokens=1)
    r = s.client(api_key="s3cret").completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert httpx.get(f"{s.url}/health").status_code == 200 and httpx.get(f"{s.url}/metrics").status_code == 200
    still_serves(s, headers={"Authorization": "Bearer s3cret"})
