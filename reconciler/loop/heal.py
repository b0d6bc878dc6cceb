"""Plan → heal: observe every server, plan, and with ``self_heal`` apply what drifted (GITOPS-5, GITOPS-7).

``Healer`` is the loop's second reconciler. ``pass_`` observes and plans every server (due ACME certificates
ordered first), records the drift, and applies what drifted under the state folder's lock and the role's fence;
without ``self_heal`` it reports the drift. One pass at a time; an interval never waits for one. Stepping down
cancels what is left of an apply (``stop_applying``): the servers finish or roll back a started commit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from reconciler.apply.acme import CERTIFICATE_BACKOFF, ensure_certificates
from reconciler.apply.run import ServerResult, apply_all
from reconciler.apply.session import Progress, recall, remember
from reconciler.backoff import Streaks
from reconciler.credentials import Secret
from reconciler.errors import LockHeld
from reconciler.loop.clock import Clock
from reconciler.metrics import LoopStats
from reconciler.model import Cluster
from reconciler.model.usage import UsageView
from reconciler.plan.lock import Fence
from reconciler.plan.observe import Observed, observe
from reconciler.plan.stamp import FactsCache
from reconciler.ssh import Runner
from reconciler.state.folder import StateFolder

log = logging.getLogger("reconciler.loop")


class Healer:
    """Observe, plan and (with ``self_heal``) apply: see the module."""

    def __init__(self, secret: Secret, state: StateFolder, base_dir: str, clock: Clock, stats: LoopStats) -> None:
        self.secret = secret
        self.state = state
        self.base_dir = base_dir
        self.clock = clock
        self.stats = stats
        self.drift: dict[str, int] = {}  # server → changes its last plan found (0: nothing to apply)
        self.acme_backoff: Streaks[str] = Streaks(CERTIFICATE_BACKOFF)  # failed orders wait longer each time
        self._busy = asyncio.Lock()  # one plan/apply at a time
        self._applying: asyncio.Future[list[ServerResult]] | None = None
        # Each server's last facts and stamp: a converged server's drift check is one short shell session.
        self.facts_cache = FactsCache()

    def applied(self) -> frozenset[str]:
        """The servers whose last plan found nothing to apply."""
        return frozenset(name for name, pending in self.drift.items() if pending == 0)

    async def pass_(self, runner: Runner, cluster: Cluster, usage: Callable[[], UsageView],
                    fence: Fence | None) -> None:
        """One pass: observe and plan every server, then apply what drifted (``self_heal``) or say it."""
        async with self._busy:
            observed = await self._observe_all(runner, cluster, usage)
            if observed is None:
                return
            pending = [o for o in observed if o.plan.changes and not (o.plan.error or o.plan.problems)]
            if not pending:
                return
            what = ", ".join(f"{o.plan.server} ({len(o.plan.actions)})" for o in pending)
            if not cluster.settings.self_heal:
                log.warning("drift: %s; self_heal is off — run `reconciler plan` and `reconciler apply`", what)
                return
            log.info("applying: %s", what)
            await self._heal(runner, cluster, pending, fence)

    def stop_applying(self) -> None:
        """This controller no longer leads: the apply in progress stops (its next steps are not its to take)."""
        if self._applying is not None and not self._applying.done():
            log.warning("stopping the apply in progress: its next steps are not this controller's to take")
            self._applying.cancel()

    async def _observe_all(self, runner: Runner, cluster: Cluster,
                           usage: Callable[[], UsageView]) -> list[Observed] | None:
        """Every server observed and planned (due ACME certificates ordered first); None (logged) when it failed."""
        started = self.clock.monotonic()
        try:
            if cluster.settings.self_heal:  # ACME certificates due for renewal are renewed before the plan
                failed = await ensure_certificates(cluster, runner, self.base_dir, backoff=self.acme_backoff)
                for inbound, why in failed.items():
                    log.warning("no certificate for inbound %s: %s", inbound, why)
            # GITOPS-7: a server that left the file is removed like in `apply` (`retired:` keeps one)
            managed = await asyncio.to_thread(self.state.managed) if cluster.settings.self_heal else {}
            observed = await observe(cluster, self.secret, runner, self.base_dir, True, managed, usage=usage(),
                                     facts_cache=self.facts_cache)
        except Exception:  # logged with traceback; the next plan tries again
            log.exception("plan failed")
            self.stats.record("plan", False, self.clock.monotonic() - started, self.clock.time())
            return None
        errors = [o.plan for o in observed if o.plan.error or o.plan.problems]
        for p in errors:
            log.warning("plan: %s: %s", p.server, p.error or "; ".join(p.problems))
        self.stats.record("plan", not errors, self.clock.monotonic() - started, self.clock.time())
        self.drift = {o.plan.server: len(o.plan.actions) for o in observed}
        return observed

    async def _heal(self, runner: Runner, cluster: Cluster, pending: list[Observed], fence: Fence | None) -> None:
        """Apply what drifted, under the state folder's lock and the leader's fence; results recorded and told."""
        started = self.clock.monotonic()
        progress = Progress([o.plan.server for o in pending], log=lambda line: log.info("apply %s", line))
        try:
            with self.state.lock("run (self-heal)"):  # not while an `apply` from this folder runs
                await asyncio.to_thread(recall, self.state)  # (what the last `apply` learnt of the releases)
                # the leader's fence goes with it; stepping down cancels what is left of it
                self._applying = asyncio.ensure_future(apply_all(pending, runner, progress, fence=fence))
                try:
                    results = await self._applying  # adds generated public keys to `pending`
                finally:
                    self._applying = None
                await asyncio.to_thread(remember, self.state, cluster, pending, results)
        except LockHeld as exc:
            log.warning("self-heal waits for the next plan: %s", exc)
            return
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the loop stops
            log.warning("apply stopped: this controller is no longer the leader (servers finish or roll back a "
                        "started commit on their own)")
            self.stats.record("apply", False, self.clock.monotonic() - started, self.clock.time())
            return
        except Exception:
            log.exception("apply failed")
            self.stats.record("apply", False, self.clock.monotonic() - started, self.clock.time())
            return
        finally:
            progress.close()
        for r in results:
            (log.info if r.ok else log.error)("apply %s: %s", r.server, r.message)
        self.stats.record("apply", all(r.ok for r in results), self.clock.monotonic() - started, self.clock.time())
        for r in results:
            if r.ok:
                self.drift[r.server] = 0
