"""Which requests and blocks the window points at, and why: one rule for every source (kvscope's engine, a replay,
a probed vLLM), so that the paper's figure never waits for a click.

In order: what the user pinned (a row or a block clicked, ``--select``); the lesson's subject (a scenario note's
``requests`` and ``blocks``); the request the audit names (the last holder of a flagged block); the newest running
request. The figure says which of these chose what it draws (``Focus.why``). No Qt here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.scenario import Subject

PINNED, LESSON, AUDIT, NEWEST, LAST, NONE = "pinned", "lesson", "audit", "newest", "last", "none"


@dataclass(frozen=True, slots=True)
class Focus:
    requests: tuple[str, ...] = ()
    blocks: tuple[int, ...] = ()
    rule: str = NONE
    step: int | None = None  # the lesson's note that names the subject

    @property
    def why(self) -> str:
        """The rule in words, for the figure's first line."""
        return {
            PINNED: "your choice (Esc follows the lesson again)",
            LESSON: f"the lesson's subject (the note of step {self.step})",
            AUDIT: "the request the audit names",
            NEWEST: "the newest running request (click a request to pin another)",
            LAST: "the last request followed (none runs now)",
        }.get(self.rule, "")


def audit_named(snap, audit) -> str | None:
    """The request the audit blames (the last holder of its first flagged block), if it is in the snapshot."""
    if audit is None or audit.ok or snap is None:
        return None
    ids = {r.request_id for r in snap.requests}
    return next((p.last_owner for p in audit.problems if p.last_owner and p.last_owner in ids), None)


def newest_running(snap) -> str | None:
    """The running request that arrived last (the highest index), if any runs."""
    running = [r for r in snap.requests if r.status == "RUNNING"] if snap is not None else []
    return max(running, key=lambda r: r.index).request_id if running else None


def choose(
    snap,
    audit=None,
    subject: Subject | None = None,
    pinned: tuple[str, ...] = (),
    pinned_blocks: tuple[int, ...] = (),
    previous: Focus | None = None,
) -> Focus:
    """What the window points at now (see the module's docstring for the order); ``pinned_blocks``: a block the
    user clicked that no request holds; ``previous``: what it pointed at before, kept while its requests are still
    in the snapshot and nothing else applies (the run ended)."""
    if pinned or pinned_blocks:
        return Focus(tuple(pinned), tuple(pinned_blocks), PINNED)
    if subject is not None and (subject.requests or subject.blocks):
        return Focus(subject.requests, subject.blocks, LESSON, subject.at)
    named = audit_named(snap, audit)
    if named is not None:
        return Focus((named,), tuple(audit.bad_blocks), AUDIT)
    newest = newest_running(snap)
    if newest is not None:
        return Focus((newest,), (), NEWEST)
    if previous is not None and previous.requests and snap is not None:
        kept = tuple(r for r in previous.requests if snap.request(r) is not None)
        if kept:
            return Focus(kept, (), LAST)
    return Focus()
