"""Prometheus config and rules (promtool), the Grafana dashboard, the Dockerfile and the metrics sidecar."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (
    ALERTS,
    DASHBOARD_DIR,
    DEPLOY,
    GRAFANA_VARS,
    K8S,
    PROM_CONFIG,
    REPO,
    alert_rules,
    dashboard_queries,
    dashboards,
)
from ports import free_port

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)")
METRIC = re.compile(r"\b((?:lserve|ray|kube)[:_][A-Za-z0-9_:]+)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


# -- promtool -----------------------------------------------------------------------------------
@needs_promtool
def test_promtool_checks_the_rules():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


@needs_promtool
def test_promtool_checks_the_prometheus_rule_of_k8s(tmp_path):
    (doc,) = [d for d in yaml.safe_load_all((K8S / "prometheusrule.yaml").read_text())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_checks_the_config():
    r = promtool("check", "config", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_alert_unit_tests_pass():
    """deploy/prometheus/alerts_test.yml: each alert fires on its condition and not on healthy data."""
    r = promtool("test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_a_broken_rule_is_rejected(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(textwrap.dedent("""\
        groups:
          - name: x
            rules:
              - alert: Broken
                expr: sum by (model) (rate(lserve:num_preemptions_total[5m]) >
        """))
    assert promtool("check", "rules", str(bad)).returncode != 0


def test_alerts_cover_the_slos_and_failure_modes():
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for needed in ("LServeTTFTBudgetBurnFast", "LServeTTFTBudgetBurnSlow", "LServeITLBudgetBurnFast",
                   "LServeITLBudgetBurnSlow", "LServeQueueGrowing", "LServeKVCacheNearFull", "LServeReplicaRestarts"):
        assert needed in names
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    tested = set(re.findall(r"alertname: (\w+)", (DEPLOY / "prometheus" / "alerts_test.yml").read_text()))
    untested = set(names) - tested - {"LServePodRestarts", "LServeHTTP5xxHigh", "LServePreemptionsHigh",
                                      "LServeITLBudgetBurnSlow"}
    assert not untested, f"alerts without a promtool unit test: {untested}"


# -- metric names -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported_names() -> set[str]:
    """Names the serving code registers (engine and ingress metrics), from a clean process."""
    code = textwrap.dedent("""\
        import json
        from prometheus_client import REGISTRY
        from lserve.serve.metrics import EngineMetrics, HttpMetrics
        m = EngineMetrics("m", "r"); m.init_series(host_kv=True); HttpMetrics("m", "r").count("/x", 200)
        names = set()
        for fam in REGISTRY.collect():
            for s in fam.samples:
                names.add(s.name)
        print(json.dumps(sorted(n for n in names if n.startswith("lserve:"))))
        """)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    names = set(json.loads(out.stdout))
    # Gauges appear once set; histograms and counters are created at zero by init_series.
    code_gauges = re.findall(r'gauge\("(\w+)"', (REPO / "lserve" / "serve" / "metrics.py").read_text())
    return names | {"lserve:" + g for g in code_gauges}


def _lserve_metrics(expr: str) -> set[str]:
    return {m for m in METRIC.findall(expr) if m.startswith("lserve:")}


def test_dashboards_and_rules_use_only_exported_metrics(exported_names):
    used: dict[str, str] = {}
    for name, title, expr in dashboard_queries():
        for m in _lserve_metrics(expr):
            used[m] = f"{name}: {title}"
    for r in alert_rules():
        for m in _lserve_metrics(r["expr"]):
            used[m] = r["alert"]
    unknown = {m: where for m, where in used.items() if m not in exported_names}
    assert not unknown, f"metrics the server does not export: {unknown}"
    # The KV-read fraction (issue 37) is on the dashboard, from the gauge and from the two counters.
    kv = {m for m in used if m.startswith("lserve:decode_kv_")}
    assert kv == {"lserve:decode_kv_read_fraction", "lserve:decode_kv_read_head_tokens_total",
                  "lserve:decode_kv_dense_head_tokens_total"}, kv
    assert all(used[m].startswith("lserve-overview.json: Decode KV read fraction [") for m in kv), used
    # The host KV tier (issue 39): pages on host and resident, the hit rate, bytes copied per step.
    host = {m for m in used if m.startswith("lserve:host_kv_")}
    assert host == {"lserve:host_kv_pages_on_host", "lserve:host_kv_resident_slots_used", "lserve:host_kv_hits_total",
                    "lserve:host_kv_misses_total", "lserve:host_kv_hit_rate", "lserve:host_kv_bytes_h2d_total",
                    "lserve:host_kv_bytes_d2h_total", "lserve:host_kv_prefill_bytes_h2d_total"}, host


# -- Grafana ------------------------------------------------------------------------------------
def test_dashboard_json_is_generated_and_current():
    r = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "build_dashboards.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_dashboard_structure():
    dash = dashboards()["lserve-overview.json"]
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model", "replica"} <= variables
    boxes = []
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not any(cells & b for b in boxes), f"panel {p['title']!r} overlaps another"
        boxes.append(cells)
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["fieldConfig"]["defaults"]["unit"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"]))
            assert used <= variables | {k.lstrip("$") for k in GRAFANA_VARS}, t["expr"]
    titles = " ".join(p["title"] for p in panels)
    for needed in ("TTFT", "ITL", "TPOT", "Tokens / s", "Running / waiting", "KV usage per", "Preemptions",
                   "selector", "Pages selected", "per replica", "KV read fraction", "Host KV pages",
                   "GPU page-cache hit rate", "Host KV bytes copied"):
        assert needed.lower() in titles.lower(), needed


@needs_promtool
def test_dashboard_queries_parse_with_promtool(tmp_path):
    """Every panel query (variables filled in as Grafana would) is valid PromQL.

    ``promtool check rules`` parses expressions, so each query becomes a throwaway recording rule.
    """
    from deploy_helpers import substitute

    queries = dashboard_queries()
    rules = [{"record": f"dashboard:query_{i}", "expr": substitute(expr)} for i, (_, _, expr) in enumerate(queries)]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(queries)} rules found" in r.stdout


def test_grafana_provisioning_points_at_the_dashboards():
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "lserve.yml").read_text())
    (provider,) = prov["providers"]
    assert Path(provider["options"]["path"]).name == DASHBOARD_DIR.name
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"


# -- Dockerfile ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dockerfile():
    import dockerfile as parser

    return parser.parse_file(str(DEPLOY / "Dockerfile"))


def test_dockerfile_builds_the_gpu_serving_image(dockerfile):
    cmds = [c.cmd for c in dockerfile]
    froms = [c for c in dockerfile if c.cmd == "FROM"]
    assert len(froms) == 2
    args = {c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1] for c in dockerfile if c.cmd == "ARG" and "=" in c.value[0]}
    image = args["CUDA_IMAGE"]
    assert image.startswith("nvidia/cuda:") and "runtime" in image, "NVRTC comes with the CUDA runtime image"
    assert all(f.value[0] == "${CUDA_IMAGE}" for f in froms)
    runs = " ".join(c.value[0] for c in dockerfile if c.cmd == "RUN")
    assert 'pip install ".[gpu,serve]"' in runs
    env = {}
    for c in dockerfile:
        if c.cmd == "ENV":
            env.update(dict(zip(c.value[::2], c.value[1::2])))
    volumes = [v for c in dockerfile if c.cmd == "VOLUME" for v in c.value]
    assert volumes == ["/cache"]
    for var in ("CUPY_CACHE_DIR", "LSERVE_CACHE_DIR", "HF_HOME"):
        assert env[var].startswith("/cache/"), f"{var} must live on the cache volume"
    assert "8000" in [v for c in dockerfile if c.cmd == "EXPOSE" for v in c.value]
    user = [c.value[0] for c in dockerfile if c.cmd == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert cmds.index("HEALTHCHECK") > cmds.index("USER")


def test_dockerfile_copies_existing_files_not_ignored(dockerfile):
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/*") for line in ignore if line.startswith("!")]
    for c in dockerfile:
        if c.cmd != "COPY" or any(f.startswith("--from") for f in c.flags):
            continue
        for src in c.value[:-1]:
            assert (REPO / src).exists(), f"COPY source {src} does not exist"
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by the .dockerignore"


def test_dockerfile_command_is_a_valid_lserve_command(dockerfile):
    from lserve.cli import build_parser

    (cmd,) = [c for c in dockerfile if c.cmd == "CMD"]
    assert cmd.json and cmd.value[0] == "lserve"
    args = build_parser().parse_args(list(cmd.value[1:]))
    assert args.command == "serve" and args.host == "0.0.0.0" and args.device == "cuda" and args.backend == "cupy"


# -- metrics sidecar ----------------------------------------------------------------------------
WRITER = textwrap.dedent("""\
    import sys, time
    from lserve.serve.metrics import EngineMetrics
    m = EngineMetrics("m", sys.argv[1]); m.init_series()
    m.of(m.running).set(3); m.of(m.generation_tokens).inc(7)
    print("ready", flush=True)
    if sys.argv[2] == "stay":
        time.sleep(60)
    """)


def test_metrics_exporter_merges_live_deployments_only(tmp_path):
    """Series of a live deployment's folder are served; a folder whose processes are all gone is not."""
    live, gone = tmp_path / "lserve-live", tmp_path / "lserve-gone"
    procs = []
    try:
        for folder, replica, mode in ((live, "r-live", "stay"), (gone, "r-gone", "exit")):
            folder.mkdir()
            env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
            p = subprocess.Popen([sys.executable, "-c", WRITER, replica, mode], env=env, stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            procs.append(p)
        procs[1].wait(timeout=30)
        port = free_port()
        exporter = subprocess.Popen([sys.executable, str(DEPLOY / "metrics_exporter.py"), "--root", str(tmp_path),
                                     "--port", str(port)], stdout=subprocess.PIPE, text=True)
        procs.append(exporter)
        assert "lserve metrics exporter" in exporter.stdout.readline()
        text = ""
        for _ in range(50):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
                break
            except OSError:
                time.sleep(0.2)
        assert 'lserve:num_requests_running{model="m",replica="r-live"} 3.0' in text
        assert 'lserve:generation_tokens_total{model="m",replica="r-live"} 7.0' in text
        assert "r-gone" not in text
        assert not [line for line in text.splitlines() if line and not line.startswith("#") and not line.startswith("lserve:")]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.read() == b"ok\n"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
