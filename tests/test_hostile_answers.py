"""SSH answers are hostile input: a server that answers garbage (or a bug that raises on one server)
is that server's error in the plan or its failed result in apply; the other servers are planned and
applied as if nothing happened. Fake hosts run the real scripts; one server's answers are replaced."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from reconciler.engine.singbox import LAYOUT
from reconciler.ssh import Result, Target
from reconciler.ssh.fake import FakeRunner
from reconciler.ssh.runner import Script
from tests.test_fakehost import apply, cluster, plan

SERVICE = LAYOUT.service


class Hostile(FakeRunner):
    """A fake fleet where server ``b`` answers ``answer`` to the script ``script`` (or raises ``raises``)."""

    def __init__(self, base, script: str, answer: str = "", raises: BaseException | None = None):  # type: ignore[no-untyped-def]
        super().__init__(base)
        self.target_script, self.answer, self.raises = script, answer, raises

    async def script(self, target: Target, script: Script, request: Mapping[str, Any], **kw: Any) -> Result:
        if target.name == "b" and script.name == self.target_script:
            if self.raises is not None:
                raise self.raises
            return Result(0, self.answer, "")
        return await super().script(target, script, request, **kw)


GARBAGE = {
    "not JSON": "hello there",
    "a list": "[1, 2]",
    "nothing": "",
    "deep nesting": "[" * 50_000 + "]" * 50_000,
    "wrong types": '{"arch": 5, "files": [], "systemd": "yes"}',
    "a path map of numbers": '{"files": {"/etc/x": 5}}',
    "another script's answer": '{"ok": "{0}"}',
}


@pytest.mark.parametrize("answer", GARBAGE.values(), ids=GARBAGE.keys())
def test_a_garbage_facts_answer_is_that_servers_plan_error(tmp_path, answer):
    runner = Hostile(tmp_path / "hosts", "facts", answer)
    observed = plan(cluster(tmp_path, servers=("a", "b")), runner)
    a, b = observed
    assert not a.plan.error and a.plan.actions  # a is planned as usual
    assert "b" in b.plan.error and "facts" in b.plan.error and not b.plan.actions, b.plan.error


@pytest.mark.parametrize("answer", [GARBAGE["not JSON"], GARBAGE["a list"], '{"ok": "yes"}', '{"ok": false}'])
def test_a_garbage_commit_answer_fails_that_server_and_the_others_apply(tmp_path, answer):
    runner = Hostile(tmp_path / "hosts", "commit", answer)
    c = cluster(tmp_path, servers=("a", "b"))
    results = apply(plan(c, runner), runner)
    assert [(r.server, r.ok) for r in results] == [("a", True), ("b", False)], [r.message for r in results]
    assert runner.host("a").unit(SERVICE)["active"] == "active"
    assert "Traceback" not in results[1].message and results[1].message


def test_an_unexpected_exception_on_one_server_is_its_result_alone(tmp_path):
    runner = Hostile(tmp_path / "hosts", "commit", raises=ZeroDivisionError("a bug"))
    results = apply(plan(cluster(tmp_path, servers=("a", "b")), runner), runner)
    assert [(r.server, r.ok) for r in results] == [("a", True), ("b", False)]
    assert "unexpected error: ZeroDivisionError" in results[1].message and "other servers" in results[1].message


def test_an_unexpected_exception_while_observing_is_that_servers_plan_error(tmp_path):
    runner = Hostile(tmp_path / "hosts", "facts", raises=KeyError("boom"))
    a, b = plan(cluster(tmp_path, servers=("a", "b")), runner)
    assert a.plan.actions and "unexpected error: KeyError" in b.plan.error


@pytest.mark.parametrize("record", [{"name": 5, "host": "192.0.2.9"}, {"host": "192.0.2.9"}, "a string",
                                    {"name": "ghost", "host": "192.0.2.9", "port": "22"}, {"name": "g", "host": 7}])
def test_a_hostile_record_of_a_removed_server_is_skipped_not_trusted(tmp_path, record):
    runner = FakeRunner(tmp_path / "hosts")
    observed = asyncio.run(_observe_with_previous(tmp_path, runner, {"ghost": record}))
    assert [o.plan.server for o in observed] == ["a"]


async def _observe_with_previous(tmp_path, runner, previous):  # type: ignore[no-untyped-def]
    from reconciler.plan.observe import observe
    from tests.test_fakehost import NOW, SECRET

    return await observe(cluster(tmp_path), SECRET, runner, ".", True, previous, NOW)
