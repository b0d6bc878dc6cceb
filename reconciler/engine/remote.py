"""The server-side scripts (``reconciler/engine/scripts/``, package data) loaded as ``Script``s for a ``Runner``.

Each script is a real module, linted, type-checked and unit-tested like the rest; here it is read as
text (importlib.resources), once, and sent to the server's ``python3 -I -S`` by the runner:

- ``FACTS``: raw observations (request spliced in: it starts without json);
- ``COMMIT``: one transaction in one round trip (request on stdin: it carries files; under ``setsid -w``);
- ``ENGINE``: stage an uploaded (zstd or gzip on stdin) or downloaded engine binary with its sidecars;
- ``FIREWALL``: load the firewall, keep it only if a fresh SSH connection gets in;
- ``LOCK``: take or release the apply lock (policy: ``reconciler.plan.lock``);
- ``FILES``: read old contents for diffs, remove files (prune);
- ``ACME``: answer a CA's HTTP-01 challenge (detached; ``reconciler.apply.acme``);
- ``AGENT``: the collection agent, installed on every server, run every report interval (``reconciler.loop``).
"""

from __future__ import annotations

from reconciler.engine.base import AGENT as AGENT_PATH
from reconciler.engine.base import AGENT_SOURCE
from reconciler.engine.scripts import source
from reconciler.ssh.runner import Script

FACTS = Script("facts", source("facts"))
COMMIT = Script("commit", source("commit"), stdin=True, survive=True)
ENGINE = Script("engine", source("engine"))
FIREWALL = Script("firewall", source("firewall"))
LOCK = Script("lock", source("lock"))
#: The lock script carrying a commit (``then``): under ``setsid -w`` like the commit alone.
LOCK_SURVIVING = Script("lock", LOCK.source, survive=True)
FILES = Script("files", source("files"))
ACME = Script("acme", source("acme"))
#: The collection agent: installed by apply (a managed file), run from there every report interval.
AGENT = Script("agent", AGENT_SOURCE.decode(), stdin=True, installed=AGENT_PATH)


def facts_script(request: dict[str, object]) -> str:
    """The facts script's text with its request spliced in (what the server runs)."""
    return FACTS.prepare(request)[0]
