"""One transaction on one server, in one round trip (request: JSON on stdin; answer: one JSON line).

Writes the changed small files it carries (certificates and keys among them: derived on the
controller), renders the engine's configuration from the template (a copy: nothing is substituted), runs the
engine's own check (``check``: an argv, e.g. ``sing-box check -c`` or ``mihomo -t``) with the staged engine,
keeps the old files (hard links), swaps the new ones in with atomic renames, stops the engines it ``retire``s
(a server that changed engines), reloads or restarts, and verifies the listeners within a timeout; on any
failure it restores the old files, restarts (the retired engines too) and verifies again. The runner starts
it under ``setsid -w``, so a dropped SSH session cannot leave a server half-switched, and it releases the
apply lock when it ends (when it is given one).
"""

from __future__ import annotations

import binascii
import json
import os
import sys
import time

from reconciler.engine.scripts.prelude import UNIT_CGROUPS, at, listening_sockets, loaded, run, write  # spliced in when sent

TYPE_CHECKING = False  # typing is not imported on the servers: mypy alone reads these imports
if TYPE_CHECKING:
    from typing import Any


def sh(cmd: list[str], timeout: float = 60) -> tuple[int, str]:
    """(exit status, the end of its output and errors); past ``timeout`` it is killed (a non-zero status).
    Without subprocess (and shutil, base64, imported only where needed): ~15 ms less of each commit's CPU."""
    r = run(cmd, timeout, merge=True)
    return int(r["code"]), str(r["out"])[-2000:]


def held_by_unit(root: str, service: str, want: list[tuple[int, str]],
                 have: dict[tuple[int, str], set[str]] | None = None) -> bool:
    """Whether processes of the unit's own cgroup hold every wanted listener (``have``: ``listening_sockets``, read
    if not given), read from /proc (no process started: ``systemctl is-active`` costs ~8 ms of a server's CPU at
    every poll). False when it cannot tell."""
    if root != "/":
        return False
    pids: list[str] = []
    for folder in UNIT_CGROUPS:
        try:
            with open((folder % service) + "/cgroup.procs") as f:
                pids = f.read().split()
            break
        except OSError:
            continue
    if not pids:
        return False
    inodes = listening_sockets(root) if have is None else have
    held = set()
    for pid in pids:
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if link.startswith("socket:["):
                held.add(link[8:-1])
    return all(inodes.get((p, t), set()) & held for p, t in want)


class Commit:
    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.root = str(req.get("root", "/"))
        self.result: dict[str, Any] = {"ok": False, "stage": "stage", "rolled_back": False, "error": "", "seconds": {}}
        self.clock = time.monotonic()
        new = req.get("binary_new")
        self.binary = self.at(new) if new and os.path.exists(self.at(new)) else self.at(req["binary"])
        self.running = req.get("running", True)  # the engine was serving before this commit (from the facts)
        self.moves = [(self.at(n), self.at(p)) for n, p in req["moves"]] + [(self.at(req["config_new"]), self.at(req["config"]))]
        self.backups: list[str] = []

    def at(self, path: str) -> str:
        return at(self.root, path)

    def check(self, binary: str, config: str) -> list[str]:
        """The engine's check of a configuration file, as the request's argv template says."""
        return [a.replace("{binary}", binary).replace("{config}", config).replace("{dir}", self.at(self.req["dir"]))
                for a in self.req["check"]]

    @property
    def checker(self) -> str:
        return "%s %s" % (self.req.get("engine", "the engine"), self.req["check"][1])

    def step(self, name: str) -> None:
        # Seconds spent in each stage (apply --json shows them): where a slow server spends its commit.
        now = time.monotonic()
        self.result["seconds"][self.result["stage"]] = round(now - self.clock, 3)
        self.clock = now
        self.result["stage"] = name

    def stage(self) -> None:
        # The changed small files travel in this request (no file-transfer session per file).
        for f in self.req["files"]:
            write(self.at(f["path"]), binascii.a2b_base64(f["data"]), f["mode"])

    def unit(self, props: str = "LoadState,NeedDaemonReload,UnitFileState") -> dict[str, str]:
        code, out = sh(["systemctl", "show", "--property=" + props, self.req["service"]])
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def verify(self) -> bool:
        # Listeners from /proc every few ms; once they are up, held by the unit's own processes (or, when that
        # cannot be told, systemd says it is active); systemd asked every half second meanwhile so that a unit that
        # failed or is crash-looping ends the wait at once.
        want = [(int(p), str(t)) for p, t in self.req["listeners"]]
        start = time.time()
        deadline, asked = start + self.req["verify_timeout"], start
        pause = 0.02
        while time.time() < deadline:
            have = listening_sockets(self.root)
            if all(w in have for w in want) and (held_by_unit(self.root, self.req["service"], want, have)
                                                 or sh(["systemctl", "is-active", self.req["service"]])[0] == 0):
                return True
            if time.time() - asked >= 0.5:
                asked = time.time()
                state = self.unit("ActiveState,SubState")
                if state.get("ActiveState") == "failed" or state.get("SubState") == "auto-restart":
                    return False
            time.sleep(pause)
            pause = min(pause * 1.5, 0.25)
        return False

    def restart(self, action: str) -> None:
        # daemon-reload costs ~150 ms of the manager's time: only when systemd says the unit needs it
        # (a new unit file loads on first use; a changed one sets NeedDaemonReload).
        service = self.req["service"]
        if self.req.get("fresh") and action in ("restart", "start"):  # no unit before this commit: one systemctl
            if sh(["systemctl", "enable", "--now", "--no-reload", service])[0] == 0:
                return
        props = self.unit("LoadState,NeedDaemonReload,UnitFileState,ActiveState")
        if props.get("LoadState") != "loaded" or props.get("NeedDaemonReload") == "yes":
            sh(["systemctl", "daemon-reload"])
            props = self.unit("LoadState,NeedDaemonReload,UnitFileState,ActiveState")
        if props.get("UnitFileState") != "enabled":
            if action in ("restart", "start") and props.get("ActiveState") in ("inactive", "failed"):
                sh(["systemctl", "enable", "--now", "--no-reload", service])  # a bare server: one systemctl, not two
                return
            sh(["systemctl", "enable", "--no-reload", service])
        if action == "reload":
            code, out = sh(["systemctl", "reload", service])
            if code != 0:
                action = "restart"
        if action in ("restart", "start"):
            sh(["systemctl", "restart", service])

    def render(self) -> None:
        new = self.at(self.req["template_new"])
        with open(new if os.path.exists(new) else self.at(self.req["template"])) as f:
            text = f.read()
        fd = os.open(self.at(self.req["config_new"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def swap(self) -> None:
        for _new, path in self.moves:
            if os.path.exists(path):
                try:  # a hard link keeps the old file at no cost (the engine binary is tens of MB)
                    if os.path.exists(path + ".reconciler-old"):
                        os.remove(path + ".reconciler-old")
                    os.link(path, path + ".reconciler-old")
                except OSError:
                    import shutil

                    shutil.copy2(path, path + ".reconciler-old")
                self.backups.append(path)
        for new, path in self.moves:
            os.replace(new, path)

    def transact(self) -> None:
        """Stage, render, check, swap, restart and verify; the first failure raises (the result's stage says where)."""
        req = self.req
        self.stage()
        self.step("render")
        self.render()
        self.step("check")
        # A running engine is protected by checking first. With none running there is nothing to protect:
        # the start itself is the check (~60 ms of CPU saved), and a failed start is explained below.
        if self.running:
            code, out = sh(self.check(self.binary, self.at(req["config_new"])))
            if code != 0:
                raise RuntimeError("%s rejected the new configuration: %s" % (self.checker, out.strip()))
        self.step("swap")
        self.swap()
        self.step("restart")
        for old in req.get("retire", []):  # a server changing engines: the old one frees the ports first
            sh(["systemctl", "disable", "--now", old])
        self.restart(req["action"])
        self.step("verify")
        if not self.verify():
            raise RuntimeError("the service did not come up with the new configuration (listeners %s)" % req["listeners"])
        self.step("done")
        self.result["ok"] = True

    def explain_start(self, config: str) -> None:
        """An engine started without the check first (none was running) that failed: its check says why."""
        try:  # swapped in by now: the new engine and configuration are in place
            code, out = sh(self.check(self.at(self.req["binary"]), config))
            if code != 0:
                self.result["error"] = "%s rejected the new configuration: %s" % (self.checker, out.strip())
        except OSError:
            pass

    def put_back(self, config: str) -> None:
        """The old files back in place and the new ones removed (a running engine keeps a configuration that had no
        old copy, unless that engine is being retired)."""
        req = self.req
        for _new, path in self.moves:
            if path in self.backups:
                os.replace(path + ".reconciler-old", path)
            elif os.path.exists(path) and (path != config or not self.running or req.get("retire")):
                os.remove(path)

    def serve_old(self) -> None:
        """After the files are back: what served before serves again (or nothing, as before), verified."""
        req, result = self.req, self.result
        if req.get("retire"):  # ... and the old one serves again
            for old in req["retire"]:
                sh(["systemctl", "enable", "--now", old])
            result["rollback_verified"] = all(sh(["systemctl", "is-active", old])[0] == 0 for old in req["retire"])
        elif self.running:
            self.restart("restart")
            result["rollback_verified"] = self.verify()
        else:  # it was not running before: back to not running
            sh(["systemctl", "stop", req["service"]])
            result["rollback_verified"] = sh(["systemctl", "is-active", req["service"]])[0] != 0

    def roll_back(self, config: str) -> None:
        if self.req.get("retire"):  # a changed engine that failed: it frees the ports (its unit still there)
            sh(["systemctl", "disable", "--now", self.req["service"]])
        self.put_back(config)
        self.result["rolled_back"] = True
        self.serve_old()

    def tidy(self) -> None:
        """Whatever happened: no staged file left, the old files kept only for a wave, the apply lock released."""
        req, result = self.req, self.result
        for new, _ in self.moves:
            if os.path.exists(new):
                os.remove(new)
        if result["ok"] and req.get("keep_backups"):  # a wave: kept until the wave is judged (restore/forget)
            paths = [p for _n, p in req["moves"]] + [req["config"]]  # as the server names them (not under root)
            result["swapped"] = [[p, self.at(p) in self.backups] for p in paths]
        else:
            for path in self.backups:
                if os.path.exists(path + ".reconciler-old"):
                    os.remove(path + ".reconciler-old")
        if req.get("lock"):
            import shutil

            shutil.rmtree(self.at(req["lock"]), ignore_errors=True)

    def stage_engine(self) -> bool:
        """The engine binary staged here first (``stage``: the engine script's request and ``source``, a download
        whose version is known): one session and one Python start less per server. False, with the staging's answer
        in ``engine``, when it failed: nothing was changed, and the lock is released as after any commit given it
        (its controller may be gone); a controller that goes on (uploading the binary where the server could not
        fetch or unpack it) takes the lock again first."""
        req = dict(self.req["stage"])
        self.result["stage"] = "engine"
        try:
            if self.root != "/":
                req["root"] = self.root
            answer = loaded(req.pop("source"), "engine")["staged"](req, None)
        except Exception as e:  # noqa: BLE001 — a broken request is this commit's answer, never a crash under the lock
            answer = {"ok": False, "kind": "stage", "error": "cannot stage the engine: %s" % e}
        self.result["engine"] = answer
        if answer.get("ok"):
            self.binary = self.at(self.req["binary_new"])
            return True
        self.result["seconds"]["engine"] = round(time.monotonic() - self.clock, 3)
        self.result["error"] = str(answer.get("error"))
        return False

    def run(self) -> dict[str, Any]:
        result = self.result
        config = self.at(self.req["config"])
        if self.req.get("stage") and not self.stage_engine():
            self.tidy()  # nothing staged to remove; the lock released when it was given
            return result
        self.step("stage")
        try:
            self.transact()
        except Exception as e:  # noqa: BLE001 — whatever failed, the answer says it and the old version comes back
            result["error"] = str(e)[-1500:]
            if not self.running and result["stage"] in ("restart", "verify"):
                self.explain_start(config)
            if result["stage"] in ("restart", "verify", "swap"):
                self.roll_back(config)
        finally:
            self.tidy()
        return result


def settle(req: dict[str, Any]) -> dict[str, Any]:
    """After a wave (``mode``): ``forget`` drops the kept old files; ``restore`` puts them back (and removes the
    files that were new), restarts the engine and verifies its listeners: the wave is rolled back."""
    root = str(req.get("root", "/"))
    restore = req["mode"] == "restore"
    for path, had_old in req["swapped"]:
        path = at(root, path)
        if restore and had_old and os.path.exists(path + ".reconciler-old"):
            os.replace(path + ".reconciler-old", path)
        elif restore and not had_old and os.path.exists(path):
            os.remove(path)
        elif os.path.exists(path + ".reconciler-old"):
            os.remove(path + ".reconciler-old")
    if not restore:
        return {"ok": True}
    commit = Commit({**req, "moves": [], "config_new": req["config"], "files": [], "binary_new": None})
    commit.restart("restart")
    return {"ok": commit.verify()}


def main(req: dict[str, Any] | None = None) -> None:
    """The request from stdin, or as given (run as the apply lock's ``then``: it read stdin and names the root)."""
    if req is None:
        req = json.load(sys.stdin)
    print(json.dumps(settle(req) if req.get("mode") in ("restore", "forget") else Commit(req).run()))


if __name__ == "__main__":
    main()
