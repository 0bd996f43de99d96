"""``OpenAIServer``: the bridge, its metrics and the HTTP app, with uvicorn on a background thread.

Whoever owns the ``LiveSource`` (``--headless``'s main thread, the window's worker, later an engine
process) creates one, starts it, puts ``server.bridge`` among the session's hooks and calls
``bridge.attach(engine)`` once the model is loaded; until then every route but ``/metrics``
answers 503. No Qt here: it must run wherever the engine runs.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

from kvscope.serve.app import create_app
from kvscope.serve.bridge import RequestBridge
from kvscope.serve.handlers import ServeContext
from kvscope.serve.metrics import ServeMetrics
from kvscope.serve.options import ServeOptions


class OpenAIServer:
    def __init__(self, options: ServeOptions, wake: Callable[[], None] | None = None) -> None:
        self.options = options
        self.bridge = RequestBridge(ServeMetrics(), wake)
        self.app = create_app(ServeContext(self.bridge, options.request_timeout, options.api_key))
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = options.port

    @property
    def url(self) -> str:
        host = self.options.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        """Bind (here, so a port in use fails now with ``OSError``) and serve on a daemon thread."""
        sock = _bind(self.options.host, self.options.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="kvscope-http", daemon=True
        )
        self._thread.start()
        t0 = time.monotonic()
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() - t0 > timeout:
                sock.close()
                raise OSError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open responses end (detach the bridge first so none waits on the engine)."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server = self._thread = None


def start_server(options: ServeOptions, say=None) -> OpenAIServer:
    """The one way a server beside the engine starts (the engine process, the window's engine thread, headless):
    bound and serving now (a port it cannot take raises ``OSError`` with one line), every route but /metrics
    answering 503 until an ``EngineHost`` attaches its bridge on load. ``say`` hears where it listens."""
    server = OpenAIServer(options)
    server.start()
    (say or (lambda text: print(text, file=sys.stderr)))(
        f"kvscope: serving at {server.url}/v1 (metrics at {server.url}/metrics)"
    )
    return server


def check_port(host: str, port: int) -> None:
    """Raise ``OSError`` (one line) now if the server could not listen there."""
    _bind(host, port).close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
