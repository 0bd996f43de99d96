"""``LLM``: vLLM's offline API on top of ``LLMEngine``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

from .config import EngineConfig, RequestOutputKind, SamplingParams
from .inputs import PromptType, is_chat, is_token_ids
from .llm_engine import LLMEngine
from .outputs import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **config))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        self = cls.__new__(cls)
        self.llm_engine = engine
        return self

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A bad prompt raises before any request is queued."""
        one = isinstance(prompts, str) or is_chat(prompts) or is_token_ids(prompts)
        prompts = cast(list[PromptType], [prompts] if one else list(cast(Sequence[PromptType], prompts)))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError("need one SamplingParams per prompt")
        # only the final outputs are read here: the engine need not build one per request per step
        params = [dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        eng = self.llm_engine
        ids, added = [], []
        try:
            for p, sp in zip(prompts, params):
                rid = eng.add_request(p, sp)
                ids.append(rid)
                added.append(rid)
        except Exception:
            for rid in added:
                eng.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in eng.step().outputs:
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]
