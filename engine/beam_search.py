"""Beam search on top of fork and copy-on-write.

A beam group owns ``beam_width`` live sequences (ordinary requests that share
blocks). Each round, once every live beam has its next-token log-probs, the
group picks the best continuations over all beams; a beam that is chosen several
times is forked (its children share its blocks, CoW on their first write), a beam
that is chosen by none is pruned and frees its own blocks.

The selection follows transformers' beam search (``num_beams``, ``length_penalty``,
``early_stopping``) step for step, so the two return the same beams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .core.request import Request


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]  # generated tokens, the stop token included
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    stopped: bool  # ended by a stop token (else by the length limit)


@dataclass(slots=True)
class BeamRound:
    """What the engine applies after a round: continuations, prunes, and whether the search ended."""

    continuations: list[tuple[Request, list[tuple[int, float]]]]  # beam -> (token, cumulative log-prob); first: itself
    pruned: list[Request]
    done: bool


@dataclass
class BeamGroup:
    group_id: str
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop_ids: frozenset[int] = frozenset()
    beams: list[Request] = field(default_factory=list)  # live, best first
    scores: dict[str, float] = field(default_factory=dict)  # request id -> cumulative log-prob
    pending: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> log-probs of its next token
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False
    _improvable: bool = True

    def add_beam(self, req: Request, score: float) -> None:
        self.beams.append(req)
        self.scores[req.request_id] = score

    def report(self, req: Request, logits: torch.Tensor) -> None:
        """The beam's next-token logits (a recomputed beam may report the same round twice)."""
        self.pending[req.request_id] = torch.log_softmax(logits.float(), dim=-1)
        req.awaiting_round = True

    def ready(self) -> bool:
        return not self.done and bool(self.beams) and all(b.request_id in self.pending for b in self.beams)

    def advance(self, length_limit: int) -> BeamRound:
        """One round over every live beam; ``length_limit`` caps the generated length (context)."""
        k = self.beam_width
        beams = self.beams
        lp = torch.stack([self.pending[b.request_id] + self.scores[b.request_id] for b in beams])
        self.pending.clear()
        vocab = lp.shape[1]
        keep = min(max(2, 1 + len(self.stop_ids)) * k, lp.numel())
        top, idx = torch.topk(lp.flatten(), keep)
        gen_len = len(beams[0].output_token_ids) + 1
        at_limit = gen_len >= min(self.max_tokens, length_limit)
        chosen: dict[int, list[tuple[int, float]]] = {}
        next_scores: list[tuple[int, int, float]] = []  # (beam, token, score) for the running set
        new_hyps: list[BeamHypothesis] = []
        for rank, (score, flat) in enumerate(zip(top.tolist(), idx.tolist())):
            b, tok = divmod(flat, vocab)
            stops = tok in self.stop_ids
            if stops or at_limit:
                # Only the top beam_width candidates may become finished hypotheses.
                if rank < k and self._improvable:
                    seq = beams[b].output_token_ids + [tok]
                    new_hyps.append(BeamHypothesis(seq, score, score / gen_len**self.length_penalty, stops))
            elif len(next_scores) < k:
                next_scores.append((b, tok, score))
        self.finished = sorted(self.finished + new_hyps, key=lambda h: -h.score)[:k]
        for b, tok, score in next_scores:
            chosen.setdefault(b, []).append((tok, score))

        # Continue only while a running beam could still beat the worst finished one.
        if next_scores and len(self.finished) == k:
            best = max(s for _, _, s in next_scores) / gen_len**self.length_penalty
            self._improvable = self._improvable and best > self.finished[-1].score
        self.done = not next_scores or not self._improvable or (self.early_stopping and len(self.finished) == k)
        if self.done:
            return BeamRound([], list(beams), True)
        # The engine re-adds the survivors and their children through add_beam.
        self.beams, self.scores = [], {}
        return BeamRound(
            [(beams[b], toks) for b, toks in chosen.items()],
            [beams[b] for b in range(len(beams)) if b not in chosen],
            False,
        )

    def sort_beams(self) -> None:
        """Best first, as transformers orders its running beams (only exact ties depend on it)."""
        self.beams.sort(key=lambda b: -self.scores[b.request_id])

    def results(self, n: int) -> list[BeamHypothesis]:
        """The best ``n`` hypotheses (finished ones, else the live beams as they stand)."""
        if self.finished or not self.beams:
            return self.finished[:n]
        live = [
            BeamHypothesis(list(b.output_token_ids), self.scores[b.request_id], self.scores[b.request_id], False)
            for b in self.beams
        ]
        return sorted(live, key=lambda h: -h.score)[:n]
