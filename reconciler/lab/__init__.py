"""Local sandbox hosts (real systemd and sshd in network namespaces) for tests, benchmarks and the demo."""

from reconciler.lab.hosts import Host, Lab, LabError, lab_dir

__all__ = ["Host", "Lab", "LabError", "lab_dir"]
