"""The probe responder started as systemd starts it (socket activation) and on its own.

systemd's protocol is real here: a listening socket on fd 3, ``LISTEN_FDS`` and ``LISTEN_PID`` naming the process
(set by the process itself before it ``exec``s the responder, as systemd does between fork and exec). The lab
(``tests/lab/test_provision.py``) shows the same under a real systemd."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from reconciler.engine import responder

RESPONDER = responder.__file__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str, deadline: float = 10.0) -> bytes:
    end = time.monotonic() + deadline
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                chunks = []
                while block := c.recv(65536):
                    chunks.append(block)
                return b"".join(chunks)
        except (ConnectionRefusedError, ConnectionResetError):
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _start(argv_address: str, handed: socket.socket | None, listen_pid: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    pass_fds: tuple[int, ...] = ()
    if handed is not None:
        os.set_inheritable(handed.fileno(), True)
        pass_fds = (handed.fileno(),)
    # What systemd does between fork and exec: the socket on fd 3, and this very process named.
    boot = ("import os, sys\n"
            "fd = int(sys.argv[1])\n"
            "if fd >= 0 and fd != 3:\n    os.dup2(fd, 3); os.close(fd)\n"
            "if fd >= 0:\n    os.environ['LISTEN_FDS'] = '1'\n"
            "    os.environ['LISTEN_PID'] = sys.argv[2] or str(os.getpid())\n"
            "os.execv(sys.executable, [sys.executable, '-I', '-S', sys.argv[3], sys.argv[4]])\n")
    fd = str(handed.fileno()) if handed is not None else "-1"
    return subprocess.Popen([sys.executable, "-c", boot, fd, listen_pid or "", RESPONDER, argv_address],
                            env=env, pass_fds=pass_fds)


def test_a_socket_activated_responder_answers_on_the_socket_systemd_hands_it():
    handed = socket.create_server(("127.0.0.1", 0), backlog=16)
    port, own = handed.getsockname()[1], _free_port()
    proc = _start(f"127.0.0.1:{own}", handed, None)
    try:
        handed.close()  # the responder's copy alone listens now
        answer = _get(port, "/pad/3000")
        assert answer.startswith(b"HTTP/1.1 204 No Content\r\n") and len(answer) >= 3000
        assert _get(port, "/nothing").startswith(b"HTTP/1.1 404")
        assert not _listening(own)  # handed a socket, it does not listen on the address of its command line
    finally:
        proc.kill()
        proc.wait(10)


def test_a_responder_started_without_its_socket_listens_itself():
    own = _free_port()
    proc = _start(f"127.0.0.1:{own}", None, None)
    try:
        assert _get(own, "/pad/10").startswith(b"HTTP/1.1 204")
    finally:
        proc.kill()
        proc.wait(10)


def test_sockets_meant_for_another_process_are_not_taken():
    # LISTEN_PID names another process (the variables leaked from a parent): the responder listens itself.
    handed = socket.create_server(("127.0.0.1", 0), backlog=16)
    own = _free_port()
    proc = _start(f"127.0.0.1:{own}", handed, "1")
    try:
        assert _get(own, "/pad/10").startswith(b"HTTP/1.1 204")
    finally:
        handed.close()
        proc.kill()
        proc.wait(10)
