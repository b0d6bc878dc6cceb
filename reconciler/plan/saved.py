"""Saved plans: what ``reconciler plan --out FILE`` writes and ``reconciler apply FILE`` carries out.

A saved plan is the JSON of ``render_json`` (``fingerprint``, ``summary``, ``servers``: each server's
actions and the digests of the desired state and the facts it was computed from) plus the cluster
file it was computed for (``file``, absolute) and the removed servers it keeps (``keep``; ``prune`` is always true).

Applying one observes the servers again and carries out the fresh plan only if nothing changed since
(pyinfra's v3 lesson: check facts at execution time): ``check_fresh`` raises ``StalePlan`` naming every
server whose desired or facts digest differs, or that appeared or left. Unreadable or invalid files
raise ``ConfigError`` with the reason (never a traceback).

    save_plan(path, plans, fingerprint, cluster_file, keep)    written through state.files.write_atomic
    load_plan(path) -> SavedPlan
    check_fresh(saved, observed)                                 raises StalePlan(servers)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reconciler.errors import ConfigError, StalePlan
from reconciler.plan.actions import ServerPlan, render_json
from reconciler.plan.observe import Observed, fingerprint
from reconciler.state.files import write_atomic


@dataclass(frozen=True)
class SavedPlan:
    """A saved plan as read back: what apply needs to check it and what it was computed for."""

    fingerprint: str
    cluster_file: str  # absolute path of the cluster file it was computed from
    prune: bool  # always true (GITOPS-7: what left the file is removed)
    keep: tuple[str, ...]  # servers that left the file and were kept this time (`--keep`)
    digests: dict[str, tuple[str, str]]  # server → (desired digest, facts digest)
    document: dict[str, Any]  # the whole file, as saved (actions, summary, ...)


def plan_document(plans: list[ServerPlan], fp: str, cluster_file: str | Path, keep: Sequence[str] = ()) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(render_json(plans, fp))
    doc["file"] = str(Path(cluster_file).resolve())
    doc["prune"] = True
    doc["keep"] = sorted(set(keep))
    return doc


def save_plan(path: str | Path, plans: list[ServerPlan], fingerprint: str, cluster_file: str | Path,
              keep: Sequence[str] = ()) -> None:
    """Write the plan to ``path`` atomically (0644: it holds no secrets — its diffs show fingerprints in their
    place, ``reconciler.plan.actions``; tests/test_leaks.py checks)."""
    doc = plan_document(plans, fingerprint, cluster_file, keep)
    write_atomic(path, (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode(), 0o644)


def load_plan(path: str | Path) -> SavedPlan:
    """The saved plan at ``path``; ``ConfigError`` saying why when it cannot be read or is not one."""
    where = f"the saved plan {path}"
    try:
        doc = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ConfigError(f"{where} is not JSON ({exc}); save it again with `reconciler plan --out`") from exc
    problem = _problem(doc)
    if problem:
        raise ConfigError(f"{where} is not a saved plan: {problem}; save it again with `reconciler plan --out`")
    return SavedPlan(fingerprint=doc["fingerprint"], cluster_file=doc["file"], prune=doc["prune"],
                     keep=tuple(doc.get("keep") or ()),
                     digests={s["server"]: (s["desired_digest"], s["facts_digest"]) for s in doc["servers"]}, document=doc)


def _problem(doc: object) -> str:
    if not isinstance(doc, dict):
        return "not a JSON object"
    for key, kind in (("fingerprint", str), ("file", str), ("prune", bool), ("servers", list)):
        if not isinstance(doc.get(key), kind):
            return f"`{key}` is missing or not a {kind.__name__}"
    keep = doc.get("keep", [])
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        return "`keep` is not a list of server names"
    for i, s in enumerate(doc["servers"]):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("server", "desired_digest", "facts_digest")):
            return f"servers[{i}] lacks its server name or digests"
    return ""


def stale_servers(saved: SavedPlan, observed: list[Observed]) -> list[str]:
    """Servers whose desired state or facts changed since the plan was saved, or that appeared or left."""
    if saved.fingerprint == fingerprint(observed):
        return []
    now = {o.plan.server: (o.plan.desired_digest, o.plan.facts_digest) for o in observed}
    changed = [name for name, digests in now.items() if saved.digests.get(name) != digests]
    return changed + sorted(set(saved.digests) - set(now))


def check_fresh(saved: SavedPlan, observed: list[Observed]) -> None:
    """Nothing when the plan still holds; else ``StalePlan`` naming the servers that changed."""
    if saved.fingerprint != fingerprint(observed):
        raise StalePlan(stale_servers(saved, observed))


def plans_of(saved: SavedPlan) -> list[ServerPlan]:
    """A saved plan's server plans, as ``render_human`` prints them (``reconciler show``)."""
    from reconciler.plan.actions import Action

    out = []
    for doc in saved.document["servers"]:
        actions = [Action(str(a.get("sign", "")), str(a.get("kind", "")), str(a.get("target", "")), str(a.get("reason", "")),
                          str(a.get("diff", ""))) for a in doc.get("actions") or [] if isinstance(a, dict)]
        out.append(ServerPlan(doc["server"], str(doc.get("host", "")), actions, [str(x) for x in doc.get("problems") or []],
                              str(doc.get("error", "")), removed=bool(doc.get("removed"))))
    return out
