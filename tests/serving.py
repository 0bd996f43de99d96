"""A served engine for tests: the session stepped on its own thread, the HTTP server on loopback."""

from __future__ import annotations

import time

import openai

from engine import LLMEngine
from kvscope.runtime import protocol as p
from kvscope.runtime.loop import HostLoop
from kvscope.serve import OpenAIServer, ServeOptions
from kvscope.sources.live import LiveSource


class SlowSteps:
    """A hook that makes every step take at least ``seconds``: time for a client to leave mid-request."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def before_step(self, engine) -> None:
        time.sleep(self.seconds)

    def after_step(self, engine, out) -> None:
        pass

    def has_work(self, engine) -> bool:
        return False


class Served:
    def __init__(
        self, engine: LLMEngine, options: ServeOptions | None = None, hooks: tuple = (), attach: bool = True
    ) -> None:
        self.engine = engine
        self.server = OpenAIServer(options or ServeOptions(port=0))
        self.bridge = self.server.bridge
        self.session = LiveSource(engine, hooks=list(hooks))  # the host puts the bridge among them on load
        self.loop = HostLoop.over(self.session, self.bridge, load=False)
        self.server.start()
        self.loop.start()
        if attach:
            self.attach()

    @property
    def url(self) -> str:
        return self.server.url

    def attach(self) -> None:
        """Load: the host attaches the bridge (every route answers from then on) and serves."""
        self.call(lambda: self.loop.host.handle(p.Load(None)))

    def call(self, fn):
        """Run ``fn`` on the engine's thread, between steps."""
        return self.loop.call(fn)

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kw)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine and the bridge have nothing left to do."""
        t0 = time.monotonic()
        while self.call(self.session.has_work):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("the engine did not go idle")
            time.sleep(0.01)

    def wait_for(self, predicate, timeout: float = 20.0) -> None:
        t0 = time.monotonic()
        while not predicate():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError("condition not reached")
            time.sleep(0.01)

    def close(self) -> None:
        try:
            self.call(lambda: self.bridge.detach("test over"))
        finally:
            self.server.stop()
            self.loop.join()
