"""The dashboard and alert rules only use metric names the server really exports."""

from __future__ import annotations

import json
import pathlib
import re

from deepserve.server.metrics import Metrics

DEPLOY = pathlib.Path(__file__).parents[2] / "deploy"


def _exported() -> set[str]:
    m = Metrics("m")
    m.record_finished("k", "ok", ["stop"], 1, 1)
    return set(re.findall(r"^(deepserve:\w+)", m.render().decode(), re.M))


def test_dashboard_metrics_are_exported():
    dashboard = json.loads((DEPLOY / "grafana" / "deepserve.json").read_text())
    used = set(re.findall(r"deepserve:\w+", json.dumps(dashboard)))
    assert used and used <= _exported(), used - _exported()


def test_alert_metrics_are_exported_or_recorded():
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    recorded = set(re.findall(r"record: (deepserve:[\w:]+)", text))
    used = set(re.findall(r"deepserve:[\w:]+", text)) - recorded
    assert used <= _exported(), used - _exported()
