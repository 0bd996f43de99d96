"""The one seam between the window and what it shows: a ``Source`` yields step records.

A live engine (in this process or a child process), a trace replay and an attached
external engine differ only in what they can fill in; ``SourceInfo.capabilities``
says which, so the views can hide what a source cannot give. No Qt here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine import SamplingParams
from engine.inspect.audit import AuditReport
from engine.inspect.events import Event
from engine.inspect.snapshot import PoolRecord
from engine.outputs import StepOutput

if TYPE_CHECKING:
    from kvscope.sources.attach_record import AttachRecord
    from kvscope.sources.fleet_record import FleetRecord
    from kvscope.sources.fleet_sim import FleetFrame

# What a source can give (SourceInfo.capabilities).
COMMANDS = "commands"  # inject, abort, fork, reset the prefix cache
BLOCK_TABLES = "block_tables"  # per-request logical -> physical tables
REF_COUNTS = "ref_counts"  # per-block ref counts and the free list
AUDIT = "audit"  # recompute ref counts from the tables
# An attached engine's cache as its KV events tell it: cached blocks by hash, chained into a prefix forest
# (the source's ``model``, a RemoteCacheModel); each record's snapshot is the poll's AttachRecord.
PREFIX_FOREST = "prefix_forest"
# Pause, Step and Run hold the engine itself, in another process kvscope does not host (a probed vLLM): the
# host tells the source (``hold``) and each Step asks that engine for one schedule.
REMOTE_STEPPING = "remote_stepping"
# Several attached engines watched together (sources/fleet): each record's snapshot is the poll's FleetRecord, the
# source's ``index`` the fleet's one forest and who holds each block, ``route`` where a prompt would go.
FLEET = "fleet"
# A request trace over a simulated fleet (sources/fleet_sim): each record's ``sim_fleet`` is what its window draws.
SIM_FLEET = "sim_fleet"
LIVE_CAPABILITIES = frozenset({COMMANDS, BLOCK_TABLES, REF_COUNTS, AUDIT})
REPLAY_CAPABILITIES = frozenset({BLOCK_TABLES, REF_COUNTS})
ATTACH_CAPABILITIES = frozenset({PREFIX_FOREST})
PROBE_CAPABILITIES = frozenset({BLOCK_TABLES, REF_COUNTS, AUDIT, REMOTE_STEPPING})
FLEET_CAPABILITIES = frozenset({FLEET})
SIM_FLEET_CAPABILITIES = frozenset({SIM_FLEET})


@dataclass(frozen=True, slots=True)
class InjectSpec:
    """One request to add: text, token ids or chat messages, with its sampling parameters."""

    prompt: object
    params: SamplingParams
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the window shows about a source once it is ready (picklable: it crosses processes)."""

    model_name: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    block_bytes: int
    max_model_len: int
    load_seconds: float
    num_cpu_blocks: int = 0
    scenario: str | None = None  # the scenario's title
    scenario_name: str | None = None
    kv_cache_dtype: str = "auto"
    capabilities: frozenset[str] = LIVE_CAPABILITIES
    has_tokenizer: bool = False
    watch: str = ""  # the scenario's "what to watch" text
    notes: tuple[tuple[int, str], ...] = ()  # the scenario's step notes
    view: str = ""  # the scenario's panel to bring to the front ("plots", "fragmentation", ...)
    plot: str = ""  # with view "plots": the series whose plot the lesson reads (scrolled into view)
    kv_layout: str = "paged"  # or "contiguous": each request reserves max_model_len up front
    prefix_caching: bool = True  # the pool publishes full blocks for prefix hits
    # whether replaying a record's events by kvscope's pool rules rebuilds the next pool (the timeline keyframes
    # every 64 steps and replays between); a probed vLLM's pool follows vLLM's own rules: a keyframe a step
    events_rebuild_pool: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def read_only(self) -> bool:
        return COMMANDS not in self.capabilities


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step (or one poll, or one command between steps) did: the state after it and its events.

    The state is in one typed field by what the source is (its capabilities say which): a block pool's
    ``snapshot`` (kvscope's engine, a replay, a probed vLLM: a ``PoolRecord``, at the level of detail the
    record travelled with), an attached engine's ``cache`` poll (PREFIX_FOREST: the forest's summary,
    counters, rates and gaps), a ``fleet``'s poll (FLEET: every instance's) or a simulated fleet's frame
    (SIM_FLEET: each pool's states, queue and the latest routes). The others are None.
    """

    step: int
    snapshot: PoolRecord | None
    events: list[Event]
    step_output: StepOutput | None
    seconds: float
    audit: AuditReport | None = None
    notice: str | None = None  # one line about the source itself (a probed vLLM restarted, say), not an error
    cache: AttachRecord | None = None
    fleet: FleetRecord | None = None
    sim_fleet: FleetFrame | None = None

    @property
    def leaked(self) -> list[int]:
        return self.audit.bad_blocks if self.audit is not None else []

    @property
    def error(self) -> str | None:
        return self.step_output.error if self.step_output is not None else None


@runtime_checkable
class Source(Protocol):
    """A run the window (or ``--headless``) can drive one step at a time."""

    info: SourceInfo

    @property
    def step_count(self) -> int: ...

    def has_work(self) -> bool: ...

    def step(self) -> StepRecord: ...

    def current(self) -> StepRecord:
        """A record of the state now (after a command between steps); raises ValueError if read-only."""
        ...

    def inject(self, prompt, params: SamplingParams, request_id: str | None = None) -> str: ...

    def abort(self, request_id: str) -> bool: ...

    def fork(self, request_id: str) -> str: ...

    def reset_prefix_cache(self) -> None: ...

    def set_audit(self, on: bool) -> None: ...

    def decode(self, token_ids: list[int]) -> str | None:
        """Token ids as text, or None without a tokenizer."""
        ...

    def close(self) -> None: ...


class ReadOnlyError(ValueError):
    """A command sent to a source that only shows what was recorded."""


class ReadOnlySource:
    """The ``Source`` commands of a source that only shows (a replay, an attached engine, a fleet, a probed vLLM):
    each refused in one line, the source's ``refusal``."""

    refusal = "this source is read-only: it shows what it hears and changes nothing"

    def current(self) -> StepRecord:
        raise ReadOnlyError(self.refusal)

    def _refuse(self, *_a, **_k):
        raise ReadOnlyError(self.refusal)

    inject = abort = fork = reset_prefix_cache = _refuse
