"""``RunAudit``: the audit of a whole run, not of one moment. No Qt (``--headless`` and the window both keep one).

A pool can heal: a block freed twice and then handed out again, a request that ends while the audit sees its
table wrong. A summary that reads the last step's audit only can say "clean" for a run whose every step but the
last was wrong. A ``RunAudit`` is fed every record's audit and keeps: how many steps had problems, the first
``MAX_LISTED`` problems, each once with the step it was first seen at (a leak seen on 100 steps is one problem),
and each problem step's report for the timeline, up to ``MAX_KEPT`` of them.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.inspect.audit import AuditProblem, AuditReport

MAX_LISTED = 100  # problems listed (the headless JSON's audit_problems)
MAX_KEPT = 4096  # problem steps whose report is kept for the timeline (the oldest go first)


class RunAudit:
    def __init__(self) -> None:
        self.steps_with_problems = 0
        self.first_step: int | None = None  # the first step with a problem
        self.last_step: int | None = None
        self.problems: list[tuple[int, AuditProblem]] = []  # (first step seen, problem), at most MAX_LISTED
        self.more = 0  # distinct problems seen beyond MAX_LISTED
        self._seen: set[tuple] = set()
        self._reports: OrderedDict[int, AuditReport] = OrderedDict()

    def add(self, step: int, report: AuditReport | None) -> None:
        if report is None or report.ok:
            return
        if step != self.last_step:
            self.steps_with_problems += 1
        self.last_step = step
        if self.first_step is None:
            self.first_step = step
        self._reports[step] = report
        if len(self._reports) > MAX_KEPT:
            self._reports.popitem(last=False)
        for p in report.problems:
            key = (p.block_id, p.problem, p.last_owner, p.group)
            if key in self._seen:
                continue
            self._seen.add(key)
            if len(self.problems) < MAX_LISTED:
                self.problems.append((step, p))
            else:
                self.more += 1

    @property
    def clean(self) -> bool:
        return self.steps_with_problems == 0

    def at(self, step: int) -> AuditReport | None:
        """The report of ``step`` if it had problems (and is still kept), else None."""
        return self._reports.get(step)

    def problem_steps(self) -> list[int]:
        """The steps with problems whose reports are kept, in order."""
        return list(self._reports)

    def listed(self) -> list[str]:
        """Each problem once, with the step it was first seen at (the headless JSON's ``audit_problems``)."""
        out = [f"step {s}: {p}" for s, p in self.problems]
        if self.more:
            out.append(f"... and {self.more} more problems")
        return out

    def text(self) -> str:
        """One line: "clean", or how many steps had problems, from which step, and the first problem."""
        if self.clean:
            return "clean on every step"
        s, p = self.problems[0]
        steps = "1 step" if self.steps_with_problems == 1 else f"{self.steps_with_problems} steps"
        return f"problems on {steps} of this run (the first at step {s}: {p})"
