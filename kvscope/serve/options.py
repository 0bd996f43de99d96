"""What a server beside the engine is started with (``kvscope.cli.parser`` reads them from the flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"  # loopback: serving beyond this machine takes an explicit --host
    port: int = 8000  # 0: any free port (tests)
    api_key: str | None = None
    request_timeout: float | None = None  # seconds from arrival; None: no limit
