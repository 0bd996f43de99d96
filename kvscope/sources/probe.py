"""``ProbeSource``: a running vLLM's block pool through kvscope's probe (``kvscope --probe tcp://HOST:PORT``).

vLLM runs with the probe installed (``pip install ./probe``) and ``KVSCOPE_PROBE_ENDPOINT`` set; the probe
sends a keyframe of the pool and then each vLLM step's changes, which ``VllmPoolMirror`` applies. A record
here is one vLLM step, so the window, the timeline, the audit, the miss explainer and ``--headless`` read a
probed vLLM exactly as they read kvscope's own engine. Pause, Step and Run hold vLLM's scheduler
(``REMOTE_STEPPING``): Step asks the probe for one schedule and waits for that step to arrive.

Every connection trouble is one line (``StepRecord.notice``) and nothing wrong is shown: a probe not there
yet is waited for, a vLLM that restarts is read again from its new keyframe (kvscope's step numbers go on),
a message kvscope cannot read is skipped and the pool read again, a gap in the steps likewise. A trace
(``--trace``) records the probe's messages as they came; ``--replay`` plays them through the same mirror.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

from engine.outputs import StepOutput
from kvscope.sources.base import PROBE_CAPABILITIES, REPLAY_CAPABILITIES, ReadOnlyError, SourceInfo, StepRecord
from kvscope.sources.probe_mirror import MirrorError, VllmPoolMirror
from kvscope_vllm_probe import __version__ as PROBE_VERSION
from kvscope_vllm_probe.client import Link, ProbeClient
from kvscope_vllm_probe.wire import (
    Held,
    Keyframe,
    Pong,
    Refused,
    Step,
    Welcome,
    decode_from_probe,
    encode,
)

TRACE_FORMAT = "kvscope-probe-trace"
TRACE_VERSION = 1
POLL_S = 0.1  # how long one step waits for vLLM while running (an idle vLLM gives the same record again)
STEP_WAIT_S = 10.0  # how long Step waits for the schedule it asked for


class ProbeTraceWriter:
    """The probe's messages as they came, one JSON line each (``t`` seconds from the start, the payload)."""

    def __init__(self, path: str, header: dict) -> None:
        try:
            self._f = Path(path).open("w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write trace {path}: {e.strerror or e}") from None
        self._t0 = time.monotonic()
        self._write({"format": TRACE_FORMAT, "version": TRACE_VERSION, **header})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._f.flush()

    def message(self, payload: bytes) -> None:
        self._write({"t": round(time.monotonic() - self._t0, 6), "payload": base64.b64encode(payload).decode()})

    def close(self) -> None:
        self._f.close()


def is_probe_trace(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            header = json.loads(f.readline())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == TRACE_FORMAT


class _Base:
    """What a live probe and its replay share: the mirror, records, the audit and the refusals."""

    info: SourceInfo
    mirror: VllmPoolMirror

    def __init__(self) -> None:
        self.step_count = 0
        self._offset = 0  # kvscope's step = vLLM's step + offset (vLLM restarts from 0; the timeline goes on)
        self.notice: str | None = None
        self.tokenizer = None  # the served model's, when its folder is on this machine

    def _info(self, kf: Keyframe, where: str, load_seconds: float, scenario=None, replay: bool = False) -> SourceInfo:
        i = kf.info
        notes = list(i.notes)
        groups = self.mirror.groups
        watch = (
            f"vLLM {i.vllm_version}'s own block pool ({where}): every block's ref count, hash and place in the "
            "free queue, and every request's block table, as vLLM holds them, audited after every step. Pause "
            "holds vLLM's scheduler at its next schedule (vLLM keeps answering and queues new requests); Step "
            "runs exactly one schedule; Run lets it go. Block 0 is vLLM's null block (a placeholder it never "
            "hands out). Requests come through vLLM's own API."
            + (
                f" {len(groups)} KV cache groups share the pool: "
                + ", ".join(f"group {g}: {x.label()}" for g, x in enumerate(groups))
                + "; every group's tables are read and audited."
                if len(groups) > 1
                else ""
            )
            + "".join(f" Note: {n}." for n in notes)
        )
        group_extra = {"kv_groups": groups, "connector": i.connector}
        if scenario is not None:  # a lab on a recorded vLLM: the lesson's own words
            return SourceInfo(
                model_name=f"vLLM {i.vllm_version} (recorded)",
                device=where,
                dtype=i.dtype or "-",
                num_blocks=i.num_blocks,
                block_size=i.block_size,
                block_bytes=i.block_bytes,
                max_model_len=i.max_model_len,
                load_seconds=load_seconds,
                capabilities=REPLAY_CAPABILITIES,
                prefix_caching=i.enable_caching,
                events_rebuild_pool=False,
                scenario=scenario.title,
                scenario_name=scenario.name,
                watch=scenario.watch,
                notes=tuple(scenario.notes),
                view=scenario.view,
                plot=scenario.plot,
                extra={
                    "vllm_version": i.vllm_version,
                    "probe_notes": notes,
                    "fault": i.fault,
                    "always_audited": True,
                    **group_extra,
                },
            )
        return SourceInfo(
            model_name=f"vLLM {i.vllm_version} · {Path(i.model).name or i.model}",
            device=where,
            dtype=i.dtype or "-",
            num_blocks=i.num_blocks,
            block_size=i.block_size,
            block_bytes=i.block_bytes,
            max_model_len=i.max_model_len,
            load_seconds=load_seconds,
            # a recording plays read-only (no vLLM to hold: the host asks a replay for no current state)
            capabilities=REPLAY_CAPABILITIES if replay else PROBE_CAPABILITIES,
            prefix_caching=i.enable_caching,
            watch=watch,
            events_rebuild_pool=False,
            extra={
                "vllm_version": i.vllm_version,
                "probe_notes": notes,
                "fault": i.fault,
                "async_scheduling": i.async_scheduling,
                "always_audited": True,
                **group_extra,
            },
        )

    def _load(self, kf: Keyframe) -> None:
        if getattr(self, "mirror", None) is None:
            self.mirror = VllmPoolMirror(kf, self.decode)
            return
        self.mirror.load(kf)
        if kf.step + self._offset <= self.step_count:  # a restarted vLLM counts from 0 again: the timeline goes on
            self._offset = self.step_count + 1 - kf.step

    def _record(self, events: list, seconds: float, stepped: bool, notice: str | None = None) -> StepRecord:
        m = self.mirror
        step = m.vllm_step + self._offset
        self.step_count = step
        snap = m.snapshot(step)
        events = m.take_pending() + events
        out = StepOutput(step, [], [], 0, {}) if stepped else None
        notice = notice or self.notice
        self.notice = None
        return StepRecord(step, snap, events, out, seconds, m.audit(), notice=notice)

    def current(self) -> StepRecord:
        return self._record([], 0.0, False)

    def _refuse(self, *_a, **_k):
        raise ReadOnlyError("a probed vLLM takes requests through its own API (its /v1/completions), not from kvscope")

    inject = abort = fork = reset_prefix_cache = _refuse

    def set_audit(self, on: bool) -> None:
        pass  # a probed pool is audited every step: it costs O(blocks) in numpy

    def decode(self, token_ids) -> str | None:
        tok = self.tokenizer
        return tok.decode(list(token_ids), skip_special_tokens=False) if tok is not None else None

    def vocab(self) -> tuple[str, ...]:
        """Each token id's text, for the window (which decodes nothing itself); () without a tokenizer."""
        tok = self.tokenizer
        if tok is None:
            return ()
        return tuple(tok.batch_decode([[i] for i in range(len(tok))], skip_special_tokens=False))


class ProbeSource(_Base):
    def __init__(
        self, endpoint: str, wait_s: float = 60.0, progress=None, trace: str | None = None, client: str = "kvscope"
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.running = True  # the host's Run: vLLM runs on; paused, a step asks vLLM for one schedule
        self.paused_remote = False
        self.client = ProbeClient(endpoint, f"{client} (kvscope-vllm-probe {PROBE_VERSION})")
        self.client.start()
        self.instance = ""
        self._writer: ProbeTraceWriter | None = None
        t0 = time.monotonic()
        kf = self._first_keyframe(wait_s, progress)
        self.tokenizer = _tokenizer(kf.info.model)
        self._load(kf)
        self.info = self._info(kf, f"vLLM at {endpoint}", time.monotonic() - t0)
        if trace:
            self._writer = ProbeTraceWriter(trace, {"endpoint": endpoint})
            self._writer.message(self._first_payload)
        self._pending: list[StepRecord] = []

    def _first_keyframe(self, wait_s: float, progress) -> Keyframe:
        deadline = time.monotonic() + wait_s
        said = False
        while time.monotonic() < deadline:
            msg = self.client.get(0.2)
            if isinstance(msg, Refused):
                self.client.close()
                raise ValueError(f"the probe at {self.endpoint} refused: {msg.reason}")
            if isinstance(msg, Welcome):
                self.instance = msg.instance
            elif isinstance(msg, Keyframe):
                self._first_payload = encode(msg)
                return msg
            elif msg is None and not said and progress is not None:
                progress(f"waiting for vLLM's probe at {self.endpoint}…")
                said = True
        self.client.close()
        raise ValueError(
            f"no probe answered at {self.endpoint} in {wait_s:.0f} s: start vLLM with "
            f"KVSCOPE_PROBE_ENDPOINT={self.endpoint} and kvscope's probe installed (pip install ./probe)"
        )

    # -- the host's pace ----------------------------------------------------------------------------------
    ended: str | None = None  # why this source has nothing more to show (a vLLM restarted with another pool)

    def has_work(self) -> bool:
        return self.ended is None  # a live vLLM: there is always a next step to wait for

    def hold(self, paused: bool) -> list[StepRecord]:
        """The host paused (True) or ran (False): vLLM's scheduler is held at its next schedule, or let go.
        Holding returns the records of the steps vLLM made before it stopped (the window shows where vLLM stands
        before its next Step)."""
        self.running = not paused
        self.client.command("pause" if paused else "run")
        if not paused:
            return []
        out, deadline = list(self._pending), time.monotonic() + 5.0
        self._pending.clear()
        while time.monotonic() < deadline:
            rec = self._next(0.2)
            if rec is not None:
                out.append(rec)
            elif self.mirror.paused:  # vLLM said it holds, and nothing more came
                break
        return out

    def step(self) -> StepRecord:
        """The next vLLM step's record. Running: what vLLM did next (within ``POLL_S``, else the same state
        again). Held: one schedule asked of vLLM, and its record once it arrives."""
        if self.ended:
            return self._record([], 0.0, False)
        if self._pending:
            return self._pending.pop(0)
        if self.running:
            rec = self._next(POLL_S)
            return rec if rec is not None else self.current()
        before = self.mirror.vllm_step
        self.client.command("step", 1)
        deadline = time.monotonic() + STEP_WAIT_S
        while time.monotonic() < deadline:
            rec = self._next(0.2)
            if rec is not None and (self.mirror.vllm_step > before or rec.notice):
                return rec
            if rec is not None:
                self._pending.append(rec)  # between steps (an abort, a new request): shown before the step
        return self._record(
            [],
            0.0,
            False,
            notice=f"vLLM did not schedule within {STEP_WAIT_S:.0f} s: it has no request to run (Step waits for one)",
        )

    def _next(self, timeout: float) -> StepRecord | None:
        """Apply what arrives until one record is made (or ``timeout`` passes with nothing)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            msg = self.client.get(max(left, 0.0) if left > 0 else None)
            if msg is None:
                return None
            if self._writer is not None and not isinstance(msg, (Link, Pong)):
                self._writer.message(encode(msg))
            rec = self._handle(msg)
            if rec is not None:
                return rec

    def _handle(self, msg) -> StepRecord | None:
        if isinstance(msg, Step):
            try:
                events = self.mirror.apply(msg)
            except MirrorError as e:
                self.client.resync()
                self.notice = f"the probe's steps did not apply ({e}): reading vLLM's pool again"
                return None
            return self._record(events, msg.seconds, not msg.between)
        if isinstance(msg, Keyframe):
            i = msg.info
            if (i.num_blocks, i.block_size) != (self.info.num_blocks, self.info.block_size):
                self.ended = (
                    f"vLLM at {self.endpoint} restarted with a pool of {i.num_blocks} blocks of "
                    f"{i.block_size} tokens (it had {self.info.num_blocks} of {self.info.block_size}): "
                    f"open kvscope --probe {self.endpoint} again to read it"
                )
                return self._record([], 0.0, False, notice=self.ended)
            self._load(msg)
            return self._record([], 0.0, False)
        if isinstance(msg, Welcome):
            if self.instance and msg.instance != self.instance:
                self.notice = f"vLLM at {self.endpoint} restarted: its pool is read again from the start"
            self.instance = msg.instance
            return None
        if isinstance(msg, Held):
            self.mirror.paused, self.mirror.holder = msg.paused, msg.holder
            if msg.paused and msg.step > self.mirror.vllm_step:
                self.mirror.paused = False  # held after a step not applied yet: it is on its way
            if not msg.paused and msg.reason:
                self.notice = f"vLLM runs again: {msg.reason}"
            return None
        if isinstance(msg, Refused):
            self.notice = f"the probe refused: {msg.reason}"
            return self.current()
        if isinstance(msg, Link):
            if msg.kind == "unreadable":
                self.client.resync()
            return self._record([], 0.0, False, notice=msg.text)
        return None  # Pong

    def close(self) -> None:
        self.client.close()  # its goodbye ends any pause this window holds
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class ProbeReplay(_Base):
    """A probe trace played back: the same messages through the same mirror, one record a vLLM step."""

    def __init__(self, path: str, scenario=None) -> None:
        """``scenario``: a lab's (kvscope.scenario.Scenario) title, notes and view, shown over the recording."""
        super().__init__()
        self.path = path
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read trace {path}: {e}") from None
        header = json.loads(lines[0])
        if header.get("version") != TRACE_VERSION:
            raise ValueError(
                f"{path}: probe trace version {header.get('version')!r}; this kvscope reads version {TRACE_VERSION}"
            )
        self._messages = []
        for n, line in enumerate(lines[1:], start=2):
            try:
                self._messages.append(decode_from_probe(base64.b64decode(json.loads(line)["payload"])))
            except (ValueError, KeyError, TypeError) as e:
                if n == len(lines):
                    break  # a torn last line (the recording was cut): the rest plays
                raise ValueError(f"{path}:{n}: not a probe message ({str(e).splitlines()[0]})") from None
        first = self._messages.pop(0) if self._messages else None
        if not isinstance(first, Keyframe):
            raise ValueError(f"{path}: a probe trace starts with a keyframe")
        self.tokenizer = _tokenizer(first.info.model)  # the recorded model's, if its folder is here too
        self._load(first)
        self.info = self._info(first, "a recorded probe trace", 0.0, scenario, replay=True)
        self._started = False

    def has_work(self) -> bool:
        return not self._started or bool(self._messages)

    def step(self) -> StepRecord:
        if not self._started:
            self._started = True
            return self._record([], 0.0, False)
        while self._messages:
            msg = self._messages.pop(0)
            if isinstance(msg, Step):
                return self._record(self.mirror.apply(msg), msg.seconds, not msg.between)
            if isinstance(msg, Keyframe):
                self._load(msg)
                return self._record([], 0.0, False)
        return self._record([], 0.0, False)

    def current(self) -> StepRecord:
        raise ReadOnlyError("a replay is read-only")

    def close(self) -> None:
        pass


def _tokenizer(model: str):
    """The served model's tokenizer, when its folder is on this machine (else rows show token ids)."""
    if not model or not Path(model).is_dir():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer: rows show token ids
        return None
