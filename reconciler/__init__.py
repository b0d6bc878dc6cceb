"""A declarative GitOps reconciler for self-hosted VPN clusters."""

__version__ = "0.1.0"
