"""A no-op observation is one short shell session (reconciler.plan.stamp): kept facts stand while the server's stamp
does, and any change to what the facts read, or to what is desired, brings fresh facts. The fake hosts, and the real
runner's command line through a local shell; tests/lab/test_provision.py does it over SSH on real hosts."""

from __future__ import annotations

import asyncio
import os
import subprocess

from reconciler.engine import remote
from reconciler.plan.observe import facts_request, gather
from reconciler.plan.stamp import FactsCache, stamp_command
from reconciler.ssh import KnownHosts, Result, SSHPool, Target
from reconciler.ssh.runner import SAME, Unless, split_stamp
from tests.test_fakehost import (
    SECRET,
    TEMPLATE,
    cluster,
    converge,
    runner,  # noqa: F401
)


def _observe(c, fake, cache):  # type: ignore[no-untyped-def]
    from reconciler.plan.observe import observe
    from tests.test_fakehost import NOW

    return asyncio.run(observe(c, SECRET, fake, ".", True, None, NOW, facts_cache=cache))


def test_a_converged_server_is_observed_without_its_facts_script_until_something_changes(tmp_path, runner):  # noqa: F811
    # spec: GITOPS-3 — a no-op plan is still a plan: drift and new desires are seen as before
    c = converge(tmp_path, runner)
    cache = FactsCache()
    [first] = _observe(c, runner, cache)
    assert first.plan.actions == [] and cache.changed and "a" in cache.entries
    runner.calls.clear()
    [again] = _observe(c, runner, cache)
    assert [name for _, name, _ in runner.calls] == ["facts:same"] and again.plan.actions == []
    assert again.facts == first.facts
    # Drift on the server: its stamp moves, the facts script runs, the plan sees it.
    runner.host("a").path(TEMPLATE).write_text("{}")
    runner.calls.clear()
    [drift] = _observe(c, runner, cache)
    assert [name for _, name, _ in runner.calls][0] == "facts" and drift.plan.actions
    converge(tmp_path, runner, c)
    [_] = _observe(c, runner, cache)
    # A new desire (a user more): fresh facts, never kept ones, whatever the server's stamp says.
    more = cluster(tmp_path, users=("alice", "bob"))
    runner.calls.clear()
    [o] = _observe(more, runner, cache)
    assert [name for _, name, _ in runner.calls][0] == "facts" and o.plan.actions


def test_kept_facts_from_the_state_folder_are_checked_and_dropped_when_odd():
    cache = FactsCache({"a": {"key": "k", "stamp": "s", "facts": "{}"}, "b": {"key": 1}, "c": "x"})
    assert list(cache.entries) == ["a"] and cache.get("a", "k") == ("s", "{}") and cache.get("a", "other") is None
    cache.keep_only({"b"})
    assert cache.entries == {} and cache.changed


def test_the_real_runners_command_stamps_compares_and_runs_the_facts_script_only_on_change(tmp_path, monkeypatch):
    # The SSH pool's command line through a local shell in place of SSH: the stamp is printed, compared in the
    # shell, and the facts script runs only when it moved (a file rewritten, one removed, the lock taken).
    pool = SSHPool(KnownHosts(tmp_path / "known_hosts.json"))
    ran: list[str] = []

    async def run(target, command, check=True, timeout=120.0, input=None):  # type: ignore[no-untyped-def]
        ran.append(command)
        out = subprocess.run(["sh", "-c", command], input=input, capture_output=True, timeout=timeout)
        return Result(out.returncode, out.stdout.decode(), out.stderr.decode())

    monkeypatch.setattr(pool, "run", run)
    files = [tmp_path / "etc" / name for name in ("config.json", "unit.service")]
    files[0].parent.mkdir()
    for f in files:
        f.write_text("one")
    req = {**facts_request(None), "files": [str(f) for f in files], "binary": str(tmp_path / "bin" / "engine"),
           "service": "stamp-test-nothing.service", "wants": str(tmp_path / "wants"), "lock": str(tmp_path / "lock"),
           "dirs": [str(tmp_path / "etc")], "firewall": False}
    t = Target("a", "192.0.2.1")

    def ask(expected: str) -> str:
        return asyncio.run(pool.script(t, remote.FACTS, req, unless=Unless(stamp_command(req), expected))).stdout

    stamp, facts = split_stamp(ask(""))
    assert stamp is not None and str(files[0]) in stamp and '"files":' in facts
    assert ask(stamp).strip() == SAME
    changes = [lambda: files[0].write_text("two"), lambda: os.replace(files[1], files[1].with_suffix(".x")),
               lambda: (tmp_path / "lock").write_text("held"), lambda: (tmp_path / "etc" / "new").write_text("")]
    for change in changes:
        change()
        moved, facts = split_stamp(ask(stamp))
        assert moved is not None and moved != stamp and '"files":' in facts
        stamp = moved
        assert ask(stamp).strip() == SAME


def test_a_hostile_same_without_kept_facts_is_not_facts(tmp_path):
    # A server answering "=same" to an observation that kept nothing for it (its expected stamp was empty): that is
    # not facts, and nothing is kept from it.
    import pytest

    from reconciler.engine.adapters import desired
    from reconciler.errors import RemoteError
    from tests.test_fakehost import NOW

    c = cluster(tmp_path)
    d = desired(c, c.servers[0], SECRET, NOW, ".")
    asked: list[Unless | None] = []

    class Liar:
        async def script(self, target, script, request, unless=None, **kw):  # type: ignore[no-untyped-def]
            asked.append(unless)
            return Result(0, SAME + "\n", "")

    cache = FactsCache()
    with pytest.raises(RemoteError, match="not facts"):
        asyncio.run(gather(Liar(), Target("a", "192.0.2.1"), d, cache))  # type: ignore[arg-type]
    assert asked and asked[0] is not None and asked[0].expected == "" and cache.entries == {}
