"""KV events: what publishing costs a step, and how fast an attached subscriber keeps up.

    python bench/kv_events.py [--quick]

Rows, side by side in one run:
- an engine step with and without the publisher (a fake runner replaces the model, so the step
  is pure bookkeeping and the publisher's share is the worst case; prompts share a prefix in a
  small pool, so steps store and evict blocks); the two alternate three times, best median kept,
  and the publisher's own time inside the step is timed too (its share of the step);
- the publisher alone: mapping + msgpack encoding + a PUB send, per batch (8 stored blocks of 16
  tokens and 4 removals, a busy decode step's worth);
- the subscriber alone: decode + apply to the prefix forest, per batch of the same shape;
- loopback end to end: batches a second from ``publish_payload`` to the attached forest.
"""

from __future__ import annotations

import random
import statistics
import time

from common import engine_for, install_fake_runner, main, pyplot, save_figure, table, tiny_model, write_results
from engine import SamplingParams
from engine.inspect.events import BlockEvicted, BlockStored
from engine.inspect.kv_events import to_wire_events
from engine.inspect.kv_wire import decode_batch, encode_batch
from kvscope.runtime.build import KVEventsObserver
from kvscope.runtime.kv_events_options import KVEventsConfig
from kvscope.runtime.kv_publisher import KVEventPublisher
from kvscope.sources.attached import AttachConfig, AttachedSource
from kvscope.sources.endpoints import connectable
from kvscope.sources.live import LiveSource
from kvscope.sources.remote_cache import RemoteCacheModel


def step_cost(publish: bool, steps: int) -> float:
    engine = engine_for(tiny_model(), block_size=16, num_gpu_blocks=256, max_num_seqs=32, max_model_len=4096)
    install_fake_runner(engine)
    session = LiveSource(engine)
    observer_times: list[float] = []
    if publish:
        pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"), 16)
        observer = KVEventsObserver(pub)

        def timed(rec) -> None:
            t = time.perf_counter()
            observer(rec)
            observer_times.append(time.perf_counter() - t)

        timed.close = observer.close
        session.observers.append(timed)
    rng = random.Random(5)
    shared = [rng.randrange(1, 500) for _ in range(64)]
    times = []
    for i in range(steps):
        if i % 2 == 0:
            session.inject(
                shared + [rng.randrange(1, 500) for _ in range(rng.randrange(16, 200))],
                SamplingParams(max_tokens=rng.randrange(8, 64), temperature=0.0, ignore_eos=True),
            )
        t0 = time.perf_counter()
        session.step()
        times.append(time.perf_counter() - t0)
    evictions = engine.pool.num_evictions
    session.close()
    return 1e6 * statistics.median(times), 1e6 * statistics.median(observer_times or [0.0]), evictions


def typical_events(i: int) -> list:
    hashes = [f"{(i * 64 + k):064x}" for k in range(8)]
    ev = [BlockStored(k, h, "r", tuple(range(16)), hashes[k - 1] if k else None) for k, h in enumerate(hashes)]
    return ev + [BlockEvicted(100 + k, f"{(i * 64 + 32 + k):064x}") for k in range(4)]


def per_batch(n: int) -> tuple[float, float]:
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*"), 16)
    batches = [typical_events(i) for i in range(n)]
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    publish_us = 1e6 * (time.perf_counter() - t0) / n
    pub.close()
    payloads = [encode_batch(to_wire_events(b, 16), 0.0) for b in batches]
    model = RemoteCacheModel(max_nodes=10 * n * 8)
    t0 = time.perf_counter()
    for p in payloads:
        for ev in decode_batch(p).events:
            model.apply(ev, 0)
    apply_us = 1e6 * (time.perf_counter() - t0) / n
    return publish_us, apply_us


def loopback(n: int) -> float:
    pub = KVEventPublisher(KVEventsConfig(endpoint="tcp://127.0.0.1:*", hwm=10 * n), 16)
    src = AttachedSource(
        AttachConfig(connectable(pub.endpoint), rcvhwm=10 * n, max_messages_per_poll=10 * n, max_nodes=10 * n * 8)
    )
    while not src.counters["batches"]:  # until the subscription is through
        pub.publish_payload(encode_batch([], 0.0))
        src.poll(0.05)
    payloads = [encode_batch(to_wire_events(typical_events(i), 16), 0.0) for i in range(n)]
    start = src.counters["batches"]
    t0 = time.perf_counter()
    for p in payloads:
        pub.publish_payload(p)
    while src.counters["batches"] - start < n and time.perf_counter() - t0 < 60:
        src.poll(0.05)
    got = src.counters["batches"] - start
    seconds = time.perf_counter() - t0
    src.close()
    pub.close()
    assert got == n, f"only {got} of {n} batches arrived"
    return n / seconds


def run(quick: bool) -> dict:
    steps, n = (40, 500) if quick else (400, 20_000)
    # Alternate the two, three times, and keep each one's best median: the machine is shared, and
    # step times move more between runs than publishing costs, so the publisher's own time is
    # measured inside the step too.
    runs = [step_cost(publish, steps) for _ in range(3) for publish in (False, True)]
    bare, _, ev_bare = min(runs[0::2])
    published, in_step, ev_pub = min(runs[1::2])
    publish_us, apply_us = per_batch(n)
    rate = loopback(n)
    rows = [
        {"what": "engine step (fake runner), no publisher", "value": bare, "unit": "µs / step", "vs_bare": 1.0},
        {
            "what": "engine step (fake runner), publishing",
            "value": published,
            "unit": "µs / step",
            "vs_bare": published / bare,
        },
        {
            "what": "of which the publisher (ratio: its share of the step)",
            "value": in_step,
            "unit": "µs / step",
            "vs_bare": in_step / published,
        },
        {"what": "publish one batch (8 stored + 4 removed)", "value": publish_us, "unit": "µs / batch", "vs_bare": ""},
        {"what": "decode + apply one such batch", "value": apply_us, "unit": "µs / batch", "vs_bare": ""},
        {"what": "loopback publish -> forest", "value": rate, "unit": "batches / s", "vs_bare": ""},
    ]
    result = {"steps_timed": steps, "batches": n, "evictions": [ev_bare, ev_pub], "rows": rows}
    write_results("kv_events", result, quick)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 2.6))
    ax.barh(["no publisher", "publishing"], [bare, published], color=["#888", "#2a7"])
    ax.set_xlabel("µs per engine step (fake runner: bookkeeping only)")
    ax.set_title(
        f"publish {publish_us:.0f} µs/batch · apply {apply_us:.0f} µs/batch · {rate:,.0f} batches/s loopback",
        fontsize=8,
    )
    save_figure(fig, "kv_events", quick)
    print(
        table(
            rows,
            [("what", "measured", ""), ("value", "value", ".1f"), ("unit", "unit", ""), ("vs_bare", "ratio", ".2f")],
        )
    )
    return result


if __name__ == "__main__":
    main(run, __doc__)
