"""Stand-in for one rank started by ``tests/helpers/forkserver.py``: ``python -S fork_client.py SOCKET MODULE ARGS``.

Run without ``site`` and with nothing but the standard library's small modules, it starts in milliseconds.
It sends the server its environment, working directory and standard streams, waits for the rank, and
exits as the rank did (the same code, or killed by the same signal). Signals sent to it are the rank's (a
SIGTERM test signals the process it started); if it is killed, the server kills the rank: the caller's time
limits and ``killpg`` work on it as on a rank started directly. Where the server answers that a fork cannot
be the process this environment asks for (``tests/helpers/fresh_state.py``), the client becomes the rank
itself: it execs ``python -m MODULE ARGS``, a fresh interpreter in the same process.
"""

import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forward(pid: int) -> None:
    """A signal sent to this process (SIGKILL excepted: that one ends it, and the server then kills the
    rank) is the rank's."""
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [len(request).to_bytes(8, "big")], [0, 1, 2])
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(64):
            reply += chunk
            if reply.startswith(b"pid ") and b"\n" in reply:  # the rank is running: signals go to it
                head, reply = reply.split(b"\n", 1)
                forward(int(head.split()[1]))
    if reply.startswith(b"fresh "):
        os.execv(sys.executable, [sys.executable, "-m", *argv])
    if not reply:
        sys.stderr.write(f"fork_client: the fork server at {path} closed without the rank's status\n")
        os._exit(70)
    kind, value = reply.decode().split()
    if kind == "signal":
        if int(value) not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
    os._exit(int(value))


if __name__ == "__main__":
    main()
