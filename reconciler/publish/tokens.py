"""Subscription tokens: each user's token, derived from the master secret, and the index a live request's token is
looked up in."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from reconciler.credentials import TOKEN_CHARS, Secret, UserCredentials, user_credentials, user_token
from reconciler.model import Cluster


class Tokens:
    """Subscription token ↔ user, derived from the master secret; credentials cached per user and rotation."""

    def __init__(self, secret: Secret, shadowsocks: bool = True):
        self.secret = secret
        self.shadowsocks = shadowsocks  # False only where no document can hold a Shadowsocks key
        self._by_user: dict[tuple[str, int], UserCredentials] = {}
        self._index = TokenIndex((), ())
        self._cluster_id: int | None = None

    def credentials(self, user: str, rotate: int) -> UserCredentials:
        key = (user, rotate)
        creds = self._by_user.get(key)
        if creds is None:
            creds = self._by_user[key] = user_credentials(self.secret, user, rotate, self.shadowsocks)
        return creds

    def token(self, user: str, rotate: int) -> str:
        creds = self._by_user.get((user, rotate))
        return creds.token if creds is not None else user_token(self.secret, user, rotate)

    def index(self, cluster: Cluster) -> TokenIndex:
        """token → user name for the cluster's users (rebuilt when the cluster changes; one HMAC per user)."""
        if self._cluster_id != id(cluster):
            self._index = TokenIndex((self.token(u.name, u.rotate) for u in cluster.users), cluster.roster.names)
            self._cluster_id = id(cluster)
        return self._index


class TokenIndex:
    """Subscription token → user name, as a sorted array of the tokens (a dict of a million was ~190 MB)."""

    WIDTH = TOKEN_CHARS  # 192 bits in URL-safe base64

    def __init__(self, tokens: Iterable[str], names: tuple[str, ...]) -> None:
        raw = np.zeros(len(names), f"S{self.WIDTH}")
        for i, token in enumerate(tokens):  # filled one by one: a million tokens as a list first were ~130 MB more
            raw[i] = token.encode()
        order = np.argsort(raw, kind="stable")
        self._tokens, self._users, self._names = raw[order], order.astype(np.int64), names

    def get(self, token: str) -> str | None:
        """The user whose token this is; None for any other text (a request's path: hostile)."""
        key = token.encode(errors="replace")
        if len(key) != self.WIDTH or not len(self._tokens):
            return None
        i = int(np.searchsorted(self._tokens, key))
        if i < len(self._tokens) and self._tokens[i] == key:
            return self._names[int(self._users[i])]
        return None

    def __len__(self) -> int:
        return len(self._tokens)
