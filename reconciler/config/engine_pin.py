"""In-place pinning of an engine: ``reconciler engine pin`` writes ``sha256`` (per architecture for a release; one
for a local binary, ``--binary``) and ``capabilities`` into ``settings.engine`` (or ``settings.engines.<name>``) of
the cluster file. The pinned capabilities are what validate knows of a binary the controller does not run (one
inside the repository: ``engine.capabilities``).

The same machinery as ``hostkeys pin`` (``reconciler.config.edit``): ruamel finds the engine's mapping and the
positions of its keys, the edit is a splice of the original text (comments, order and quoting stay), the
result is checked as a whole before it is written atomically. Settings live in the main file.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ruamel.yaml import YAML

from reconciler.config.edit import _atomic_write, _set_key
from reconciler.config.loader import load_cluster
from reconciler.config.yamlread import read_text
from reconciler.errors import EditError, Problem


def pin_engine(path: str, name: str, sha256: dict[str, str] | str, capabilities: tuple[str, ...] | None) -> None:
    """Write the pins of engine ``name`` into the file at ``path``: ``sha256`` per architecture (a release) or one
    (a local binary); ``EditError`` (nothing written) when its settings cannot be found or the result would be invalid."""
    try:
        text = read_text(path, path)
    except Problem as problem:
        raise EditError(f"cannot read {path}: {problem.diagnostic.message}") from None
    node = _engine_node(text, name)
    if node is None:
        raise EditError(f"{path} has no settings for the {name} engine to pin (settings.engine with name: {name}, "
                        f"or settings.engines.{name}); add its install: download and url (or its binary) first")
    value = sha256 if isinstance(sha256, str) else "{" + ", ".join(f"{arch}: {digest}" for arch, digest in sorted(sha256.items())) + "}"
    text = _set_key(text, node, "sha256", value)
    if capabilities is not None:
        node = _engine_node(text, name)
        text = _set_key(text, node, "capabilities", "[" + ", ".join(capabilities) + "]")
    check = load_cluster(path, overrides={os.path.abspath(path): text})
    if check.cluster is None:
        raise EditError("pinning would make the file invalid; nothing was written", check.errors)
    _atomic_write(path, text)


def _engine_node(text: str, name: str) -> Any:
    with warnings.catch_warnings():  # a reused anchor warns; the loader already accepted the file
        warnings.simplefilter("ignore")
        doc = YAML(typ="rt").load(text)
    settings = (doc or {}).get("settings") or {}
    engine = settings.get("engine")
    if isinstance(engine, dict) and engine.get("name", "sing-box") == name:
        return engine
    engines = settings.get("engines")
    if isinstance(engines, dict) and isinstance(engines.get(name), dict):
        return engines[name]
    return None
