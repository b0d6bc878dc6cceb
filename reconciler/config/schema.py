"""The JSON Schema of the cluster file (GITOPS-1), generated from the model; editors validate with it."""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.model import Cluster

SCHEMA_PATH = Path("schemas") / "cluster.schema.json"


def schema_text() -> str:
    schema = Cluster.model_json_schema(mode="validation")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://reconciler.invalid/schemas/cluster.schema.json",
        **schema,
        "title": "reconciler cluster file",
        "description": "Desired state of a self-hosted VPN cluster: settings, servers, routes, users.",
    }
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
