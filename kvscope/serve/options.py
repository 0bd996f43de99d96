"""The serving flags (``--serve``, ``--host``, ``--port``, ``--api-key``, ``--request-timeout``) and their options."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"  # loopback: serving beyond this machine takes an explicit --host
    port: int = 8000  # 0: any free port (tests)
    api_key: str | None = None
    request_timeout: float | None = None  # seconds from arrival; None: no limit

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        # The key's default is read here, not in the parser: --help must never print it.
        key = getattr(args, "api_key", None) or os.environ.get("KVSCOPE_API_KEY") or None
        return cls(args.host, args.port, key, args.request_timeout)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not s > 0:
        raise argparse.ArgumentTypeError(f"the timeout must be > 0 seconds, got {text}")
    return s


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("serving (an OpenAI-compatible HTTP server beside the engine)")
    g.add_argument("--serve", action="store_true",
                   help="serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics while the "
                        "window (or --headless) shows the pool; the window starts in Run")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; serving beyond this machine needs an explicit one (e.g. 0.0.0.0)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (0: any free port)")
    g.add_argument("--api-key", default=argparse.SUPPRESS, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVSCOPE_API_KEY if set, "
                        "else no key)")
    g.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="abort a request still running this long after it arrived (HTTP 504)")
