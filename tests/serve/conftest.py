"""One local Ray + one Ray Serve app (two CPU engine replicas of the default model) per test session.

The app is deliberately small so the whole serve suite fits a 2-core machine: 2 engine replicas
(half a CPU and one torch thread each), a 256-token prefix block for routing, a small KV cache,
fast health checks (a dead engine is replaced in seconds) and an API key. Tests that break the app
(the failover drill) are marked ``disruptive`` and run last.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest
from ports import free_port

API_KEY = "test-key-lserve"
APP_NAME = "lserve-test"


def pytest_configure(config):
    config.addinivalue_line("markers", "serve: needs the session's Ray Serve app (starts it on first use)")
    config.addinivalue_line("markers", "disruptive: breaks part of the app (kills an engine); runs last")
    # Ray Serve's own pydantic models use a deprecated Field style; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore:Using extra keyword arguments on `Field`:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda it: it.get_closest_marker("disruptive") is not None)  # stable: order kept otherwise


@dataclass
class ServeApp:
    """What tests need to talk to the running app."""

    url: str
    api_key: str
    settings: object
    app_name: str
    log_dir: str = ""  # Ray's session logs (every replica's and the proxy's output)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def engines(self) -> list[dict]:
        """``/admin/engines``: one dict per engine replica."""
        r = httpx.get(f"{self.url}/admin/engines", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["replicas"]

    def wait_idle(self, timeout: float = 30.0) -> list[dict]:
        """Wait until every replica reports no request and every KV page free; returns the last report."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reps = self.engines()
            except httpx.HTTPError as e:  # a replica too busy to answer in time: ask again
                reps = [repr(e)]
            if reps and all(isinstance(r, dict) and r["running"] == 0 and r["waiting"] == 0 and r["all_pages_free"]
                            for r in reps):
                return reps
            if time.monotonic() > deadline:
                raise AssertionError(f"engines not idle after {timeout}s: {reps}")
            time.sleep(0.25)

    def log_offsets(self) -> dict[str, int]:
        """Size of every Ray log file now (to read what is written after)."""
        out = {}
        for root, _, files in os.walk(self.log_dir):
            for f in files:
                path = os.path.join(root, f)
                out[path] = os.path.getsize(path)
        return out

    def logs_since(self, offsets: dict[str, int]) -> str:
        """Everything Ray's processes logged since :meth:`log_offsets` returned ``offsets``."""
        parts = []
        for path in self.log_offsets():
            with open(path, "rb") as fh:
                fh.seek(offsets.get(path, 0))
                parts.append(fh.read().decode(errors="replace"))
        return "".join(parts)




@pytest.fixture(scope="session")
def serve_app():
    """Start Ray, Serve and the app once; shut everything down after the session."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from lserve.serve.app import build_app_from_settings
    from lserve.serve.settings import API_KEY_ENV, ServeSettings

    settings = ServeSettings(
        device="cpu", replicas=2, num_cpus=0.5, ingress_num_cpus=0.2, torch_threads=1,
        max_num_seqs=12, max_ongoing_requests=12, max_queued_requests=6, retry_after_s=2.0,
        max_cache_tokens=8192, max_model_len=2048, token_budget=0,
        health_check_period_s=1.0, health_check_timeout_s=2.0, routing_stats_period_s=0.5,
        prefix_block_chars=256, min_prefix_blocks=2, imbalance_tokens=1024, imbalance_ratio=1.0,
        max_body_bytes=256 * 1024, default_max_tokens=32, sse_keepalive_s=0.25, app_name=APP_NAME)
    tmp = tempfile.mkdtemp(prefix="lsr-", dir="/tmp")
    port = free_port()
    old_key = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = API_KEY
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             namespace="lserve-tests")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(build_app_from_settings(settings, total_cpus=2), name=APP_NAME, route_prefix="/",
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
        yield ServeApp(f"http://127.0.0.1:{port}", API_KEY, settings, APP_NAME,
                       os.path.join(tmp, "session_latest", "logs"))
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if old_key is None:
                os.environ.pop(API_KEY_ENV, None)
            else:
                os.environ[API_KEY_ENV] = old_key
            shutil.rmtree(tmp, ignore_errors=True)
            if settings.metrics_dir:
                shutil.rmtree(settings.metrics_dir, ignore_errors=True)


@pytest.fixture
def app(serve_app):
    """The session app, checked idle before the test (a test must not inherit another's load)."""
    serve_app.wait_idle(timeout=60)
    return serve_app
