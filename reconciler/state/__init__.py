"""The controller's state on disk: ``files`` (the one atomic writer, used by every writer in the
project) and ``folder`` (the state folder beside the cluster file: its lock, known host keys,
facts, managed servers and the learned state).

Nothing is imported here, so the writer can sit at the bottom of the layers and the folder above
the fleet core.
"""
