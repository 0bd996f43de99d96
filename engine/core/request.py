"""Request state: token ids, progress (``num_computed_tokens``) and lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..config import SamplingParams
from .kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after a recompute preemption
    SWAPPED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13
    FINISHED_PRUNED = 14  # a beam that no continuation chose

    @property
    def finished(self) -> bool:
        return self._value_ >= 10  # FINISHED_*: the raw value, no enum lookup (called per request per step)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(int(self))


_FINISH_REASONS = {10: "stop", 11: "length", 12: "abort", 13: "error", 14: "pruned"}


@dataclass(eq=False)
class Request:
    request_id: str
    index: int  # monotonically increasing admission number, used as the owner id in snapshots
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # of its full blocks, in order
    output_text: str = ""
    error: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: object | None = None  # a seeded request's torch.Generator: the sampler's, opaque here
    group_id: str = ""  # the user's request id; n > 1 samples share it
    sample_index: int = 0
    parent_id: str | None = None  # set on forked sequences
    pending_forks: int = 0  # n - 1 until the prompt's prefill is done
    snapshot_row: object = field(default=None, repr=False)  # its RequestInfo once finished (it never changes)
    prompt_tuple: tuple[int, ...] | None = field(default=None, repr=False)  # the prompt for snapshot rows, once
    num_forks: int = 0  # on-demand forks made of this sequence (names the next one)
    cpu_block_ids: list[int] = field(default_factory=list)  # while swapped out
    awaiting_round: bool = False  # a beam whose logits are in, waiting for its siblings' (beam search)
    client: str = ""  # who sent it (an HTTP client's host:port); "" for the window, scripts, scenarios
    stop_rules: tuple[int, bool] | None = field(default=None, repr=False)  # OutputProcessor's, once

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
