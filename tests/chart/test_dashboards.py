"""The committed dashboards are exactly what charts/dashboards/generate.py makes."""

from __future__ import annotations

import json
import subprocess
import sys

from helm_tools import CHART, ROOT

GENERATOR = ROOT / "charts" / "dashboards" / "generate.py"


def test_regenerated_dashboards_equal_the_committed_files(tmp_path):
    run = subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    made = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    committed = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert made.keys() == committed.keys()
    for name, text in made.items():
        assert text == committed[name], f"{name} is stale: run python charts/dashboards/generate.py"


def test_check_mode_reports_a_stale_file(tmp_path):
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(tmp_path)], check=True)
    stale = next(tmp_path.glob("*.json"))
    stale.write_text(stale.read_text().replace("MaruCache", "MaroCache"))
    run = subprocess.run([sys.executable, str(GENERATOR), "--check", "--out", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and stale.name in run.stderr


def test_every_panel_has_a_unique_id_and_uses_the_datasource_variable():
    for path in (CHART / "dashboards").glob("*.json"):
        board = json.loads(path.read_text())
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and 0 not in ids, path.name
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
