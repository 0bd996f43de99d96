"""Each instance's own numbers, from its Prometheus ``/metrics`` (vLLM's names; kvscope serves the same).

KV events say which blocks are cached; they do not say how full the pool is or how busy the instance is. vLLM's
``/metrics`` does: ``vllm:kv_cache_usage_perc`` (blocks in use over the pool), ``vllm:num_requests_running`` and
``..._waiting`` (the load a router balances). kvscope also serves ``kvscope:prefix_cache_blocks``, its own count
of cached blocks, which the fleet view's count from the events should equal. One thread scrapes every instance
that names a ``metrics`` URL, every ``interval`` seconds, so a slow or dead server never holds up a poll.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# metric family -> (key in the fleet's JSON, how the data-parallel engines' samples combine)
WANTED = {
    "vllm:kv_cache_usage_perc": ("kv_cache_usage_perc", "mean"),
    "vllm:num_requests_running": ("num_requests_running", "sum"),
    "vllm:num_requests_waiting": ("num_requests_waiting", "sum"),
    "kvscope:prefix_cache_blocks": ("prefix_cache_blocks", "sum"),
}


@dataclass(frozen=True)
class Scrape:
    values: dict[str, float]  # WANTED's keys found
    at: float  # time.monotonic() of the answer
    error: str | None = None  # one line: why the last scrape failed (values: the last good ones, if any)

    def as_dict(self, now: float) -> dict:
        return {**self.values, "age_s": round(now - self.at, 1), "error": self.error}


def parse_metrics(text: str) -> dict[str, float]:
    """The wanted series from a Prometheus text page, each engine's samples combined."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        want = WANTED.get(fam.name)
        if want is None:
            continue
        key, how = want
        vals = [s.value for s in fam.samples if s.name == fam.name]
        if vals:
            out[key] = sum(vals) / len(vals) if how == "mean" else sum(vals)
    return out


class MetricsScraper:
    """Scrapes ``urls`` (instance name -> URL) on a daemon thread; ``latest`` is read from any thread."""

    def __init__(self, urls: dict[str, str], interval: float = 2.0, timeout: float = 1.0) -> None:
        self.urls, self.interval, self.timeout = urls, interval, timeout
        self.latest: dict[str, Scrape] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-fleet-metrics", daemon=True)
        if urls:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, url in self.urls.items():
                if self._stop.is_set():
                    return
                self.latest[name] = self._scrape(url, self.latest.get(name))
            self._stop.wait(self.interval)

    def _scrape(self, url: str, last: Scrape | None) -> Scrape:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:  # noqa: S310 - the user's own URL
                values = parse_metrics(r.read().decode("utf-8", "replace"))
            return Scrape(values, time.monotonic())
        except Exception as e:  # noqa: BLE001 - a dead server is one line, never a crash of the view
            why = str(getattr(e, "reason", "") or e).strip().splitlines()
            return Scrape(
                last.values if last else {},
                last.at if last else time.monotonic(),
                f"{url}: {why[0] if why else type(e).__name__}",
            )

    def get(self, name: str) -> Scrape | None:
        return self.latest.get(name)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout + 1.0)
