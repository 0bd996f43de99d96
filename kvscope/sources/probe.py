"""``ProbeSource``: a running vLLM's block pool through kvscope's probe (``kvscope --probe tcp://HOST:PORT``).

vLLM runs with the probe installed (``pip install ./probe``) and ``KVSCOPE_PROBE_ENDPOINT`` set; the probe
sends a keyframe of the pool and then each vLLM step's changes, which ``VllmPoolMirror`` applies. A record
here is one vLLM step, so the window, the timeline, the audit, the miss explainer and ``--headless`` read a
probed vLLM exactly as they read kvscope's own engine. Pause, Step and Run hold vLLM's scheduler
(``REMOTE_STEPPING``) when vLLM allows it (``KVSCOPE_PROBE_CONTROL=1``): Step asks the probe for one schedule and
waits for that step to arrive. A read-only probe (the default) is watched as it goes: Pause stops kvscope's view,
not vLLM, and Step shows the next step vLLM made.

With data parallelism each rank's engine core has its own probe (``kvscope_vllm_probe.endpoints``): the source
reads every rank (``ProbeRank`` each) and shows one (``select_rank``); the others are read as they go, and their
records go to ``on_rank_record`` (``--headless``'s ``dp_ranks``).

Every connection trouble is one line (``StepRecord.notice``) and nothing wrong is shown: a probe not there
yet is waited for, a vLLM that restarts is read again from its new keyframe (kvscope's step numbers go on),
a message kvscope cannot read is skipped and the pool read again, a gap in the steps likewise. A trace
(``--trace``) records the messages of the rank at ``endpoint`` as they came (shown or not: a replay has one pool);
``--replay`` plays them through the same mirror.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path

from engine.inspect.jsonl import read_versioned_header
from engine.messages import one_line
from engine.outputs import StepOutput
from kvscope.sources.base import PROBE_CAPABILITIES, REPLAY_CAPABILITIES, ReadOnlySource, SourceInfo, StepRecord
from kvscope.sources.probe_mirror import MirrorError, VllmPoolMirror
from kvscope.sources.probe_trace import (  # noqa: F401 - is_probe_trace: one import for the probe's readers
    TRACE_FORMAT,
    TRACE_VERSION,
    ProbeTraceWriter,
    is_probe_trace,
)
from kvscope_vllm_probe import __version__ as PROBE_VERSION
from kvscope_vllm_probe.client import Link, ProbeClient
from kvscope_vllm_probe.endpoints import base_endpoint, rank_endpoint
from kvscope_vllm_probe.wire import (
    OP_HASH,
    OP_MAP_INSERT,
    OP_MAP_POP,
    Held,
    Keyframe,
    Pong,
    Refused,
    Step,
    Welcome,
    block_key,
    decode_from_probe,
    encode,
)

POLL_S = 0.1  # how long one step waits for vLLM while running (an idle vLLM gives the same record again)
STEP_WAIT_S = 10.0  # how long Step waits for the schedule it asked for
RANK_WAIT_S = 10.0  # how long the other data-parallel ranks are waited for once the first has answered
RESYNC_WAIT_S = 3.0  # steps that cannot apply while a fresh keyframe is on its way are dropped, this long at most
READ_ONLY = (
    "vLLM's probe at {at} is read-only: Pause stops kvscope's view and vLLM runs on (start vLLM with "
    "KVSCOPE_PROBE_CONTROL=1 to hold its scheduler)"
)


class _Base(ReadOnlySource):
    """What a live probe and its replay share: the mirror, records, the audit and the refusals."""

    info: SourceInfo
    mirror: VllmPoolMirror

    def __init__(self) -> None:
        self.step_count = 0
        self._offset = 0  # kvscope's step = vLLM's step + offset (vLLM restarts from 0; the timeline goes on)
        self.notice: str | None = None
        self.tokenizer = None  # the served model's, when its folder is on this machine

    def _info(
        self, kf: Keyframe, where: str, load_seconds: float, scenario=None, extra=None, replay: bool = False
    ) -> SourceInfo:
        i = kf.info
        notes = list(i.notes)
        groups = self.mirror.groups
        stepping = (
            "Pause holds vLLM's scheduler at its next schedule (vLLM keeps answering and queues new requests); Step "
            "runs exactly one schedule; Run lets it go."
            if (extra or {}).get("control", True)
            else "The probe is read-only (vLLM was started without KVSCOPE_PROBE_CONTROL=1): Pause stops kvscope's "
            "view, Step shows the next step vLLM made, and vLLM runs on."
        )
        watch = (
            f"vLLM {i.vllm_version}'s own block pool ({where}): every block's ref count, hash and place in the "
            f"free queue, and every request's block table, as vLLM holds them, audited after every step. {stepping} "
            "Block 0 is vLLM's null block (a placeholder it never hands out). Requests come through vLLM's own "
            "API."
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
                **(extra or {}),
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

    refusal = "a probed vLLM takes requests through its own API (its /v1/completions), not from kvscope"

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


class ProbeRank(_Base):
    """One probe (one data-parallel rank's engine core): its connection, the mirror of its pool, its records."""

    def __init__(self, endpoint: str, client: str, keys=None) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.client = ProbeClient(endpoint, client, keys)
        self.client.start()
        self.welcome: Welcome | None = None
        self.instance = ""
        self.mirror: VllmPoolMirror | None = None
        self.first_payload = b""
        self.running = True  # the host's Run: vLLM runs on; paused, a step asks vLLM for one schedule
        self.holding = False  # this subscriber asked vLLM to hold (a Run from it lets vLLM go; else it sends none)
        self.writer: ProbeTraceWriter | None = None
        self.ended: str | None = None  # why it has nothing more to show (a vLLM restarted with another pool)
        self._pending: list[StepRecord] = []
        self._resync_since: float | None = None
        # a restarted vLLM's steps wait for its keyframe: its sequence numbers start again, and one that followed the
        # old run's last would have been applied to the old pool (a race seen once in CI: blocks in tables at ref 0)
        self._awaiting_keyframe = False
        self._said_read_only = False

    @property
    def loaded(self) -> bool:
        return self.mirror is not None

    @property
    def dp_rank(self) -> int:
        return self.welcome.dp_rank if self.welcome else 0

    @property
    def dp_size(self) -> int:
        return self.welcome.dp_size if self.welcome else 1

    @property
    def control(self) -> bool:
        return bool(self.welcome and self.welcome.control)

    def wait_keyframe(self, deadline: float, progress=None) -> Keyframe | None:
        """Until the probe's first keyframe (loaded) or ``deadline`` (None). A refusal is ``ValueError``."""
        said, t0 = False, time.monotonic()
        while time.monotonic() < deadline:
            msg = self.client.get(0.2)
            if isinstance(msg, Refused):
                raise ValueError(f"the probe at {self.endpoint} refused: {msg.reason}")
            if isinstance(msg, Link) and msg.kind == "refused":
                raise ValueError(msg.text)
            if isinstance(msg, Link) and msg.kind == "behind":
                # the first keyframe itself was dropped with a flood of steps behind it: ask for another (once)
                self._resync()
            elif isinstance(msg, Welcome):
                self.welcome, self.instance = msg, msg.instance
            elif isinstance(msg, Keyframe):
                self._first(msg, time.monotonic() - t0)
                return msg
            elif msg is None and not said and progress is not None:
                progress(f"waiting for vLLM's probe at {self.endpoint}…")
                said = True
        return None

    # -- the host's pace ----------------------------------------------------------------------------------
    def hold(self, paused: bool) -> list[StepRecord]:
        """The host paused (True) or ran (False): vLLM's scheduler is held at its next schedule, or let go (a
        read-only probe: kvscope's view only). Holding returns the records of the steps vLLM made before it
        stopped (the window shows where vLLM stands before its next Step)."""
        self.running = not paused
        if not self.control:
            if paused and not self._said_read_only:
                self._said_read_only = True
                return [self._record([], 0.0, False, notice=READ_ONLY.format(at=self.endpoint))]
            return []
        if not paused:
            if self.holding:
                self.client.command("run")
                self.holding = False
            return []
        self.client.command("pause")
        self.holding = True
        out, deadline = list(self._pending), time.monotonic() + 5.0
        self._pending.clear()
        while time.monotonic() < deadline:
            rec = self.next_record(0.2)
            if rec is not None:
                out.append(rec)
            elif self.mirror.paused:  # vLLM said it holds, and nothing more came
                break
        return out

    def step(self) -> StepRecord:
        """The next vLLM step's record. Running (or read-only): what vLLM did next (within ``POLL_S``, else the
        same state again). Held: one schedule asked of vLLM, and its record once it arrives."""
        if self.ended:
            return self._record([], 0.0, False)
        if self._pending:
            return self._pending.pop(0)
        if self.running or not self.control:
            rec = self.next_record(POLL_S)
            return rec if rec is not None else self.current()
        before = self.mirror.vllm_step
        self.client.command("step", 1)
        self.holding = True
        deadline = time.monotonic() + STEP_WAIT_S
        while time.monotonic() < deadline:
            rec = self.next_record(0.2)
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

    def next_record(self, timeout: float) -> StepRecord | None:
        """Apply what arrives until one record is made (or ``timeout`` passes with nothing; 0: what is there)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            msg = self.client.get(left if left > 0 else None)
            if msg is None:
                return None
            if self.writer is not None and not isinstance(msg, (Link, Pong)):
                self.writer.message(encode(msg))
            rec = self._handle(msg)
            if rec is not None:
                return rec

    def drain(self) -> list[StepRecord]:
        """Every record that what has arrived makes, waiting for nothing (a rank read but not shown)."""
        out = []
        while (rec := self.next_record(0.0)) is not None:
            out.append(rec)
        return out

    def _resync(self) -> None:
        """Ask for a fresh keyframe, once: steps that cannot apply until it comes are dropped meanwhile."""
        now = time.monotonic()
        if self._resync_since is None or now - self._resync_since > RESYNC_WAIT_S:
            self._resync_since = now
            self.client.resync()

    def _handle(self, msg) -> StepRecord | None:
        if isinstance(msg, Welcome):
            if self.instance and msg.instance != self.instance:
                self.notice = f"vLLM at {self.endpoint} restarted: its pool is read again from the start"
                self._awaiting_keyframe = True
            self.welcome, self.instance = msg, msg.instance
            return None
        if isinstance(msg, Refused):
            self.notice = f"the probe at {self.endpoint} refused: {msg.reason}"
            return self.current() if self.loaded else None
        if isinstance(msg, Link):
            if msg.kind in ("unreadable", "behind"):
                self._resync()
            return self._record([], 0.0, False, notice=msg.text) if self.loaded else None
        if not self.loaded:
            if isinstance(msg, Keyframe):  # a rank that answered after the others: read from now on
                self._first(msg, 0.0)
                return self._record([], 0.0, False, notice=f"vLLM's probe at {self.endpoint} answers: read from now on")
            return None
        if isinstance(msg, Step):
            if self._awaiting_keyframe:
                return None  # a restarted vLLM's step, before the keyframe of its pool
            if self._resync_since is not None and msg.seq > self.mirror.seq + 1:
                return None  # a keyframe is on its way
            try:
                events = self.mirror.apply(msg)
            except MirrorError as e:
                self._resync()
                self.notice = f"the probe's steps did not apply ({e}): reading vLLM's pool again"
                return None
            return self._record(events, msg.seconds, not msg.between)
        if isinstance(msg, Keyframe):
            self._resync_since = None
            self._awaiting_keyframe = False
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
        if isinstance(msg, Held):
            self.mirror.paused, self.mirror.holder = msg.paused, msg.holder
            if msg.paused and msg.step > self.mirror.vllm_step:
                self.mirror.paused = False  # held after a step not applied yet: it is on its way
            if not msg.paused:
                self.holding = False
                if msg.reason:
                    self.notice = f"vLLM runs again: {msg.reason}"
            return None
        return None  # Pong

    def _first(self, kf: Keyframe, load_seconds: float) -> None:
        self.first_payload = encode(kf)
        self._resync_since = None
        self.tokenizer = _tokenizer(kf.info.model)
        self._load(kf)
        self.info = self._rank_info(kf, load_seconds)

    def _rank_info(self, kf: Keyframe, load_seconds: float) -> SourceInfo:
        size = self.dp_size
        where = f"vLLM at {self.endpoint}" + (f", data-parallel rank {self.dp_rank} of {size}" if size > 1 else "")
        extra = {"control": self.control, "dp_rank": self.dp_rank, "dp_ranks": list(range(size))}
        return self._info(kf, where, load_seconds, extra=extra)

    def close(self) -> None:
        self.client.close()  # its goodbye ends any pause this subscriber holds
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class ProbeSource(ReadOnlySource):
    """A probed vLLM: every data-parallel rank's probe read, one rank shown (the one at ``endpoint``, at first).

    ``keys``: CURVE (this subscriber's public key, its secret key, the probe's public key), for a probe on the
    network (``kvscope_vllm_probe.security.client_keys`` reads them from certificate files). ``fault``: switched
    on in every rank once subscribed (vLLM must allow it: ``KVSCOPE_PROBE_REMOTE_FAULTS=1``)."""

    def __init__(
        self,
        endpoint: str,
        wait_s: float = 60.0,
        progress=None,
        trace: str | None = None,
        client: str = "kvscope",
        keys: tuple[bytes, bytes, bytes] | None = None,
        fault: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        name = f"{client} (kvscope-vllm-probe {PROBE_VERSION})"
        # a rank's records when it is not the one shown (--headless keeps a summary of each rank with them)
        self.on_rank_record: Callable[[int, StepRecord], None] | None = None
        t0 = time.monotonic()
        first = ProbeRank(endpoint, name, keys)
        self.ranks: dict[int, ProbeRank] = {}
        try:
            kf = first.wait_keyframe(t0 + wait_s, progress)
            if kf is None:
                raise ValueError(
                    f"no probe answered at {endpoint} in {wait_s:.0f} s: start vLLM with "
                    f"KVSCOPE_PROBE_ENDPOINT={endpoint} and kvscope's probe installed (pip install ./probe)"
                )
            self.ranks[first.dp_rank] = first
            if first.dp_size > 1:
                self._read_other_ranks(first, name, keys, min(wait_s, RANK_WAIT_S), progress)
            if fault:
                self._set_fault(fault)
        except BaseException:
            first.close()
            for r in self.ranks.values():
                r.close()
            raise
        self.shown_rank = first.dp_rank
        if trace:
            first.writer = ProbeTraceWriter(trace, {"endpoint": endpoint})
            first.writer.message(first.first_payload)

    def _read_other_ranks(self, first: ProbeRank, name: str, keys, wait_s: float, progress) -> None:
        base = base_endpoint(first.endpoint, first.dp_rank)
        for r in range(first.dp_size):
            if r != first.dp_rank:
                self.ranks[r] = ProbeRank(rank_endpoint(base, r), name, keys)
        deadline = time.monotonic() + wait_s
        for r, rank in self.ranks.items():
            if rank is first:
                continue
            if rank.wait_keyframe(deadline, progress) is None:
                first.notice = (
                    f"data-parallel rank {r} of {first.dp_size} did not answer at {rank.endpoint} in "
                    f"{wait_s:.0f} s: it is read when it does"
                )

    def _set_fault(self, fault: str) -> None:
        for rank in self.ranks.values():
            if rank.welcome is not None and not rank.welcome.remote_faults:
                raise ValueError(
                    f"--probe-fault {fault}: vLLM's probe at {rank.endpoint} takes no faults from kvscope (start "
                    "vLLM with KVSCOPE_PROBE_REMOTE_FAULTS=1, for tests only)"
                )
            rank.client.set_fault(fault, True)

    # -- the rank shown ----------------------------------------------------------------------------------
    @property
    def shown(self) -> ProbeRank:
        return self.ranks[self.shown_rank]

    @property
    def info(self) -> SourceInfo:
        return self.shown.info

    @property
    def mirror(self) -> VllmPoolMirror:
        return self.shown.mirror

    @property
    def client(self) -> ProbeClient:
        return self.shown.client

    @property
    def ended(self) -> str | None:
        return self.shown.ended

    @property
    def tokenizer(self):
        return self.shown.tokenizer

    def select_rank(self, rank: int) -> list[StepRecord]:
        """Show data-parallel rank ``rank`` from now on (its own pool, steps and timeline): the host loads its
        ``info`` again. Paused, the rank left runs on and the rank shown is held. ``ValueError`` if it is not read."""
        new = self.ranks.get(rank)
        if new is None or not new.loaded:
            have = ", ".join(str(r) for r, k in sorted(self.ranks.items()) if k.loaded)
            raise ValueError(f"data-parallel rank {rank} is not read (ranks read: {have})")
        old = self.shown
        if new is old:
            return []
        paused = not old.running
        old.hold(False)
        self.shown_rank = rank
        new.drain()  # what it did while it was not shown: its pool is current, its history starts now
        new.running = True
        return new.hold(True) if paused else []

    # -- the Source protocol -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.ended is None  # a live vLLM: there is always a next step to wait for

    def hold(self, paused: bool) -> list[StepRecord]:
        return self.shown.hold(paused)

    def step(self) -> StepRecord:
        self._read_others()
        return self.shown.step()

    def _read_others(self) -> None:
        for r, rank in self.ranks.items():
            if r != self.shown_rank:
                for rec in rank.drain():
                    if self.on_rank_record is not None:
                        self.on_rank_record(r, rec)

    refusal = _Base.refusal

    def current(self) -> StepRecord:
        return self.shown.current()

    def set_audit(self, on: bool) -> None:
        pass  # a probed pool is audited every step: it costs O(blocks) in numpy

    def decode(self, token_ids) -> str | None:
        return self.shown.decode(token_ids)

    def vocab(self) -> tuple[str, ...]:
        return self.shown.vocab()

    def close(self) -> None:
        self._read_others()  # what the ranks not shown sent last reaches on_rank_record
        for rank in self.ranks.values():
            rank.close()


class ProbeReplay(_Base):
    """A probe trace played back: the same messages through the same mirror, one record a vLLM step."""

    refusal = "a replay is read-only: it shows what was recorded"
    current = ReadOnlySource.current  # a recording has no "now" to show (the live probe's reads vLLM's pool)

    def __init__(self, path: str, scenario=None) -> None:
        """``scenario``: a lab's (kvscope.scenario.Scenario) title, notes and view, shown over the recording."""
        super().__init__()
        self.path = path
        header = read_versioned_header(path, TRACE_FORMAT, TRACE_VERSION, "a probe trace")  # one line if not one
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        self._messages = []
        for n, line in enumerate(lines[1:], start=2):
            try:
                msg = decode_from_probe(base64.b64decode(json.loads(line)["payload"]))
                if header["version"] == 1 and isinstance(msg, Step):
                    msg.ops = _keyed_ops(msg.ops)
                self._messages.append(msg)
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                if n == len(lines):
                    break  # a torn last line (the recording was cut): the rest plays
                raise ValueError(f"{path}:{n}: not a probe message ({one_line(e)})") from None
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

    def close(self) -> None:
        pass


def _tokenizer(model: str):
    """The served model's tokenizer, when its folder is on this machine, or when it was a conversion of the embedded
    GGUF made elsewhere (the shipped lab's recording names such a folder: another machine's transformers and cache
    format are in its name); else None, and rows show token ids."""
    if not model:
        return None
    try:
        if Path(model).is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(model, local_files_only=True)
        from engine.runner.models.loader import (
            COMPLETE,
            embedded_source,
            gguf_cache_dir,
            is_conversion_of,
            load_tokenizer,
        )

        source = embedded_source()
        if is_conversion_of(model, source):
            here = gguf_cache_dir(source)  # this machine's conversion, when made: 0.5 s, against the GGUF's ~5
            if (here / COMPLETE).is_file():
                return _tokenizer(str(here))
            assert source.gguf_file is not None
            return load_tokenizer(str(Path(source.path) / source.gguf_file))
    except Exception:  # noqa: BLE001 - no tokenizer (the embedded model not installed, a bad folder): token ids
        return None
    return None


def _keyed_ops(ops: list[list]) -> list[list]:
    """The ops of a trace of version 1 (probe protocol 4), which named a block key by its two numbers (the hash's
    low 64 bits, the group), as the probe now sends them: vLLM's key bytes."""
    out = []
    for op in ops:
        code = op[0]
        if code == OP_HASH:
            key = None if op[2] is None else block_key(op[2], op[5] if len(op) > 5 else 0)
            op = [code, op[1], key, op[3], None if op[4] is None else op[4].to_bytes(8, "big")]
        elif code in (OP_MAP_INSERT, OP_MAP_POP):
            op = [code, block_key(op[1], op[3] if len(op) > 3 else 0), op[2]]
        out.append(op)
    return out
