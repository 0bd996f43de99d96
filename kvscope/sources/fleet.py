"""A fleet of engines watched together: one ``AttachedSource`` per instance, one index of who holds what.

``FleetSource`` is a ``Source`` whose one capability is ``FLEET``: a step is one poll of every instance (waiting
up to ``poll_interval`` for the first message from any of them), its record's snapshot a ``FleetRecord``: each
instance's cache (blocks, tokens, bytes, stored and removed per second, the blocks another instance holds too,
its connection, restarts, gaps and whether its hashes can be reproduced, its usage and load from ``/metrics``)
and the fleet's (blocks, distinct blocks, the duplicated ones). Each instance is the same model of one engine's
cache as ``kvscope --attach``; the fleet adds ``FleetIndex`` (one forest, holders, duplication), a ``HashCheck``
per instance and ``route`` (where would a prompt go).

An instance that goes away (its connection drops, or heartbeats stop) is marked down and its cache kept as last
heard; one that restarts (its sequence goes back) has its cache cleared; a gap is repaired from its replay socket
or listed; the others go on. Every change of that kind is one line in the record's ``notices``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from kvscope.messages import count_text
from kvscope.sources.attach_record import AttachRecord
from kvscope.sources.attached import AttachConfig, AttachedBase, AttachedSource
from kvscope.sources.base import FLEET_CAPABILITIES, SourceInfo, StepRecord
from kvscope.sources.fleet_index import FleetIndex, InstanceFeed
from kvscope.sources.fleet_metrics import MetricsScraper
from kvscope.sources.fleet_record import FleetRecord, InstanceRow
from kvscope.sources.fleet_route import RouteAnswer, score
from kvscope.sources.fleet_spec import FleetSpec, InstanceSpec
from kvscope.sources.hash_check import HashCheck

CANNOT_SHOW = (
    "A fleet's KV events: each instance's cached blocks by hash. They carry no block ids, tables, ref "
    "counts or requests; usage and load come from each instance's /metrics when the fleet file names it."
)


class FleetMember:
    """One instance: its subscriber, its hash check, and its feed of the fleet's index."""

    def __init__(self, spec: InstanceSpec, index: FleetIndex, max_blocks: int, place: int = 0) -> None:
        self.spec, self.index, self.place = spec, index, place
        self.check = HashCheck(spec.hash_algo, spec.hash_seed, spec.block_size)
        self.feed = InstanceFeed(index, place, spec.name, spec.dp_size, spec.bytes_per_block, also=self.check)
        self.source = AttachedSource(
            AttachConfig(
                endpoint=spec.endpoint,
                replay_endpoint=spec.replay_endpoint,
                topic=spec.topic,
                dp_size=spec.dp_size,
                block_size=spec.block_size,
                max_nodes=max_blocks,
                poll_interval=0.0,
                watch_connection=True,
            )
        )
        self.source.model.listener = self.feed
        self.last: AttachRecord | None = None
        self.state = "connecting"  # as of the last record (what a route after close() goes by)
        self.said: dict[str, object] = {}  # what the notices last said of it

    # -- its state ------------------------------------------------------------------------------
    def connection(self, now: float) -> tuple[str, float, float | None]:
        """(state, seconds in it, seconds since its last batch): the worst of its ranks."""
        cons = [s.connection for s in self.source.streams if s.connection is not None]
        order = {"down": 0, "connecting": 1, "up": 2}
        worst = min(cons, key=lambda c: order[c.state])
        heard = [c.last_batch for c in cons if c.last_batch is not None]
        return worst.state, now - worst.since, (now - max(heard)) if heard else None

    def row(self, now: float, metrics: dict | None) -> InstanceRow:
        rec, model = self.last, self.source.model
        summary = model.summary()
        state, state_s, heard = self.connection(now)
        self.state = state
        bpb = self.spec.bytes_per_block
        shared = self.feed.shared_blocks
        c = rec.counters
        return InstanceRow(
            self.spec.name,
            self.spec.endpoint,
            state,
            state_s,
            summary.blocks,
            summary.tokens,
            summary.blocks * bpb if bpb else None,
            rec.rates["stored_per_s"],
            rec.rates["removed_per_s"],
            shared,
            shared * bpb if bpb else None,
            c["publisher_restarts"],
            c["gaps_unrepaired"],
            c["batches_missing"],
            heard,
            self.check.why_not() is None,
            self.check.describe(),
            metrics,
        )

    def notices(self, row: InstanceRow) -> list[str]:
        """What changed about this instance since the last poll, one line each."""
        out, said, name = [], self.said, f"instance {self.spec.name} ({self.spec.endpoint})"
        if row.state != said.get("state", "connecting"):
            if row.state == "down":
                out.append(f"{name} went away: its cache is shown as last heard")
            elif said.get("state") == "down":
                out.append(f"{name} is back")
        if row.restarts > said.get("restarts", 0):
            out.append(f"{name} restarted (its sequence numbers went back): its cache was cleared")
        if row.batches_missing > said.get("missing", 0):
            lost = count_text(row.batches_missing - said.get("missing", 0), "batch", "batches")
            out.append(f"{name}: {lost} missing and not repaired: its cache may miss blocks")
        if not row.reproducible and self.check.failed + bool(self.check.fatal) and not said.get("unreproducible"):
            out.append(f"{name}: {row.hashes}")
            said["unreproducible"] = True
        said.update(state=row.state, restarts=row.restarts, missing=row.batches_missing)
        return out

    def close(self) -> None:
        self.source.close()


class FleetSource(AttachedBase):
    """Every instance of a ``FleetSpec`` polled together. Not thread-safe: one thread polls."""

    refusal = "a fleet is read-only: kvscope hears its instances' KV events and sends them nothing"

    def __init__(
        self, spec: FleetSpec, poll_interval: float = 0.1, max_blocks: int = 200_000, metrics_interval: float = 2.0
    ) -> None:
        self.spec = spec
        self.poll_interval = poll_interval
        self.index = FleetIndex(max_nodes=max_blocks * len(spec.instances))
        self.members: list[FleetMember] = []
        self._t0 = time.monotonic()
        self.tick = 0
        self.closed = False
        try:
            for i, inst in enumerate(spec.instances):
                self.members.append(FleetMember(inst, self.index, max_blocks, i))
        except ValueError as e:
            self.close()
            raise ValueError(f"{spec.origin}: {e}") from None
        self._poller = zmq.Poller()
        for m in self.members:
            for sock in m.source.sockets():
                self._poller.register(sock, zmq.POLLIN)
        self.metrics = MetricsScraper({i.name: i.metrics for i in spec.instances if i.metrics}, metrics_interval)
        names = ", ".join(i.name for i in spec.instances)
        self.info = SourceInfo(
            model_name=f"a fleet of {len(spec.instances)}: {names}",
            device="KV events",
            dtype="-",
            num_blocks=0,
            block_size=0,
            block_bytes=0,
            max_model_len=0,
            load_seconds=0.0,
            capabilities=FLEET_CAPABILITIES,
            extra={"instances": [i.name for i in spec.instances], "origin": spec.origin, "cannot_show": CANNOT_SHOW},
        )

    @property
    def step_count(self) -> int:
        return self.tick

    def has_work(self) -> bool:
        return not self.closed  # a live fleet's events have no end

    def step(self) -> StepRecord:
        t0 = time.perf_counter()
        rec = self.poll(self.poll_interval)
        notice = "; ".join(rec.notices) if rec.notices else None
        return StepRecord(rec.tick, None, [], None, time.perf_counter() - t0, notice=notice, fleet=rec)

    def poll(self, timeout: float = 0.1) -> FleetRecord:
        """Wait up to ``timeout`` s for any instance's first message, then poll each one without waiting."""
        if timeout > 0:
            self._poller.poll(int(timeout * 1000))
        for m in self.members:
            m.last = m.source.poll(0.0)
        self.tick += 1
        return self.record()

    def record(self) -> FleetRecord:
        now = time.monotonic() - self._t0
        clock = time.monotonic()
        rows, notices = [], []
        for m in self.members:
            scrape = self.metrics.get(m.spec.name)
            row = m.row(now, scrape.as_dict(clock) if scrape else None)
            rows.append(row)
            notices += m.notices(row)
        return FleetRecord(
            self.tick,
            now,
            tuple(rows),
            sum(r.blocks for r in rows),
            self.index.distinct_blocks,
            self.index.duplication(),
            tuple(notices),
        )

    def poll_summary(self, rec: StepRecord, polls: int, route: RouteAnswer | None = None) -> dict:
        """What a headless run prints (``PollSummary``): the ``fleet`` object at the last poll, with the route's
        answer when a prompt was given."""
        last = rec.fleet
        out = {
            "origin": self.spec.origin,
            "polls": polls,
            "seconds": round(last.t, 3),
            "instances": [r.as_dict() for r in last.instances],
            "in_all": last.in_all(),
            "cannot_show": CANNOT_SHOW,
        }
        if route is not None:
            out["route"] = route.as_dict()
        return {"fleet": out}

    def route(self, token_ids: Sequence[int]) -> RouteAnswer:
        """Each instance's longest cached prefix of ``token_ids`` (see ``fleet_route``)."""
        if not self.closed:  # the connections as they are now
            now = time.monotonic() - self._t0
            for m in self.members:
                m.state = m.connection(now)[0]
        scores = [score(m.spec.name, m.source.model, m.check, token_ids, m.state == "up") for m in self.members]
        return RouteAnswer(len(token_ids), tuple(scores))

    def close(self) -> None:
        """Sockets and threads closed; the caches stay as last heard (a headless run routes its prompt after)."""
        if self.closed:
            return
        self.closed = True
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        for m in self.members:
            m.close()
