"""The CI examples as written (issue 15): validated by the tools CI providers' users run (action-validator for GitHub
Actions, gitlab-ci-local for GitLab CI), and their steps run against lab hosts: the GitLab plan job through
gitlab-ci-local's shell executor, the GitHub steps' own scripts through bash, with the API each posts to stood in
for by a recording HTTP server on loopback. The comment is one, updated, and names no address and no secret.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from reconciler.lab import lab_cluster_yaml
from tests.lab.conftest import ROOT, SECRET, reset_hosts

TOOLS = ROOT / ".tools" / "node_modules" / ".bin"
EXAMPLES = ROOT / "examples" / "ci"
ADDRESS = re.compile(r"\b198\.18\.\d+\.\d+\b")


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (`make setup` installs it with npm)")
    return str(path)


def test_the_github_workflow_is_valid():
    run = subprocess.run([tool("action-validator"), str(EXAMPLES / "github-actions.yml")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


class Notes(BaseHTTPRequestHandler):
    """GitLab's notes API as the example uses it: list, create, update; what was posted is kept."""

    store: dict[int, str] = {}
    calls: list[str] = []

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append("GET")
        self._send(200, [{"id": i, "body": b} for i, b in self.store.items()])

    def do_POST(self) -> None:
        self.calls.append("POST")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["body"]
        self.store[len(self.store) + 1] = body
        self._send(201, {"id": len(self.store)})

    def do_PUT(self) -> None:
        self.calls.append("PUT")
        note = int(self.path.rsplit("/", 1)[1])
        self.store[note] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["body"]
        self._send(200, {"id": note})

    def log_message(self, *args: object) -> None:
        pass


def repository(lab, env: Path, ci_file: str) -> Path:
    """A git repository holding the CI file and a cluster of two lab hosts, keys and host keys as CI has them."""
    repo = env / "repo"
    repo.mkdir()
    shutil.copy(EXAMPLES / ci_file, repo / (".gitlab-ci.yml" if ci_file.startswith("gitlab") else "workflow.yml"))
    text = lab_cluster_yaml(lab, lab.state.hosts[:2], ["DE"]).replace(str(lab.key), "~/.ssh_deploy_key")
    (repo / "cluster.yaml").write_text(text.replace("state_dir: .reconciler-lab", "state_dir: .reconciler"))
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=ci@lab", "-c", "user.name=ci", "commit", "-qm", "cluster"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, timeout=60)
    return repo


def test_the_gitlab_pipeline_lists_its_jobs_and_its_plan_job_runs_against_lab_hosts(lab, env):
    reset_hosts(lab)
    runner = tool("gitlab-ci-local")
    repo = repository(lab, env, "gitlab-ci.yml")
    base = {**os.environ, "HOME": str(env), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def listed(*variables: str) -> list[str]:
        run = subprocess.run([runner, "--list-json", *(x for v in variables for x in ("--variable", v))], cwd=repo,
                             capture_output=True, text=True, timeout=120, env=base)
        assert run.returncode == 0, run.stdout + run.stderr
        return [j["name"] for j in json.loads(run.stdout[run.stdout.index("\n[") + 1:]) if j.get("when") != "never"]

    assert listed("CI_PIPELINE_SOURCE=merge_request_event") == ["plan"]
    assert listed("CI_COMMIT_BRANCH=main", "CI_DEFAULT_BRANCH=main") == ["apply"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Notes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Notes.store, Notes.calls = {}, []
    variables = {"CI_PIPELINE_SOURCE": "merge_request_event", "RECONCILER_INSTALL": "true", "RECONCILER_SECRET": SECRET,
                 "SSH_PRIVATE_KEY": str(lab.key), "GITLAB_API_TOKEN": "token",
                 "CI_API_V4_URL": f"http://127.0.0.1:{server.server_address[1]}/api/v4", "CI_PROJECT_ID": "7",
                 "CI_MERGE_REQUEST_IID": "3"}
    try:
        for _ in range(2):  # two pushes to the merge request: one note, updated
            run = subprocess.run([runner, "plan", "--force-shell-executor", "--no-color",
                                  *(x for k, v in variables.items() for x in ("--variable", f"{k}={v}"))],
                                 cwd=repo, capture_output=True, text=True, timeout=600, env=base)
            assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    finally:
        server.shutdown()
        server.server_close()
    assert Notes.calls == ["GET", "POST", "GET", "PUT"] and len(Notes.store) == 1
    note = Notes.store[1]
    assert note.startswith("<!-- reconciler-plan -->") and "| vps1 |" in note and "to add" in note
    assert not ADDRESS.search(note) and SECRET not in note


def test_the_github_steps_plan_comment_and_apply_that_plan_against_lab_hosts(lab, env):
    # The workflow's own `run:` scripts, in order, in bash (what the runner would execute), on lab hosts.
    reset_hosts(lab)
    repo = repository(lab, env, "github-actions.yml")
    workflow = YAML(typ="safe").load((repo / "workflow.yml").read_text())
    script = {job: [s for s in workflow["jobs"][job]["steps"] if "run" in s] for job in ("plan", "apply")}
    env_vars = {**os.environ, "HOME": str(env), "RECONCILER_SECRET": SECRET, "SSH_PRIVATE_KEY": Path(lab.key).read_text(),
                "GITHUB_OUTPUT": str(env / "github-output"),
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def run_steps(job: str) -> None:
        for step in script[job]:
            if step["run"].startswith("pip install"):
                continue  # installed already: this checkout is the package
            run = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=repo, env=env_vars, capture_output=True,
                                 text=True, timeout=600)
            assert run.returncode == 0, f"{step.get('name', step['run'][:40])}: {run.stdout[-3000:]}{run.stderr[-2000:]}"

    run_steps("plan")
    comment = (repo / "comment.md").read_text()
    assert comment.startswith("<!-- reconciler-plan -->") and not ADDRESS.search(comment) and SECRET not in comment
    assert (repo / "plan.json").exists()
    run_steps("apply")  # plans once, applies exactly that plan
    again = subprocess.run(["reconciler", "plan", "-f", "cluster.yaml", "--strict-host-keys"], cwd=repo, env=env_vars,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr  # converged
