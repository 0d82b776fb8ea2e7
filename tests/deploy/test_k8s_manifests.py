"""Every manifest in k8s/ validates against its schema, and the pieces fit together.

* RayService: KubeRay's CRD ``openAPIV3Schema`` (k8s/schemas/, a copy of ../shared/schemas/), made
  strict (unknown fields are errors, as ``kubectl apply --validate=strict`` would report);
* core kinds (and the pod templates and Service embedded in the RayService): the Kubernetes JSON
  schemas of ``kubernetes-validate``, strict;
* PodMonitor / PrometheusRule: prometheus-operator's models (``cloudcoil-models-prometheus-operator``),
  with a round trip that catches fields the models do not know;
* cross-references: labels and selectors, ports, volumes, the Serve Service, autoscaling bounds,
  and serveConfigV2 = deploy/serve_config.yaml plus the documented cluster overrides.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_helpers import DEPLOY, K8S, REPO

K8S_VERSION = "1.30"
CRD_COPY = K8S / "schemas" / "ray.io_rayservices.crd.yaml"
CRD_SHARED = REPO.parent / "shared" / "schemas" / "ray.io_rayservices.crd.yaml"
SERVE_CONFIG = DEPLOY / "serve_config.yaml"


def _load_render():
    spec = importlib.util.spec_from_file_location("render_k8s", DEPLOY / "render_k8s.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["render_k8s"] = mod
    spec.loader.exec_module(mod)
    return mod


render = _load_render()


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def all_docs() -> list[tuple[str, dict]]:
    out = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in all_docs() if d["kind"] == kind]


@pytest.fixture(scope="module")
def rayservice() -> dict:
    (rs,) = by_kind("RayService")
    return rs


def pod_templates(rs: dict) -> dict[str, dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    for g in cluster["workerGroupSpecs"]:
        out[g["groupName"]] = g["template"]
    return out


# -- schema validation --------------------------------------------------------------------------
def strict(schema):
    """A copy of an OpenAPI v3 schema in which objects with listed properties allow no others."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator():
    crd = yaml.safe_load(CRD_COPY.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_crd_copy_is_the_shared_schema():
    if not CRD_SHARED.is_file():
        pytest.skip(f"{CRD_SHARED} is not on this machine; k8s/schemas/ keeps the copy")
    assert CRD_COPY.read_bytes() == CRD_SHARED.read_bytes(), "k8s/schemas/ drifted from ../shared/schemas/"


def test_every_manifest_is_a_named_kubernetes_object():
    docs = all_docs()
    assert {name for name, _ in docs} == {p.name for p in manifest_files()}
    for name, d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), name
        assert d["metadata"].get("name"), name
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == sorted(["Namespace", "PersistentVolumeClaim", "RayService", "Ingress", "PodDisruptionBudget",
                            "PodMonitor", "PrometheusRule", "ConfigMap"])


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in manifest_files())
    assert kust["namespace"] == "lserve"
    (ns,) = by_kind("Namespace")
    assert ns["metadata"]["name"] == kust["namespace"]
    images = {c["image"].split(":")[0] for t in pod_templates(by_kind("RayService")[0]).values()
              for c in t["spec"]["containers"]}
    assert images == {i["name"] for i in kust["images"]}


def test_rayservice_matches_the_kuberay_crd(rayservice, crd_validator):
    assert rayservice["apiVersion"] == "ray.io/v1"
    assert crd_errors(crd_validator, rayservice) == []


@pytest.mark.parametrize("mutate, expected", [
    (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplica=4), "maxReplica"),
    (lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"].update(rayStartParams={"num-cpus": 0}), "num-cpus"),
    (lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    (lambda rs: rs["spec"].update(serveConfigV2={"applications": []}), "serveConfigV2"),
])
def test_crd_validation_catches_mistakes(rayservice, crd_validator, mutate, expected):
    """The validator is strict enough to matter: a typo, a wrong type, a missing field are errors."""
    bad = copy.deepcopy(rayservice)
    mutate(bad)
    errors = crd_errors(crd_validator, bad)
    assert errors and any(expected in e for e in errors), errors


def k8s_validate(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kind", ["Namespace", "PersistentVolumeClaim", "Ingress", "PodDisruptionBudget", "ConfigMap"])
def test_core_kinds_validate(kind):
    docs = by_kind(kind)
    assert docs
    for d in docs:
        k8s_validate(d)


def test_embedded_pod_templates_and_service_validate(rayservice):
    for name, tmpl in pod_templates(rayservice).items():
        k8s_validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lserve-{name}"},
                      "template": tmpl})
    svc = copy.deepcopy(rayservice["spec"]["serveService"])
    k8s_validate({"apiVersion": "v1", "kind": "Service", **svc})


def test_core_validation_catches_mistakes():
    import kubernetes_validate

    (ing,) = by_kind("Ingress")
    bad = copy.deepcopy(ing)
    bad["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = None
    bad["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["prot"] = {"number": 8000}
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(bad)


def prometheus_operator_check(doc: dict) -> None:
    """Validate with prometheus-operator's models; fields the models drop are unknown fields."""
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"]).model_validate(doc)
    back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert _normalize(back) == _normalize(doc), "unknown or misspelt fields were dropped by the schema"


def _normalize(x):
    if isinstance(x, dict):
        return {k: _normalize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_normalize(v) for v in x]
    return x


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_monitoring_kinds_validate(kind):
    (doc,) = by_kind(kind)
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    prometheus_operator_check(doc)


def test_monitoring_validation_catches_mistakes():
    (pm,) = by_kind("PodMonitor")
    bad = copy.deepcopy(pm)
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError, match="unknown or misspelt"):
        prometheus_operator_check(bad)


# -- how the pieces fit -------------------------------------------------------------------------
def containers(tmpl: dict) -> dict[str, dict]:
    return {c["name"]: c for c in tmpl["spec"]["containers"]}


def test_cpu_head_and_gpu_workers(rayservice):
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "the head must not host Serve replicas"
    for c in head["template"]["spec"]["containers"]:
        for part in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get(part, {}), "the head is CPU-only"
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True
    for g in cluster["workerGroupSpecs"]:
        ray = containers(g["template"])["ray-worker"]
        assert int(ray["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert ray["resources"]["requests"]["nvidia.com/gpu"] == ray["resources"]["limits"]["nvidia.com/gpu"]
        assert 1 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        # readiness on the Serve proxy of the pod
        probe = ray["readinessProbe"]["httpGet"]
        assert (probe["path"], probe["port"]) == ("/-/healthz", 8000)
        assert any(t.get("key") == "nvidia.com/gpu" for t in g["template"]["spec"].get("tolerations", []))
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == _installed_ray_version()


def _installed_ray_version() -> str:
    from importlib.metadata import version

    return version("ray")


def test_every_mount_has_a_volume_and_claims_exist(rayservice):
    claims = {d["metadata"]["name"] for d in by_kind("PersistentVolumeClaim")}
    for name, tmpl in pod_templates(rayservice).items():
        volumes = {v["name"]: v for v in tmpl["spec"]["volumes"]}
        for c in tmpl["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}/{c['name']} mounts unknown volume {m['name']}"
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        # the kernel/weights cache volume sits where the image's cache variables point
        ray = [c for c in tmpl["spec"]["containers"] if c["name"].startswith("ray-")][0]
        assert any(m["mountPath"] == "/cache" for m in ray["volumeMounts"])


def test_metrics_sidecar_shares_the_metrics_folder(rayservice, tmp_path, monkeypatch):
    """Every Ray pod runs the exporter on the folder where LServe's processes write their samples."""
    from lserve.serve import metrics

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    made = Path(metrics.new_metrics_dir("lserve"))
    root_name = made.parent.name  # what the app creates under the system temp folder
    for name, tmpl in pod_templates(rayservice).items():
        spec = tmpl["spec"]
        assert spec.get("shareProcessNamespace") is True, f"{name}: the exporter must see the Ray processes"
        cs = containers(tmpl)
        side = cs["lserve-metrics"]
        ray = [c for n, c in cs.items() if n.startswith("ray-")][0]
        root = side["command"][side["command"].index("--root") + 1]
        assert root == f"/tmp/{root_name}"
        for c in (side, ray):
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get(root) == "lserve-metrics", f"{name}/{c['name']} lacks the metrics folder"
        assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}["lserve-metrics"]
        assert side["command"][1] == "/opt/lserve/metrics_exporter.py"
    # An explicit metrics_dir in the Serve config must sit in the folder the sidecars serve.
    for app in serve_config_v2(rayservice)["applications"]:
        explicit = (app.get("args") or {}).get("metrics_dir")
        if explicit:
            assert Path(explicit).parent == Path(f"/tmp/{root_name}"), explicit


def test_podmonitor_selects_every_ray_pod_and_named_ports(rayservice):
    (pm,) = by_kind("PodMonitor")
    selector = pm["spec"]["selector"]["matchLabels"]
    for name, tmpl in pod_templates(rayservice).items():
        labels = tmpl["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"the PodMonitor misses the {name} pods"
        ports = {p["name"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ep["port"] in ports, f"{name} pods have no port named {ep['port']}"
    (rule,) = by_kind("PrometheusRule")
    assert pm["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"]


def test_ingress_reaches_the_serve_service(rayservice):
    (ing,) = by_kind("Ingress")
    svc = rayservice["spec"]["serveService"]
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    target_ports = {p["targetPort"] for p in svc["spec"]["ports"]}
    backends = [p["backend"]["service"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    assert backends
    for b in backends:
        assert b["name"] == svc["metadata"]["name"]
        assert b["port"].get("name") in port_names or b["port"].get("number") in {p["port"] for p in svc["spec"]["ports"]}
    for tmpl in list(pod_templates(rayservice).values())[1:]:  # workers serve
        ports = {p["containerPort"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        assert target_ports <= ports
    paths = {p["path"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]}
    assert "/v1" in paths and not any(p.startswith(("/metrics", "/admin")) for p in paths)


def test_pdb_selects_the_gpu_workers(rayservice):
    (pdb,) = by_kind("PodDisruptionBudget")
    sel = pdb["spec"]["selector"]["matchLabels"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert sel.items() <= cluster["workerGroupSpecs"][0]["template"]["metadata"]["labels"].items()
    assert not sel.items() <= cluster["headGroupSpec"]["template"]["metadata"]["labels"].items()


# -- serveConfigV2 ------------------------------------------------------------------------------
def serve_config_v2(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def test_serve_config_v2_is_deploy_serve_config(rayservice):
    assert SERVE_CONFIG.is_file(), "deploy/serve_config.yaml is missing"
    local = yaml.safe_load(SERVE_CONFIG.read_text())
    cluster = serve_config_v2(rayservice)
    assert cluster == render.cluster_serve_config(local)
    # Same applications: names, routes, import paths, deployment overrides; args differ only by
    # the documented cluster overrides.
    assert [a["name"] for a in cluster["applications"]] == [a["name"] for a in local["applications"]]
    for mine, theirs in zip(cluster["applications"], local["applications"]):
        for key in set(mine) | set(theirs):
            if key != "args":
                assert mine.get(key) == theirs.get(key), key
        diff = {k for k in set(mine.get("args") or {}) | set(theirs.get("args") or {})
                if (mine.get("args") or {}).get(k) != (theirs.get("args") or {}).get(k)}
        assert diff <= set(render.CLUSTER_ARGS)


def test_serve_config_v2_builds_valid_settings_within_the_gpu_bounds(rayservice):
    from lserve.serve.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT
    from lserve.serve.settings import ServeSettings

    cfg = serve_config_v2(rayservice)
    (app,) = [a for a in cfg["applications"] if a["import_path"] == render.LSERVE_IMPORT_PATH]
    s = ServeSettings.from_dict(app.get("args"))
    assert s.uses_gpu and s.backend == "cupy"
    for d in app.get("deployments") or []:
        assert d["name"] in (ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT)
    workers = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus_max = sum(g["maxReplicas"] * int(containers(g["template"])["ray-worker"]["resources"]["limits"]["nvidia.com/gpu"])
                   for g in workers)
    need = s.peak_replicas * s.replica_num_gpus()
    assert need <= gpus_max, f"serve wants {need} GPUs at peak, the worker groups offer {gpus_max}"
    assert cfg["http_options"]["host"] == "0.0.0.0" and cfg["http_options"]["port"] == 8000


def test_worker_readiness_is_a_proxy_that_runs_on_workers(rayservice):
    """Worker pods turn Ready when their own Serve proxy answers: the cluster config must put a
    proxy on every node (HeadOnly would leave every GPU worker unready forever)."""
    cfg = serve_config_v2(rayservice)
    for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        probe = containers(g["template"])["ray-worker"]["readinessProbe"]["httpGet"]
        if probe["path"] == "/-/healthz" and probe["port"] == cfg["http_options"]["port"]:
            assert cfg.get("proxy_location") == "EveryNode", g["groupName"]


def test_pods_outlive_the_shutdown_grace_period(rayservice, tmp_path):
    """Every pod waits out its preStop hook, then the longest replica stop Ray Serve allows."""
    from lserve.serve.app import stop_timeouts_s
    from lserve.serve.settings import ServeSettings

    cfg = serve_config_v2(rayservice)
    (app,) = [a for a in cfg["applications"] if a["import_path"] == render.LSERVE_IMPORT_PATH]
    grace = ServeSettings.from_dict(app.get("args")).shutdown_grace_s
    assert grace > 0
    stops = stop_timeouts_s(grace)
    assert min(stops.values()) > grace  # running requests get the whole grace period
    for name, template in pod_templates(rayservice).items():
        pre_stop = render.pre_stop_s(template)
        assert template["spec"]["terminationGracePeriodSeconds"] >= pre_stop + max(stops.values()), name
    # and it follows the setting: a longer grace period gives longer pod grace periods
    local = yaml.safe_load(SERVE_CONFIG.read_text())
    for a in local["applications"]:
        if a["import_path"] == render.LSERVE_IMPORT_PATH:
            a["args"]["shutdown_grace_s"] = grace + 100
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(local))
    longer = pod_templates(yaml.safe_load(render.rayservice(path)))
    for name, template in pod_templates(rayservice).items():
        # a drain in the preStop hook (the head's) takes the longer grace period too
        pre_stop_longer = render.pre_stop_s(longer[name]) - render.pre_stop_s(template)
        assert pre_stop_longer in (0, 100), name
        assert (longer[name]["spec"]["terminationGracePeriodSeconds"]
                == template["spec"]["terminationGracePeriodSeconds"] + 100 + pre_stop_longer), name
    assert render.pre_stop_s(longer["head"]) == render.pre_stop_s(pod_templates(rayservice)["head"]) + 100


def _pre_stop(container: dict) -> list[str]:
    return container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])


def test_head_pre_stop_drains_through_its_proxy(rayservice):
    """Deleting the head ends the cluster: its preStop runs ``lserve drain --wait`` with the app's grace period."""
    from lserve.serve.app import stop_timeouts_s
    from lserve.serve.drain import wait_limit_s
    from lserve.serve.settings import ServeSettings

    (app,) = [a for a in serve_config_v2(rayservice)["applications"]
              if a["import_path"] == render.LSERVE_IMPORT_PATH]
    grace = ServeSettings.from_dict(app.get("args")).shutdown_grace_s
    head = pod_templates(rayservice)["head"]
    (container,) = [c for c in head["spec"]["containers"] if _pre_stop(c)]
    cmd = _pre_stop(container)
    assert cmd[:2] == ["lserve", "drain"] and "--wait" in cmd, cmd
    assert float(cmd[cmd.index("--grace-s") + 1]) == grace, cmd
    url = cmd[cmd.index("--url") + 1]
    port = int(url.rsplit(":", 1)[1])
    assert url.startswith("http://127.0.0.1:") and port == serve_config_v2(rayservice)["http_options"]["port"]
    assert {"name": "serve", "containerPort": port} in container["ports"]
    # the pod waits out the drain (grace period, cut, margin), then the replicas' stop, as the workers do
    assert render.pre_stop_s(head) == wait_limit_s(grace) > grace
    assert head["spec"]["terminationGracePeriodSeconds"] >= wait_limit_s(grace) + max(stop_timeouts_s(grace).values())


def test_generated_files_are_up_to_date():
    assert render.main(["--check"]) == 0, "run: python deploy/render_k8s.py"


def test_prometheus_rule_carries_the_alert_file():
    (rule,) = by_kind("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]


def test_dashboards_configmap_carries_the_dashboards():
    import json

    (cm,) = by_kind("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: json.loads(p.read_text()) for p in (DEPLOY / "grafana" / "dashboards").glob("*.json")}
    assert files and {k: json.loads(v) for k, v in cm["data"].items()} == files
