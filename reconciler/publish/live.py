"""The live answers' cache: what the HTTP endpoint serves from, the same documents the files hold."""

from __future__ import annotations

from reconciler.balance import Snapshot, decide
from reconciler.credentials import Secret
from reconciler.gcpause import freeze_survivors, thaw_and_collect
from reconciler.publish.tokens import Tokens
from reconciler.subscriptions import Document, render
from reconciler.subscriptions.document import left_out, render_formats


class LiveAnswers:
    """Per-snapshot cache of rendered documents for the HTTP endpoint (same function as the files)."""

    FREEZE_EVERY = 2000  # newly cached documents between two freezes (see ``answer``)

    def __init__(self, secret: Secret, tokens: Tokens):
        self.secret = secret
        self.tokens = tokens
        self.snapshot: Snapshot | None = None
        self._cache: dict[tuple[str, str, str | None], Document] = {}
        self._published = 0
        self._fresh = 0  # documents cached since the last freeze

    def publish(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._cache = {}
        self.tokens.index(snapshot.cluster)
        if snapshot.cluster.users:  # the snapshot's shared memos (user keys, assignment counts, placements): not on a request
            decide(snapshot, snapshot.cluster.users[0].name)
        self._published += 1
        # A snapshot of many users is millions of long-lived objects; the cyclic GC would walk all of them
        # in every full collection (~100 ms pauses under load). Freezing moves what exists now out of its
        # sight; the old snapshot is still freed by reference counting. Now and then a real collection
        # clears any cycles that were frozen with it.
        if self._published % 100 == 0:
            thaw_and_collect()
        freeze_survivors(collect_young=False)

    @property
    def published(self) -> int:
        """How many snapshots this cache has been given (a listener's kept answers are good for one)."""
        return self._published

    def user_of(self, token: str) -> str | None:
        if self.snapshot is None:
            return None
        return self.tokens.index(self.snapshot.cluster).get(token)

    def left_out(self, user: str) -> dict[str, list[str]]:
        """Format → the user's entries it cannot carry (the page explains them beside that format's QR code)."""
        snapshot = self.snapshot
        assert snapshot is not None
        entries = decide(snapshot, user)
        return {fmt: names for fmt in ("sing-box", "clash", "links")
                if (names := left_out(snapshot, entries, fmt, self.secret))}

    def answer(self, user: str, fmt: str, region: str | None = None) -> Document:
        snapshot = self.snapshot
        assert snapshot is not None
        key = (user, fmt, region)
        doc = self._cache.get(key)
        if doc is None:
            try:
                rotate = snapshot.cluster.user(user).rotate
            except KeyError:
                return render(snapshot, user, fmt, self.secret, region=region)
            creds = self.tokens.credentials(user, rotate)  # derived on the user's first request, then kept
            doc = self._cache[key] = render_formats(snapshot, user, (fmt,), self.secret, region, credentials=creds)[fmt]
            self._fresh += 1
            if self._fresh >= self.FREEZE_EVERY:
                # The cache lives as long as the snapshot, as the snapshot does: out of the cyclic GC's sight too.
                # Left in it, 100k users' documents made every full collection a ~200 ms pause under load (p99
                # 180 ms at 100k users against 1.6 ms without one). The young generations are collected first
                # so that little garbage is frozen with them (``publish`` clears it every 100 snapshots).
                self._fresh = 0
                freeze_survivors()
        return doc
