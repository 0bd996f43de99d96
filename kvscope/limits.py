"""How much of a long run the window keeps: one bound for each store that grows with steps, requests or
events, each with its default, here and nowhere else.

A window left open on a served engine sees steps, requests and events without end. Every store that grows
with them stops at its bound and drops its oldest entries first, never what is on screen now (the live
step, the rows in view, the selected request):

- the timeline (``kvscope.history.RunHistory``): everything it holds (keyframes, packed events, per-step
  numbers, per-request rows, the prefix cache's stored values), counted object by object as it is added,
  within ``timeline_bytes``, and rows of at most ``timeline_requests`` requests; past either, its oldest
  steps go. The plots draw the timeline's series, so they reach as far back as it does;
- the event log's rows (``event_log_rows``);
- the prefix-cache miss explanations, one per request (``miss_explanations``), and the evicted blocks
  the explainer remembers to say "evicted at step s" (``evicted_blocks``);
- the requests table shows what the engine's snapshot carries: the requests in flight and its last
  ``engine.request_groups.MAX_FINISHED`` finished ones (the engine's own bound).

Each bound is a flag of the window (``kvscope --help``, "window limits": ``--timeline-mib``,
``--timeline-requests``, ``--event-log-rows``, ``--miss-explanations``, ``--evicted-blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowLimits:
    timeline_bytes: int = 96 * 2**20
    timeline_requests: int = 20_000
    event_log_rows: int = 100_000
    miss_explanations: int = 20_000
    evicted_blocks: int = 20_000


LIMITS = WindowLimits()


def event_log_text(rows: int = LIMITS.event_log_rows) -> str:
    return f"event log: last {rows:,} events"


def timeline_text(budget_bytes: int = LIMITS.timeline_bytes, requests: int = LIMITS.timeline_requests) -> str:
    return f"timeline: last {budget_bytes / 2**20:,.0f} MiB of steps, rows of the last {requests:,} requests"


def requests_text() -> str:
    from engine.request_ids import MAX_FINISHED  # the engine's own bound

    return f"requests table: those in flight and the engine's last {MAX_FINISHED} finished"


def misses_text(requests: int = LIMITS.miss_explanations) -> str:
    return f"prefix-cache misses: explained for the last {requests:,} requests"
