"""The vLLM general plugin: ``register()`` runs in every vLLM process (API server, engine core, workers).

It only patches: ``SchedulerConfig.get_scheduler_cls`` returns a subclass of whichever scheduler vLLM chose,
and that subclass starts the probe once, where the scheduler is built (the engine core: one per data-parallel
rank, each probe at its rank's endpoint, ``endpoints.rank_endpoint``). Nothing happens unless
``KVSCOPE_PROBE_ENDPOINT`` is set; a vLLM release the probe was not checked against, one whose internals differ
from what it reads, or an endpoint on the network without keys (``security.py``) is refused in one line in vLLM's
log and vLLM runs untouched.
"""

from __future__ import annotations

import logging
import os

from .compat import KNOWN_RELEASES, missing, release_of
from .constants import ENV_ANY_RELEASE, ENV_DP_SIZE, ENV_ENDPOINT, ENV_FAULT, FAULTS
from .endpoints import rank_endpoint
from .security import access_from_env

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
    try:
        access = access_from_env(endpoint)
        dp_size_from_env()
    except ValueError as e:
        logger.warning("kvscope probe: %s; not probing, vLLM runs untouched", e)
        return
    if getattr(SchedulerConfig, _PATCHED, False):
        return
    original = SchedulerConfig.get_scheduler_cls
    made: dict[type, type] = {}

    def get_scheduler_cls(self):
        base = original(self)
        if base not in made:
            made[base] = probed_scheduler(base, endpoint, version, fault, access)
        return made[base]

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    setattr(SchedulerConfig, _PATCHED, True)
    _export_dp_size()


def dp_size_from_env() -> int:
    """``KVSCOPE_PROBE_DP_SIZE``, or 0 when not set; ``ValueError`` in one line when it is not a count."""
    text = os.environ.get(ENV_DP_SIZE, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{ENV_DP_SIZE}={text!r}: give the number of data-parallel ranks")
    return int(text)


def data_parallel(scheduler) -> tuple[int, int]:
    """This engine core's data-parallel (rank, size). vLLM keeps the rank in ``parallel_config.data_parallel_index``
    (0.32+; ``data_parallel_rank`` before); a dense model's engine cores run as independent ranks whose config says
    ``data_parallel_size`` 1, so the size comes from ``KVSCOPE_PROBE_DP_SIZE``, which ``_export_dp_size`` set where
    vLLM made its config (its engine cores inherit the environment)."""
    pc = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    size = int(getattr(pc, "data_parallel_size", 1) or 1)
    if size <= 1:
        size = dp_size_from_env() or 1
    rank = int(rank or 0)
    return rank, max(size, rank + 1)


def _export_dp_size() -> None:
    """Where vLLM makes its config (``EngineArgs.create_engine_config``, in the process that then starts the engine
    cores), put its data-parallel size in the environment they inherit, forked or spawned."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # noqa: BLE001 - without it a rank knows its rank, not how many: set ENV_DP_SIZE by hand
        return
    if getattr(EngineArgs, _PATCHED, False):
        return
    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        try:
            size = int(config.parallel_config.data_parallel_size)
        except (AttributeError, TypeError, ValueError):
            return config
        if size > 1:
            os.environ.setdefault(ENV_DP_SIZE, str(size))
        return config

    EngineArgs.create_engine_config = create_engine_config
    setattr(EngineArgs, _PATCHED, True)


class _ToVllmsLog(logging.Handler):
    """Hands each line to vLLM's logger when it is said: vLLM may set its handlers up after the plugin loads (its
    engine core does it before, its front end may do it after), and a script that never does sends them to the
    root logger's."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _say_to_vllms_log() -> None:
    """Our lines go where vLLM's go (vLLM's logger does not propagate to the root)."""
    if logger.handlers:
        return
    logger.addHandler(_ToVllmsLog())
    logger.setLevel(logging.INFO)
    logger.propagate = False


def probed_scheduler(base: type, endpoint: str, version: str, fault: str, access=None) -> type:
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

            rank, size = data_parallel(self)
            at = endpoint
            try:
                at = rank_endpoint(endpoint, rank)
                self._kvscope_probe = Probe(self, at, version, fault, access, rank, size)
            except Exception as e:  # noqa: BLE001 - e.g. the endpoint's port is taken
                logger.warning(
                    "kvscope probe: could not start at %s (%s); vLLM runs untouched",
                    at,
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
