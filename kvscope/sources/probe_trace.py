"""A probe's recording (``kvscope --probe ADDR --trace F``): the probe's messages as they came, one JSON line each.

Reading whether a file is one needs no probe package (``kvscope --replay`` decides with it which replay to
build); writing one is the live ``ProbeSource``'s, playing one ``ProbeReplay``'s (``sources/probe.py``).
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

TRACE_FORMAT = "kvscope-probe-trace"
TRACE_VERSION = 1


class ProbeTraceWriter:
    """The probe's messages as they came, one JSON line each (``t`` seconds from the start, the payload)."""

    def __init__(self, path: str, header: dict) -> None:
        try:
            self._f = Path(path).open("w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write trace {path}: {e.strerror or e}") from None
        self._t0 = time.monotonic()
        self._write({"format": TRACE_FORMAT, "version": TRACE_VERSION, **header})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def message(self, payload: bytes) -> None:
        self._write({"t": round(time.monotonic() - self._t0, 6), "payload": base64.b64encode(payload).decode()})

    def close(self) -> None:
        self._f.close()


def is_probe_trace(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == TRACE_FORMAT
