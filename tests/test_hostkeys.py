"""Host keys (issue 13): first contact is warned about or refused, and ``reconciler hostkeys pin`` writes the keys
real SSH servers present into the cluster file in place, comments kept.

The SSH servers are real: asyncssh's own server on 127.0.0.1 (in a thread with its own event loop), with keys
generated here — the client side is the very code that reaches production servers.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import asyncssh
import pytest

from reconciler.config import load_cluster
from reconciler.errors import ConnectError, HostKeyChanged, RemoteError
from reconciler.ssh import KnownHosts, SSHPool, Target
from reconciler.ssh.fake import FakeRunner
from reconciler.ssh.pool import IDLE_KEEPALIVE_S, KEEPALIVE_S, openssh_line


class _NoAuth(asyncssh.SSHServer):
    def begin_auth(self, username: str) -> bool:
        return False  # anyone may log in: these servers only show their host keys


class SSHServers:
    """Real SSH servers on 127.0.0.1, one per key list, served by an event loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[asyncssh.SSHAcceptor] = []

    def start(self, *keys: asyncssh.SSHKey, process_factory: object = None) -> int:
        async def listen() -> asyncssh.SSHAcceptor:
            return await asyncssh.create_server(_NoAuth, "127.0.0.1", 0, server_host_keys=list(keys),
                                                process_factory=process_factory, encoding=None)

        server = asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)
        self.servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    def close(self) -> None:
        async def stop() -> None:
            for server in self.servers:
                server.close()
                await server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def ssh_servers() -> Iterator[SSHServers]:
    servers = SSHServers()
    yield servers
    servers.close()


INBOUND = '[{{id: {id}-ss, name: S, protocol: shadowsocks-2022, port: 8388, route: r}}]'
CLUSTER = """\
# The fleet. Every comment and blank line here must survive pinning.
servers:
  - name: flow        # ssh as a flow mapping
    host: 127.0.0.1
    ssh: {{user: root, port: {flow_port}}}   # keep me
    country: DE
    inbounds: {flow_inbounds}

  - name: block
    host: 127.0.0.1
    country: DE
    ssh:
      user: root
      port: {block_port}   # block style
    inbounds: {block_inbounds}
  - name: remembered  # no ssh mapping at all; its key is in the state folder
    host: 192.0.2.9
    country: DE
    inbounds: {remembered_inbounds}
  - name: pinned
    host: 192.0.2.10
    country: DE
    ssh: {{host_key: "{pinned_key}"}}
    inbounds: {pinned_inbounds}

routes:
  - {{id: r, name: R}}   # the only route
users:
  - name: alice
"""


def key_line(kind: str = "ssh-ed25519") -> tuple[asyncssh.SSHKey, str]:
    key = asyncssh.generate_private_key(kind)
    return key, openssh_line(key)


def test_pin_writes_the_presented_and_remembered_keys_in_place(cli, tmp_path, ssh_servers):
    # Issue 13 — pinning: a key exchange with each real server (no login), remembered keys used as they are
    rsa, rsa_line = key_line("ssh-rsa")
    ed, ed_line = key_line()
    ecdsa, ecdsa_line = key_line("ecdsa-sha2-nistp256")
    _, remembered_line = key_line()
    _, pinned_line = key_line()
    flow_port = ssh_servers.start(rsa, ed)  # offers two: the ed25519 key is the one pinned, as OpenSSH prefers
    block_port = ssh_servers.start(ecdsa)
    text = CLUSTER.format(flow_port=flow_port, block_port=block_port, pinned_key=pinned_line,
                          **{f"{n}_inbounds": INBOUND.format(id=n) for n in ("flow", "block", "remembered", "pinned")})
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    state = tmp_path / ".reconciler"
    state.mkdir()
    (state / "known_hosts.json").write_text(json.dumps({"192.0.2.9:22": remembered_line}))

    run = cli("hostkeys", "pin", "-f", str(path))
    assert run.rc == 0, run.text
    cluster = load_cluster(str(path)).cluster
    assert {s.name: s.ssh.host_key for s in cluster.servers} == {
        "flow": ed_line, "block": ecdsa_line, "remembered": remembered_line, "pinned": pinned_line}
    after = path.read_text()
    added = [line for line in after.splitlines() if line not in text.splitlines()]
    assert len(added) == 3 and all("host_key" in line for line in added), added  # the rest, byte for byte
    assert [line for line in text.splitlines() if line not in after.splitlines()] == [
        f"    ssh: {{user: root, port: {flow_port}}}   # keep me"]  # the flow mapping's line gained the key
    assert f'    ssh: {{user: root, port: {flow_port}, host_key: "{ed_line}"}}   # keep me' in after
    assert f'      port: {block_port}   # block style\n      host_key: "{ecdsa_line}"\n' in after
    assert f'  - name: remembered  # no ssh mapping at all; its key is in the state folder\n    ssh: {{host_key: "{remembered_line}"}}\n' in after
    assert "pinned: already pinned" in run.out and "flow: pinned in" in run.out
    assert "SHA256:" in run.err and ed.get_fingerprint("sha256") in run.err  # to compare with ssh-keygen -l
    known = json.loads((state / "known_hosts.json").read_text())
    assert known[f"127.0.0.1:{flow_port}"] == ed_line and known[f"127.0.0.1:{block_port}"] == ecdsa_line

    again = cli("hostkeys", "pin", "-f", str(path), "--server", "flow")
    assert again.rc == 0 and "flow: already pinned" in again.out and path.read_text() == after
    assert cli("hostkeys", "pin", "-f", str(path), "--server", "nope").rc == 1


def test_the_pinned_key_is_the_one_the_pool_then_demands(tmp_path, ssh_servers):
    # The pool connects to the real server with the pinned key, refuses a different one, and under
    # --strict-host-keys refuses a server with no key before any packet is sent
    ed, ed_line = key_line()
    _, other_line = key_line()
    port = ssh_servers.start(ed)

    async def connect(target: Target, strict: bool = False) -> None:
        async with SSHPool(KnownHosts(tmp_path / "known.json"), retries=0, strict_host_keys=strict) as pool:
            await pool.connection(target)

    asyncio.run(connect(Target("s", "127.0.0.1", port, host_key=ed_line)))
    with pytest.raises(HostKeyChanged):
        asyncio.run(connect(Target("s", "127.0.0.1", port, host_key=other_line)))
    with pytest.raises(RemoteError, match="--strict-host-keys is set; pin it with `reconciler hostkeys pin --server s`") as err:
        asyncio.run(connect(Target("s", "127.0.0.1", port), strict=True))
    assert not err.value.temporary and not (tmp_path / "known.json").exists()


def test_a_server_that_cannot_be_reached_is_not_pinned_and_the_others_are(cli, tmp_path, ssh_servers):
    ed, ed_line = key_line()
    port = ssh_servers.start(ed)
    closed = ssh_servers.start(key_line()[0])
    ssh_servers.servers[-1].close()  # a port nothing answers on any more
    text = CLUSTER.format(flow_port=port, block_port=closed, pinned_key=key_line()[1],
                          **{f"{n}_inbounds": INBOUND.format(id=n) for n in ("flow", "block", "remembered", "pinned")})
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    run = cli("hostkeys", "pin", "-f", str(path), "--server", "flow", "--server", "block", "--timeout", "5")
    assert run.rc == 1 and "block: not pinned — block (127.0.0.1:" in run.err and "flow: pinned in" in run.out, run.text
    assert {s.name: s.ssh.host_key for s in load_cluster(str(path)).cluster.servers}["flow"] == ed_line


# --------------------------------------------------------------------------- plan warns, or refuses



def test_plan_warns_of_first_contact_and_strict_refuses_only_those_servers(cli, tmp_path, monkeypatch):
    # Issue 13 — a server with neither a pinned nor a remembered key: plan warns; --strict-host-keys does not
    # connect to it (its plan says why) and plans the others
    from tests.test_leaks import new_certificates, write_cluster

    monkeypatch.setenv("RECONCILER_SECRET", "hostkeys-test-Secret-7Qm2xV9pLs")
    runner = FakeRunner(tmp_path / "hosts")
    monkeypatch.setattr("reconciler.apply.session.pool_for", lambda state, **kw: runner)
    new_certificates(tmp_path)
    path = str(write_cluster(tmp_path))
    state = tmp_path / ".reconciler"
    state.mkdir()
    (state / "known_hosts.json").write_text(json.dumps({"192.0.2.1:22": key_line()[1]}))  # a is known, b is not

    run = cli("plan", "-f", path)
    assert run.rc == 2, run.text
    assert "warning: first contact with b (192.0.2.2:22) will trust whatever key it presents" in run.err
    assert "first contact with a" not in run.err
    runner.calls.clear()
    run = cli("plan", "-f", path, "--strict-host-keys", "--json")
    assert run.rc == 1, run.text
    plans = {p["server"]: p for p in json.loads(run.out)["servers"]}
    assert "not connecting — no host key is pinned (ssh.host_key) or remembered" in plans["b"]["error"]
    assert plans["a"]["actions"] and not plans["a"]["error"]
    assert {server for server, _, _ in runner.calls} == {"a"}  # b was never contacted
    assert "first contact" not in run.err
    run = cli("apply", "-f", path, "--strict-host-keys")
    assert run.rc == 1 and "ok   a" in run.out and "FAIL b" in run.out and "--strict-host-keys" in run.out, run.text


def test_pin_and_secret_commands_are_registered(cli):
    assert cli("hostkeys").rc == 1 and cli("secret").rc == 1  # a group without its action prints its help


async def _commands(process: asyncssh.SSHServerProcess) -> None:
    """A server's answers to the pool's sessions: echo stdin (and a line on stderr, and an exit code), bytes that
    are not UTF-8, or a command that never ends."""
    command = process.command or ""
    if command == "hang":
        await asyncio.sleep(3600)
    elif command == "garbage":
        process.stdout.write(b"ok \xff\xfe\n")
        process.exit(0)
    else:
        data = await process.stdin.read()
        process.stdout.write(data)
        process.stderr.write(b"said on stderr\n")
        process.exit(int(command.split()[-1]))


def test_a_pooled_session_carries_input_output_and_exit_and_a_hung_one_costs_only_its_connection(tmp_path, ssh_servers):
    # The pool's sessions (reconciler.ssh.pool._execute) against a real SSH server: stdin (text or bytes, large)
    # in, stdout and stderr apart, the exit code; output that is not UTF-8 is replaced, never an exception. A
    # session past its timeout drops its connection from the pool (the next run connects afresh), and the dropped
    # connection is closed once its last session is over (a slower one on it still finishes), never left open.
    ed, ed_line = key_line()
    port = ssh_servers.start(ed, process_factory=_commands)
    target = Target("s", "127.0.0.1", port, host_key=ed_line)

    async def scenario() -> None:
        async with SSHPool(KnownHosts(tmp_path / "known.json"), retries=0) as pool:
            res = await pool.run(target, "echo 3", check=False, input="héllo\n")
            assert (res.code, res.stdout, res.stderr) == (3, "héllo\n", "said on stderr\n")
            big = bytes(range(256)) * 8192  # 2 MB: more than any window
            res = await pool.run(target, "echo 0", input=big)
            assert res.stdout == big.decode(errors="replace")
            assert (await pool.run(target, "garbage")).stdout == "ok \ufffd\ufffd\n"
            first = await pool.connection(target)
            # keepalives: after 5 s of silence while a session runs (a cut is found mid-step), after 2 minutes idle
            # (asyncssh has no getter for the interval: its attribute is read)
            assert first._keepalive_interval == IDLE_KEEPALIVE_S
            slow = asyncio.ensure_future(pool.run(target, "hang", timeout=1.5))
            await asyncio.sleep(0.1)
            assert first._keepalive_interval == KEEPALIVE_S
            with pytest.raises(ConnectError, match="connection lost while running a command"):
                await pool.run(target, "hang", timeout=0.3)
            assert not first.is_closed()  # the slower session on it is still running
            with pytest.raises(ConnectError):
                await slow
            assert first.is_closed()  # dropped, and its last session over: closed
            again = await pool.connection(target)
            assert again is not first and (await pool.run(target, "echo 0", input="x")).stdout == "x"

    asyncio.run(scenario())
