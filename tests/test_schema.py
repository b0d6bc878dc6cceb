"""The JSON Schema in schemas/ is generated from the models and kept fresh (GITOPS-1)."""

from __future__ import annotations

import json

import jsonschema
from ruamel.yaml import YAML

from reconciler.config.schema import schema_text
from tests.conftest import EXAMPLE, ROOT

SCHEMA = ROOT / "schemas" / "cluster.schema.json"


def test_committed_schema_is_fresh():
    # spec: GITOPS-1
    assert SCHEMA.read_text(encoding="utf-8") == schema_text(), "run `reconciler schema` and commit the result"


def test_schema_check_command(cli, tmp_path):
    out = tmp_path / "s.json"
    assert cli("schema", "--out", str(out), "--check").rc == 1
    assert cli("schema", "--out", str(out)).rc == 0
    assert cli("schema", "--out", str(out), "--check").rc == 0


def test_editors_accept_the_example_with_the_schema():
    schema = json.loads(SCHEMA.read_text())
    data = YAML(typ="safe").load(EXAMPLE.read_text())
    data = json.loads(json.dumps(data, default=str))  # dates as editors see them: strings
    jsonschema.validate(data, schema)


def test_editors_flag_an_unknown_key_with_the_schema():
    schema = json.loads(SCHEMA.read_text())
    data = YAML(typ="safe").load(EXAMPLE.read_text())
    data = json.loads(json.dumps(data, default=str))
    data["servers"][0]["inbounds"][0]["camoflage"] = "x"
    try:
        jsonschema.validate(data, schema)
    except jsonschema.ValidationError:
        return
    raise AssertionError("schema accepted an unknown key")


def test_example_carries_the_schema_modeline():
    assert EXAMPLE.read_text().splitlines()[0] == "# yaml-language-server: $schema=schemas/cluster.schema.json"
