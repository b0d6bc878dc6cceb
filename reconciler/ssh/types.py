"""What a runner talks about, whichever it is: where a server is (``Target``) and what a command answered
(``Result``). The interface (``ssh.runner``), the real runner (``ssh.pool``) and the fake one share them, so the
interface never imports the implementation."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """Where and how to reach one server."""

    name: str
    host: str
    port: int = 22
    user: str = "root"
    identity: str | None = None
    host_key: str | None = None  # pinned in the cluster file

    @classmethod
    def from_record(cls, info: Any) -> Target | None:
        """A target from the state folder's record of a managed server; None when the record is not one
        (the state folder is untrusted input: a hand-edited or corrupt record is skipped, not trusted)."""
        if not isinstance(info, dict):
            return None
        fields: dict[str, Any] = {k: info.get(k) for k in ("name", "host", "port", "user", "identity", "host_key") if k in info}
        text = ("name", "host", "user")
        if (not all(isinstance(fields.get(k), str) for k in text if k in fields) or "name" not in fields
                or "host" not in fields or not isinstance(fields.get("port", 22), int)
                or not all(fields.get(k) is None or isinstance(fields[k], str) for k in ("identity", "host_key"))):
            return None
        return cls(**fields)

    @classmethod
    def from_server(cls, server: object) -> Target:
        ssh = server.ssh  # type: ignore[attr-defined]
        return cls(name=server.name, host=server.host, port=ssh.port, user=ssh.user,  # type: ignore[attr-defined]
                   identity=os.path.expanduser(ssh.identity) if ssh.identity else None, host_key=ssh.host_key)


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str
