"""The topology picture (ROUTE-8) in Mermaid, DOT and SVG."""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from reconciler.config import load_cluster
from reconciler.topology import dot, mermaid, svg
from tests.conftest import EXAMPLE

SVG_NS = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(str(EXAMPLE)).cluster


def test_mermaid_links_routes_but_not_empty_ones(cluster):
    # spec: ROUTE-8, ROUTE-5
    text = mermaid(cluster)
    assert text.startswith("flowchart LR")
    assert "route_europe --> dist" in text and "route_usa --> dist" in text
    assert "route_japan --> dist" not in text
    assert 'route_japan(["🇯🇵 Japan (empty)"]):::empty' in text
    assert "in_ber_1_ss -.-> unassigned" in text
    assert "in_fra_1_reality -->|central| route_europe" in text


def test_dot_is_accepted_by_graphviz(cluster, tmp_path):
    # spec: ROUTE-8
    text = dot(cluster)
    assert "route_japan -> dist" not in text and "style=dashed" in text
    binary = shutil.which("dot")
    assert binary, "graphviz is installed by `make setup`"
    out = subprocess.run([binary, "-Tsvg"], input=text.encode(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stderr.decode()
    assert b"<svg" in out.stdout


def test_svg_is_well_formed_with_dashed_empty_routes_and_health_colours(cluster):
    # spec: ROUTE-8, HEALTH-13
    text = svg(cluster, health={"fra-1": "unreachable", "ny-1": "ok"})
    root = ET.fromstring(text)
    groups = {g.get("data-route"): g for g in root.iter(f"{SVG_NS}g") if g.get("data-route")}
    assert set(groups) == {"europe", "usa", "fast", "japan"}
    japan_rect = groups["japan"].find(f"{SVG_NS}rect")
    assert japan_rect.get("stroke-dasharray")
    assert groups["usa"].find(f"{SVG_NS}rect").get("stroke-dasharray") is None
    links_to_dist = [p for p in root.iter(f"{SVG_NS}path") if p.get("class") == "to-dist"]
    assert len(links_to_dist) == 3  # europe, usa, fast — not the empty japan
    servers = {g.get("data-server"): g.get("data-status") for g in root.iter(f"{SVG_NS}g") if g.get("data-server")}
    assert servers["fra-1"] == "unreachable" and servers["ny-1"] == "ok" and servers["ams-1"] == "unknown"
    assert any(g.get("class") == "unassigned" for g in root.iter(f"{SVG_NS}g"))


def test_topology_command_writes_each_format(cli, tmp_path):
    for fmt in ("svg", "mermaid", "dot"):
        out = tmp_path / f"t.{fmt}"
        run = cli("topology", "-f", str(EXAMPLE), "--format", fmt, "-o", str(out))
        assert run.rc == 0, run.text
        assert out.read_text()


def test_the_svg_shows_each_inbounds_health_and_its_labels_fit_their_boxes():
    # issue 15 / ROUTE-8: per inbound, not only per server; boxes as wide as their longest label
    import re

    from reconciler.model import Cluster
    from reconciler.topology import svg, text_width

    long = "🇯🇵 東京 — a very long display name for an inbound that users see"
    c = Cluster.model_validate({
        "servers": [{"name": "tokyo-primary-datacenter-01", "host": "192.0.2.1", "country": "JP", "prober": True,
                     "inbounds": [{"id": "t1", "name": long, "protocol": "trojan", "port": 443, "route": "r",
                                   "tls": {"server_name": "x.test"}},
                                  {"id": "t2", "name": "short", "protocol": "shadowsocks-2022", "port": 8388, "route": "r"}]}],
        "routes": [{"id": "r", "name": "A route whose name is much longer than the old fixed box", "flag": "🇯🇵"}]})
    drawn = svg(c, {"tokyo-primary-datacenter-01": "ok", "t1": "unreachable", "t2": "ok"})
    assert re.search(r'<circle[^>]*data-inbound="t1" data-status="unreachable"', drawn)
    assert re.search(r'<circle[^>]*data-inbound="t2" data-status="ok"', drawn)
    server_w = float(re.search(r'<g class="server"[^>]*><rect x="20.0" y="40.0" width="(\d+)"', drawn).group(1))
    assert text_width(f"{long} trojan:443 · unreachable") + 26 <= server_w
    route_w = float(re.search(r'<g class="route"[^>]*><rect x="[\d.]+" y="[\d.]+" width="(\d+)"', drawn).group(1))
    assert text_width("🇯🇵 A route whose name is much longer than the old fixed box", bold=True) + 16 <= route_w
