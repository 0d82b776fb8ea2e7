"""Killing a replica's engine loop: its health check fails, Ray Serve replaces it, service continues."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.disruptive, pytest.mark.slow]


def test_killed_engine_fails_health_and_is_replaced(app):
    from ray import serve

    from lserve.engine.async_engine import EngineDeadError
    from lserve.serve.app import ENGINE_DEPLOYMENT

    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app.app_name)
    before = {r["replica"] for r in app.engines()}
    assert len(before) == 2
    victim = handle.kill_engine.remote().result(timeout_s=30)
    assert victim in before
    survivor = (before - {victim}).pop()

    # the victim's own health check now raises, as Ray Serve's periodic check sees it
    with pytest.raises(EngineDeadError):
        handle.check_health.remote(lserve_target=victim).result(timeout_s=30)
    handle.check_health.remote(lserve_target=survivor).result(timeout_s=30)

    # requests keep being answered meanwhile: by the survivor, or refused with a retryable 503
    deadline = time.monotonic() + 120
    statuses = []
    with app.client(timeout=60) as c:
        while time.monotonic() < deadline:
            r = c.post("/v1/completions", json={"prompt": "During the failover,", "max_tokens": 2})
            statuses.append(r.status_code)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.json()["error"]["code"] in ("engine_dead", "service_unavailable")
                assert int(r.headers["retry-after"]) >= 1
            reps = app.engines()
            ids = {x["replica"] for x in reps if isinstance(x, dict)}
            if victim not in ids and len(ids) == 2 and all(x["alive"] for x in reps):
                break
            time.sleep(1.0)
        else:
            pytest.fail(f"the killed replica {victim} was not replaced within 120 s: {app.engines()}")
    assert 200 in statuses
    replacement = (ids - {survivor}).pop()
    assert replacement != victim

    # the replaced deployment is healthy and serves on both replicas
    assert httpx.get(f"{app.url}/health", timeout=30).json() == {"status": "ok", "replicas": 2}
    with app.client() as c:
        served = set()
        for i in range(12):
            r = c.post("/v1/completions", json={"prompt": (f"After failover {i}. " * 30) + "Next:", "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-lserve-replica"])
    assert served <= {survivor, replacement} and replacement in served
