"""A probe's recording (``kvscope --probe ADDR --trace F``): the probe's messages as they came, one JSON line each.

Reading whether a file is one needs no probe package (``kvscope --replay`` decides with it which replay to
build); writing one is the live ``ProbeSource``'s, playing one ``ProbeReplay``'s (``sources/probe.py``).
"""

from __future__ import annotations

import base64
import time

from engine.inspect.jsonl import JsonLinesWriter, file_format

TRACE_FORMAT = "kvscope-probe-trace"
TRACE_VERSION = 2  # 2: the ops carry vLLM's block keys as bytes (probe protocol 5); 1 is read too


class ProbeTraceWriter(JsonLinesWriter):
    """The probe's messages as they came, one JSON line each (``t`` seconds from the start, the payload)."""

    def __init__(self, path: str, header: dict) -> None:
        self._t0 = time.monotonic()
        super().__init__(path, TRACE_FORMAT, TRACE_VERSION, header)

    def message(self, payload: bytes) -> None:
        self.write({"t": round(time.monotonic() - self._t0, 6), "payload": base64.b64encode(payload).decode()})


def is_probe_trace(path: str) -> bool:
    return file_format(path) == TRACE_FORMAT
