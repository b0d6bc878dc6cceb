"""The file outlet under faults: a full disk never publishes a cut document as current, what an
earlier crash or full disk left is repaired at start, and tokens from the state folder never
name a path outside the subscriptions folder. Real OS limits (RLIMIT_FSIZE in a child process),
no root needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from reconciler.fleet import Learned
from reconciler.publish import MANIFEST, FileOutlet
from tests.test_loop import SECRET, cluster, snapshot_after

NAMES = ("links.txt", "sing-box.json", "clash.yaml", "headers.json")


def published(tmp_path, outlet: FileOutlet) -> dict[str, bytes]:
    return {f"{p.token}/{n}": (tmp_path / "subs" / p.token / n).read_bytes() for p in outlet.published.values() for n in NAMES}


@pytest.mark.parametrize("existing", [True, False], ids=["into-a-folder", "no-folder-yet"])
def test_a_full_disk_never_publishes_a_cut_file_and_the_next_write_completes(tmp_path, existing):
    # The child writes under a 600-byte file-size limit (what a full disk looks like to a writer): every
    # write fails with EFBIG, nothing is renamed into place, and the manifest is not advanced. Into an existing
    # folder, each user's folder is staged (a killed writer's staging is cleaned at start); with no folder yet, all
    # go into a folder of the pass's own beside it, removed when the pass fails.
    child = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        sys.path.insert(0, {str(os.getcwd())!r})
        from reconciler.fleet import Learned
        from reconciler.publish import FileOutlet
        from tests.test_loop import SECRET, cluster, snapshot_after
        c = cluster(3, users=5)
        snap = snapshot_after(c, Learned.fresh(c))
        if {existing!r}:
            Path({str(tmp_path / 'subs')!r}).mkdir()
        resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))
        try:
            FileOutlet(Path({str(tmp_path / 'subs')!r}), Path({str(tmp_path / 'state')!r}), SECRET).write(snap)
        except OSError as exc:
            print("refused:", exc.errno)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert "refused: 27" in out.stdout, out.stdout + out.stderr  # EFBIG
    assert not (tmp_path / "state" / MANIFEST).exists()
    assert not [p for p in (tmp_path / "subs").glob("*/*") if not p.parent.name.startswith(".")]  # none published
    assert (tmp_path / "subs").is_dir() == existing and not list(tmp_path.glob("subs.*"))  # no folder of the pass left
    # Space is back: a restarted outlet cleans up and writes everything, complete.
    c = cluster(3, users=5)
    snap = snapshot_after(c, Learned.fresh(c))
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert outlet.clean_temporaries() >= existing
    assert outlet.write(snap).written == 5
    reference = FileOutlet(tmp_path / "ref" / "subs", tmp_path / "ref" / "state", SECRET)
    reference.write(snap)
    assert published(tmp_path, outlet) == published(tmp_path / "ref", reference)


def test_files_cut_short_by_an_earlier_run_are_found_at_start_and_written_again(tmp_path):
    c = cluster(3, users=4)
    snap = snapshot_after(c, Learned.fresh(c))
    first = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    first.write(snap)
    good = published(tmp_path, first)
    victim = next(iter(first.published.values())).token
    (tmp_path / "subs" / victim / "sing-box.json").write_bytes(good[f"{victim}/sing-box.json"][:600])  # cut, as before the fix
    (tmp_path / "subs" / list(first.published.values())[-1].token / "clash.yaml").unlink()
    again = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert again.verify() == 2
    stats = again.write(snap)
    assert stats.written == 2 and not stats.skipped_all
    assert published(tmp_path, again) == good
    assert FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET).verify() == 0


def test_tokens_in_a_hostile_manifest_never_reach_a_path(tmp_path):
    victim = tmp_path / "victim_dir"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (tmp_path / "state").mkdir()
    token = "A" * 32
    (tmp_path / "state" / MANIFEST).write_text(json.dumps({"digest": "x", "users": {
        "mallory": ["../../victim_dir", "f" * 32, 1], "eve": ["/" + str(victim), "f" * 32, 1], "u0": "not a list",
        "trudy": [token, 'ffff", "u9": ["' + "f" * 20, 1], "walter": [token, "F" * 32, 1]}}))  # (fingerprints: hex)
    c = cluster(3, users=2)
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    assert outlet.published == {} and outlet.notes  # every malformed entry dropped, and said so
    outlet.write(snapshot_after(c, Learned.fresh(c)))
    assert (victim / "precious").read_text() == "keep me"


def test_subscription_files_are_private(tmp_path):
    c = cluster(3, users=2)
    outlet = FileOutlet(tmp_path / "subs", tmp_path / "state", SECRET)
    outlet.write(snapshot_after(c, Learned.fresh(c)))
    assert oct((tmp_path / "subs").stat().st_mode & 0o777) == "0o700"
    for p in outlet.published.values():
        assert oct((tmp_path / "subs" / p.token).stat().st_mode & 0o777) == "0o700"
        for name in NAMES:
            assert oct((tmp_path / "subs" / p.token / name).stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "state" / MANIFEST).stat().st_mode & 0o777) == "0o600"


def test_the_manifest_is_json_whatever_the_names(tmp_path):
    # The manifest's members are written without a JSON encoder (``PublishedTable.json_members``): the same bytes as
    # ``json.dumps`` for any name, and read back whole.
    from reconciler.publish import PublishedTable

    names = ("plain", 'qu"ote', "back\\slash", "ünï", "tab\there", "\u2028line", "x" * 63)
    table = PublishedTable(names, {n: i for i, n in enumerate(names)})
    for i in range(len(names) - 1):  # (the last: nothing recorded)
        table.tokens[i], table.prints[i], table.sizes[i] = (b"T%031d" % i, b"%032x" % (i * 7919), 10 ** i)
    members = b", ".join(table.json_members(3))
    expected = {n: [f"T{i:031d}", f"{i * 7919:032x}", 10 ** i] for i, n in enumerate(names[:-1])}
    assert members == json.dumps(expected)[1:-1].encode()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / MANIFEST).write_bytes(b'{"digest": "d", "users": {' + members + b"}}")
    assert json.loads((tmp_path / "state" / MANIFEST).read_bytes())["users"] == expected
