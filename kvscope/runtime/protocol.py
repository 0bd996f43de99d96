"""The typed protocol between the window and an engine host: commands one way, results the other.

The same messages travel through queued Qt signals (an engine on a worker thread) and through a
pipe (an engine in a child process), so the window cannot tell the two apart. All picklable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvscope.sources.base import InjectSpec, SourceInfo, StepRecord
from kvscope.sysinfo import MemoryReading


# -- commands (window -> host) ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Load:
    scenario: str | None = None  # None: what the command line asked for; "": the plain model


@dataclass(frozen=True, slots=True)
class Step:
    n: int = 1


@dataclass(frozen=True, slots=True)
class Run:
    pass


@dataclass(frozen=True, slots=True)
class Pause:
    pass


@dataclass(frozen=True, slots=True)
class SetInterval:
    ms: int


@dataclass(frozen=True, slots=True)
class Inject:
    spec: InjectSpec


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Fork:
    request_id: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True, slots=True)
class SetAudit:
    on: bool


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class CompareCaching:
    """Run these prompts (token ids, in order) greedily with prefix caching on and off, on the same weights."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = 16


Command = (
    Load
    | Step
    | Run
    | Pause
    | SetInterval
    | Inject
    | Abort
    | Fork
    | ResetPrefixCache
    | SetAudit
    | Shutdown
    | CompareCaching
)


# -- results (host -> window) ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Loaded:
    info: SourceInfo
    vocab: tuple[str, ...] = ()  # each token id's text, so the window decodes without a tokenizer of its own


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str
    bad_input: bool = False  # a bad model name, option, scenario or trace (exit code 2), not a crash


@dataclass(frozen=True, slots=True)
class Progress:
    text: str
    fraction: float | None = None  # None: indeterminate


@dataclass(frozen=True, slots=True)
class Stepped:
    """A step (or a command between steps) happened: the record of it and the memory reading after it."""

    record: StepRecord
    memory: MemoryReading

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def snapshot(self):
        return self.record.snapshot

    @property
    def events(self):
        return self.record.events

    @property
    def audit(self):
        return self.record.audit

    @property
    def step_seconds(self) -> float:
        return self.record.seconds

    def assembled(self) -> Stepped:
        """This result with its pool's state assembled into the ``KVSnapshot`` the views draw (an engine
        process's raw ``PoolState``); a digest, a poll or a snapshot as it is."""
        snap = self.record.snapshot
        drawn = snap.assembled() if snap is not None else None
        if drawn is None or drawn is snap:
            return self
        return Stepped(replace(self.record, snapshot=drawn), self.memory)


@dataclass(frozen=True, slots=True)
class Error:
    message: str
    refused: bool = False  # bad input (a request the engine refuses): exit 2 where a command line sent it


@dataclass(frozen=True, slots=True)
class RunningChanged:
    running: bool


@dataclass(frozen=True, slots=True)
class Injected:
    request_id: str


@dataclass(frozen=True, slots=True)
class Died:
    """The engine process ended without being asked to (a crash, a kill, a hang cut short)."""

    message: str


@dataclass(frozen=True, slots=True)
class Compared:
    """The answer to ``CompareCaching``: one line to show, and where the outputs part (None: they agree)."""

    text: str
    divergence: dict | None = None


Result = Loaded | LoadFailed | Progress | Stepped | Error | RunningChanged | Injected | Died | Compared
