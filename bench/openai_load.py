"""A load of streaming ``/v1/completions`` requests against any OpenAI-compatible server (kvscope's, vLLM's).

``run_load(url, model, prompts, concurrency, max_tokens)`` (``model`` None: the one the server lists):
``concurrency`` clients, each sending the next
prompt (token ids, so both servers see the very same input) as soon as its last answer ended; greedy,
``ignore_eos``, ``return_token_ids`` and the usage in the stream's last chunk. Measured as a client sees it:
output tokens per second from the first request sent to the last answer received, the time to each
request's first token, and the gaps between its tokens (inter-token latency).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between two tokens, one per token after the first
    completion_tokens: int | None = None  # as the server's usage counts them


@dataclass
class LoadResult:
    answers: list[Answer]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(a.token_ids) for a in self.answers)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> Answer:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    ans = Answer()
    t0 = last = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            if ev.get("usage"):
                ans.completion_tokens = ev["usage"]["completion_tokens"]
            for choice in ev.get("choices") or ():
                ids = choice.get("token_ids") or []
                if not ids:
                    continue
                now = time.perf_counter()
                if ans.ttft is None:
                    ans.ttft = now - t0
                else:
                    ans.gaps += [(now - last) / len(ids)] * len(ids)
                last = now
                ans.token_ids += ids
    return ans


async def _load(url: str, model: str | None, prompts: list[list[int]], concurrency: int, max_tokens: int) -> LoadResult:
    todo = list(enumerate(prompts))
    answers: list[Answer | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        if model is None:  # the name the server serves its model under
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker() -> None:
            while todo:
                i, prompt = todo.pop(0)
                answers[i] = await _one(client, model, prompt, max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    return LoadResult(answers, seconds)  # type: ignore[arg-type]


def run_load(url: str, model: str | None, prompts: list[list[int]], concurrency: int, max_tokens: int) -> LoadResult:
    return asyncio.run(_load(url, model, prompts, concurrency, max_tokens))
