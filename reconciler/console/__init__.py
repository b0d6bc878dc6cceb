"""The read-only console on the operations listener: the fleet, each server's and user's card, the routes and the
topology, server-rendered with no script (``render``), from what the loop knew after its last interval (``views``)."""

from reconciler.console.render import Answer, answer, is_console

__all__ = ["Answer", "answer", "is_console"]
