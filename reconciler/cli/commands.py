"""The commands, which module holds each and its line in `reconciler --help`: known without importing any.

``reconciler COMMAND`` imports only COMMAND's module (each imports what it needs), so `--version`, `--help` and
each command start without loading the others' libraries (``bench/cli_start.py`` measures it)."""

from __future__ import annotations

#: command → (the module in ``reconciler.cli`` that registers it, its one line in ``--help``), in ``--help``'s order.
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("validate", "check a cluster file: schema and semantics (GITOPS-2)"),
    "schema": ("validate", "write the JSON Schema of the cluster file (GITOPS-1)"),
    "init": ("init", "scaffold a minimal valid cluster file"),
    "route": ("routes", "edit route membership in place, comments kept (ROUTE-3)"),
    "routes": ("routes", "list routes, their inbounds and warnings (ROUTE-4, ROUTE-5)"),
    "topology": ("routes", "draw servers, inbounds and routes (ROUTE-8)"),
    "plan": ("plan", "what apply would change on each server (GITOPS-3); exit 0 none, 2 changes, 1 error"),
    "show": ("plan", "print a plan saved with `plan --out`"),
    "apply": ("apply", "make the servers match the file (GITOPS-4)"),
    "subscription": ("fleet", "print a user's subscription document (needs the master secret, GITOPS-6)"),
    "status": ("status", "the fleet (like kubectl get), a server (like describe) or a user's entries"),
    "users": ("usage", "every user: usage this period, limit, reset, expiry, state, devices, last seen"),
    "user": ("users", "hand out a user's subscription"),
    "run": ("run", "the reconcile loop: collect, verdicts, outlets, drift correction (GITOPS-5)"),
    "simulate": ("run", "replay a health scenario through the verdict engine (HEALTH-1..13)"),
    "lab": ("lab", "local sandbox servers (root): network namespaces with systemd and sshd"),
    "demo": ("lab", "show what the reconciler does with the example cluster"),
    "secret": ("secret", "the master secret: make a strong one (GITOPS-6)"),
    "hostkeys": ("hostkeys", "pin the servers' SSH host keys in the cluster file"),
    "engine": ("engine", "pin engine releases the servers download"),
    "completion": ("completion", "print the shell code that completes commands and options"),
}

#: command → its one line in ``--help``: what each module passes to ``add_command``.
HELP: dict[str, str] = {name: help for name, (_, help) in COMMANDS.items()}
