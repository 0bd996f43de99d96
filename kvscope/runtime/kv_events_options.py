"""What kvscope's KV-event publisher is started with: vLLM's ``KVEventsConfig`` defaults, the two format
choices and the rank. No sockets here (the command line reads it without loading ZeroMQ)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.inspect.kv_events import HASH_FORMATS, MEDIUM_GPU, WIRE_FORMATS


@dataclass
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` defaults, plus the two format choices and the rank."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # e.g. "tcp://*:5558"; None: no replay
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark: past it, slow subscribers lose batches (gaps)
    data_parallel_rank: int = 0
    wire_format: str = "array"
    hash_format: str = "int"
    medium: str = MEDIUM_GPU

    def validate(self) -> None:
        if self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"KV events format must be one of {', '.join(WIRE_FORMATS)}, got {self.wire_format!r}")
        if self.hash_format not in HASH_FORMATS:
            raise ValueError(f"KV events hash must be one of {', '.join(HASH_FORMATS)}, got {self.hash_format!r}")
        if self.buffer_steps < 1 or self.hwm < 1:
            raise ValueError("KV events buffer_steps and hwm must be >= 1")
        if self.data_parallel_rank < 0:
            raise ValueError("data_parallel_rank must be >= 0")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and "://" not in ep:
                raise ValueError(f"KV events endpoint {ep!r} is not a ZeroMQ address (like tcp://127.0.0.1:5557)")
