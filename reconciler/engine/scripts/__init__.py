"""The scripts that run on the servers, as real files (package data read by ``reconciler.engine.remote``).

Each runs on the server's own ``python3 -I -S`` (standard library only; Python 3.7 syntax, the oldest
we meet): ``facts``, ``commit``, ``engine`` (stage an uploaded or downloaded engine binary), ``firewall``,
``lock`` and ``files``. Every path a script touches is a server path from its request, joined under the
request's ``root`` (default ``/``), so the same text runs unchanged against a temporary directory in the
fake host's tests (``reconciler.ssh.fake``). They are also importable here, for unit tests and type checks:
nothing runs at import, only under ``__main__``.
"""
