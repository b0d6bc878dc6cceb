"""Includes: more servers, routes and users from other files, confined to the cluster's folder (GITOPS-1).

The main file may list ``includes:`` (paths or globs, relative to the main file).
Each included file holds ``servers``, ``routes`` and/or ``users`` lists that are
appended, in order, to the main file's; errors in an included entry point into the
included file. Called by the loader before the schema is checked.

An include names a file, and the cluster file is what a pull request edits, so it is
confined (``safe_read.confine``, the one place that decides):

- every file it reaches must lie, after resolving symlinks, inside the main
  file's folder tree (the repository) or inside a folder the operator allows outside
  the file (``--allow-path DIR``, ``RECONCILER_ALLOW_PATHS``); ``../`` or a symlink out
  of the tree is refused *before* the file is opened, checked again on the opened file
  (a symlink swapped in meanwhile is refused too), and the refusal never shows what
  the file holds; ``settings.include_roots``, which once allowed more from inside the
  file, is refused with a pointer to the option;
- a glob is expanded by a bounded walk: at most ``MAX_GLOB_PARTS`` path parts with
  wildcards, ``MAX_GLOB_VISITS`` directory entries looked at, ``MAX_INCLUDED_FILES``
  files in all (a ``**/**/**…`` pattern over a large tree is refused in milliseconds);
- every file is read bounded and parsed against the budget the main file started.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from typing import Any

from reconciler import safe_read
from reconciler.config.diagnostics import Diagnostic, Pos, SourceMap, at, shown
from reconciler.config.yamlread import MAX_FILE_BYTES, Budget, TopLevel, decoded, file_bytes, read_yaml
from reconciler.errors import Problem

INCLUDABLE = ("servers", "routes", "users")
# An included file's lists stop at their first wrong kind (before the value is read); another key is refused below,
# with what an included file may hold.
INCLUDED_TOP = TopLevel(dict.fromkeys(INCLUDABLE, "list"), closed=False, records=frozenset(INCLUDABLE))
#: Files all includes together may name (each is parsed; the node budget bounds the rest).
MAX_INCLUDED_FILES = 256
#: Path parts with a wildcard in one pattern (``servers.d/*/*.yaml`` has two).
MAX_GLOB_PARTS = 4
#: Directory entries one pattern's expansion may look at.
MAX_GLOB_VISITS = 20_000


class _GlobTooBig(Exception):
    pass


def allow_hint(folder: str | None = None) -> str:
    """What to do about a file outside the repository (an include, or any other path the file names)."""
    where = shown(folder, 200) if folder else "DIR"  # quoted: a folder's name may hold anything
    return (f"move the file into the cluster file's folder (the repository), or, if the controller may read it where it "
            f"is, allow its folder where reconciler runs: `{safe_read.OPTION} {where}` or the environment variable "
            f"{safe_read.ENV}; no setting in the file can allow it, since a pull request can edit the file")


ALLOW_HINT = allow_hint()


def moved_settings(data: dict[str, Any], source: SourceMap) -> list[Diagnostic]:
    """An error at ``settings.include_roots``, which allowed includes outside the repository from inside the file
    (a pull request could edit it); taken out of ``data`` so the schema does not report it a second time."""
    settings = data.get("settings")
    if not isinstance(settings, dict) or "include_roots" not in settings:
        return []
    del settings["include_roots"]
    return [at("error", source.key(("settings", "include_roots")),
               "settings.include_roots is no longer read from the cluster file: a pull request could edit it to let "
               "includes read any file of the controller",
               f"remove it, and allow the folders outside the repository where reconciler runs: `{safe_read.OPTION} DIR` "
               f"(repeatable) or the environment variable {safe_read.ENV} (folders separated by {os.pathsep!r})",
               "include-roots")]


def expand(pattern: str, base: str) -> list[str]:
    """The files a pattern names, sorted; a plain path is returned as is (its existence is checked on reading)."""
    full = os.path.normpath(os.path.join(base, pattern))
    if not glob.has_magic(pattern):
        return [full]
    anchor, *parts = full.split(os.sep)
    if sum(1 for p in parts if glob.has_magic(p)) > MAX_GLOB_PARTS:
        raise _GlobTooBig
    candidates = [anchor + os.sep]
    visits = 0
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        found: list[str] = []
        for folder in candidates:
            if not glob.has_magic(part):
                path = os.path.join(folder, part)
                if last or os.path.isdir(path):
                    found.append(path)
                continue
            try:
                entries = os.scandir(folder)
            except (OSError, ValueError):
                continue
            with entries:
                for entry in entries:
                    visits += 1
                    if visits > MAX_GLOB_VISITS:
                        raise _GlobTooBig
                    if entry.name.startswith(".") and not part.startswith("."):
                        continue  # like glob: hidden names only for a pattern that starts with a dot
                    if fnmatch.fnmatchcase(entry.name, part) and (last or entry.is_dir()):
                        found.append(entry.path)
        candidates = found
        if len(candidates) > MAX_INCLUDED_FILES:
            raise _GlobTooBig
    return sorted(c for c in candidates if os.path.lexists(c))


def merge_includes(data: dict[str, Any], main_path: str, display: str, source: SourceMap,
                   overrides: dict[str, str] | None, budget: Budget) -> list[Diagnostic]:
    """Append the lists of every included file to ``data`` in place, remapping positions."""
    problems = moved_settings(data, source)
    includes = data.get("includes")
    if includes is None:
        return problems
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        return [*problems, at("error", source.value(("includes",)), "includes must be a list of file paths",
                              "write e.g. `includes: [users.yaml, servers.d/*.yaml]`", "include")]
    if len(includes) > MAX_INCLUDED_FILES:
        return [*problems, at("error", source.value(("includes",)), f"includes lists {len(includes)} entries, more than {MAX_INCLUDED_FILES}",
                   "use a glob such as `users.d/*.yaml`", "include")]
    base = os.path.dirname(os.path.abspath(main_path))
    roots = safe_read.roots(base)
    display_base = os.path.dirname(display)
    seen: set[str] = {os.path.realpath(main_path)}
    for index, pattern in enumerate(includes):
        here = source.value(("includes", index))
        if "\x00" in pattern:
            problems.append(at("error", here, "an include path contains a NUL character", None, "include"))
            continue
        try:
            matches = expand(pattern, base)
        except _GlobTooBig:
            problems.append(at("error", here, f"include {shown(pattern)} reaches too far (more than {MAX_GLOB_PARTS} wildcard "
                                              f"parts, {MAX_GLOB_VISITS} entries looked at or {MAX_INCLUDED_FILES} files)",
                               "name the folder, e.g. `users.d/*.yaml`", "include"))
            continue
        if not matches:
            problems.append(at("error", here, f"include {shown(pattern)} matches no file", "check the path or pattern", "include"))
        for match in matches:
            try:
                real = safe_read.confine(match, roots)
            except safe_read.OutsideRepository as exc:
                problems.append(at("error", here, f"include {shown(pattern)} reaches outside the cluster's folder (the "
                                                  "repository)", allow_hint(os.path.dirname(exc.resolved)), "include"))
                break
            if real in seen:
                problems.append(at("error", here, f"{shown(pattern)} is included twice (or includes the main file)", None, "include"))
                continue
            seen.add(real)
            if len(seen) > MAX_INCLUDED_FILES + 1:
                problems.append(at("error", here, f"more than {MAX_INCLUDED_FILES} files are included",
                                   "merge small files", "include"))
                return problems
            rel = os.path.relpath(match, base)
            where = os.path.join(display_base, rel) if display_base else rel
            problems.extend(_merge_one(data, source, match, where, here, pattern, overrides, budget, base))
    return problems


def _confined_text(match: str, where: str, base: str) -> str:
    """The included file's text, read through ``safe_read.read_confined`` (checked again on the opened file);
    ``Problem`` as ``yamlread.read_text`` gives it when it cannot be had."""
    def read() -> bytes:
        try:
            return safe_read.read_confined(match, base, MAX_FILE_BYTES)
        except safe_read.OutsideRepository as exc:  # before file_bytes' OSError: it says why, and what to do
            raise Problem(Diagnostic("error", f"reaches outside the cluster's folder (the repository): {exc.strerror}",
                                     ALLOW_HINT, file=where, code="include")) from None
    return decoded(file_bytes(read, where), where)


def _merge_one(data: dict[str, Any], source: SourceMap, match: str, where: str, here: Pos | None, pattern: str,
               overrides: dict[str, str] | None, budget: Budget, base: str) -> list[Diagnostic]:
    full = os.path.abspath(match)
    try:
        if not (overrides and full in overrides):  # an edit being checked stands in for the file; else the disk's
            overrides = {**(overrides or {}), full: _confined_text(full, where, base)}
        sub, sub_source = read_yaml(full, where, overrides, budget, top=INCLUDED_TOP)
    except Problem as problem:
        d = problem.diagnostic
        return [d if d.line else at("error", here, f"include {shown(pattern)}: {d.message}", d.hint, d.code)]
    if sub is None:
        return []
    if not isinstance(sub, dict):
        return [at("error", sub_source.root, "an included file must be a mapping",
                   f"give it top-level keys among: {', '.join(INCLUDABLE)}", "include")]
    problems = []
    for key, value in sub.items():
        kpos = sub_source.key((key,))
        if key not in INCLUDABLE:
            problems.append(at("error", kpos, f"{shown(key)} cannot be set in an included file",
                               f"included files may hold only: {', '.join(INCLUDABLE)}", "include"))
            continue
        if value is None:
            continue
        if not isinstance(value, list):
            problems.append(at("error", kpos, f"{key} must be a list", None, "type"))
            continue
        target = data.setdefault(key, [])
        if target is None:
            target = data[key] = []
        if not isinstance(target, list):
            continue  # the main file's own type error is reported by validation
        offset = len(target)
        target.extend(value)
        for table, sub_table in ((source.keys, sub_source.keys), (source.values, sub_source.values)):
            for p, pos in sub_table.items():
                if len(p) >= 2 and p[0] == key and isinstance(p[1], int):
                    table[(key, p[1] + offset) + p[2:]] = pos
    return problems
