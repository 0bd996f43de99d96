"""``kvscope --headless --serve``: the HTTP server, and the main thread stepping the engine when there is work."""

from __future__ import annotations

import argparse
import signal
import sys

from engine import EngineConfig, SamplingParams
from engine.messages import one_line
from kvscope.cli.parser import serve_options, source_spec
from kvscope.runtime.build import build_source
from kvscope.runtime.loop import HostLoop
from kvscope.serve.server import start_server
from kvscope.sources.live import LiveSource


def _fail(msg: str, code: int) -> int:
    print(f"kvscope: {msg}", file=sys.stderr)
    return code


def serve_headless(config: EngineConfig, args: argparse.Namespace) -> int:
    if args.replay:
        return _fail("--serve needs a live engine: a --replay cannot serve requests", 2)
    try:
        server = start_server(serve_options(args), say=lambda _text: None)
    except OSError as e:
        return _fail(one_line(e), 2)
    print(f"kvscope: listening on {server.url} (503 until the model is loaded)", file=sys.stderr)
    try:
        session = build_source(source_spec(config, args))
    except KeyboardInterrupt:
        server.stop()
        return _fail("interrupted while loading the model", 130)
    except ValueError as e:
        server.stop()
        return _fail(one_line(e), 2)
    except Exception as e:  # noqa: BLE001 - one clear line, not a traceback
        server.stop()
        return _fail(one_line(e), 1)
    assert isinstance(session, LiveSource)
    loop = HostLoop.over(session, server.bridge)  # loaded: the bridge attached, serving
    print(
        f"kvscope: serving {session.engine.model_name} at {server.url}/v1 (metrics at {server.url}/metrics); "
        "Ctrl+C stops",
        file=sys.stderr,
    )

    def on_signal(_sig, _frame) -> None:
        loop.stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    try:
        for prompt in args.inject + getattr(args, "inject_ids", []):
            session.inject(prompt, params)
        loop.run()  # until Ctrl+C or SIGTERM: the host then detaches the bridge and closes the source
    except ValueError as e:
        loop.host.shutdown()
        return _fail(f"request refused: {one_line(e)}", 2)
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    report = session.engine.audit()
    aborted = len(server.bridge.abort_log)
    print(
        f"kvscope: stopped after {session.step_count} steps; {aborted} requests aborted by their clients; "
        f"audit {'clean' if report.ok else f'found {len(report.bad_blocks)} bad blocks'}",
        file=sys.stderr,
    )
    return 0 if report.ok else 1
