"""Loading and editing the cluster file: positions, includes, semantic checks."""

from reconciler.config.diagnostics import Diagnostic, Pos, SourceMap
from reconciler.config.loader import LoadResult, load_cluster, load_document

__all__ = ["Diagnostic", "LoadResult", "Pos", "SourceMap", "load_cluster", "load_document"]
