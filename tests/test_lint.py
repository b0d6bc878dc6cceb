"""Style and layering are checked by tools, not by memory (STYLE.md)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib

from tests.conftest import ROOT

BIN = os.path.dirname(sys.executable)


def test_ruff_is_clean():
    targets = [d for d in ("reconciler", "tests", "bench") if (ROOT / d).is_dir()]
    out = subprocess.run([os.path.join(BIN, "ruff"), "check", *targets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_import_layers_hold():
    out = subprocess.run([os.path.join(BIN, "lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy_strict_is_clean():
    # [tool.mypy] in pyproject.toml: strict over reconciler/, so an unneeded `type: ignore` fails too.
    out = subprocess.run([os.path.join(BIN, "mypy")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import only for the type checker (``if TYPE_CHECKING:``) or optional (``try: ... except ImportError``)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and node in parent.body and "TYPE_CHECKING" in ast.unparse(parent.test):
            return True
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = " ".join(ast.unparse(h.type) for h in parent.handlers if h.type is not None)
            if "ImportError" in caught or "ModuleNotFoundError" in caught:
                return True
        node = parent
    return False


def test_runtime_imports_are_declared():
    # What the controller imports at run time must be in [project].dependencies, not merely present
    # because something else pulled it in (cryptography came with asyncssh until it was declared).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower().replace("_", "-")
                for d in project["dependencies"]}
    owners = importlib.metadata.packages_distributions()
    missing: dict[str, list[str]] = {}
    for path in sorted((ROOT / "reconciler").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.partition(".")[0]
                if top in sys.stdlib_module_names or top == "reconciler" or _guarded(node, parents):
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                if not dists & declared:
                    missing.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, f"imported but not in [project].dependencies: {missing}"


def test_every_error_the_reconciler_raises_on_purpose_is_defined_in_errors_py():
    # One tree (reconciler/errors.py): a public exception class defined anywhere else is a second home. Private ones
    # (a module's own control flow, never leaving it) and the server scripts' (they run alone, stdlib only) are not.
    import builtins

    bases = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), BaseException)}
    errors = ROOT / "reconciler" / "errors.py"
    defined_in_errors = {n.name for n in ast.parse(errors.read_text()).body if isinstance(n, ast.ClassDef)}
    elsewhere = []
    for path in (ROOT / "reconciler").rglob("*.py"):
        if path == errors or "engine/scripts" in str(path) or path.name == "agent.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            names = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if names & (bases | defined_in_errors):
                elsewhere.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not elsewhere, elsewhere
