"""One pure function from (snapshot, user, format) to a subscription document and its headers.

Both outlets — files for every user and the live ``/sub/<token>`` endpoint —
call ``render``; for the same snapshot they return the same bytes.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property

from reconciler.balance.decide import Entry, decide
from reconciler.balance.snapshot import Snapshot
from reconciler.credentials import Secret, UserCredentials, user_credentials
from reconciler.model import User
from reconciler.subscriptions.formats import FORMATS, clash, links, singbox
from reconciler.subscriptions.outbound import client_outbound

CONTENT_TYPES = {"links": "text/plain; charset=utf-8", "sing-box": "application/json; charset=utf-8",
                 "clash": "text/yaml; charset=utf-8"}
EXTENSIONS = {"links": "txt", "sing-box": "json", "clash": "yaml"}
_SINGBOX_AGENTS = re.compile(r"sing-?box|\bSF[AIMT]\b|hiddify", re.I)
_CLASH_AGENTS = re.compile(r"clash|mihomo|stash|flclash", re.I)


@dataclass(frozen=True)
class Document:
    body: bytes
    headers: dict[str, str]
    entries: list[Entry] = field(default_factory=list)

    @cached_property  # asked on every live request (If-None-Match): hash the body once
    def etag(self) -> str:
        return '"' + hashlib.sha256(self.body).hexdigest()[:32] + '"'


def choose_format(requested: str | None, user_agent: str | None) -> str:
    """An explicit format (path or query) wins; else the User-Agent decides; else share links."""
    if requested:
        if requested not in FORMATS:
            raise ValueError(f"unknown format {requested!r}; use one of {', '.join(FORMATS)}")
        return requested
    agent = user_agent or ""
    if _SINGBOX_AGENTS.search(agent):
        return "sing-box"
    if _CLASH_AGENTS.search(agent):
        return "clash"
    return "links"


def _header_base(snapshot: Snapshot, fmt: str) -> dict[str, str]:
    """The headers of ``fmt`` that do not depend on the user, built once per snapshot (the file outlet
    asks for 300,000 documents' headers); ``subscription-userinfo`` is left empty."""
    memo = snapshot.memo.header_bases
    base = memo.get(fmt)
    if base is None:
        out = snapshot.cluster.settings.outputs
        title = out.profile_title
        ascii_name = re.sub(r"[^A-Za-z0-9._-]+", "_", title).strip("_") or "subscription"
        base = memo[fmt] = {
            "content-type": CONTENT_TYPES[fmt],
            "subscription-userinfo": "",
            "profile-update-interval": str(max(1, round(out.profile_update_interval / 3600))),
            "profile-title": "base64:" + base64.b64encode(title.encode()).decode(),
            "content-disposition": f'attachment; filename="{ascii_name}.{EXTENSIONS[fmt]}"',
            "cache-control": "no-cache",
        }
    return base


def headers(snapshot: Snapshot, user_name: str, fmt: str, user: User | None = None) -> dict[str, str]:
    """The response headers of a user's document (its ETag is added with the body)."""
    u = user if user is not None else snapshot.cluster.user(user_name)
    result = dict(_header_base(snapshot, fmt))
    result["subscription-userinfo"] = f"upload=0; download=0; total={u.data_limit or 0}; expire={int(u.expires_at or 0)}"
    return result


def headers_json(snapshot: Snapshot, docs: dict[str, Document]) -> bytes:
    """``{format: headers}`` of one user's documents as JSON (the file outlet's ``headers.json``). The
    user-independent part is encoded once per snapshot: the C encoder took 22 µs per user."""
    memo = snapshot.memo.header_json_heads
    parts = []
    for fmt, doc in docs.items():
        head = memo.get(fmt)
        if head is None:
            fixed = {k: v for k, v in _header_base(snapshot, fmt).items() if k != "subscription-userinfo"}
            head = memo[fmt] = json.dumps(fmt, ensure_ascii=False) + ": " + json.dumps(fixed, ensure_ascii=False)[:-1]
        parts.append(f'{head}, "subscription-userinfo": {json.dumps(doc.headers["subscription-userinfo"])}, '
                     f'"etag": {json.dumps(doc.etag)}}}')
    return ("{" + ", ".join(parts) + "}").encode()


def render(snapshot: Snapshot, user_name: str, fmt: str, secret: Secret, region: str | None = None) -> Document:
    """The user's subscription in ``fmt``. An unknown, disabled or expired user gets an empty document."""
    return render_formats(snapshot, user_name, (fmt,), secret, region)[fmt]


# Stand-ins for a user's credentials: documents of users with the same entries differ only in these, so a
# snapshot renders each (entries, format) once and substitutes (as in an HTTP template cache). They are plain
# ASCII hex, need no escaping in JSON, YAML or URLs, and carry a tag derived from the master secret, so no
# text in the cluster file (a route or inbound name) can contain one and be replaced by a credential; being
# derived, not random, they are the same in the file outlet's worker processes.
@functools.lru_cache(maxsize=4)
def _stand_in(secret: Secret) -> UserCredentials:
    tag = secret.derive("document-stand-in", length=8).hex().upper()
    return UserCredentials(uuid=f"CREDUUID{tag}", password=f"CREDPASS{tag}", ss_key_128=f"CREDSS128{tag}",
                           ss_key_256=f"CREDSS256{tag}", token="")


def render_formats(snapshot: Snapshot, user_name: str, fmts: tuple[str, ...], secret: Secret, region: str | None = None,
                   entries: list[Entry] | None = None, credentials: UserCredentials | None = None) -> dict[str, Document]:
    """Several formats from one decision (the file outlet writes them all); ``entries``: already decided."""
    entries = decide(snapshot, user_name, region) if entries is None else entries
    try:
        user = snapshot.cluster.user(user_name)
    except KeyError:
        return {fmt: Document(b"", {"content-type": CONTENT_TYPES[fmt]}, []) for fmt in fmts}
    creds = credentials or user_credentials(secret, user.name, user.rotate)
    out = {}
    for fmt in fmts:
        if fmt == "links" and any(e.ref.inbound.protocol == "shadowsocks-2022" for e in entries):
            # SIP002 links base64 the Shadowsocks user info: no stand-in survives that, so render per user.
            body = links([client_outbound(e, snapshot, secret, creds) for e in entries])
        else:
            body = _substitute(_template(snapshot, entries, fmt, secret), _stand_in(secret), creds)
            if fmt == "links":
                body = base64.b64encode(body)
        doc = Document(body, headers(snapshot, user_name, fmt, user), entries)
        doc.headers["etag"] = doc.etag
        out[fmt] = doc
    return out


def _template(snapshot: Snapshot, entries: list[Entry], fmt: str, secret: Secret) -> bytes:
    memo = snapshot.memo.document_templates
    key = (fmt, tuple((e.name, e.ref.inbound.id) for e in entries))
    body = memo.get(key)
    if body is None:
        outbounds = [client_outbound(e, snapshot, secret, _stand_in(secret)) for e in entries]
        if fmt == "links":  # the text before base64
            body = base64.b64decode(links(outbounds))
        else:
            body = (singbox if fmt == "sing-box" else clash)(outbounds)
        memo[key] = body
    return body


def _substitute(body: bytes, stand_in: UserCredentials, creds: UserCredentials) -> bytes:
    for placeholder, real in ((stand_in.uuid, creds.uuid), (stand_in.password, creds.password),
                              (stand_in.ss_key_128, creds.ss_key_128), (stand_in.ss_key_256, creds.ss_key_256)):
        body = body.replace(placeholder.encode(), real.encode())
    return body
