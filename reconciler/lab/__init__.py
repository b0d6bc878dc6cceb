"""Local sandbox hosts (real systemd and sshd in network namespaces) for tests, benchmarks and the demo.

- ``hosts``: the hosts themselves (``Lab``);
- ``cluster``: the cluster file for them (``lab_cluster_yaml``);
- ``demo``: ``reconciler demo`` against them, and ``LoopProcess`` (``reconciler run`` as a child process).
"""

from reconciler.lab.cluster import lab_cluster_yaml
from reconciler.lab.hosts import Host, Lab, lab_dir

__all__ = ["Host", "Lab", "lab_cluster_yaml", "lab_dir"]
