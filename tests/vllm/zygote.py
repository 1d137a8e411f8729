"""A process that imports torch and vLLM once and forks a new engine process per request.

    python zygote.py <fd of a Unix socket>

An engine process started from scratch spends most of its start-up importing vLLM (11 s of
CPU on a 2-vCPU AVX2 host, 13-15 s with torch); a fork of this process starts with those
modules in memory, as vLLM's own multiprocessing workers do by default (they are forked
after the same imports). Nothing here initialises Ray, torch's thread pools or an engine:
each child connects to Ray and builds its engine itself, after taking its environment.

Each request on the socket (a ``SOCK_SEQPACKET`` pair) is one JSON message ``{"spec", "env",
"cwd"}`` sent with three file descriptors (the child's stdin, stdout and stderr); the answer
is ``{"pid"}``. Children are
reaped by the kernel (SIGCHLD ignored here, restored in the child), so a finished engine's
pid disappears and ``os.kill(pid, 0)`` tells whether it runs. The zygote exits when the
socket closes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
engine_proc = None  # imported by main()


def serve(sock: socket.socket) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 3)
        if not msg:
            return
        req = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the engine
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                os.environ.clear()
                os.environ.update({**engine_proc.ENV_DEFAULTS, **req["env"]})
                os.chdir(req["cwd"])
                os.setpgid(0, 0)
                engine_proc.main(req["spec"])
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sys.path.insert(0, HERE)
    global engine_proc
    import engine_proc  # its environment defaults, before vLLM reads them
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401

    sock.send(b'{"ready": true}')
    serve(sock)


if __name__ == "__main__":
    main()
