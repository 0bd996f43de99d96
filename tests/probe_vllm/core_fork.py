"""vLLM's engine cores forked from a fork server that imported vLLM once, not spawned (tests only).

The CPU platform makes vLLM start each process of its own (an engine core, a data-parallel coordinator) with
``spawn``, and a spawned engine core spends about 9 s of this machine's CPU importing vLLM before it loads a model:
the live tests start nine. ``tests/probe_vllm/zygote.py`` starts one of multiprocessing's own fork servers before it
forks any API server, with the engine core's modules imported (``PRELOAD``); each API server it forks then asks that
fork server (``use_fork_server``) where it would have spawned. What a spawned child has that a fork of the fork server
would not, the child is given: the API server's environment and working folder as they are when the process starts
(vLLM sets variables around ``start()``), and its stdout and stderr, so that the engine core's log is the server's
log as before (the tests read the probe's lines there). The child is the fork server's, not the API server's, so its
pid, exit code and sentinel come through multiprocessing's own ``popen_forkserver``, as vLLM reads them.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import context, forkserver, reduction

# What an engine core imports, in their order of cost (a server's process re-runs only the API server's module, as
# a spawned child would: ``__mp_main__``).
PRELOAD = [
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    __name__,  # this module: the child unpickles ``run_as_spawned`` from it
]


def start_fork_server() -> None:
    """In the zygote, before any fork: multiprocessing's fork server with ``PRELOAD`` imported (it imports them in
    a process of its own, so the zygote starts no thread and is ready at once)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


class _Fd:
    """A descriptor of the parent's, passed to the forked child by multiprocessing (``DupFd`` at pickling time)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def run_as_spawned(
    env: dict[str, str], cwd: str, out: int, err: int, address: str, target, args: tuple, kwargs: dict
) -> None:
    """In the forked child: the parent's environment, folder and output, then vLLM's own target. What it would
    spawn in turn (an engine core's worker process, with vLLM's ``mp`` executor) comes from the same fork server:
    multiprocessing gave the child the pipe that keeps the fork server alive, and ``address`` says where it is."""
    for fd, target_fd in ((out, 1), (err, 2)):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    forkserver._forkserver._forkserver_address = address
    use_fork_server()
    target(*args, **kwargs)


class _Process(context.ForkServerProcess):
    def start(self) -> None:
        address = forkserver._forkserver._forkserver_address
        self._args = (dict(os.environ), os.getcwd(), _Fd(1), _Fd(2), address, self._target, self._args, self._kwargs)
        self._target, self._kwargs = run_as_spawned, {}
        super().start()


class _Context(context.ForkServerContext):
    Process = _Process


def use_fork_server() -> None:
    """In an API server forked from the zygote, and in what the fork server forks for it: what vLLM would spawn
    comes from the zygote's fork server."""
    # the fork server is the zygote's child, not this process's: its waitpid() here would fail; its address and the
    # pipe that keeps it alive came with the fork
    forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]
    ctx = _Context()
    get_context = multiprocessing.get_context

    def get(method: str | None = None):
        return ctx if method == "spawn" else get_context(method)

    multiprocessing.get_context = get  # type: ignore[assignment]
