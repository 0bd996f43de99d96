"""kvscope's OpenAI-compatible server for the peer benchmark, in a process of its own.

    python bench/peer_kvscope_server.py --model FOLDER --port PORT [--block-size 32] [--dtype float32]
        [--inspect window|headless|off] [--profile FILE]

What ``kvscope --serve`` runs, the window aside: the HTTP server on its thread (uvicorn), the engine stepped
by the host loop on the main thread, the server's bridge among the live source's hooks. ``--inspect``:

- ``window`` (the default): every step recorded as the window's engine process records it: the live state,
  the step's events, the pool's audit after every step and the write audit before every forward, encoded
  for the wire and pickled in batches (the pipe to a window is all that is left out);
- ``headless``: what ``kvscope --headless --serve --audit`` does: a full snapshot and the audit every step;
- ``off``: the engine and the server alone: no record, no audit (the bookkeeping's reference point).

``--profile FILE``: the step sections (``step_sections.py``) of every step, written as JSON when the process
is stopped (SIGTERM). Prints ``ready PORT`` on stdout once the model is loaded and serving.
"""

from __future__ import annotations

import argparse
import json
import pickle
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import EngineConfig  # noqa: E402
from engine.gc_policy import tune_gc  # noqa: E402
from kvscope.runtime import protocol as p  # noqa: E402
from kvscope.runtime.build import SourceSpec, build_source  # noqa: E402
from kvscope.runtime.host import EngineHost  # noqa: E402
from kvscope.runtime.loop import HostLoop  # noqa: E402
from kvscope.runtime.wire import RecordEncoder  # noqa: E402
from kvscope.serve.options import ServeOptions  # noqa: E402
from kvscope.serve.server import start_server  # noqa: E402
from kvscope.sources.base import StepRecord  # noqa: E402

INSPECT_MODES = ("window", "headless", "off")


def window_emit(encoder: RecordEncoder):
    """The engine process's emit, the pipe aside: each step's record encoded, a batch pickled when due."""
    sent = [0]

    def emit(res: p.Result) -> None:
        if isinstance(res, p.Stepped):
            encoder.add(res)
            if not encoder.due:
                return
        batch = encoder.flush()
        if batch is not None:
            sent[0] += len(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))

    return emit


def bare_records(source) -> None:
    """The inspector off: a step's record carries the step's output only (no state, no audit)."""
    engine = source.engine

    def record(out, seconds: float = 0.0) -> StepRecord:
        return StepRecord(engine.step_count, None, [], out, seconds, None)

    source._record = record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--inspect", choices=INSPECT_MODES, default="window")
    ap.add_argument("--profile", default=None, metavar="FILE")
    ap.add_argument("--no-fuse-ops", action="store_true", help="PyTorch's ops one by one (the fused kernels' baseline)")
    args = ap.parse_args()

    server = start_server(ServeOptions(port=args.port), say=lambda _text: None)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        fuse_ops=not args.no_fuse_ops,
    )
    source = build_source(SourceSpec(config, audit=args.inspect != "off"))
    emit = (lambda _res: None) if args.inspect != "window" else window_emit(RecordEncoder())
    if args.inspect == "off":
        bare_records(source)
    host = EngineHost(
        lambda _scenario, progress=None: source, emit, server.bridge, raw_snapshots=args.inspect == "window"
    )
    host.audit_enabled = args.inspect != "off"
    loop = HostLoop(host)
    server.bridge.wake = loop.wake
    host.handle(p.Load(None))  # the bridge attached, the audit on: serving
    sections = None
    if args.profile:  # after the load, which set the write audit
        from step_sections import StepSections

        sections = StepSections()
        sections.install(source.engine, source, server.bridge)
        host.emit = sections.charged(host.emit, "inspector")
    tune_gc()  # as kvscope's engine process does once a model is loaded
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda _sig, _frame: loop.stop())
    print(f"ready {server.port}", flush=True)
    try:
        loop.run()
    finally:
        server.stop()
        if sections is not None:
            Path(args.profile).write_text(json.dumps(sections.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
