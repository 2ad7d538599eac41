"""Start the ranks of a test run without paying the imports each time: ``python -m tests.helpers.forkserver SOCKET``.

A rank of a multi-process test spends most of its life importing torch and Lightning (about 4 s of CPU, and
the suite starts hundreds of ranks on 2 cores). This server imports them once, then forks one child per
request: the child is a real, separate process (its own gloo connections over TCP, its own memory) that runs
the requested module as ``python -m`` would, with the requester's environment, working directory, standard
streams and ``PYTHONPATH``. The requester is ``tests/helpers/fork_client.py``, an interpreter without imports
that stands in for the rank as the process that ``start_processes`` waits on and kills: the rank's exit code
or signal becomes the client's, and a client that dies (killed by a time limit) takes its rank with it.

A forked rank is the process a fresh interpreter would be: what the imports derived from the server's
environment is derived again from the rank's (``tests/helpers/fresh_state.py``), and a rank whose environment
asks for what only an interpreter's start can give (``PYTHONHASHSEED``, ...) is told so, and its client
becomes that fresh interpreter (``exec``, the same process). Every child of one server shares its hash seed,
so rank ``r`` of a run is forked by server ``r``: the ranks of a run differ, as separate interpreters do
(servers are started as a run first needs them, once per test session).

The server imports nothing that starts a thread (forking a threaded process is unsafe); it refuses to start
otherwise.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from tests.helpers.fresh_state import Preloaded

__all__ = ["PRELOADED", "serve", "rank_commands"]

CLIENT = Path(__file__).with_name("fork_client.py")
_sockets: list[str] = []  # server r's socket: it forks rank r of every run
_server_env: dict[str, str] = {}  # the environment the servers start with

#: what every rank imports before its first line of work (the worker's own modules are left to the rank:
#: ``runpy`` warns about a ``-m`` module that is already imported)
PRELOADED = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "lightning.pytorch.callbacks",
    "lightning_parallel",
    "lightning_parallel.materialize.share",
    "lightning_parallel.memory.accounting",
)


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's length-prefixed JSON request and its three standard file descriptors."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        body += chunk
    return json.loads(body), fds


def _run_child(request: dict, fds: list[int], base_path: list[str], preloaded: Preloaded) -> None:
    """In the forked child: become the requested ``python -m module args`` and exit with its status."""
    code = 0
    try:
        os.setsid()  # its own session, as ``start_new_session`` gives a directly started rank
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        env = request["env"]
        os.chdir(request["cwd"])
        preloaded.become(env)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdout = sys.__stdout__ = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *extra, *base_path]
        module, *args = request["argv"]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what a normal interpreter exit runs (process groups destroyed, ...)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _kill(pid: int) -> None:
    """A rank and whatever it started (its session's process group; itself, if it has not made one yet)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(path: str) -> None:
    """Accept requests on the Unix socket ``path`` until the parent (the test session) is gone."""
    preloaded = Preloaded.load(PRELOADED)
    if threading.active_count() != 1:
        raise RuntimeError(f"the imports started threads, forking would be unsafe: {threading.enumerate()}")
    parent = os.getppid()
    own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    base_path = [p for p in sys.path[1:] if p not in own]  # less the server's working directory, PYTHONPATH
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # rank pid: its client's connection
    print("ready", flush=True)
    while os.getppid() == parent:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (ConnectionError, OSError, ValueError):
                    conn.close()
                    continue
                reason = preloaded.fresh_start_reason(request["env"])
                if reason is not None:  # the client execs a fresh interpreter
                    for fd in fds:
                        os.close(fd)
                    try:
                        conn.sendall(f"fresh {reason}\n".encode())
                    except OSError:
                        pass
                    conn.close()
                    continue
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for other in [conn, *children.values()]:
                        other.close()
                    _run_child(request, fds, base_path, preloaded)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass  # the client is gone: the selector sees it and the rank is killed
                children[pid] = conn
                selector.register(conn, selectors.EVENT_READ, pid)
            else:  # the client sends nothing: readable means it is gone, so its rank goes too
                _kill(key.data)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            selector.unregister(conn)
            if os.WIFSIGNALED(status):
                reply = f"signal {os.WTERMSIG(status)}"
            else:
                reply = f"exit {os.WEXITSTATUS(status)}"
            try:
                conn.sendall(reply.encode())
            except OSError:
                pass
            conn.close()
    for pid in children:
        _kill(pid)


def _start_servers(count: int, env: dict) -> list[str]:
    """``count`` servers, stopped when this test session ends (and stopping by themselves if it dies)."""
    folder = Path(tempfile.mkdtemp(prefix="lp-fork-"))
    paths = [str(folder / f"{i}.sock") for i in range(count)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, path], env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        for path in paths
    ]

    def stop() -> None:
        for proc in procs:
            proc.kill()
            proc.wait()
        for path in paths:
            Path(path).unlink(missing_ok=True)
        folder.rmdir()

    atexit.register(stop)
    for proc in procs:
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"a fork server did not start (exit {proc.wait()})")
    return paths


def rank_commands(command: list[str], world_size: int, env: dict) -> list[list[str]]:
    """``world_size`` commands that run ``command`` (``[python, "-m", module, *args]``), rank ``r`` as a fork
    of server ``r``; the servers this session lacks are started with ``env`` (the first call's: a rank whose
    own environment differs where a fork cannot follow starts fresh)."""
    python, flag, *rest = command
    if flag != "-m":
        raise ValueError(f"a fork server runs modules (python -m ...), not {command}")
    if not _server_env:
        _server_env.update(env)
    if len(_sockets) < world_size:
        _sockets.extend(_start_servers(world_size - len(_sockets), _server_env))
    return [[python, "-S", str(CLIENT), _sockets[r], *rest] for r in range(world_size)]


if __name__ == "__main__":
    serve(sys.argv[1])
