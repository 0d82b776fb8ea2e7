"""Serving settings, the ``serve run`` YAML and the CLI mapping (no cluster needed)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from lserve.cli import build_parser
from lserve.config import ConfigError
from lserve.serve.settings import ENGINE_FIELDS, ServeSettings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "serve_config.yaml"


def test_engine_defaults_match_the_cli():
    cli = vars(build_parser().parse_args(["serve"]))
    defaults = ServeSettings.__dataclass_fields__
    for name in ENGINE_FIELDS + ("host", "port", "replicas", "autoscaling", "min_replicas", "max_replicas",
                                 "max_ongoing_requests", "max_queued_requests", "served_model_name"):
        assert defaults[name].default == cli[name], name
    assert ServeSettings().device in ("cpu", "cuda")  # "auto" is resolved where the app is built


def test_settings_from_cli_flags():
    args = build_parser().parse_args(["serve", "--port", "9001", "--replicas", "2", "--token-budget", "512",
                                      "--max-queued-requests", "7", "--autoscaling", "--max-replicas", "3",
                                      "--pattern", "none"])
    s = ServeSettings.from_args(args)
    assert (s.port, s.replicas, s.token_budget, s.max_queued_requests, s.autoscaling, s.max_replicas, s.pattern) == \
        (9001, 2, 512, 7, True, 3, "none")
    cfg = s.engine_config()
    assert cfg.sparsity.token_budget == 512 and cfg.model == "default"


def test_engine_switches_reach_the_engine_config():
    """--no-cuda-graphs / --no-fused-ops / --no-async-decode on ``lserve serve`` (and the same keys
    in a serve config) turn the engine features off instead of being dropped."""
    args = build_parser().parse_args(["serve", "--no-cuda-graphs", "--no-fused-ops", "--no-async-decode"])
    cfg = ServeSettings.from_args(args).engine_config()
    assert (cfg.cuda_graphs, cfg.fused_ops, cfg.async_decode) == (False, False, False)
    cfg = ServeSettings.from_dict({"async_decode": "false"}).engine_config()
    assert (cfg.cuda_graphs, cfg.fused_ops, cfg.async_decode) == (True, True, False)
    assert ServeSettings().engine_config().async_decode is True


def test_from_dict_converts_strings_and_rejects_unknown_keys():
    s = ServeSettings.from_dict({"replicas": "2", "token-budget": "0", "request_timeout_s": "none",
                                 "autoscaling": "false", "imbalance_ratio": "1.5"})
    assert (s.replicas, s.token_budget, s.request_timeout_s, s.autoscaling, s.imbalance_ratio) == (2, 0, None, False, 1.5)
    with pytest.raises(ConfigError, match="unknown serve setting"):
        ServeSettings.from_dict({"replica": 2})
    with pytest.raises(ConfigError, match="must be a number"):
        ServeSettings.from_dict({"port": "eighty"})


@pytest.mark.parametrize("bad, msg", [
    ({"replicas": 0}, "replicas must be >= 1"),
    ({"autoscaling": True, "replicas": 3, "max_replicas": 2}, "autoscaling needs"),
    ({"overload_status_code": 500}, "429 or 503"),
    ({"token_budget": 10}, "at least two pages"),  # the engine's own validation
    ({"page_size": 48}, "multiple"),
])
def test_invalid_settings_are_one_line_errors(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        ServeSettings(**bad)


def test_cpu_and_gpu_resources():
    s = ServeSettings(replicas=2)
    assert 0 < s.replica_num_cpus(total_cpus=2) < 1  # two engines + the ingress fit on 2 cores
    assert s.replica_num_gpus() == 0
    assert ServeSettings(replicas=1, num_cpus=3).replica_num_cpus(2) == 3
    g = ServeSettings(device="cuda")
    assert g.replica_num_gpus() == 1.0 and g.replica_num_cpus(64) == 1.0
    assert ServeSettings(max_num_seqs=8).replica_max_ongoing == 16


def test_yaml_is_a_valid_serve_config_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    from lserve.serve.app import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, build_app
    from lserve.serve.ray_router import PrefixAwareRequestRouter

    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    app_cfg = schema.applications[0]
    assert app_cfg.import_path == "lserve.serve.app:build_app"
    args = app_cfg.args
    # every key is a settings field, and the file states the defaults the CLI has
    s = ServeSettings.from_dict(args)
    assert s.model == "default" and s.replicas == 1 and s.pattern == "auto"
    assert set(args) <= {f for f in ServeSettings.__dataclass_fields__}

    app = build_app({**args, "replicas": 2, "metrics_dir": "/tmp/lserve-metrics-test-unused"})
    ingress = app._bound_deployment
    engine = ingress.init_args[1]._bound_deployment
    assert ingress.name == INGRESS_DEPLOYMENT and engine.name == ENGINE_DEPLOYMENT
    assert engine.num_replicas == 2
    opts = engine.ray_actor_options
    assert 0 < opts["num_cpus"] <= 1 and opts["runtime_env"]["env_vars"]["PROMETHEUS_MULTIPROC_DIR"]
    rc = engine._deployment_config.request_router_config
    assert rc.request_router_class.endswith("PrefixAwareRequestRouter")
    assert PrefixAwareRequestRouter.__name__ in rc.request_router_class
    assert engine._deployment_config.health_check_period_s == 5


def test_autoscaling_config_reaches_the_deployment():
    from lserve.serve.app import build_app

    app = build_app({"autoscaling": True, "min_replicas": 1, "replicas": 1, "max_replicas": 3,
                     "metrics_dir": "/tmp/lserve-metrics-test-unused"})
    engine = app._bound_deployment.init_args[1]._bound_deployment
    asc = engine._deployment_config.autoscaling_config
    assert (asc.min_replicas, asc.max_replicas) == (1, 3)


def test_lserve_serve_fails_fast_on_a_missing_model(capsys):
    from lserve.cli import main

    t0 = time.monotonic()
    assert main(["serve", "--model", "/nonexistent/model.gguf", "--port", "9"]) == 2
    assert "not found" in capsys.readouterr().err
    assert time.monotonic() - t0 < 30  # refused before starting Ray
