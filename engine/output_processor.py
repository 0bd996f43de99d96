"""The output processor: sampled tokens in, request state and ``RequestOutput``\\s out.

Detokenization, the stop rules (EOS, stop token ids, stop strings, length) and the
user-visible outputs of a request group (one completion per sample or beam), as
vLLM's ``OutputProcessor`` does them. It never touches blocks: finishing a request
is the caller's (``RequestGroups.finish``).
"""

from __future__ import annotations

import time

from .beam_search import BeamGroup
from .core.request import Request, RequestStatus
from .outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def push_token(self, req: Request, tok: int) -> None:
        """Append one generated token and refresh the request's text."""
        req.output_token_ids.append(tok)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if self.tokenizer is not None:
            req.output_text = self.decode(req.output_token_ids)

    def append_token(self, req: Request, tok: int) -> RequestStatus | None:
        """Append a sampled token and apply the stop rules; returns the finish status, if any.

        Called for every running request every step: ``push_token`` inlined, the rules cheapest first.
        """
        out = req.output_token_ids
        out.append(tok)
        self.num_generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if self.tokenizer is not None:
            req.output_text = self.decode(out)
        rules = req.stop_rules
        if rules is None:
            req.stop_rules = rules = self._stop_rules(req)
        limit, look = rules
        if look:
            p = req.sampling_params
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if tok in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop:
                hits = [i for i in (req.output_text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    req.output_text = req.output_text[: min(hits)]  # the stop string is not part of the output
                    return RequestStatus.FINISHED_STOPPED
        if len(out) >= limit:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _stop_rules(self, req: Request) -> tuple[int, bool]:
        """(output tokens at which it ends by length, whether any token or text ends it sooner): both
        fixed once the request is admitted (its prompt and sampling parameters never change)."""
        p = req.sampling_params
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        look = bool((not p.ignore_eos and req.eos_token_ids) or p.stop_token_ids or p.stop)
        return limit, look

    def make_output(self, members: list[Request], beams: BeamGroup | None, decode: bool = True) -> RequestOutput:
        """The user-visible output of one group: one completion per sample (or per best beam).

        ``decode=False`` (a failed step's outputs) never calls the tokenizer: beams get no text.
        """
        head = members[0]
        if len(members) == 1 and not head.pending_forks and beams is None:  # the common case
            comp = CompletionOutput(0, head.output_text, head.output_token_ids[:], head.status.finish_reason)
            # prompt_token_ids is never mutated after admission: shared, not copied every step.
            return RequestOutput(
                head.group_id,
                head.prompt,
                head.prompt_token_ids,
                [comp],
                head.is_finished,
                max(head.num_cached_tokens, 0),
                head.error,
            )
        error = next((r.error for r in members if r.error), None)
        if beams is not None:

            def reason(h) -> str | None:
                return None if not beams.done else "error" if error else "stop" if h.stopped else "length"

            comps = [
                CompletionOutput(i, self.decode(h.token_ids) if decode else "", h.token_ids, reason(h), h.cum_logprob)
                for i, h in enumerate(beams.results(head.sampling_params.n))
            ]
        else:
            comps = [
                CompletionOutput(r.sample_index, r.output_text, list(r.output_token_ids), r.status.finish_reason)
                for r in sorted(members, key=lambda r: r.sample_index)
            ]
        done = all(r.is_finished for r in members) and not head.pending_forks
        return RequestOutput(
            head.group_id, head.prompt, head.prompt_token_ids, comps, done, max(head.num_cached_tokens, 0), error
        )
