"""The scripts that run on the servers, as real files (package data read by ``reconciler.engine.remote``).

Each runs on the server's own ``python3 -I -S`` (standard library only; Python 3.7 syntax, the oldest
we meet): ``facts``, ``commit``, ``engine`` (stage an uploaded or downloaded engine binary), ``firewall``,
``lock`` and ``files``. Every path a script touches is a server path from its request, joined under the
request's ``root`` (default ``/``), so the same text runs unchanged against a temporary directory in the
fake host's tests (``reconciler.ssh.fake``). They are also importable here, for unit tests and type checks:
nothing runs at import, only under ``__main__``.

The helpers they share live in ``prelude``: a script imports them (``from reconciler.engine.scripts.prelude import
…``), and ``source`` splices the prelude's body in place of that line when the script is read to be sent.
"""

from __future__ import annotations

import re
from importlib import resources

_PRELUDE_IMPORT = re.compile(r"^from reconciler\.engine\.scripts\.prelude import [^\n]+\n", re.M)


def _text(name: str) -> str:
    return resources.files("reconciler.engine.scripts").joinpath(f"{name}.py").read_text(encoding="utf-8")


def prelude_body() -> str:
    """The prelude without its docstring: what is spliced into a script."""
    text = _text("prelude")
    return text[text.index('"""', 3) + 3:].lstrip("\n")


def spliced(text: str) -> str:
    """A script's text as the server runs it: its import of the prelude replaced by the prelude's body."""
    return _PRELUDE_IMPORT.sub(lambda _: "# --- prelude (reconciler/engine/scripts/prelude.py) ---\n" + prelude_body()
                               + "# --- end of prelude ---\n", text, count=1)


def source(name: str) -> str:
    """The text of ``reconciler/engine/scripts/<name>.py``, as the server runs it (``spliced``)."""
    return spliced(_text(name))
