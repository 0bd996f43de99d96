"""The vLLM general plugin: ``register()`` runs in every vLLM process (API server, engine core, workers).

It only patches: ``SchedulerConfig.get_scheduler_cls`` returns a subclass of whichever scheduler vLLM chose,
and that subclass starts the probe once, where the scheduler is built (the engine core). Nothing happens
unless ``KVSCOPE_PROBE_ENDPOINT`` is set; a vLLM release the probe was not checked against, or one whose
internals differ from what it reads, is refused in one line in vLLM's log and vLLM runs untouched.
"""

from __future__ import annotations

import logging
import os

from .compat import KNOWN_RELEASES, missing, release_of
from .constants import ENV_ANY_RELEASE, ENV_ENDPOINT, ENV_FAULT, FAULTS

logger = logging.getLogger("kvscope_vllm_probe")
_PATCHED = "_kvscope_probe_patched"


def register() -> None:
    endpoint = os.environ.get(ENV_ENDPOINT, "").strip()
    if not endpoint:
        return  # inert
    _say_to_vllms_log()
    try:
        import vllm
        from vllm.config.scheduler import SchedulerConfig
    except Exception as e:  # noqa: BLE001 - a plugin must not stop vLLM
        logger.warning("kvscope probe: cannot read vLLM's scheduler config (%s); not probing", e)
        return
    version = getattr(vllm, "__version__", "unknown")
    if release_of(version) is None and os.environ.get(ENV_ANY_RELEASE) != "1":
        logger.warning(
            "kvscope probe: vLLM %s is not a release the probe was checked against (%s); not probing, "
            "vLLM runs untouched (%s=1 tries anyway)",
            version,
            ", ".join(KNOWN_RELEASES),
            ENV_ANY_RELEASE,
        )
        return
    fault = os.environ.get(ENV_FAULT, "").strip()
    if fault and fault not in FAULTS:
        logger.warning(
            "kvscope probe: unknown fault %r (%s); not probing, vLLM runs untouched", fault, ", ".join(FAULTS)
        )
        return
    if getattr(SchedulerConfig, _PATCHED, False):
        return
    original = SchedulerConfig.get_scheduler_cls
    made: dict[type, type] = {}

    def get_scheduler_cls(self):
        base = original(self)
        if base not in made:
            made[base] = probed_scheduler(base, endpoint, version, fault)
        return made[base]

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    setattr(SchedulerConfig, _PATCHED, True)


def _say_to_vllms_log() -> None:
    """Our lines go where vLLM's go (vLLM's logger does not propagate to the root)."""
    if logger.handlers:
        return
    try:
        from vllm.logger import init_logger

        parent = init_logger("vllm")
        for h in parent.handlers:
            logger.addHandler(h)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    except Exception:  # noqa: BLE001
        logging.basicConfig(level=logging.INFO)


def probed_scheduler(base: type, endpoint: str, version: str, fault: str) -> type:
    """``base`` with the probe: every scheduler entry under the probe's lock, a pause at ``schedule()``."""

    class ProbedScheduler(base):
        _kvscope_probe = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            lacking = missing(self)
            if lacking:
                logger.warning(
                    "kvscope probe: vLLM %s's scheduler lacks what the probe reads (%s); not probing, "
                    "vLLM runs untouched",
                    version,
                    ", ".join(lacking),
                )
                return
            from .probe import Probe

            try:
                self._kvscope_probe = Probe(self, endpoint, version, fault)
            except Exception as e:  # noqa: BLE001 - e.g. the endpoint's port is taken
                logger.warning(
                    "kvscope probe: could not start at %s (%s); vLLM runs untouched",
                    endpoint,
                    str(e).splitlines()[0] if str(e) else type(e).__name__,
                )
                from .recorder import _active

                if _active is not None:
                    _active.uninstall()

        def schedule(self, *args, **kwargs):
            p = self._kvscope_probe
            if p is None:
                return super().schedule(*args, **kwargs)
            p.before_schedule()
            with p.lock:
                p.recorder.begin()
                return super().schedule(*args, **kwargs)

        def update_from_output(self, *args, **kwargs):
            p = self._kvscope_probe
            if p is None:
                return super().update_from_output(*args, **kwargs)
            with p.lock:
                p.recorder.begin()
                out = super().update_from_output(*args, **kwargs)
                _guarded(self, p.end_step)
            return out

        def add_request(self, request, *args, **kwargs):
            p = self._kvscope_probe
            if p is None:
                return super().add_request(request, *args, **kwargs)
            with p.lock:
                p.recorder.begin()
                out = super().add_request(request, *args, **kwargs)
                p.rows.added.add(request.request_id)
            return out

        def finish_requests(self, *args, **kwargs):
            p = self._kvscope_probe
            if p is None:
                return super().finish_requests(*args, **kwargs)
            with p.lock:
                p.recorder.begin()
                return super().finish_requests(*args, **kwargs)

        def reset_prefix_cache(self, *args, **kwargs):
            p = self._kvscope_probe
            if p is None:
                return super().reset_prefix_cache(*args, **kwargs)
            with p.lock:
                p.recorder.begin()
                return super().reset_prefix_cache(*args, **kwargs)

        def shutdown(self, *args, **kwargs):
            p = self._kvscope_probe
            if p is not None:
                self._kvscope_probe = None
                p.close()
            if hasattr(super(), "shutdown"):
                return super().shutdown(*args, **kwargs)

    ProbedScheduler.__name__ = ProbedScheduler.__qualname__ = f"KvscopeProbed{base.__name__}"
    return ProbedScheduler


def _guarded(scheduler, fn) -> None:
    """The probe's own work at the end of a step: a failure there stops the probe, never vLLM."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        logger.exception("kvscope probe: failed at the end of a step; it stops, vLLM runs on unprobed")
        p = scheduler._kvscope_probe
        scheduler._kvscope_probe = None
        if p is not None:
            p.close()
