"""Shared helpers of the deployment tests: file locations, PromQL extraction, Prometheus HTTP API."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = REPO / "k8s"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"

#: What Grafana would put in for the dashboard variables when every model/replica is selected.
GRAFANA_VARS = {"$__rate_interval": "20s", "$__interval": "5s", "$model": ".*", "$replica": ".*"}


def dashboards() -> dict[str, dict]:
    """File name -> parsed dashboard JSON."""
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def dashboard_queries() -> list[tuple[str, str, str]]:
    """``(dashboard file, panel title + refId, expr)`` of every panel target of every dashboard."""
    out = []
    for name, dash in dashboards().items():
        for panel in _panels(dash["panels"]):
            for t in panel.get("targets", []):
                out.append((name, f"{panel['title']} [{t['refId']}]", t["expr"]))
    return out


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))
    return out


def substitute(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would (All selected)."""
    for var, value in sorted(GRAFANA_VARS.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    left = re.findall(r"\$\{?\w+", expr)
    if left:
        raise AssertionError(f"unknown dashboard variable(s) {left} in {expr!r}")
    return expr


def alert_rules(path: Path = ALERTS) -> list[dict]:
    """Every rule of a Prometheus rule file (alerts and recording rules)."""
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


class PromAPI:
    """A few calls of Prometheus' HTTP API.

    Parameters
    ----------
    url : str
        e.g. ``http://127.0.0.1:9090``.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def get(self, path: str, **params) -> dict:
        q = urllib.parse.urlencode(params)
        req = urllib.request.Request(f"{self.url}{path}?{q}" if q else f"{self.url}{path}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as e:  # 400/422: a PromQL error, with a JSON body
            return json.loads(e.read() or b"{}") | {"http_status": e.code}

    def query(self, expr: str, at: float | None = None) -> dict:
        return self.get("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at else {}))

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> dict:
        return self.get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=str(step))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_for(self, expr: str, predicate, timeout: float = 60.0) -> list:
        """Poll an instant query until ``predicate(result list)`` holds; returns that result."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.query(expr)
            if last.get("status") == "success" and predicate(last["data"]["result"]):
                return last["data"]["result"]
            time.sleep(1.0)
        raise AssertionError(f"{expr!r} did not reach the expected value in {timeout}s; last answer: {last}")


def finite_points(result: dict) -> int:
    """Number of finite sample values in a query_range answer."""
    n = 0
    for series in result["data"]["result"]:
        for _, v in series.get("values", []):
            if v not in ("NaN", "+Inf", "-Inf"):
                n += 1
    return n
