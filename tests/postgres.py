"""A real PostgreSQL for the tests: Debian's server binaries, a fresh cluster in a temporary folder, listening on a
loopback port only, started by ``start`` and stopped by its PID (``stop``), its folder removed. PostgreSQL refuses to
run as root, so under root it runs as the ``postgres`` user the Debian package creates. Needs the postgresql package
(`make setup` installs it)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from reconciler.lab.demo import free_port

BIN = max(glob.glob("/usr/lib/postgresql/*/bin"), default=None, key=lambda p: int(p.split("/")[-2]))
USER = "reconciler"
DEADLINE = 30.0


def users_in_database(text: str) -> str:
    """A cluster file's text with its users moved out: no `users:` list, ``settings.users.source: postgres``."""
    head = text.split("\nusers:\n")[0] + "\n"
    return head.replace("settings:\n", "settings:\n  users: {source: postgres}\n", 1)


class Postgres:
    def __init__(self) -> None:
        assert BIN is not None, "no PostgreSQL server binaries under /usr/lib/postgresql"
        self.folder = Path(tempfile.mkdtemp(prefix="reconciler-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.prefix: list[str] = []
        self._log: int | None = None  # the server's log file, opened at the first start
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
            self.prefix = ["setpriv", f"--reuid={owner.pw_uid}", f"--regid={owner.pw_gid}", "--init-groups"]

    def dsn(self, database: str = "vpn", password: str | None = None) -> str:
        secret = f":{password}" if password else ""
        return f"postgresql://{USER}{secret}@127.0.0.1:{self.port}/{database}"

    def start(self) -> Postgres:
        init = subprocess.run([*self.prefix, f"{BIN}/initdb", "-D", str(self.folder / "data"), "-U", USER, "--auth=trust",
                               "-E", "UTF8", "--no-sync"], capture_output=True, text=True, timeout=120)
        assert init.returncode == 0, init.stderr[-2000:]
        self._launch()
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute("CREATE DATABASE vpn")
        return self

    def start_again(self) -> None:
        """The same cluster started after ``stop`` (a database back from an outage)."""
        assert self.proc is None
        self._launch()

    def _launch(self) -> None:
        """The server on its folder's data, its log a file (never a pipe nobody reads: a full pipe would stall it);
        returns once it answers."""
        if self._log is None:
            self._log = os.open(self.folder / "postgres.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.proc = subprocess.Popen([*self.prefix, f"{BIN}/postgres", "-D", str(self.folder / "data"), "-p", str(self.port),
                                      "-k", str(self.folder), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                                      "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
                                     stdout=subprocess.DEVNULL, stderr=self._log, start_new_session=True)
        end = time.monotonic() + DEADLINE
        while True:
            try:
                psycopg.connect(self.dsn("postgres"), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                assert self.proc.poll() is None, (self.folder / "postgres.log").read_text(errors="replace")[-2000:]
                assert time.monotonic() < end, "PostgreSQL did not start"
                time.sleep(0.2)

    def stop(self) -> None:
        """Stop it by its PID (a fast shutdown, then a kill); keep the folder for ``start_again``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(DEADLINE)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            os.close(self._log)
        shutil.rmtree(self.folder, ignore_errors=True)
