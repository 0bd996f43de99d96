"""Build the source the command line asks for: a replay, a scenario, or a plain engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine import EngineConfig

from ..scenario import ScenarioRunner, load_scenario
from ..serve.options import ServeOptions
from .live import LiveSource
from .replay import ReplaySource


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """Everything needed to build a source, picklable so that a child engine process can build it."""
    config: EngineConfig
    scenario: str | None = None
    replay: str | None = None
    trace: str | None = None
    audit: bool = False
    serve: ServeOptions | None = None  # an HTTP server beside the engine, wherever the engine runs

    @classmethod
    def from_args(cls, config: EngineConfig, args) -> SourceSpec:
        return cls(config, getattr(args, "scenario", None), getattr(args, "replay", None),
                   getattr(args, "trace", None), bool(getattr(args, "audit", False)))

    def with_scenario(self, name: str | None) -> SourceSpec:
        """The spec for a scenario picked from the menu ("" or None: the plain model)."""
        return dataclasses.replace(self, scenario=name or None, replay=None)

    def factory(self, scenario: str | None) -> LiveSource | ReplaySource:
        """A ``SourceFactory``: the command line's source (``None``) or a scenario picked from the menu."""
        return build_source(self if scenario is None else self.with_scenario(scenario))


def build_source(spec: SourceSpec, hooks: list | None = None) -> LiveSource | ReplaySource:
    """Raises ``ValueError`` (bad input or configuration) or ``TraceError`` with a one-line message.

    ``hooks``: more ``StepHook``s of a live source (an HTTP server's bridge).
    """
    if spec.replay:
        return ReplaySource(spec.replay)
    config, runner = spec.config, None
    if spec.scenario:
        sc = load_scenario(spec.scenario)
        config = dataclasses.replace(config, **sc.config)
        config.validate()
        runner = ScenarioRunner(sc)
    from engine import LLMEngine  # torch and transformers: only where an engine is built
    engine = LLMEngine(config)
    if runner is not None:
        runner.check(engine)  # a request the engine would refuse stops the run here, with one line
    return LiveSource(engine, runner, spec.trace, audit=spec.audit, hooks=hooks)
