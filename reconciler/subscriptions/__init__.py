"""Subscriptions: pure renderers (share links, sing-box JSON, Clash/Mihomo YAML) and their headers."""

from reconciler.subscriptions.document import Document, choose_format, render
from reconciler.subscriptions.formats import FORMATS

__all__ = ["FORMATS", "Document", "choose_format", "render"]
