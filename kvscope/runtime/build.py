"""Build the source the command line asks for: a replay, a scenario, a workload, or a plain engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine import EngineConfig
from kvscope.scenario import ScenarioRunner, load_scenario, scenario_config
from kvscope.serve.options import ServeOptions

if TYPE_CHECKING:
    from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.sources.live import LiveSource
from kvscope.sources.probe_package import require_probe
from kvscope.sources.replay import ReplaySource
from kvscope.sources.workload import WorkloadSpec


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """``kvscope --probe ADDR``: a running vLLM through kvscope's probe."""

    endpoint: str
    wait_s: float = 60.0  # vLLM may start after kvscope
    fault: str | None = None  # switched on inside vLLM once subscribed (kvscope_vllm_probe's FAULTS)
    key: str | None = None  # kvscope's secret CURVE certificate (a probe on the network asks for keys)
    server_key: str | None = None  # the probe's public certificate


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """Everything needed to build a source, picklable so that a child engine process can build it."""

    config: EngineConfig
    scenario: str | None = None
    replay: str | None = None
    trace: str | None = None
    audit: bool = False
    serve: ServeOptions | None = None  # an HTTP server beside the engine, wherever the engine runs
    kv_events: KVEventsConfig | None = None  # publish the engine's KV events (vLLM's wire format)
    workload: WorkloadSpec | None = None  # a request trace played without weights (kvscope --workload)
    probe: ProbeSpec | None = None  # a running vLLM's pool through kvscope's probe (kvscope --probe)
    # the config's fields a command-line flag set: applied over a scenario's settings, or refused
    # (kvscope.scenario.scenario_config); empty: the scenario's settings win, as a menu pick of the plain model's
    given: frozenset[str] = frozenset()

    def with_scenario(self, name: str | None) -> SourceSpec:
        """The spec for a scenario picked from the menu ("" or None: the plain model)."""
        return dataclasses.replace(self, scenario=name or None, replay=None, workload=None, probe=None)

    def factory(self, scenario: str | None, progress=None) -> LiveSource | ReplaySource:
        """A ``SourceFactory``: the command line's source (``None``) or a scenario picked from the menu."""
        return build_source(self if scenario is None else self.with_scenario(scenario), progress=progress)


_last_weights = None  # the last engine's weights in this process: a scenario over the same model reuses them


def build_source(spec: SourceSpec, hooks: list | None = None, progress=None) -> LiveSource | ReplaySource:
    """Raises ``ValueError`` (bad input or configuration) or ``TraceError`` with a one-line message.

    ``hooks``: more ``StepHook``s of a live source (an HTTP server's bridge).
    """
    if spec.probe is not None:  # the command line refused what a probed vLLM cannot do (cli.checks)
        return _probe_source(spec.probe, spec.trace, progress)
    if spec.replay:
        if spec.kv_events is not None:
            raise ValueError("--kv-events-endpoint publishes a live engine's events, not a trace replay")
        from kvscope.sources.probe_trace import is_probe_trace

        if is_probe_trace(spec.replay):
            require_probe(f"--replay {spec.replay} (a probed vLLM's recording)")
            from kvscope.sources.probe import ProbeReplay

            return ProbeReplay(spec.replay)
        return ReplaySource(spec.replay)
    if spec.workload is not None:  # the command line refused what a workload cannot do (cli.workload)
        from kvscope.sources.workload import build_workload_source

        return build_workload_source(spec.workload, spec.config, spec.audit, hooks)
    config, runner = spec.config, None
    if spec.scenario:
        sc = load_scenario(spec.scenario)
        if sc.probe_trace:  # a lab recorded from a real vLLM: played back, no engine of kvscope's
            require_probe(f"--scenario {sc.name} (a probed vLLM's recording)")
            from kvscope.sources.probe import ProbeReplay

            return ProbeReplay(sc.probe_trace, scenario=sc)
        config, _ = scenario_config(config, sc, spec.given)  # the command line said the notices (cli.main)
        runner = ScenarioRunner(sc)
    from engine import LLMEngine  # torch and transformers: only where an engine is built

    publisher = None
    if spec.kv_events is not None:  # bound before the model loads: a busy port fails at once
        from kvscope.runtime.kv_publisher import KVEventPublisher

        publisher = KVEventPublisher(spec.kv_events, config.block_size)
    global _last_weights
    try:
        engine = LLMEngine(config, weights=_last_weights, progress=progress)
        _last_weights = engine.weights
        if runner is not None:
            runner.check(engine)  # a request the engine would refuse stops the run here, with one line
        source = LiveSource(engine, runner, spec.trace, audit=spec.audit, hooks=hooks)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    if publisher is not None:
        source.observers.append(KVEventsObserver(publisher))
    return source


class KVEventsObserver:
    """A live source's observer: publishes each step record's events; ``close`` releases the ports."""

    def __init__(self, publisher) -> None:
        self.publisher = publisher

    def __call__(self, rec) -> None:
        self.publisher.publish(rec.events)

    def close(self) -> None:
        self.publisher.close()


def _probe_source(probe: ProbeSpec, trace: str | None, progress):
    """``kvscope --probe``: every rank of a probed vLLM, with kvscope's keys if the probe asks for them."""
    require_probe("--probe")
    from kvscope.sources.probe import ProbeSource
    from kvscope_vllm_probe.security import client_keys

    keys = client_keys(probe.key, probe.server_key) if probe.key else None
    return ProbeSource(probe.endpoint, probe.wait_s, progress, trace, keys=keys, fault=probe.fault)
