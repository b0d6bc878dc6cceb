"""The file outlet decides and fills users in blocks (``decide_block``, ``Prepared``, ``file_headers``); what it writes
must be what deciding and rendering each user alone gives, which the live endpoint answers. Checked over many fleets
drawn at random: two or three servers as most are, twenty as the benchmark's, routes with and without failover
orders, servers out of rotation, a server weighing next to nothing, users not served and users the balancer never saw."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from reconciler.balance import decide, rebalance
from reconciler.balance.decide import decide_block
from reconciler.credentials import Secret, user_credentials
from reconciler.model import Cluster, UserUsage
from reconciler.publish import FileOutlet
from reconciler.publish.digests import user_fingerprint
from reconciler.publish.parallel import locality_order
from reconciler.subscriptions import FORMATS
from reconciler.subscriptions.document import _TEMPLATES, headers_json, render_formats
from tests.balance_helpers import snapshot, verdicts

SECRET = Secret(b"outlet-batch-test-secret-0123456789")
PROTOCOLS = ("vless-reality", "vless-tls", "trojan", "shadowsocks-2022", "hysteria2", "tuic")


def fleet(rng: np.random.Generator, servers: int, users: int) -> Cluster:
    routes = [{"id": "r", "name": "Main"}] + ([{"id": "q", "name": "Other"}] if rng.random() < 0.4 else [])
    if rng.random() < 0.2:  # pools: decided alone
        routes[0] |= {"pools": ["a", "b"], "steering": "random"}
    out = []
    for i in range(servers):
        inbounds = []
        for route in routes:
            protocol = str(rng.choice(PROTOCOLS))
            ib = {"id": f"s{i}-{route['id']}", "name": f"Server {i % 3}", "protocol": protocol, "port": 1000 + len(inbounds),
                  "route": route["id"]}
            if route.get("pools"):
                ib["pool"] = "ab"[i % 2]
            if protocol == "vless-reality":
                ib["camouflage"] = "www.example.com"
            elif protocol != "shadowsocks-2022":
                ib["tls"] = {"server_name": "www.lab.test", "insecure": bool(rng.random() < 0.5)}
            inbounds.append(ib)
        out.append({"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": str(rng.choice(["DE", "NL", "US"])),
                    "coefficient": float(rng.choice([0.01, 1.0, 1.0, 2.5])), "inbounds": inbounds})
    people = []
    for j in range(users):
        person: dict[str, object] = {"name": f"user{j}", "rotate": int(rng.integers(0, 2))}
        if rng.random() < 0.05:
            person["enabled"] = False
        if rng.random() < 0.05:
            person["expires"] = "2020-01-01"
        elif rng.random() < 0.1:
            person["expires"] = "2099-03-04T05:06:07+02:00"
        if rng.random() < 0.1:
            person |= {"data_limit": "5GB", "reset": {"period": "monthly", "day": 15}}
        if rng.random() < 0.05:
            person |= {"device_limit": 3, "on_device_limit": "refuse", "region": "EEU"}
        people.append(person)
    members = int(rng.integers(1, 5))
    return Cluster.model_validate({"servers": out, "routes": routes, "users": people,
                                   "settings": {"outputs": {"failover": {"members": members}}}})


def snapshots(seed: int):
    rng = np.random.default_rng(seed)
    servers = int(rng.choice([1, 2, 3, 3, 5, 20]))
    c = fleet(rng, servers, int(rng.integers(5, 120)))
    down = tuple(f"s{i}" for i in range(servers) if rng.random() < 0.2)
    base = snapshot(c, verdicts=verdicts(c, down=down) if down else None)
    # Some users joined after the balancer ran: placed afresh, one at a time.
    before = c.model_copy(update={"users": c.users[: max(1, len(c.users) - int(rng.integers(0, 4)))]})
    held = rebalance(dataclasses.replace(base, cluster=before)) if rng.random() < 0.3 else rebalance(base)
    return dataclasses.replace(base, assignments=held)


@pytest.mark.parametrize("seed", range(60))
def test_a_block_of_users_is_decided_as_each_alone(seed):
    # spec: LB-6, LB-9, ROUTE-7
    snap = snapshots(seed)
    positions = np.arange(len(snap.cluster.users))[::-1].copy()  # any order
    entries, keys = decide_block(snap, positions)
    alone = [decide(snap, snap.cluster.users[i].name) for i in positions.tolist()]
    assert entries == alone
    named: dict[object, object] = {}
    for key, got in zip(keys, entries, strict=True):
        if key is not None:  # one key, one list of entries
            assert named.setdefault(key, got) == got


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_the_files_are_each_users_rendered_documents(tmp_path, seed):
    snap = snapshots(seed)
    snap = dataclasses.replace(snap, public_keys={r.inbound.id: "k" * 43 for r in snap.cluster.inbounds
                                                  if r.inbound.protocol == "vless-reality"})
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    outlet.write(snap)
    formats = ("links", "sing-box", "clash")
    for user in snap.cluster.users:
        creds = user_credentials(SECRET, user.name, user.rotate)
        docs = render_formats(snap, user.name, formats, SECRET, credentials=creds)
        folder = tmp_path / "subs" / creds.token
        assert (folder / "links.txt").read_bytes() == docs["links"].body
        assert (folder / "sing-box.json").read_bytes() == docs["sing-box"].body
        assert (folder / "clash.yaml").read_bytes() == docs["clash"].body
        assert (folder / "headers.json").read_bytes() == headers_json(snap, docs)


def test_users_who_keep_their_assignment_are_decided_together():
    snap = snapshots(4)  # five servers, no pools, failover orders of four
    served = int((snap.standings == 0).sum())
    _, keys = decide_block(snap, np.arange(len(snap.cluster.users)))
    assert sum(k is not None for k in keys) >= served - 8  # all but the few the balancer never saw


def test_users_of_routes_with_nothing_to_hand_out_yet_get_what_each_alone_gets(tmp_path):
    # REALITY inbounds whose public keys no apply has learnt yet cannot be handed out: served users get no entries
    # (the key ``()``), and their files are what rendering each alone gives.
    servers = [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": "NL", "inbounds": [
        {"id": f"s{i}-r", "name": f"Server {i}", "protocol": "vless-reality", "port": 443, "route": "r",
         "camouflage": "www.example.com"}]} for i in range(2)]
    c = Cluster.model_validate({"servers": servers, "routes": [{"id": "r", "name": "Main"}],
                                "users": [{"name": f"user{j}"} for j in range(5)] + [{"name": "off", "enabled": False}]})
    snap = snapshot(c)
    entries, keys = decide_block(snap, np.arange(6))
    assert keys == [(), (), (), (), (), None] and entries == [decide(snap, u.name) for u in c.users] == [[]] * 6
    FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1).write(snap)
    for user in c.users:
        creds = user_credentials(SECRET, user.name, user.rotate)
        docs = render_formats(snap, user.name, ("links", "sing-box", "clash"), SECRET, credentials=creds)
        assert (tmp_path / "subs" / creds.token / "sing-box.json").read_bytes() == docs["sing-box"].body
        assert (tmp_path / "subs" / creds.token / "headers.json").read_bytes() == headers_json(snap, docs)


@pytest.mark.parametrize("seed", range(1, 60, 7))
def test_the_manifest_records_each_users_fingerprint_by_its_definition(tmp_path, seed):
    snap = snapshots(seed)
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET, workers=1)
    outlet.write(snap)
    inbound_json = {r.inbound.id: r.inbound.model_dump_json() for r in snap.cluster.inbounds}
    outputs_json = snap.cluster.settings.outputs.model_dump_json()
    for user in snap.cluster.users:
        assert outlet.published[user.name].fingerprint == user_fingerprint(snap, user.name, inbound_json, outputs_json)


@pytest.mark.parametrize("seed", range(2, 60, 9))
def test_users_go_to_the_workers_as_columns_and_come_back_the_same(seed):
    import pickle

    from reconciler.publish.parallel import spilled

    snap = snapshots(seed)
    back = pickle.loads(pickle.dumps(spilled(snap)))
    users, theirs = snap.cluster.users, back.cluster.users
    assert len(theirs) == len(users) and theirs[-1] == users[-1] and theirs[1:4] == users[1:4]
    for mine, made in zip(users, theirs, strict=True):
        assert made == mine and made.model_dump_json() == mine.model_dump_json()
        assert made.model_fields_set == mine.model_fields_set and made.expires_at == mine.expires_at
        assert back.standing(made) == snap.standing(mine)
    assert all(theirs[i] is made for i, made in enumerate(theirs))  # made once: ``Snapshot.standing`` asks ``is``
    assert snap.cluster.users is users and type(users) is list  # the snapshot itself is left as it was
    assert "user_key_array" in back.__dict__ and (back.user_key_array == snap.user_key_array).all()  # not hashed again


def test_a_stretch_of_users_keeps_what_its_snapshot_derived_and_starts_a_memo_of_its_own():
    snap = snapshots(7)
    snap.memo[_TEMPLATES]  # (a slot in use)
    derived = snap.standings, snap.user_key_array, snap.held
    view = snap.with_fresh_memo()
    assert view.standings is derived[0] and view.user_key_array is derived[1] and view.held is derived[2]
    assert view.memo is not snap.memo and not view.memo._slots and snap.memo._slots
    assert view == snap


@pytest.mark.parametrize("seed", range(5, 60, 11))
def test_a_pass_split_with_a_worker_writes_what_one_process_writes(tmp_path, seed, monkeypatch, worker_takes_part):
    from tests.test_loop import tree

    snap = snapshots(seed)
    one = FileOutlet(tmp_path / "one" / "subs", tmp_path / "one" / "state", SECRET, workers=1)
    one.write(snap)
    monkeypatch.setattr(FileOutlet, "PARALLEL_MIN", 2)
    two = FileOutlet(tmp_path / "two" / "subs", tmp_path / "two" / "state", SECRET, workers=2)
    two.write(snap)
    assert len(worker_takes_part) == 1 and worker_takes_part[0][0] > 0 and worker_takes_part[0][1] > 0  # both wrote
    assert tree(tmp_path / "two" / "subs") == tree(tmp_path / "one" / "subs") and two.published == one.published


@pytest.mark.parametrize("seed", range(7, 40, 16))
def test_a_restarted_outlet_split_with_a_worker_compares_what_was_published(tmp_path, seed, monkeypatch,
                                                                            worker_takes_part):
    # After a restart, a pass compares every user with what the manifest recorded: its worker gets that record too
    # (a first pass's worker gets None and makes the empty columns itself).
    from tests.test_loop import tree

    first = snapshots(seed)
    then = dataclasses.replace(first, usage={first.cluster.users[0].name: UserUsage(up=3 * 10**12)})  # (a new digest)
    counts = []
    for name, workers in (("one", 1), ("two", 2)):
        FileOutlet(tmp_path / name / "subs", tmp_path / name / "state", SECRET, workers=1).write(first)
        if workers == 2:
            monkeypatch.setattr(FileOutlet, "PARALLEL_MIN", 2)
        again = FileOutlet(tmp_path / name / "subs", tmp_path / name / "state", SECRET, workers=workers)
        assert len(again.published) == len(first.cluster.users)
        stats = again.write(then)
        counts.append((stats.written, stats.unchanged, stats.removed))
    assert len(worker_takes_part) == 1 and worker_takes_part[0][1] > 0
    assert counts[0] == counts[1] and counts[0][1] > 0  # (given nothing, the worker wrote its users all again)
    assert tree(tmp_path / "two" / "subs") == tree(tmp_path / "one" / "subs")


@pytest.mark.parametrize("servers", [3, 5])
def test_blocks_taken_from_the_back_make_the_templates_blocks_from_the_front_make(tmp_path, servers, monkeypatch):
    # A pass's worker takes blocks from the back of the users' list (``parallel.Ends``). Taken as they come, each
    # block turned back on the runs of users assigned alike, and a run met again began a stretch of its own and made
    # its templates again (40% more at 100k users); taken from their ends (``backward``), the worker makes what the
    # front makes, and writes the same. (Stretches of 8 and blocks of 5: what 100k users do with 4096 and 512.)
    import reconciler.subscriptions.document as document
    from reconciler.publish import userfiles

    monkeypatch.setattr(userfiles, "STRETCH", 8)
    made: list[int] = []
    real = document._template
    monkeypatch.setattr(document, "_template", lambda *a: made.append(1) or real(*a))
    c = Cluster.model_validate({
        "servers": [{"name": f"s{i}", "host": f"198.18.0.{10 + i}", "country": "DE", "inbounds": [
            {"id": f"s{i}-in", "name": f"Server {i}", "protocol": "vless-tls", "port": 443, "route": "r",
             "tls": {"server_name": "www.lab.test", "insecure": True}}]} for i in range(servers)],
        "routes": [{"id": "r", "name": "Main"}], "users": [{"name": f"user{j}"} for j in range(120)],
        "settings": {"outputs": {"failover": {"members": 3}}}})
    base = snapshot(c)
    snap = dataclasses.replace(base, assignments=rebalance(base))
    n = len(c.users)
    which = np.arange(n)[locality_order(list(snap.held.columns.values()), np.arange(n))]
    before = (np.zeros(n, "S32"), np.zeros(n, "S32"), np.zeros(n, np.int64))
    blocks = [(lo, min(n, lo + 5)) for lo in range(0, n, 5)]
    counts, parts = [], []
    for k, (order, backward) in enumerate(((blocks, False), (blocks[::-1], True), (blocks[::-1], False))):
        made.clear()
        (tmp_path / str(k)).mkdir()
        parts.append(userfiles.write_users(dataclasses.replace(snap), SECRET, str(tmp_path / str(k)), FORMATS, before,
                                           which, np.zeros(n, bool), False, iter(order), backward=backward))
        counts.append(len(made))
    assert counts[1] == counts[0] < counts[2]
    ranks = [np.argsort(p.which) for p in parts]
    for p, r in zip(parts[1:], ranks[1:], strict=True):
        assert (p.tokens[r] == parts[0].tokens[ranks[0]]).all() and (p.prints[r] == parts[0].prints[ranks[0]]).all()
        assert (p.sizes[r] == parts[0].sizes[ranks[0]]).all()


@pytest.mark.parametrize("seed", range(0, 60, 4))
def test_an_etag_names_one_body(seed):
    # A document filled from a template takes its ETag from the template and the user's token (``Prepared.etag``), not
    # from a hash of its bytes: still a strong validator (RFC 9110, 8.8.1), one ETag never stands for two bodies, over
    # users, formats, keys, rotations and failover orders.
    base = snapshots(seed)
    keys = {r.inbound.id: "k" * 43 for r in base.cluster.inbounds if r.inbound.protocol == "vless-reality"}
    data = base.cluster.model_dump(mode="json", exclude_none=True)
    for person in data["users"]:
        person["rotate"] = person.get("rotate", 0) + 1
    rotated = Cluster.model_validate(data)
    data["settings"]["outputs"]["failover"]["members"] = 1 + data["settings"]["outputs"]["failover"]["members"] % 4
    variants = [dataclasses.replace(base, public_keys=keys), dataclasses.replace(base, public_keys={k: "j" * 43 for k in keys}),
                dataclasses.replace(snapshot(rotated), public_keys=keys),
                dataclasses.replace(snapshot(Cluster.model_validate(data)), public_keys=keys)]
    named: dict[str, bytes] = {}
    bodies: dict[tuple[str, str], set[bytes]] = {}
    for snap in variants:
        for user in snap.cluster.users:
            for fmt, doc in render_formats(snap, user.name, ("links", "sing-box", "clash"), SECRET).items():
                assert named.setdefault(doc.etag, doc.body) == doc.body, (user.name, fmt)
                assert len(doc.etag) == 34 and (doc.refused or doc.headers["etag"] == doc.etag)
                bodies.setdefault((user.name, fmt), set()).add(doc.body)
    assert max(map(len, bodies.values())) >= 2  # (documents did change between the variants)


def test_share_links_carry_the_credentials_percent_encoded():
    # The Shadowsocks key is base64 (+, / and =): SIP002 user info percent-encodes it; a clean value is as it is.
    import base64

    from reconciler.subscriptions.document import Prepared

    links = Prepared(b"ss://%s@h#%%20|%s|%s", (0, 2, 3), links=True)
    filled = links.fill_values((b"a-b_c.d~e", b"unused", b"p+/=", b"k%"))
    assert base64.b64decode(filled) == b"ss://a-b_c.d~e@h#%20|p%2B%2F%3D|k%25"
    assert Prepared(b"%s", (1,), links=False).fill_values((b"", b"p+/=", b"", b"")) == b"p+/="
