"""``ClientWatch``: every wait of a handler races the client's disconnect and the request's deadline.

Starlette does not cancel a handler when its client goes away, and a streaming response notices
only when it next writes (a request still waiting for its turn writes nothing). So a task reads
the ASGI ``receive`` channel, whose next message after the body is ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


class RequestTimedOut(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientWatch:
    def __init__(self, request: Request, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self.deadline = None if timeout is None else loop.time() + timeout
        self._gone = asyncio.ensure_future(_until_disconnect(request))

    async def wait(self, aw: Awaitable[T]) -> T:
        task = asyncio.ensure_future(aw)
        timeout = None if self.deadline is None else max(self.deadline - self._loop.time(), 0.0)
        try:
            done, _ = await asyncio.wait((task, self._gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if task in done:
            return task.result()
        if self._gone in done:
            raise ClientDisconnected
        raise RequestTimedOut

    def close(self) -> None:
        self._gone.cancel()
