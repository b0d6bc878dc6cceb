"""One pure function from (snapshot, user, format) to a subscription document and its headers.

Both outlets — files for every user and the live ``/sub/<token>`` endpoint — fill in the same templates
(``prepared``): the live one through ``render``, the file outlet in blocks of users (``Prepared.fill_values``,
``file_headers``); for the same snapshot they give the same bytes.

A disabled or expired user gets a refusal, not a profile: status 403, a one-line text body
that says why (what clients show of a failed update), the title and ``subscription-userinfo`` headers,
and no entry; the file outlet writes that same text, which no client takes for a profile.

An entry a format cannot give without telling clients to skip verification is left out of that format
(``formats.omission``) and logged once per process as a warning: the loop's log, and the note
``reconciler subscription`` prints.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import operator
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import quote

from reconciler.balance.decide import Entry, decide
from reconciler.balance.snapshot import Slot, Snapshot
from reconciler.credentials import Secret, UserCredentials, user_credentials
from reconciler.model import InboundRef, User
from reconciler.subscriptions.formats import FORMATS, clash, links_text, omission, singbox
from reconciler.subscriptions.outbound import ClientOutbound, client_outbound, outbound_for
from reconciler.text import size_text

log = logging.getLogger("reconciler.subscriptions")

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
    status: int = 200  # 403: a refusal (disabled or expired user); its body says why
    tag: str = ""  # the ETag's 32 hex digits, when the body is a filled template (``Prepared.etag``); else its hash

    @property
    def refused(self) -> bool:
        return self.status != 200

    @cached_property  # asked on every live request (If-None-Match): made once
    def etag(self) -> str:
        return '"' + (self.tag or hashlib.sha256(self.body).hexdigest()[:32]) + '"'


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


# What documents on one snapshot share (``SnapshotMemo``): a format's headers that do not depend on the user, their
# JSON text, and a document per (format, entries and backups) with stand-ins for the user's credentials.
_HEADER_BASES: Slot[dict[str, dict[str, str]]] = Slot("header bases", dict)
_HEADER_JSON_HEADS: Slot[dict[str, str]] = Slot("header JSON heads", dict)
_HEADER_FORMS: Slot[dict[tuple[str, ...], str]] = Slot("headers.json forms", dict)  # ``file_headers``
#: Templates a snapshot keeps. Users share a template when they share their entries and failover orders: a few
#: servers give a few templates, all kept; on a big fleet the orders are nearly each user's own, and keeping them all
#: held a template per user for the snapshot's life (~1.5 GB at a million users): the first ones are kept, the rest
#: made when asked.
TEMPLATES_KEPT = 4096
_TEMPLATES: Slot[dict[tuple[str, tuple[tuple[str, ...], ...]], Prepared]] = Slot("document templates", dict)


def _header_base(snapshot: Snapshot, fmt: str) -> dict[str, str]:
    """The headers of ``fmt`` that do not depend on the user, built once per snapshot (the file outlet
    asks for 300,000 documents' headers); ``subscription-userinfo`` is left empty."""
    memo = snapshot.memo[_HEADER_BASES]
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
    result["subscription-userinfo"] = userinfo(snapshot, u)
    return result


def userinfo(snapshot: Snapshot, user: User) -> str:
    """The ``subscription-userinfo`` header: bytes up and down this period, the limit (0: none) and the expiry."""
    used = snapshot.usage.get(user.name)
    up, down = (used.up, used.down) if used else (0, 0)
    return f"upload={up}; download={down}; total={user.data_limit or 0}; expire={int(user.expires_at or 0)}"


def headers_json(snapshot: Snapshot, docs: dict[str, Document]) -> bytes:
    """``{format: headers}`` of one user's documents as JSON (the file outlet's ``headers.json``). The
    user-independent part is encoded once per snapshot: the C encoder took 22 µs per user. A refusal's
    headers carry its ``status`` too (for an uploader that serves the files)."""
    parts = []
    for fmt, doc in docs.items():
        if doc.refused:
            parts.append(json.dumps(fmt) + ": " + json.dumps({**doc.headers, "status": str(doc.status)}, ensure_ascii=False))
            continue
        parts.append(f'{_headers_head(snapshot, fmt)}, "subscription-userinfo": '
                     f'{json.dumps(doc.headers["subscription-userinfo"])}, "etag": {json.dumps(doc.etag)}}}')
    return ("{" + ", ".join(parts) + "}").encode()


def _headers_head(snapshot: Snapshot, fmt: str) -> str:
    """``headers_json``'s text of a format's headers but the user's two, up to where they follow."""
    memo = snapshot.memo[_HEADER_JSON_HEADS]
    head = memo.get(fmt)
    if head is None:
        fixed = {k: v for k, v in _header_base(snapshot, fmt).items() if k != "subscription-userinfo"}
        head = memo[fmt] = json.dumps(fmt, ensure_ascii=False) + ": " + json.dumps(fixed, ensure_ascii=False)[:-1]
    return head


_USERINFO_VALUE = re.compile(rb"[a-z]+=\d+(?:; [a-z]+=\d+)*")  # what ``userinfo`` writes
_ETAG_TAIL = re.compile(rb'", "etag": "\\"[0-9a-f]{32}\\""}')  # the figures' end, and json.dumps of an ETag


def headers_json_restamped(snapshot: Snapshot, data: bytes, formats: tuple[str, ...], info: str) -> bytes | None:
    """``headers_json``'s bytes of a user's served documents with another ``subscription-userinfo`` (the bodies,
    hence the ETags, unchanged), for ``data`` that is exactly what ``headers_json`` wrote for these formats from
    this snapshot's headers: the figures replaced in the bytes (a JSON round trip was 30 µs a user). None for
    anything else (the caller renders the user whole): garbled, foreign, other formats or other fixed headers."""
    if not _USERINFO_VALUE.fullmatch(info.encode()) or data[:1] != b"{":
        return None
    parts, at = [], 1
    for i, fmt in enumerate(formats):
        head = (_headers_head(snapshot, fmt) + ', "subscription-userinfo": "').encode()
        if not data.startswith(head, at):
            return None
        at += len(head)
        end = data.find(b'"', at)
        tail = _ETAG_TAIL.match(data, end) if end > at and _USERINFO_VALUE.fullmatch(data, at, end) else None
        if tail is None:
            return None
        parts.append(head + info.encode() + tail.group())
        at = tail.end()
        sep = b", " if i + 1 < len(formats) else b"}"
        if not data.startswith(sep, at):
            return None
        at += len(sep)
    return b"{" + b", ".join(parts) + b"}" if at == len(data) and parts else None


def refusal(snapshot: Snapshot, user: User, fmt: str) -> Document:
    """What a user who is not served gets instead of a profile: 403 and one line that says why."""
    why = refusal_reason(snapshot, user)
    base = _header_base(snapshot, fmt)
    hdrs = {"content-type": "text/plain; charset=utf-8", "profile-title": base["profile-title"],
            "subscription-userinfo": headers(snapshot, user.name, fmt, user)["subscription-userinfo"],
            "cache-control": "no-cache"}
    return Document(f"{why}\n".encode(), hdrs, [], status=403)


def refusal_reason(snapshot: Snapshot, user: User) -> str:
    """Why ``user`` is not served, in the words its app shows (one line; the page says it too)."""
    standing = snapshot.standing(user)
    if standing == "disabled":
        return "This subscription is disabled. Ask the operator to enable it."
    if standing == "expired":
        when = time.strftime("%Y-%m-%d", time.gmtime(user.expires_at or snapshot.now))
        return f"This subscription expired on {when}. Ask the operator to renew it."
    usage = snapshot.usage.get(user.name)
    if standing == "over_quota":
        nxt = usage.next_reset if usage else None
        back = (f" It resets on {time.strftime('%Y-%m-%d', time.gmtime(nxt))}." if nxt
                else " Ask the operator to raise the limit.")
        return f"This subscription used its traffic limit ({size_text(user.data_limit or 0)}).{back}"
    if standing == "device_limit":
        return (f"This subscription is in use on more devices ({usage.devices if usage else 0}) than it allows "
                f"({user.device_limit}). Disconnect the others and try again in a few minutes.")
    return ""


def render(snapshot: Snapshot, user_name: str, fmt: str, secret: Secret, region: str | None = None) -> Document:
    """The user's subscription in ``fmt``. An unknown user gets an empty document; a disabled or expired
    one a refusal (``Document.refused``)."""
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
    if not snapshot.active(user):
        return {fmt: refusal(snapshot, user, fmt) for fmt in fmts}
    creds = credentials or user_credentials(secret, user.name, user.rotate)
    mine = user_tag(creds.token)
    out = {}
    for fmt in fmts:
        form = prepared(snapshot, entries, fmt, secret)
        doc = Document(form.fill(creds), headers(snapshot, user_name, fmt, user), entries, tag=form.etag(mine))
        doc.headers["etag"] = doc.etag
        out[fmt] = doc
    return out


@dataclass(frozen=True)
class Prepared:
    """A document of some entries with the places of a user's credentials marked: ``form`` is the text with ``%``
    doubled and ``%s`` where a credential goes, ``slots`` which credential goes there (``credential_values``' order);
    share links take them percent-encoded and are base64 as a whole. Filling one in is a single ``%`` (the file
    outlet fills 300,000 a pass)."""

    form: bytes
    slots: tuple[int, ...]
    links: bool

    @classmethod
    def of(cls, body: bytes, stand_in: UserCredentials, links: bool) -> Prepared:
        marks = credential_values(stand_in)
        pieces = _marks(marks).split(body)
        slots = tuple(marks.index(mark) for mark in pieces[1::2])
        return cls(b"%s".join(piece.replace(b"%", b"%%") for piece in pieces[::2]), slots, links)

    @cached_property
    def tag(self) -> str:
        """The template's half of its documents' ETags: 64 bits of the hash of what it is."""
        return hashlib.sha256(b"template\0%d\0%s\0%s" % (self.links, bytes(self.slots), self.form)).hexdigest()[:16]

    def etag(self, user: str) -> str:
        """The ETag (32 hex digits, unquoted) of this template filled in for the user of ``user_tag`` ``user``. The
        document is a function of the two: of the template, and of the user's credentials, which are derived from what
        its token is derived from (the master secret, the name, ``rotate``). Hashing each document's bytes instead
        was ~3 µs a user for the file outlet's three (a tenth of its work for a user)."""
        return self.tag + user

    def fill(self, creds: UserCredentials) -> bytes:
        """The document of the user holding ``creds``."""
        return self.fill_values(credential_values(creds))

    def fill_values(self, values: tuple[bytes, ...]) -> bytes:
        """``fill`` from the user's ``credential_values`` (those of ``slots`` at least)."""
        if not self.links:
            return self.form % self._pick(values)
        return base64.b64encode(self.form % tuple([_in_url(values[i]) for i in self.slots]))

    @cached_property
    def _pick(self) -> Callable[[tuple[bytes, ...]], tuple[bytes, ...] | bytes]:
        """What ``form`` takes of the user's credentials: those of ``slots``, as one tuple, or the one value alone (a
        tuple of one made for each of 200,000 documents a pass was a third of filling one in)."""
        if not self.slots:
            return lambda values: ()
        return operator.itemgetter(*self.slots)


def user_tag(token: str) -> str:
    """A user's half of the ETags of its documents made from templates (``Prepared.etag``): 64 bits of a hash of its
    token, never the token."""
    return hashlib.sha256(b"etag\0" + token.encode()).hexdigest()[:16]


def credential_values(creds: UserCredentials) -> tuple[bytes, ...]:
    """The credentials a document can hold, in ``Prepared.slots``' order, encoded (``credentials.credential_bytes``
    gives them so)."""
    return creds.uuid.encode(), creds.password.encode(), creds.ss_key_128.encode(), creds.ss_key_256.encode()


def _in_url(value: bytes) -> bytes:
    """A credential as it stands in a share link's user info: percent-encoded (SIP002's Shadowsocks key is base64,
    with ``+``, ``/`` and ``=``; a derived UUID or password is left as it is)."""
    return value if _URL_SAFE.fullmatch(value) else quote(value, safe="").encode()


@functools.lru_cache(maxsize=4)
def _marks(marks: tuple[bytes, ...]) -> re.Pattern[bytes]:
    return re.compile(b"(" + b"|".join(re.escape(m) for m in marks) + b")")


_URL_SAFE = re.compile(rb"[A-Za-z0-9_.~-]*")  # what ``quote(safe="")`` leaves as it is


def prepared(snapshot: Snapshot, entries: list[Entry], fmt: str, secret: Secret) -> Prepared:
    """``fmt``'s document of these entries, to be filled with a user's credentials (kept on the snapshot: users with
    the same entries and failover orders share it)."""
    memo = snapshot.memo[_TEMPLATES]
    failover = fmt != "links" and snapshot.cluster.settings.outputs.failover.members > 1
    key = (fmt, tuple((e.name, e.ref.inbound.id, *(b.inbound.id for b in e.backups if failover)) for e in entries))
    found = memo.get(key)
    if found is None:
        found = Prepared.of(_template(snapshot, entries, fmt, secret, failover), _stand_in(secret), fmt == "links")
        if len(memo) < TEMPLATES_KEPT:
            memo[key] = found
    return found


def file_headers(snapshot: Snapshot, fmts: tuple[str, ...], etags: list[str], info: str) -> bytes:
    """``headers_json`` of a served user's documents, from their ETags (``Prepared.etag``) and
    ``subscription-userinfo`` (the file outlet: no ``Document`` made). The same bytes."""
    if not (info.isascii() and info.isprintable()) or '"' in info or "\\" in info:  # (figures from ``userinfo``: never)
        return headers_json(snapshot, {f: Document(b"", {"subscription-userinfo": info}, tag=t)
                                       for f, t in zip(fmts, etags, strict=True)})
    memo = snapshot.memo[_HEADER_FORMS]
    form = memo.get(fmts)
    if form is None:
        form = memo[fmts] = "{" + ", ".join(_headers_head(snapshot, fmt).replace("%", "%%") + ', "subscription-userinfo": "%s", '
                                            '"etag": "\\"%s\\""}' for fmt in fmts) + "}"
    args = [info] * (2 * len(etags))
    args[1::2] = etags
    return (form % tuple(args)).encode()


def _template(snapshot: Snapshot, entries: list[Entry], fmt: str, secret: Secret, failover: bool) -> bytes:
    """``fmt``'s document of these entries for the stand-in credentials."""
    outbounds = _verifiable([_stand_in_outbound(snapshot, e.ref, secret) for e in entries], fmt)
    if fmt == "links":  # the text before base64; share links stay one entry per route
        return links_text(outbounds)
    kept = {o.inbound for o in outbounds}
    groups = [[o, *_verifiable([_stand_in_outbound(snapshot, b, secret) for b in e.backups], fmt)]
              for e, o in zip([e for e in entries if e.ref.inbound.id in kept], outbounds, strict=True)] if failover else None
    settings = snapshot.cluster.settings
    return (singbox if fmt == "sing-box" else clash)(outbounds, settings.split, groups, settings.outputs.failover)


_STAND_IN_OUTBOUNDS: Slot[dict[str, ClientOutbound]] = Slot("outbounds with stand-in credentials", dict)


def _stand_in_outbound(snapshot: Snapshot, ref: InboundRef, secret: Secret) -> ClientOutbound:
    """``client_outbound`` of an entry on ``ref`` (named after it, ROUTE-2) with the stand-in credentials: the same
    for every template that has it (a failover order of three is in thousands of them)."""
    memo = snapshot.memo[_STAND_IN_OUTBOUNDS]
    found = memo.get(ref.inbound.id)
    if found is None:
        ib = ref.inbound
        made = outbound_for(ref, ib.name, secret, _stand_in(secret), snapshot.public_keys.get(ib.id, ""),
                            snapshot.tls_pins.get(ib.id, ""))
        # One object for equal outbounds, snapshot after snapshot (a pass's stretches each have a memo of their own):
        # the formats' caches of their pieces (keyed by outbound) then find it by identity, not field by field.
        found = _SAME_OUTBOUNDS.get(made)
        if found is None:
            if len(_SAME_OUTBOUNDS) >= 4096:  # (inbounds long gone)
                _SAME_OUTBOUNDS.clear()
            found = _SAME_OUTBOUNDS[made] = made
        memo[ib.id] = found
    return found


_SAME_OUTBOUNDS: dict[ClientOutbound, ClientOutbound] = {}


def left_out(snapshot: Snapshot, entries: list[Entry], fmt: str, secret: Secret) -> list[str]:
    """The names of the entries ``fmt`` cannot carry (``formats.omission``: a server it cannot verify), in order."""
    stand_in = _stand_in(secret)
    return [e.name for e in entries if omission(client_outbound(e, snapshot, secret, stand_in), fmt) is not None]


_warned: set[tuple[str, str, str]] = set()  # (inbound, format, why) already logged by this process


def _verifiable(outbounds: list[ClientOutbound], fmt: str) -> list[ClientOutbound]:
    """The outbounds ``fmt`` can give with their servers verified; the others are left out, with a warning."""
    kept = []
    for o in outbounds:
        why = omission(o, fmt)
        if why is None:
            kept.append(o)
        elif (o.inbound, fmt, why) not in _warned:
            _warned.add((o.inbound, fmt, why))
            log.warning("note: inbound %r is left out of %s subscriptions: %s", o.inbound, fmt, why)
    return kept
